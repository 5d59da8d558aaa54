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

FileDigest digest_file(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  TORCH_CHECK(f != nullptr, "cannot open '", path, "' to checksum it: ", std::strerror(errno));
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(),
                                                                       &XXH3_freeState);
  TORCH_CHECK(state && XXH3_64bits_reset(state.get()) == XXH_OK, "xxh3: cannot create a hash state");
  std::vector<char> chunk(1 << 20);
  FileDigest d;
  while (true) {
    const size_t n = std::fread(chunk.data(), 1, chunk.size(), f.get());
    if (n > 0) {
      XXH3_64bits_update(state.get(), chunk.data(), n);
      d.bytes += n;
    }
    if (n < chunk.size()) {
      TORCH_CHECK(!std::ferror(f.get()), "reading '", path, "' failed: ", std::strerror(errno));
      break;
    }
  }
  d.xxh3 = XXH3_64bits_digest(state.get());
  return d;
}

uint64_t digest_bytes(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

std::string to_hex(uint64_t value) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(value));
  return buf;
}

}  // namespace zeroshard::checkpoint
