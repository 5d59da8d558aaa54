// Pipeline partitions, no communication: layout strings, uniform and
// balanced splits, and the check that no block is dropped or repeated.
#include "test_util.h"
#include "zeroshard/pipeline_partition.h"

#include <gtest/gtest.h>

#include <functional>
#include <random>

namespace zeroshard::pipeline {
namespace partition_test {

// A BART-like model: embeddings, ten layers, the head.
std::vector<Block> model(int layers = 10) {
  std::vector<Block> b{{"embed", "E", 100}};
  for (int i = 0; i < layers; ++i) b.push_back({"layers." + std::to_string(i), "t", 10});
  b.push_back({"head", "L", 50});
  return b;
}

std::vector<size_t> sizes(const Partition& p) {
  std::vector<size_t> out;
  for (const auto& s : p.stages) out.push_back(s.size());
  return out;
}

TEST(PipelinePartition, LayoutStringsReadAndWrite) {
  const auto blocks = model();
  const auto p = partition_by_layout(blocks, "E t*3 | t*4 | t*3 L");
  EXPECT_EQ(sizes(p), (std::vector<size_t>{4, 4, 4}));
  EXPECT_EQ(p.stages[1].front(), 4u);
  EXPECT_EQ(p.stage_of(11), 2u);
  EXPECT_EQ(to_layout(blocks, p), "E t*3 | t*4 | t*3 L");
  EXPECT_EQ(sizes(partition_by_layout(blocks, "E t t t t t t t t t t L")), (std::vector<size_t>{12}));
}

TEST(PipelinePartition, ALayoutThatDropsALayerIsNamed) {
  const auto blocks = model();
  std::string err = testing::error_of([&] { partition_by_layout(blocks, "E t*3 | t*4 | t*2"); });
  EXPECT_NE(err.find("covers 10 of the model's 12 blocks; block 10 'layers.9' (t) and 1 after it are in no stage"),
            std::string::npos) << err;
  err = testing::error_of([&] { partition_by_layout(blocks, "E t*3 | t*4 | t*3 L L"); });
  EXPECT_NE(err.find("names 13 or more blocks but the model has 12"), std::string::npos) << err;
  err = testing::error_of([&] { partition_by_layout(blocks, "E t*3 | L t*4 | t*3"); });
  EXPECT_NE(err.find("puts a 'L' in stage 1 where the model has block 4 'layers.3' (t)"), std::string::npos) << err;
  err = testing::error_of([&] { partition_by_layout(blocks, "E t*3 || t*7 L"); });
  EXPECT_NE(err.find("stage 1 of layout 'E t*3 || t*7 L' holds no block"), std::string::npos) << err;
  err = testing::error_of([&] { partition_by_layout(blocks, "E t*0 t*10 L"); });
  EXPECT_NE(err.find("'t*0' in layout"), std::string::npos) << err;
}

TEST(PipelinePartition, UniformSplitsByBlockCount) {
  EXPECT_EQ(sizes(partition_uniform(model(), 5)), (std::vector<size_t>{3, 3, 2, 2, 2}));
  EXPECT_EQ(sizes(partition_uniform(model(), 12)), (std::vector<size_t>(12, 1)));
  EXPECT_NE(testing::error_of([&] { partition_uniform(model(), 13); }).find("13 stages for 12 blocks"),
            std::string::npos);
}

// Against exhaustive search: every way to cut n blocks into k contiguous stages.
int64_t brute_force_best(const std::vector<Block>& blocks, size_t k) {
  int64_t best = -1;
  const size_t n = blocks.size();
  std::vector<size_t> cuts(k - 1);
  std::function<void(size_t, size_t)> go = [&](size_t j, size_t from) {
    if (j == k - 1) {
      int64_t worst = 0, sum = 0;
      size_t c = 0;
      for (size_t i = 0; i < n; ++i) {
        if (c < cuts.size() && i == cuts[c]) {
          worst = std::max(worst, sum);
          sum = 0;
          ++c;
        }
        sum += blocks[i].params;
      }
      worst = std::max(worst, sum);
      if (best < 0 || worst < best) best = worst;
      return;
    }
    for (size_t i = from; i + (k - 2 - j) <= n - 1; ++i) {  // room for the cuts after this one
      cuts[j] = i;
      go(j + 1, i + 1);
    }
  };
  go(0, 1);
  return best;
}

TEST(PipelinePartition, BalancedMinimisesTheLargestStage) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<Block> blocks;
    const size_t n = 1 + rng() % 9;
    for (size_t i = 0; i < n; ++i) blocks.push_back({"b" + std::to_string(i), "t", static_cast<int64_t>(rng() % 50)});
    for (size_t k = 1; k <= n; ++k) {
      const auto p = partition_balanced(blocks, static_cast<int>(k));
      ASSERT_EQ(p.stages.size(), k);
      int64_t worst = 0;
      for (const auto& s : p.stages) {
        int64_t sum = 0;
        for (size_t b : s) sum += blocks[b].params;
        worst = std::max(worst, sum);
      }
      EXPECT_EQ(worst, brute_force_best(blocks, k)) << "n " << n << " k " << k;
    }
  }
  // The embedding (100) takes a stage of its own; of the splits whose largest
  // stage is 100, the later stages take the extra blocks.
  const auto p = partition_balanced(model(), 3);
  EXPECT_EQ(to_layout(model(), p), "E | t*5 | t*5 L");
}

TEST(PipelinePartition, CheckNamesMissingAndRepeatedBlocks) {
  const auto blocks = model();
  Partition p{{{0, 1, 2}, {4, 5}}};
  EXPECT_NE(testing::error_of([&] { check_partition(blocks, p); })
                .find("block 3 'layers.2' (t) is in no stage (stage 1 jumps to block 4 'layers.3' (t))"),
            std::string::npos);
  p = Partition{{{0, 1, 2}, {2, 3}}};
  EXPECT_NE(testing::error_of([&] { check_partition(blocks, p); }).find("stage 1 holds block 2 'layers.1' (t) again"),
            std::string::npos);
  p = Partition{{{0, 1, 2}, {3, 4, 5, 6, 7, 8, 9, 10}}};
  EXPECT_NE(testing::error_of([&] { check_partition(blocks, p); })
                .find("block 11 'head' (L) and every block after it are in no stage"),
            std::string::npos);
}

}  // namespace partition_test
}  // namespace zeroshard::pipeline
