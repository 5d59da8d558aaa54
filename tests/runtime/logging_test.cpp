// The "zeroshard" logger: rank/world in every line, info from rank 0 only,
// warnings from every rank, ZS_LOG_LEVEL honoured and checked.
#include "test_util.h"

#include <gtest/gtest.h>

namespace zeroshard {
namespace logging_test {

testing::CommandResult log_run(const std::string& level) {
  return testing::run_command((level.empty() ? "" : "ZS_LOG_LEVEL=" + level + " ") + testing::build_dir() +
                              "/zeroshard-run --nproc-per-node 3 -- " + testing::build_dir() +
                              "/tests/zs_tests --helper log_lines");
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TEST(Logging, InfoFromRankZeroWarningsFromEveryRank) {
  auto r = log_run("");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "[zeroshard info] [rank 0/3] info line"), 1u) << r.output;
  EXPECT_EQ(count(r.output, "info line"), 1u) << "info from ranks other than 0:\n" << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(count(r.output, "[zeroshard warning] [rank " + std::to_string(rank) + "/3] warn line"), 1u)
        << r.output;
  }
  EXPECT_EQ(count(r.output, "debug line"), 0u) << r.output;
}

TEST(Logging, LevelComesFromTheEnvironment) {
  auto r = log_run("debug");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "debug line"), 3u) << "debug was asked for on every rank:\n" << r.output;
  r = log_run("warn");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "info line"), 0u) << r.output;
  EXPECT_EQ(count(r.output, "warn line"), 3u) << r.output;
  r = log_run("loud");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("ZS_LOG_LEVEL='loud' is not a log level"), std::string::npos) << r.output;
}

}  // namespace logging_test
}  // namespace zeroshard
