// TokenStore / TokenStoreWriter: the Megatron indexed layout byte for byte
// (closed form), every sequence read back, merging parts, and every damage
// refused by name. megatron-core's own reader and builder are the oracle in
// tests/data/check_megatron.py.
#include "test_util.h"

#include <zeroshard/token_store.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace zeroshard {
namespace token_store_test {

namespace fs = std::filesystem;
using Documents = std::vector<std::vector<std::vector<int64_t>>>;  // documents of sequences of tokens

// Documents with sequences of varied lengths (empty ones too) and ids that use the type's range.
Documents sample(int64_t top, int documents, int seed) {
  Documents out(static_cast<size_t>(documents));
  for (int d = 0; d < documents; ++d) {
    const int n = (d * 7 + seed) % 5;  // 0..4 sequences: an empty document too
    for (int s = 0; s < n; ++s) {
      std::vector<int64_t> seq;
      for (int k = 0; k < (s * 13 + d * 3 + seed) % 9; ++k) seq.push_back((d * 1009 + s * 31 + k * 7919 + seed) % (top + 1));
      if (s == 0 && d == 1) seq.push_back(top);  // the largest id the type holds
      out[static_cast<size_t>(d)].push_back(seq);
    }
  }
  return out;
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Writes the documents; checks the checksums the writer took against the files' own.
void write(const std::string& prefix, TokenType type, const Documents& docs) {
  TokenStoreWriter w(prefix, type);
  for (const auto& d : docs) {
    for (const auto& s : d) w.add(s);
    w.end_document();
  }
  const auto digest = w.finish();
  const auto bin = bytes_of(prefix + ".bin"), idx = bytes_of(prefix + ".idx");
  EXPECT_EQ(digest.bin_bytes, bin.size());
  EXPECT_EQ(digest.bin_xxh3, XXH3_64bits(bin.data(), bin.size()));
  EXPECT_EQ(digest.idx_bytes, idx.size());
  EXPECT_EQ(digest.idx_xxh3, XXH3_64bits(idx.data(), idx.size()));
  const auto read = TokenStore(prefix).digest();
  EXPECT_EQ(read.bin_xxh3, digest.bin_xxh3);
  EXPECT_EQ(read.idx_xxh3, digest.idx_xxh3);
}

template <typename T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

TEST(TokenStore, WritesMegatronsLayoutAndReadsEverySequenceBack) {
  const auto dir = testing::make_temp_dir("token_store");
  for (auto [type, top] : {std::pair{TokenType::kUInt16, int64_t{65535}}, std::pair{TokenType::kInt32, int64_t{2147483647}},
                           std::pair{TokenType::kUInt8, int64_t{255}}, std::pair{TokenType::kInt64, int64_t{1} << 40}}) {
    const std::string prefix = dir + "/s" + to_string(type);
    const auto docs = sample(top, 9, 3);
    write(prefix, type, docs);
    // The index in closed form: header, lengths, consecutive byte pointers, document ends.
    std::string idx("MMIDIDX\0\0", 9), bin;
    std::vector<int32_t> lengths;
    std::vector<int64_t> pointers, ends{0};
    int64_t at = 0;
    for (const auto& d : docs) {
      for (const auto& s : d) {
        lengths.push_back(static_cast<int32_t>(s.size()));
        pointers.push_back(at);
        at += static_cast<int64_t>(s.size()) * token_bytes(type);
        for (int64_t t : s) bin.append(reinterpret_cast<const char*>(&t), static_cast<size_t>(token_bytes(type)));
      }
      ends.push_back(static_cast<int64_t>(lengths.size()));
    }
    put<uint64_t>(idx, 1);
    put<uint8_t>(idx, static_cast<uint8_t>(type));
    put<uint64_t>(idx, lengths.size());
    put<uint64_t>(idx, ends.size());
    for (auto v : lengths) put(idx, v);
    for (auto v : pointers) put(idx, v);
    for (auto v : ends) put(idx, v);
    EXPECT_EQ(bytes_of(prefix + ".idx"), idx) << to_string(type);
    EXPECT_EQ(bytes_of(prefix + ".bin"), bin) << to_string(type);  // little-endian, as x86 writes
    for (const char* partial : {".bin.partial", ".idx.partial", ".lengths.partial", ".documents.partial"}) {
      EXPECT_FALSE(fs::exists(prefix + partial)) << partial;
    }

    TokenStore store(prefix);
    EXPECT_EQ(store.type(), type);
    EXPECT_EQ(store.documents(), 9);
    EXPECT_EQ(store.sequences(), static_cast<int64_t>(lengths.size()));
    EXPECT_EQ(store.tokens(), at / token_bytes(type));
    store.verify();
    int64_t i = 0;
    for (int64_t d = 0; d < store.documents(); ++d) {
      const auto& doc = docs[static_cast<size_t>(d)];
      ASSERT_EQ(store.document_end(d) - store.document_begin(d), static_cast<int64_t>(doc.size()));
      for (const auto& s : doc) {
        EXPECT_EQ(store.document_begin(d) + (&s - doc.data()), i);
        EXPECT_EQ(store.sequence(i), s) << "sequence " << i;
        if (s.size() >= 3) {  // a slice
          std::vector<int64_t> part{-1};
          store.read(i, 1, 2, part);
          EXPECT_EQ(part, (std::vector<int64_t>{-1, s[1], s[2]}));
        }
        ++i;
      }
    }
  }
  fs::remove_all(dir);
}

TEST(TokenStore, PartsAppendedEqualTheWholeWrittenAtOnce) {
  const auto dir = testing::make_temp_dir("token_store_merge");
  const auto a = sample(50000, 5, 1), b = sample(50000, 7, 2), c = sample(50000, 1, 4);
  write(dir + "/a", TokenType::kUInt16, a);
  write(dir + "/b", TokenType::kUInt16, b);
  write(dir + "/c", TokenType::kUInt16, c);
  Documents all = a;
  all.insert(all.end(), b.begin(), b.end());
  all.insert(all.end(), c.begin(), c.end());
  write(dir + "/whole", TokenType::kUInt16, all);
  {
    TokenStoreWriter w(dir + "/merged", TokenType::kUInt16);
    w.append(TokenStore(dir + "/a"));
    w.append(TokenStore(dir + "/b"));
    for (const auto& s : c.front()) w.add(s);  // appends and documents of its own mix
    w.end_document();
    w.finish();
    EXPECT_EQ(w.documents(), 13);
  }
  for (const char* ext : {".idx", ".bin"}) {
    EXPECT_EQ(bytes_of(dir + "/merged" + ext), bytes_of(dir + "/whole" + ext)) << ext;
  }
  TokenStoreWriter w(dir + "/wide", TokenType::kInt32);
  try {
    w.append(TokenStore(dir + "/a"));
    ADD_FAILURE() << "appended uint16 tokens to an int32 store";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("whose tokens are uint16, to int32 tokens"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(TokenStore, AnUnfinishedWriterLeavesNoStore) {
  const auto dir = testing::make_temp_dir("token_store_partial");
  {
    TokenStoreWriter w(dir + "/s", TokenType::kUInt16);
    w.add({1, 2, 3});
    w.end_document();
    EXPECT_TRUE(fs::exists(dir + "/s.bin.partial"));
  }  // a prepare that stopped before finish()
  EXPECT_TRUE(fs::is_empty(dir));
  try {
    TokenStore store(dir + "/s");
    ADD_FAILURE() << "opened a store that was never finished";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no index '" + dir + "/s.idx'"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

void expect_refused(const std::string& prefix, const std::string& what) {
  try {
    TokenStore store(prefix);
    store.verify();
    ADD_FAILURE() << "opened a damaged store; expected: " << what;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(TokenStore, DamageIsRefusedNamingTheFile) {
  const auto dir = testing::make_temp_dir("token_store_damage");
  const std::string p = dir + "/s";
  write(p, TokenType::kUInt16, sample(1000, 6, 5));
  const auto idx = bytes_of(p + ".idx"), bin = bytes_of(p + ".bin");
  auto rewrite = [&](const std::string& ext, const std::string& bytes) { std::ofstream(p + ext, std::ios::binary) << bytes; };

  rewrite(".bin", bin.substr(0, bin.size() - 2));
  expect_refused(p, "'" + p + ".bin' is " + std::to_string(bin.size() - 2) + " bytes but its index ends at byte " +
                        std::to_string(bin.size()) + " (uint16 tokens): the tokens are truncated");
  rewrite(".bin", bin);
  rewrite(".idx", idx.substr(0, idx.size() - 8));
  expect_refused(p, "'" + p + ".idx' is " + std::to_string(idx.size() - 8) + " bytes but its header counts");
  rewrite(".idx", "MMIDIDY" + idx.substr(7));
  expect_refused(p, "'" + p + ".idx' is not an indexed dataset index");
  std::string floats = idx;
  floats[17] = 7;
  rewrite(".idx", floats);
  expect_refused(p, "holds float32 values, not token ids");
  std::string version = idx;
  version[9] = 2;
  rewrite(".idx", version);
  expect_refused(p, "has index version 2");
  // A pointer moved inside the file: caught by verify(), which reads the whole index.
  std::string moved = idx;
  const int64_t n = TokenStore((rewrite(".idx", idx), p)).sequences();
  int64_t second = 0;
  std::memcpy(&second, moved.data() + 34 + 4 * n + 8, 8);
  second += 2;
  std::memcpy(moved.data() + 34 + 4 * n + 8, &second, 8);
  rewrite(".idx", moved);
  expect_refused(p, "sequence 1 has length");
  rewrite(".idx", idx);
  fs::remove(p + ".bin");
  expect_refused(p, "its index is there but not its tokens '" + p + ".bin'");
  fs::remove_all(dir);
}

// An index read that fails part-way (the file truncated while open) throws,
// and leaves nothing behind for later reads of the same thread: the block it
// was reading into is no longer taken for the store's, so an entry of the
// first block comes from the file again, not from the failed read's bytes.
TEST(TokenStore, AFailedIndexReadLeavesNoStaleEntries) {
  const auto dir = testing::make_temp_dir("token_store_failed_read");
  const std::string p = dir + "/s";
  constexpr int64_t kSequences = 6000;  // lengths: 24,000 bytes, two 16 KiB blocks
  {
    TokenStoreWriter w(p, TokenType::kUInt16);
    for (int64_t i = 0; i < kSequences; ++i) w.add(std::vector<int64_t>(static_cast<size_t>(1 + i % 7), 5));
    w.end_document();
    w.finish();
  }
  TokenStore store(p);
  ASSERT_EQ(store.sequences(), kSequences);
  EXPECT_EQ(store.length(0), 1);
  fs::resize_file(p + ".idx", 34 + 16384 + 100);  // the second block of lengths: 100 bytes, then the end
  const auto error = testing::error_of([&] { store.length(5000); });
  EXPECT_NE(error.find("reading '" + p + ".idx' at byte"), std::string::npos) << error;
  EXPECT_NE(error.find("the file ends there"), std::string::npos) << error;
  for (int64_t i : {0, 1, 2, 3, 4095}) EXPECT_EQ(store.length(i), 1 + i % 7) << "sequence " << i;
  fs::remove_all(dir);
}

// A short read or a read a signal interrupted (EINTR: the preemption guard's
// handlers do not restart system calls) is read again; the file's end and
// other errors are named. The interruptions are injected by this test
// program's pread (below), which returns EINTR or a short count when asked.
std::atomic<int> preads_interrupted{0}, preads_short{0};

TEST(TokenStore, ReadFileRangeRetriesInterruptedAndShortReads) {
  const auto dir = testing::make_temp_dir("read_file_range");
  const std::string path = dir + "/f";
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>('a' + i % 26);
  std::ofstream(path, std::ios::binary) << text;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::string got(300, '\0');
  preads_interrupted = 3;
  preads_short = 2;
  read_file_range(fd, got.data(), 300, 100, path);
  EXPECT_EQ(got, text.substr(100, 300));
  EXPECT_EQ(preads_interrupted.load(), 0) << "the injected interruptions were not all met";
  EXPECT_EQ(preads_short.load(), 0);
  const auto past_end = testing::error_of([&] { read_file_range(fd, got.data(), 300, 800, path); });
  EXPECT_NE(past_end.find("reading '" + path + "' at byte 1000 failed: the file ends there"), std::string::npos)
      << past_end;
  ::close(fd);
  const auto closed = testing::error_of([&] { read_file_range(fd, got.data(), 10, 0, path); });
  EXPECT_NE(closed.find("reading '" + path + "' at byte 0 failed: Bad file descriptor"), std::string::npos) << closed;
  fs::remove_all(dir);
}

TEST(TokenStore, ATokenThatDoesNotFitIsRefusedByName) {
  const auto dir = testing::make_temp_dir("token_store_fit");
  TokenStoreWriter w(dir + "/s", TokenType::kUInt16);
  try {
    w.add({5, 65536});
    ADD_FAILURE() << "wrote 65536 as a uint16";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 65536 does not fit its uint16 tokens (0..65535)"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(token_type_for(50265), TokenType::kUInt16);  // BART's vocabulary
  EXPECT_EQ(token_type_for(65500), TokenType::kInt32);
  fs::remove_all(dir);
}

}  // namespace token_store_test
}  // namespace zeroshard

// The test program's pread: libc's, except that while the counters above are
// positive a call fails with EINTR or reads half of what was asked.
extern "C" ssize_t pread(int fd, void* buf, size_t n, off_t at) {
  using Pread = ssize_t (*)(int, void*, size_t, off_t);
  static const auto real = reinterpret_cast<Pread>(::dlsym(RTLD_NEXT, "pread"));
  auto& interrupted = zeroshard::token_store_test::preads_interrupted;
  auto& short_reads = zeroshard::token_store_test::preads_short;
  if (interrupted.load() > 0) {
    --interrupted;
    errno = EINTR;
    return -1;
  }
  if (short_reads.load() > 0 && n > 1) {
    --short_reads;
    return real(fd, buf, n / 2, at);
  }
  return real(fd, buf, n, at);
}
