// File checksums against the xxhash project's own CLI (`xxhsum -H3`).
#include "checksum.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace zeroshard {
namespace checksum_test {

TEST(Checksum, MatchesXxhsumH3AcrossChunkBoundaries) {
  const auto dir = testing::make_temp_dir("xxh");
  // Sizes around the 1 MiB read chunk, and an empty file.
  for (size_t size : {size_t(0), size_t(1), size_t(1 << 20), size_t((1 << 20) + 13), size_t(3'000'001)}) {
    const std::string path = dir + "/f" + std::to_string(size);
    {
      std::ofstream f(path, std::ios::binary);
      for (size_t i = 0; i < size; ++i) f.put(static_cast<char>((i * 2654435761u) >> 13));
    }
    auto d = checkpoint::digest_file(path);
    EXPECT_EQ(d.bytes, size);
    auto r = testing::run_command("xxhsum -H3 " + path);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("= " + checkpoint::to_hex(d.xxh3)), std::string::npos)
        << "ours " << checkpoint::to_hex(d.xxh3) << ", xxhsum: " << r.output;
  }
  std::filesystem::remove_all(dir);
}

TEST(Checksum, MissingFileIsNamed) {
  try {
    checkpoint::digest_file("/nonexistent/rank-00000-of-00002.h5");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("/nonexistent/rank-00000-of-00002.h5"),
              std::string::npos);
  }
}

}  // namespace checksum_test
}  // namespace zeroshard
