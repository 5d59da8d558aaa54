// packed_examples.cpp — packing a token store into examples, once, into a file.
#include "data/packed_examples.h"

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
constexpr int64_t kHeader = 64, kRecord = 16;

struct Header {
  char magic[8];
  uint64_t version;
  int64_t max_tokens, validation_docs, train, validation, store_sequences, store_tokens;
};
static_assert(sizeof(Header) == kHeader);

struct Record {
  int64_t sequence;
  int32_t offset, tokens;
};
static_assert(sizeof(Record) == kRecord);

// The packing's records, streamed: the training ones to `path`, the held-out ones
// to a side file appended at the end; the header last.
void build(const zeroshard::TokenStore& store, const PackingOptions& o, int64_t held_docs, const std::string& path) {
  const std::string held_path = path + ".held";
  std::FILE* out = std::fopen(path.c_str(), "wb");
  TORCH_CHECK(out != nullptr, "BART examples: cannot create '", path, "': ", std::strerror(errno));
  std::FILE* held = std::fopen(held_path.c_str(), "w+b");
  TORCH_CHECK(held != nullptr, "BART examples: cannot create '", held_path, "': ", std::strerror(errno));
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = 1;
  h.max_tokens = o.max_tokens;
  h.validation_docs = held_docs;
  h.store_sequences = store.sequences();
  h.store_tokens = store.tokens();
  bool ok = std::fwrite(&h, sizeof(h), 1, out) == 1;
  const int64_t budget = o.max_tokens - 2, docs = store.documents();
  int64_t next_held = 0;  // the j of the next held-out document, floor((2j + 1) D / 2V)
  auto held_doc = [&](int64_t j) { return j < held_docs ? (2 * j + 1) * docs / (2 * held_docs) : docs; };
  bool validation = false;
  Record cur{0, 0, 0};
  auto emit = [&] {
    if (cur.tokens == 0) return;
    ok = ok && std::fwrite(&cur, sizeof(cur), 1, validation ? held : out) == 1;
    ++(validation ? h.validation : h.train);
    cur.tokens = 0;
  };
  for (int64_t d = 0; d < docs; ++d) {
    validation = held_doc(next_held) == d;
    if (validation) ++next_held;
    int64_t used = 0;
    for (int64_t s = store.document_begin(d); s < store.document_end(d); ++s) {
      const int64_t len = store.length(s);
      for (int64_t p = 0; p < len;) {  // pieces of at most `budget`
        const int64_t take = std::min(len - p, budget);
        if (used + take > budget) {
          emit();
          used = 0;
        }
        if (cur.tokens == 0) cur = Record{s, static_cast<int32_t>(p), 0};
        cur.tokens += static_cast<int32_t>(take);
        used += take;
        p += take;
      }
    }
    emit();  // examples never span two documents
  }
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
  held_ = held_out_documents(store_->documents(), o.validation_docs);
  auto matches = [&](int fd) {
    Header h{};
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size < kHeader) return false;
    zeroshard::read_file_range(fd, &h, sizeof(h), 0, path);
    return std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0 && h.version == 1 &&
           h.max_tokens == o.max_tokens && h.validation_docs == held_ &&
           h.store_sequences == store_->sequences() && h.store_tokens == store_->tokens() && h.train >= 0 &&
           h.validation >= 0 && st.st_size == kHeader + kRecord * (h.train + h.validation);
  };
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0 || !matches(fd_)) {
    if (fd_ >= 0) ::close(fd_);
    // Beside, then renamed: another rank, of this host or another, may be building the same file.
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    const std::string tmp = path + ".tmp." + host + "." + std::to_string(::getpid());
    build(*store_, o, held_, tmp);
    fs::rename(tmp, path);
    built_ = true;
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK(fd_ >= 0 && matches(fd_), "BART examples: '", path, "' cannot be read back after building it");
  }
  Header h{};
  zeroshard::read_file_range(fd_, &h, sizeof(h), 0, path_);
  train_.owner_ = validation_.owner_ = this;
  train_.size_ = h.train;
  validation_.first_ = h.train;
  validation_.size_ = h.validation;
}

int64_t held_out_documents(int64_t documents, int64_t validation_docs) {
  TORCH_CHECK_VALUE(validation_docs >= 0, "--validation-docs ", validation_docs, ": must be 0 (the default) or more");
  if (validation_docs == 0) return std::min<int64_t>(100, (documents + 19) / 20);
  TORCH_CHECK_VALUE(2 * validation_docs <= documents, "--validation-docs ", validation_docs, " holds out more than half "
                    "of the dataset's ", documents, " documents; give at most ", documents / 2,
                    " (or prepare the text in more documents: prepare --document-separator)");
  return validation_docs;
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
