// The minimal example (ShardedAdamW) trains to a low loss, and 4 ranks (stage 2)
// and 2 ranks (stage 1) train the same model as 1.
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <regex>

namespace zeroshard {
namespace minimal_example_test {

double final_loss(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex("final loss ([0-9.]+)"))) return -1;
  return std::stod(m[1]);
}

TEST(MinimalExample, ConvergesAndMatchesAcrossWorldSizes) {
  const auto dir = testing::make_temp_dir("minimal");
  const std::string bin = testing::build_dir() + "/examples/zs_minimal --steps 150 --global-batch 128";
  const std::string run = testing::build_dir() + "/zeroshard-run";
  auto one = testing::run_command(run + " --nproc-per-node 1 -- " + bin + " --save-params " + dir + "/p1.pt");
  auto four = testing::run_command(run + " --nproc-per-node 4 -- " + bin + " --save-params " + dir + "/p4.pt");
  auto two = testing::run_command(run + " --nproc-per-node 2 -- " + bin + " --stage 1 --save-params " + dir + "/p2.pt");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(four.exit_code, 0) << four.output;
  ASSERT_EQ(two.exit_code, 0) << two.output;

  // The threshold: the synthetic target's variance is ~1.2; a trained MLP gets far below.
  constexpr double kLossThreshold = 0.05;
  EXPECT_GT(final_loss(one.output), 0) << one.output;
  EXPECT_LT(final_loss(one.output), kLossThreshold) << one.output;
  EXPECT_LT(final_loss(four.output), kLossThreshold) << four.output;

  torch::Tensor p1, p4, p2;
  torch::load(p1, dir + "/p1.pt");
  torch::load(p4, dir + "/p4.pt");
  torch::load(p2, dir + "/p2.pt");
  ASSERT_EQ(p1.sizes(), p4.sizes());
  ASSERT_EQ(p1.sizes(), p2.sizes());
  EXPECT_TRUE(torch::allclose(p1, p2, /*rtol=*/1e-4, /*atol=*/1e-5)) << "stage 1 at 2 ranks";
  // Same global batches; only the gradient summation order differs, so float rounding.
  const double max_diff = (p1 - p4).abs().max().item<double>();
  std::printf("minimal example: max |p1 - p4| = %.3g over %lld parameters\n", max_diff,
              static_cast<long long>(p1.numel()));
  EXPECT_LT(max_diff, 1e-4);
  EXPECT_TRUE(torch::allclose(p1, p4, /*rtol=*/1e-4, /*atol=*/1e-5));
  std::filesystem::remove_all(dir);
}

}  // namespace minimal_example_test
}  // namespace zeroshard
