// checksum.h — xxh3-64 checksums of files, as recorded in checkpoint manifests.
//
// Streams the file in fixed-size chunks (memory use is constant, whatever the
// file size). Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace zeroshard::checkpoint {

struct FileDigest {
  uint64_t xxh3 = 0;  // XXH3_64bits of the whole file, seed 0
  uint64_t bytes = 0;
};

// Throws c10::Error naming the file when it cannot be read.
FileDigest digest_file(const std::string& path);

// A digest fed in order, piece by piece: value() equals digest_bytes() of the pieces joined.
// Not copyable; one thread at a time.
class Digest {
 public:
  Digest();
  ~Digest();
  Digest(const Digest&) = delete;
  Digest& operator=(const Digest&) = delete;
  void update(const void* data, size_t bytes);
  uint64_t value() const;

 private:
  void* state_;  // XXH3_state_t
};

// XXH3_64bits of `bytes` bytes at `data`, seed 0 (a file's digest when they are its contents).
uint64_t digest_bytes(const void* data, size_t bytes);

// 16 lowercase hex digits, as `xxhsum -H3` prints them.
std::string to_hex(uint64_t value);

}  // namespace zeroshard::checkpoint
