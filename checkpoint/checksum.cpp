#include "checksum.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace zeroshard::checkpoint {

Digest::Digest() : state_(XXH3_createState()) {
  TORCH_CHECK(state_ != nullptr && XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)) == XXH_OK,
              "xxh3: cannot create a hash state");
}

Digest::~Digest() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void Digest::update(const void* data, size_t bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, bytes);
}

uint64_t Digest::value() const { return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_)); }

FileDigest digest_file(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  TORCH_CHECK(f != nullptr, "cannot open '", path, "' to checksum it: ", std::strerror(errno));
  Digest digest;
  std::vector<char> chunk(1 << 20);
  FileDigest d;
  while (true) {
    const size_t n = std::fread(chunk.data(), 1, chunk.size(), f.get());
    if (n > 0) {
      digest.update(chunk.data(), n);
      d.bytes += n;
    }
    if (n < chunk.size()) {
      TORCH_CHECK(!std::ferror(f.get()), "reading '", path, "' failed: ", std::strerror(errno));
      break;
    }
  }
  d.xxh3 = digest.value();
  return d;
}

uint64_t digest_bytes(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

std::string to_hex(uint64_t value) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(value));
  return buf;
}

}  // namespace zeroshard::checkpoint
