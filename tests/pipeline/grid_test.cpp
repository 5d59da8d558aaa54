// The pp x dp grid at the world size of the run (1-4 ranks): every divisor as
// the stage count, each group's members named by their world ranks, posted
// sends between pipeline neighbours in both directions at once, and tie groups.
#include "test_util.h"
#include "zeroshard/pipeline_grid.h"

#include <gtest/gtest.h>

namespace zeroshard::pipeline {
namespace grid_test {

using testing::world;
using testing::world_ptr;

// The world ranks of a group's members, in its rank order.
std::vector<std::string> members(const ProcessGroup& g) {
  return all_gather_text(*g.control, std::to_string(world().rank()));
}
std::vector<std::string> names(std::vector<int> ranks) {
  std::vector<std::string> out;
  for (int r : ranks) out.push_back(std::to_string(r));
  return out;
}

TEST(PipelineGrid, EveryStageCountLaysOutRanksStageMajor) {
  const int n = world().size(), rank = world().rank();
  for (int pp = 1; pp <= n; ++pp) {
    if (n % pp != 0) continue;
    SCOPED_TRACE("pp " + std::to_string(pp));
    GridOptions o;
    o.stages = pp;
    if (pp >= 2) o.ties = {{0, pp - 1}};
    const PipelineGrid grid(world_ptr(), o);
    const int dp = n / pp;
    ASSERT_EQ(grid.dp(), dp);
    EXPECT_EQ(grid.stage(), rank / dp);
    EXPECT_EQ(grid.dp_rank(), rank % dp);
    std::vector<int> want;
    for (int d = 0; d < dp; ++d) want.push_back(grid.world_rank(grid.stage(), d));
    EXPECT_EQ(members(grid.dp_group()), names(want));
    want.clear();
    for (int s = 0; s < pp; ++s) want.push_back(s * dp + grid.dp_rank());
    EXPECT_EQ(members(grid.pp_group()), names(want));
    EXPECT_EQ(grid.pp_group().data->rank(), grid.stage());
    if (pp >= 2) {
      const auto& tie = grid.tie_group(0);
      const bool in_tie = grid.stage() == 0 || grid.stage() == pp - 1;
      ASSERT_EQ(tie.data != nullptr, in_tie);
      if (in_tie) {
        EXPECT_EQ(members(tie), names({grid.dp_rank(), (pp - 1) * dp + grid.dp_rank()}));
      }
      // Neighbours exchange both ways at once: activations down, gradients up.
      auto& pipe = *grid.pp_group().data;
      const int s = grid.stage();
      std::vector<std::shared_ptr<Work>> works;
      auto from_prev = at::zeros({5}), from_next = at::zeros({7});
      if (s > 0) works.push_back(pipe.recv(from_prev, s - 1));
      if (s + 1 < pp) works.push_back(pipe.recv(from_next, s + 1));
      if (s + 1 < pp) works.push_back(pipe.send(testing::pattern(s, 5, at::kFloat), s + 1));
      if (s > 0) works.push_back(pipe.send(testing::pattern(s, 7, at::kFloat, 1), s - 1));
      for (auto& w : works) w->wait();
      if (s > 0) {
        EXPECT_TRUE(from_prev.equal(testing::pattern(s - 1, 5, at::kFloat)));
      }
      if (s + 1 < pp) {
        EXPECT_TRUE(from_next.equal(testing::pattern(s + 1, 7, at::kFloat, 1)));
      }
    }
  }
}

TEST(PipelineGrid, BadOptionsFailOnEveryRank) {
  const int n = world().size();
  GridOptions o;
  o.stages = n + 1;
  std::string err = testing::error_of([&] { PipelineGrid g(world_ptr(), o); });
  EXPECT_NE(err.find(std::to_string(n + 1) + " pipeline stages do not divide the " + std::to_string(n) + " ranks"),
            std::string::npos) << err;
  o.stages = 1;
  o.ties = {{0}};
  err = testing::error_of([&] { PipelineGrid g(world_ptr(), o); });
  EXPECT_NE(err.find("tie 0 names 1 stage(s)"), std::string::npos) << err;
  if (n < 2) GTEST_SKIP() << "the rest (ranks that disagree) needs 2 ranks; collectives_np2..4 run it";
  o.stages = world().rank() == 0 ? 1 : n;  // ranks disagree: named, not a hang
  o.ties = {};
  err = testing::error_of([&] { PipelineGrid g(world_ptr(), o); });
  EXPECT_NE(err.find("PipelineGrid options"), std::string::npos) << err;
}

}  // namespace grid_test
}  // namespace zeroshard::pipeline
