// token_store_writer.cpp — the token store's streaming writer: sequences and
// documents appended to the data file, the index written at the end, every
// file's checksum taken as it is written.
#include <zeroshard/token_store.h>

#include "data/token_store_format.h"

#include <c10/util/Exception.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>

namespace zeroshard {

namespace fs = std::filesystem;
using namespace token_store_format;

// A file written through stdio with a large buffer; every failure names the file.
// Its checksum is taken as it is written.
struct TokenStoreOut {
  std::string path;
  std::FILE* f = nullptr;
  XXH3_state_t* hash = XXH3_createState();
  uint64_t bytes = 0;
  explicit TokenStoreOut(std::string p) : path(std::move(p)) {
    XXH3_64bits_reset(hash);
    f = std::fopen(path.c_str(), "wb");
    TORCH_CHECK(f != nullptr, "token store: cannot create '", path, "': ", std::strerror(errno));
    std::setvbuf(f, nullptr, _IOFBF, kChunk);
  }
  ~TokenStoreOut() {
    if (f != nullptr) std::fclose(f);
    XXH3_freeState(hash);
  }
  TokenStoreOut(const TokenStoreOut&) = delete;
  TokenStoreOut& operator=(const TokenStoreOut&) = delete;
  void write(const void* p, size_t n) {
    TORCH_CHECK(n == 0 || std::fwrite(p, 1, n, f) == n, "token store: writing '", path, "' failed: ",
                std::strerror(errno), " (a full disk?)");
    XXH3_64bits_update(hash, p, n);
    bytes += n;
  }
  uint64_t xxh3() const { return XXH3_64bits_digest(hash); }
  void close() {
    const bool ok = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
    const int e = errno;
    std::fclose(f);
    f = nullptr;
    TORCH_CHECK(ok, "token store: writing '", path, "' failed: ", std::strerror(e), " (a full disk?)");
  }
};

namespace {

// Copies `path` onto `out` in chunks, after `skip` bytes.
void copy_file(const std::string& path, int64_t skip, TokenStoreOut& out) {
  std::FILE* in = std::fopen(path.c_str(), "rb");
  TORCH_CHECK(in != nullptr, "token store: cannot read '", path, "': ", std::strerror(errno));
  std::vector<char> buf(kChunk);
  bool ok = std::fseek(in, skip, SEEK_SET) == 0;
  for (size_t got = 0; ok && (got = std::fread(buf.data(), 1, buf.size(), in)) > 0;) out.write(buf.data(), got);
  ok = ok && std::ferror(in) == 0;
  std::fclose(in);
  TORCH_CHECK(ok, "token store: reading '", path, "' failed");
}

}  // namespace

struct TokenStoreWriter::Files {
  std::unique_ptr<TokenStoreOut> bin, lengths, ends;
};

TokenStoreWriter::TokenStoreWriter(std::string prefix, TokenType type)
    : prefix_(std::move(prefix)), type_(type), f_(std::make_unique<Files>()) {
  token_bytes(type);  // a known type
  f_->bin = std::make_unique<TokenStoreOut>(prefix_ + ".bin.partial");
  f_->lengths = std::make_unique<TokenStoreOut>(prefix_ + ".lengths.partial");
  f_->ends = std::make_unique<TokenStoreOut>(prefix_ + ".documents.partial");
  write_document_end(0);
}

TokenStoreWriter::~TokenStoreWriter() {
  if (finished_) return;
  f_.reset();
  std::error_code ec;
  for (const char* s : {".bin.partial", ".lengths.partial", ".documents.partial", ".idx.partial"}) {
    fs::remove(prefix_ + s, ec);
  }
}

void TokenStoreWriter::write_lengths(const int32_t* lengths, int64_t count) {
  f_->lengths->write(lengths, static_cast<size_t>(count) * 4);
}

void TokenStoreWriter::write_document_end(int64_t end) { f_->ends->write(&end, 8); }

void TokenStoreWriter::add(const int64_t* tokens, int64_t count) {
  TORCH_CHECK(!finished_, "token store '", prefix_, "': add after finish");
  TORCH_CHECK_VALUE(count >= 0 && count <= std::numeric_limits<int32_t>::max(), "token store '", prefix_,
                    "': a sequence of ", count, " tokens (at most 2^31 - 1)");
  const int64_t item = token_bytes(type_);
  const int64_t lo = type_ == TokenType::kUInt8 || type_ == TokenType::kUInt16 ? 0 : -(int64_t{1} << (8 * item - 1));
  const int64_t hi = type_ == TokenType::kInt64 ? std::numeric_limits<int64_t>::max()
                     : type_ == TokenType::kUInt8 || type_ == TokenType::kUInt16 ? (int64_t{1} << (8 * item)) - 1
                                                                                 : (int64_t{1} << (8 * item - 1)) - 1;
  buffer_.resize(static_cast<size_t>(count * item));
  char* o = buffer_.data();
  for (int64_t k = 0; k < count; ++k) {
    const int64_t t = tokens[k];
    TORCH_CHECK_VALUE(t >= lo && t <= hi, "token store '", prefix_, "': token id ", t, " does not fit its ",
                      to_string(type_), " tokens (", lo, "..", hi, "); a vocabulary of 65500 or more entries needs "
                      "int32 (token_type_for)");
    switch (type_) {
      case TokenType::kUInt8: o[k] = static_cast<char>(static_cast<uint8_t>(t)); break;
      case TokenType::kInt8: o[k] = static_cast<char>(static_cast<int8_t>(t)); break;
      case TokenType::kInt16: { const auto v = static_cast<int16_t>(t); std::memcpy(o + 2 * k, &v, 2); break; }
      case TokenType::kUInt16: { const auto v = static_cast<uint16_t>(t); std::memcpy(o + 2 * k, &v, 2); break; }
      case TokenType::kInt32: { const auto v = static_cast<int32_t>(t); std::memcpy(o + 4 * k, &v, 4); break; }
      case TokenType::kInt64: std::memcpy(o + 8 * k, &t, 8); break;
    }
  }
  f_->bin->write(buffer_.data(), buffer_.size());
  const auto len = static_cast<int32_t>(count);
  write_lengths(&len, 1);
  ++sequences_;
  ++open_sequences_;
  tokens_ += count;
}

void TokenStoreWriter::end_document() {
  TORCH_CHECK(!finished_, "token store '", prefix_, "': end_document after finish");
  write_document_end(sequences_);
  ++documents_;
  open_sequences_ = 0;
}

void TokenStoreWriter::append(const TokenStore& other) {
  TORCH_CHECK_VALUE(open_sequences_ == 0, "token store '", prefix_, "': append with a document open (end_document first)");
  TORCH_CHECK_VALUE(other.type() == type_, "token store '", prefix_, "': cannot append '", other.prefix(), "', whose "
                    "tokens are ", to_string(other.type()), ", to ", to_string(type_), " tokens");
  other.verify();  // its pointers must be consecutive: ours are recomputed from the lengths
  std::vector<int32_t> lengths;
  for (int64_t i = 0; i < other.sequences(); i += static_cast<int64_t>(kChunk / 4)) {
    lengths.clear();
    for (int64_t j = i; j < std::min(other.sequences(), i + static_cast<int64_t>(kChunk / 4)); ++j) {
      lengths.push_back(static_cast<int32_t>(other.length(j)));
    }
    write_lengths(lengths.data(), static_cast<int64_t>(lengths.size()));
  }
  for (int64_t d = 0; d < other.documents(); ++d) write_document_end(sequences_ + other.document_end(d));
  copy_file(other.prefix() + ".bin", 0, *f_->bin);
  sequences_ += other.sequences();
  documents_ += other.documents();
  tokens_ += other.tokens();
}

TokenStoreDigest TokenStoreWriter::finish() {
  TORCH_CHECK(!finished_, "token store '", prefix_, "': finish twice");
  TORCH_CHECK_VALUE(open_sequences_ == 0, "token store '", prefix_, "': finish with a document open (", open_sequences_,
                    " sequences since the last end_document)");
  f_->bin->close();
  TokenStoreDigest digest;
  digest.bin_bytes = f_->bin->bytes;
  digest.bin_xxh3 = f_->bin->xxh3();
  f_->lengths->close();
  f_->ends->close();
  {
    TokenStoreOut idx(prefix_ + ".idx.partial");
    idx.write(kMagic, sizeof(kMagic));
    const uint64_t version = 1, n = static_cast<uint64_t>(sequences_), d = static_cast<uint64_t>(documents_) + 1;
    const auto code = static_cast<uint8_t>(type_);
    idx.write(&version, 8);
    idx.write(&code, 1);
    idx.write(&n, 8);
    idx.write(&d, 8);
    copy_file(f_->lengths->path, 0, idx);
    // Pointers: the running byte offset, from the lengths read back in chunks.
    std::FILE* in = std::fopen(f_->lengths->path.c_str(), "rb");
    TORCH_CHECK(in != nullptr, "token store: cannot read '", f_->lengths->path, "': ", std::strerror(errno));
    std::vector<int32_t> lengths(kChunk / 4);
    std::vector<int64_t> pointers;
    int64_t at = 0;
    for (size_t got = 0; (got = std::fread(lengths.data(), 4, lengths.size(), in)) > 0;) {
      pointers.resize(got);
      for (size_t k = 0; k < got; ++k) {
        pointers[k] = at;
        at += static_cast<int64_t>(lengths[k]) * token_bytes(type_);
      }
      idx.write(pointers.data(), got * 8);
    }
    std::fclose(in);
    copy_file(f_->ends->path, 0, idx);
    idx.close();
    digest.idx_bytes = idx.bytes;
    digest.idx_xxh3 = idx.xxh3();
  }
  fs::remove(f_->lengths->path);
  fs::remove(f_->ends->path);
  // An .idx in place means its tokens are too: a store written over goes away first.
  fs::remove(prefix_ + ".idx");
  fs::rename(prefix_ + ".bin.partial", prefix_ + ".bin");
  fs::rename(prefix_ + ".idx.partial", prefix_ + ".idx");
  finished_ = true;
  return digest;
}

}  // namespace zeroshard
