// token_store.cpp — the Megatron-LM indexed dataset's reader (pread); token_store_writer.cpp writes it.
#include <zeroshard/token_store.h>

#include "data/token_store_format.h"

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

using namespace token_store_format;

namespace {

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

}  // namespace zeroshard
