// token_store.cpp — the Megatron-LM indexed dataset: reader (pread), streaming writer.
#include <zeroshard/token_store.h>

#include <c10/util/Exception.h>
#include <xxhash.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>

namespace zeroshard {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kHeaderBytes = 34;  // magic, u64 version, u8 type, u64 sequences, u64 documents + 1
constexpr size_t kChunk = size_t{1} << 20;

bool known(uint8_t code) { return (code >= 1 && code <= 5) || code == 8; }

template <typename T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

void read_file_range(int fd, void* out, int64_t n, int64_t at, const std::string& path) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, static_cast<size_t>(n), at);
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got > 0, "reading '", path, "' at byte ", at, " failed: ",
                got == 0 ? "the file ends there (truncated while open?)" : std::strerror(errno));
    p += got;
    at += got;
    n -= got;
  }
}

// A file open for reading with pread: many threads read it at once, and what
// is read lands in the page cache (shared by every process of the host), not
// in this process's resident memory as a mapping's pages would.
struct TokenStoreFile {
  std::string path;
  int fd = -1;
  int64_t bytes = 0;
  explicit TokenStoreFile(std::string p) : path(std::move(p)) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK_VALUE(fd >= 0, "token store: cannot open '", path, "': ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      TORCH_CHECK(false, "token store: cannot stat '", path, "': ", std::strerror(e));
    }
    bytes = static_cast<int64_t>(st.st_size);
  }
  ~TokenStoreFile() { ::close(fd); }
  TokenStoreFile(const TokenStoreFile&) = delete;
  TokenStoreFile& operator=(const TokenStoreFile&) = delete;
  // Bytes [at, at + n), all of them or an error naming the file.
  void read(void* out, int64_t n, int64_t at) const { read_file_range(fd, out, n, at, path); }
};

namespace {

// The last block of one of a store's index arrays a thread read, so that a
// scan (packing, verify, append) reads each block once. Blocks are keyed by
// the store's serial number (never reused) and the array's byte offset.
struct IndexBlock {
  uint64_t store = 0;
  int64_t first = -1;  // byte offset in .idx
  int64_t bytes = 0;
  char data[16384];
};

std::atomic<uint64_t> next_store_serial{1};

}  // namespace

std::string to_string(TokenType type) {
  switch (type) {
    case TokenType::kUInt8: return "uint8";
    case TokenType::kInt8: return "int8";
    case TokenType::kInt16: return "int16";
    case TokenType::kInt32: return "int32";
    case TokenType::kInt64: return "int64";
    case TokenType::kUInt16: return "uint16";
  }
  return "type code " + std::to_string(static_cast<int>(type));
}

int64_t token_bytes(TokenType type) {
  switch (type) {
    case TokenType::kUInt8:
    case TokenType::kInt8: return 1;
    case TokenType::kInt16:
    case TokenType::kUInt16: return 2;
    case TokenType::kInt32: return 4;
    case TokenType::kInt64: return 8;
  }
  TORCH_CHECK_VALUE(false, "token store: unknown token type code ", static_cast<int>(type));
}

TokenType token_type_for(int64_t vocab_size) { return vocab_size < 65500 ? TokenType::kUInt16 : TokenType::kInt32; }

// ---------------------------------------------------------------------------------------------
// Reader

struct TokenStore::Files {
  std::string prefix;
  std::unique_ptr<TokenStoreFile> idx, bin;
  uint64_t serial = next_store_serial++;
  TokenType type = TokenType::kUInt16;
  int64_t item = 2, sequences = 0, documents = 0;  // documents: entries of the document array less one
  int64_t lengths = 0, pointers = 0, ends = 0;     // the arrays' byte offsets in .idx

  // Entry i of the index array at byte `array`, of T, through this thread's block for that array.
  template <typename T>
  T entry(int64_t array, int64_t i, int which) const {
    thread_local std::array<IndexBlock, 3> blocks;
    IndexBlock& b = blocks[static_cast<size_t>(which)];
    const int64_t at = array + static_cast<int64_t>(sizeof(T)) * i;
    if (b.store != serial || at < b.first || at + static_cast<int64_t>(sizeof(T)) > b.first + b.bytes) {
      const int64_t start = array + (at - array) / static_cast<int64_t>(sizeof(b.data)) * static_cast<int64_t>(sizeof(b.data));
      b.bytes = std::min<int64_t>(sizeof(b.data), idx->bytes - start);
      b.store = 0;  // no store's block until the read succeeds (serials start at 1)
      idx->read(b.data, b.bytes, start);
      b.store = serial;
      b.first = start;
    }
    return load<T>(b.data + (at - b.first));
  }
  int64_t length(int64_t i) const { return entry<int32_t>(lengths, i, 0); }
  int64_t pointer(int64_t i) const { return entry<int64_t>(pointers, i, 1); }
  int64_t end(int64_t d) const { return entry<int64_t>(ends, d, 2); }  // documents[d]
};

TokenStore::TokenStore(const std::string& prefix) : m_(std::make_unique<Files>()) {
  auto& m = *m_;
  m.prefix = prefix;
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  TORCH_CHECK_VALUE(fs::exists(idx), "token store '", prefix, "': no index '", idx, "' (prepare the corpus into it, "
                    "or give the prefix of a store: PREFIX.idx and PREFIX.bin)");
  m.idx = std::make_unique<TokenStoreFile>(idx);
  char h[kHeaderBytes] = {};
  if (m.idx->bytes >= kHeaderBytes) m.idx->read(h, kHeaderBytes, 0);
  TORCH_CHECK_VALUE(m.idx->bytes >= kHeaderBytes && std::memcmp(h, kMagic, sizeof(kMagic)) == 0, "token store: '",
                    idx, "' is not an indexed dataset index (it does not start with MMIDIDX)");
  const auto version = load<uint64_t>(h + 9);
  TORCH_CHECK_VALUE(version == 1, "token store: '", idx, "' has index version ", version, "; version 1 is read");
  const auto code = static_cast<uint8_t>(h[17]);
  TORCH_CHECK_VALUE(known(code), "token store: '", idx, "' holds ",
                    code == 6 ? "float64" : code == 7 ? "float32" : "type code " + std::to_string(code),
                    " values, not token ids (integer types are read)");
  m.type = static_cast<TokenType>(code);
  m.item = token_bytes(m.type);
  const auto n = load<uint64_t>(h + 18), d = load<uint64_t>(h + 26);
  const auto expect = static_cast<uint64_t>(kHeaderBytes) + 12 * n + 8 * d;  // overflow-safe for real files
  const auto got = static_cast<uint64_t>(m.idx->bytes);
  TORCH_CHECK_VALUE(n < (uint64_t{1} << 40) && d >= 1 && d < (uint64_t{1} << 40) && (got == expect || got == expect + n),
                    "token store: '", idx, "' is ", got, " bytes but its header counts ", n, " sequences and ", d,
                    " document entries (", expect, " bytes): the index is truncated or damaged; prepare it again");
  m.sequences = static_cast<int64_t>(n);
  m.documents = static_cast<int64_t>(d) - 1;
  m.lengths = kHeaderBytes;
  m.pointers = m.lengths + 4 * m.sequences;
  m.ends = m.pointers + 8 * m.sequences;
  TORCH_CHECK_VALUE(m.end(0) == 0 && m.end(m.documents) == m.sequences, "token store: '", idx,
                    "': its document array runs from ", m.end(0), " to ", m.end(m.documents), ", not from 0 to its ",
                    n, " sequences: the index is damaged; prepare it again");
  TORCH_CHECK_VALUE(fs::exists(bin), "token store '", prefix, "': its index is there but not its tokens '", bin, "'");
  m.bin = std::make_unique<TokenStoreFile>(bin);
  const int64_t need = n == 0 ? 0 : m.pointer(m.sequences - 1) + m.length(m.sequences - 1) * m.item;
  TORCH_CHECK_VALUE(m.bin->bytes == need && m.bin->bytes % m.item == 0, "token store: '", bin, "' is ", m.bin->bytes,
                    " bytes but its index ends at byte ", need, " (", to_string(m.type), " tokens): ",
                    m.bin->bytes < need ? "the tokens are truncated" : "the index is not this file's",
                    "; prepare the store again");
  // The kernel reads what a batch touches, not ahead: sequences are read in random order.
  ::posix_fadvise(m.bin->fd, 0, 0, POSIX_FADV_RANDOM);
}

TokenStore::~TokenStore() = default;
TokenStore::TokenStore(TokenStore&&) noexcept = default;
TokenStore& TokenStore::operator=(TokenStore&&) noexcept = default;

const std::string& TokenStore::prefix() const { return m_->prefix; }
TokenType TokenStore::type() const { return m_->type; }
int64_t TokenStore::sequences() const { return m_->sequences; }
int64_t TokenStore::documents() const { return m_->documents; }
int64_t TokenStore::tokens() const { return m_->bin->bytes / m_->item; }

int64_t TokenStore::length(int64_t i) const {
  TORCH_CHECK_INDEX(i >= 0 && i < m_->sequences, "token store '", m_->prefix, "': sequence ", i, " of ",
                    m_->sequences);
  return m_->length(i);
}

int64_t TokenStore::document_begin(int64_t d) const {
  TORCH_CHECK_INDEX(d >= 0 && d < m_->documents, "token store '", m_->prefix, "': document ", d, " of ",
                    m_->documents);
  return m_->end(d);
}

int64_t TokenStore::document_end(int64_t d) const {
  TORCH_CHECK_INDEX(d >= 0 && d < m_->documents, "token store '", m_->prefix, "': document ", d, " of ",
                    m_->documents);
  return m_->end(d + 1);
}

void TokenStore::read(int64_t i, int64_t offset, int64_t count, std::vector<int64_t>& out) const {
  const auto& m = *m_;
  const int64_t len = length(i);
  TORCH_CHECK_INDEX(offset >= 0 && count >= 0 && offset + count <= len, "token store '", m.prefix, "': tokens [",
                    offset, ", ", offset + count, ") of sequence ", i, ", which has ", len);
  const int64_t at = m.pointer(i);
  TORCH_CHECK_VALUE(len >= 0 && at >= 0 && at + len * m.item <= m.bin->bytes, "token store '", m.prefix,
                    "': sequence ", i, " (", len, " tokens at byte ", at, ") lies outside its ", m.bin->bytes,
                    "-byte .bin: the index is damaged; prepare the store again");
  thread_local std::vector<char> bytes;
  bytes.resize(static_cast<size_t>(count * m.item));
  m.bin->read(bytes.data(), count * m.item, at + offset * m.item);
  const char* p = bytes.data();
  const size_t base = out.size();
  out.resize(base + static_cast<size_t>(count));
  int64_t* o = out.data() + base;
  switch (m.type) {
    case TokenType::kUInt8:
      for (int64_t k = 0; k < count; ++k) o[k] = load<uint8_t>(p + k);
      break;
    case TokenType::kInt8:
      for (int64_t k = 0; k < count; ++k) o[k] = load<int8_t>(p + k);
      break;
    case TokenType::kInt16:
      for (int64_t k = 0; k < count; ++k) o[k] = load<int16_t>(p + 2 * k);
      break;
    case TokenType::kUInt16:
      for (int64_t k = 0; k < count; ++k) o[k] = load<uint16_t>(p + 2 * k);
      break;
    case TokenType::kInt32:
      for (int64_t k = 0; k < count; ++k) o[k] = load<int32_t>(p + 4 * k);
      break;
    case TokenType::kInt64:
      std::memcpy(o, p, static_cast<size_t>(count) * 8);
      break;
  }
}

std::vector<int64_t> TokenStore::sequence(int64_t i) const {
  std::vector<int64_t> out;
  read(i, 0, length(i), out);
  return out;
}

void TokenStore::verify() const {
  const auto& m = *m_;
  int64_t at = 0;
  for (int64_t i = 0; i < m.sequences; ++i) {
    const int64_t len = m.length(i);
    TORCH_CHECK_VALUE(len >= 0 && m.pointer(i) == at, "token store '", m.prefix, "': sequence ", i, " has length ",
                      len, " at byte ", m.pointer(i), " where byte ", at,
                      " was expected: the index is damaged; prepare the store again");
    at += len * m.item;
  }
  for (int64_t d = 0; d < m.documents; ++d) {
    TORCH_CHECK_VALUE(m.end(d) <= m.end(d + 1), "token store '", m.prefix, "': document ", d,
                      " ends before it begins: the index is damaged; prepare the store again");
  }
}

namespace {

// XXH3-64 of a whole file, read front to back in chunks.
uint64_t file_xxh3(const TokenStoreFile& f) {
  ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  std::vector<char> buf(kChunk);
  for (int64_t at = 0; at < f.bytes;) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(buf.size()), f.bytes - at);
    try {
      f.read(buf.data(), n, at);
    } catch (...) {
      XXH3_freeState(h);
      throw;
    }
    XXH3_64bits_update(h, buf.data(), static_cast<size_t>(n));
    at += n;
  }
  const uint64_t digest = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_RANDOM);
  return digest;
}

}  // namespace

TokenStoreDigest TokenStore::digest() const {
  const auto& m = *m_;
  TokenStoreDigest d;
  d.bin_bytes = static_cast<uint64_t>(m.bin->bytes);
  d.bin_xxh3 = file_xxh3(*m.bin);
  d.idx_bytes = static_cast<uint64_t>(m.idx->bytes);
  d.idx_xxh3 = file_xxh3(*m.idx);
  return d;
}

// ---------------------------------------------------------------------------------------------
// Writer

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
