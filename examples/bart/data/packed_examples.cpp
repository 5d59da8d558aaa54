// packed_examples.cpp — packing a token store into examples, once, into a file.
#include "data/packed_examples.h"

#include "data/held_out.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace bart {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'Z', 'S', 'P', 'A', 'C', 'K', 'E', 'D'};
constexpr int64_t kHeader = 128, kRecord = 16;
constexpr uint64_t kVersion = 3;  // 3: a span holds the whole pieces that fit in it

struct Header {
  char magic[8];
  uint64_t version;
  int64_t max_tokens, train, validation, store_sequences, store_tokens;
  int64_t validation_docs, validation_target;  // the choice: ValidationOptions::documents, or the tokens asked for
  int64_t held_kind, held_tokens, held_documents, held_spans;  // what it held out
  int64_t unused[3];
};
static_assert(sizeof(Header) == kHeader);

struct Record {
  int64_t sequence;
  int32_t offset, tokens;
};
static_assert(sizeof(Record) == kRecord);

// Whether each piece the packer makes is held out: its document is, or it
// overlaps a held-out span that still has room for it. A span takes whole
// pieces (a sentence, or a part of a long one) in order while they fit in its
// size, so the set never holds more than its size in tokens; the piece that
// holds a span's centre is taken even when it alone is larger, so that every
// span holds something (a corpus of a few sentences). Asked in the order of
// the pieces.
class HeldPieces {
 public:
  explicit HeldPieces(const HeldOut& h) : h_(h) {}
  bool document(int64_t d) {
    while (doc_ < h_.documents.size() && h_.documents[doc_] < d) ++doc_;
    return doc_ < h_.documents.size() && h_.documents[doc_] == d;
  }
  // The piece [begin, end) of the corpus's tokens end to end.
  bool piece(int64_t begin, int64_t end) {
    while (span_ < h_.spans.size() && h_.spans[span_].second <= begin) {
      ++span_;
      taken_ = 0;
    }
    if (span_ == h_.spans.size() || h_.spans[span_].first >= end) return false;
    const auto [first, last] = h_.spans[span_];
    const int64_t centre = first + (last - first) / 2;
    if (taken_ + (end - begin) > last - first && !(taken_ == 0 && begin <= centre && centre < end)) return false;
    taken_ += end - begin;
    return true;
  }

 private:
  const HeldOut& h_;
  size_t doc_ = 0, span_ = 0;
  int64_t taken_ = 0;  // tokens the current span holds
};

// The records of `store`'s examples, in order, each to `emit(record, held)`;
// `header` counts them and what is held out.
template <class Emit>
void pack(const zeroshard::TokenStore& store, int64_t budget, const HeldOut& held_out, Header& h, Emit&& emit_record) {
  HeldPieces is_held(held_out);
  bool validation = false;
  Record cur{0, 0, 0};
  auto emit = [&] {
    if (cur.tokens == 0) return;
    emit_record(cur, validation);
    ++(validation ? h.validation : h.train);
    if (validation) h.held_tokens += cur.tokens;
    cur.tokens = 0;
  };
  int64_t at = 0;  // the corpus's tokens end to end before this piece
  for (int64_t d = 0; d < store.documents(); ++d) {
    const bool whole = is_held.document(d);
    bool touched = false;
    int64_t used = 0;
    for (int64_t s = store.document_begin(d); s < store.document_end(d); ++s) {
      const int64_t len = store.length(s);
      for (int64_t p = 0; p < len;) {  // pieces of at most `budget`
        const int64_t take = std::min(len - p, budget);
        const bool piece_held = whole || is_held.piece(at, at + take);
        if (used + take > budget || piece_held != validation) {  // examples never mix the two sets
          emit();
          used = 0;
        }
        validation = piece_held;
        touched = touched || piece_held;
        if (cur.tokens == 0) cur = Record{s, static_cast<int32_t>(p), 0};
        cur.tokens += static_cast<int32_t>(take);
        used += take;
        p += take;
        at += take;
      }
    }
    emit();  // examples never span two documents
    h.held_documents += touched ? 1 : 0;
  }
}

// The packing's records, streamed: the training ones to `path`, the held-out ones
// to a side file appended at the end; the header last.
void build(const zeroshard::TokenStore& store, const PackingOptions& o, const HeldOut& held_out,
           const std::string& path) {
  const std::string held_path = path + ".held";
  std::FILE* out = std::fopen(path.c_str(), "wb");
  TORCH_CHECK(out != nullptr, "BART examples: cannot create '", path, "': ", std::strerror(errno));
  std::FILE* held = std::fopen(held_path.c_str(), "w+b");
  TORCH_CHECK(held != nullptr, "BART examples: cannot create '", held_path, "': ", std::strerror(errno));
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kVersion;
  h.max_tokens = o.max_tokens;
  h.validation_docs = o.validation.documents;
  h.validation_target = held_out.target_tokens;
  h.held_kind = static_cast<int64_t>(held_out.kind);
  h.held_spans = static_cast<int64_t>(held_out.spans.size());
  h.store_sequences = store.sequences();
  h.store_tokens = store.tokens();
  bool ok = std::fwrite(&h, sizeof(h), 1, out) == 1;
  pack(store, o.max_tokens - 2, held_out, h, [&](const Record& r, bool validation) {
    ok = ok && std::fwrite(&r, sizeof(r), 1, validation ? held : out) == 1;
  });
  std::rewind(held);
  char buf[1 << 16];
  for (size_t got = 0; ok && (got = std::fread(buf, 1, sizeof(buf), held)) > 0;) ok = std::fwrite(buf, 1, got, out) == got;
  ok = ok && std::fseek(out, 0, SEEK_SET) == 0 && std::fwrite(&h, sizeof(h), 1, out) == 1 && std::fflush(out) == 0;
  const int e = errno;
  std::fclose(held);
  std::fclose(out);
  fs::remove(held_path);
  TORCH_CHECK(ok, "BART examples: writing '", path, "' failed: ", std::strerror(e), " (a full disk?)");
}

}  // namespace

PackedExamples::PackedExamples(std::shared_ptr<const zeroshard::TokenStore> store, const PackingOptions& o,
                               const std::string& path)
    : store_(std::move(store)), options_(o), path_(path) {
  TORCH_CHECK_VALUE(o.max_tokens >= 8, "BART examples: max_tokens is ", o.max_tokens, "; use at least 8");
  const int64_t target = o.validation.documents > 0 ? 0
                         : o.validation.tokens > 0  ? o.validation.tokens
                                                    : default_validation_tokens(store_->tokens());
  auto matches = [&](int fd) {
    Header h{};
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size < kHeader) return false;
    zeroshard::read_file_range(fd, &h, sizeof(h), 0, path);
    return std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0 && h.version == kVersion &&
           h.max_tokens == o.max_tokens && h.validation_docs == o.validation.documents &&
           h.validation_target == target && h.store_sequences == store_->sequences() &&
           h.store_tokens == store_->tokens() && h.train >= 0 && h.validation >= 0 &&
           st.st_size == kHeader + kRecord * (h.train + h.validation);
  };
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0 || !matches(fd_)) {
    if (fd_ >= 0) ::close(fd_);
    const HeldOut held = choose_held_out(*store_, o.validation, o.max_tokens);
    // Beside, then renamed: another rank, of this host or another, may be building the same file.
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    const std::string tmp = path + ".tmp." + host + "." + std::to_string(::getpid());
    build(*store_, o, held, tmp);
    fs::rename(tmp, path);
    built_ = true;
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK(fd_ >= 0 && matches(fd_), "BART examples: '", path, "' cannot be read back after building it");
  }
  Header h{};
  zeroshard::read_file_range(fd_, &h, sizeof(h), 0, path_);
  held_.within_documents = h.held_kind == static_cast<int64_t>(HeldOut::Kind::kSpans);
  held_.documents = h.held_documents;
  held_.spans = h.held_spans;
  held_.tokens = h.held_tokens;
  held_.target_tokens = h.validation_target;
  train_.owner_ = validation_.owner_ = this;
  train_.size_ = h.train;
  validation_.first_ = h.train;
  validation_.size_ = h.validation;
}

PackedExamples::~PackedExamples() {
  if (fd_ >= 0) ::close(fd_);
}

Example PackedExamples::Split::at(int64_t i) const {
  TORCH_CHECK_INDEX(i >= 0 && i < size_, "BART examples: example ", i, " of ", size_);
  return owner_->read(first_ + i);
}

int64_t PackedExamples::Split::target_tokens(int64_t i) const {
  TORCH_CHECK_INDEX(i >= 0 && i < size_, "BART examples: example ", i, " of ", size_);
  return owner_->record_tokens(first_ + i) + 2;
}

int64_t PackedExamples::record_tokens(int64_t record) const {
  Record r{};
  zeroshard::read_file_range(fd_, &r, sizeof(r), kHeader + kRecord * record, path_);
  return r.tokens;
}

Example PackedExamples::read(int64_t record) const {
  Record r{};
  zeroshard::read_file_range(fd_, &r, sizeof(r), kHeader + kRecord * record, path_);
  const int64_t budget = options_.max_tokens - 2;
  Example ex;
  int64_t s = r.sequence, off = r.offset, left = r.tokens;
  while (left > 0) {
    TORCH_CHECK(s < store_->sequences(), "BART examples: '", path_, "' runs past the store's last sequence; delete it "
                "to build it again");
    const int64_t len = store_->length(s);
    if (off >= len) {  // the sentence's end (an empty sentence has none)
      ++s;
      off = 0;
      continue;
    }
    const int64_t take = std::min(len - off, budget);
    TORCH_CHECK(take <= left, "BART examples: '", path_, "' does not match the store; delete it to build it again");
    ex.emplace_back();
    store_->read(s, off, take, ex.back());
    off += take;
    left -= take;
  }
  return ex;
}

}  // namespace bart
