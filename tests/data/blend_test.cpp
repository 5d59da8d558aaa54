// Blend: the shares of a block, its order, and each source's examples once per its own
// epoch through a sampler that runs on 4, then 3, then 4 ranks, restarting from its state.
#include "test_util.h"

#include <zeroshard/blend.h>
#include <zeroshard/sampler.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <vector>

namespace zeroshard {
namespace blend_test {

// Weights normalised into slots by largest remainders; any window of consecutive positions
// holds each source's share within two samples; a weight below one slot is refused.
TEST(Blend, SharesOfAnyWindowFollowTheWeights) {
  const Blend b({{1000, 7}, {500, 2}, {300, 1}}, 1000);
  EXPECT_EQ(b.slots_of(0), 700);
  EXPECT_EQ(b.slots_of(1), 200);
  EXPECT_EQ(b.slots_of(2), 100);
  EXPECT_EQ(b.size(), 2000);  // 1,800 examples, rounded up to blocks
  const Blend odd({{10, 1}, {10, 1}, {10, 1}}, 100);
  EXPECT_EQ(odd.slots_of(0) + odd.slots_of(1) + odd.slots_of(2), 100);
  EXPECT_EQ(odd.slots_of(0), 34);  // the remainders tie: the first source takes the slot left
  std::vector<int> source;
  for (int64_t e = 0; e < 2; ++e) {
    for (int64_t i = 0; i < b.size(); ++i) source.push_back(b.at(e, i, 3).source);
  }
  for (size_t window : {1u, 7u, 100u, 999u, 2500u}) {
    for (size_t start = 0; start + window <= source.size(); start += 37) {
      for (int d = 0; d < 3; ++d) {
        const auto n = std::count(source.begin() + static_cast<std::ptrdiff_t>(start),
                                  source.begin() + static_cast<std::ptrdiff_t>(start + window), d);
        const double want = static_cast<double>(window) * static_cast<double>(b.slots_of(d)) / 1000.0;
        ASSERT_LE(std::abs(static_cast<double>(n) - want), 2.0) << "window " << window << " at " << start;
      }
    }
  }
  EXPECT_NE(testing::error_of([] { Blend({{10, 1}, {10, 1e-6}}, 1000); }).find("below one slot"), std::string::npos);
  EXPECT_NE(testing::error_of([] { Blend({{0, 1}}); }).find("source 0 has 0 examples"), std::string::npos);
}

// Each source sees each of its examples once per its own epoch, through a sampler that runs
// on 4 ranks, saves, resumes on 3, saves, resumes on 4; a pick is a pure function of
// (epoch, position, seed), so the picks are the blend's whatever the ranks.
TEST(Blend, EachSourceExampleOncePerItsEpochAcrossWorldSizes) {
  const Blend b({{53, 5}, {31, 3}, {7, 2}}, 100);
  const uint64_t seed = 11;
  std::map<std::pair<int64_t, int64_t>, Blend::Pick> drawn;  // (epoch, position) -> pick; padding repeats one
  std::string state;
  const int64_t batch = 5;
  const std::vector<std::pair<int, int>> phases = {{4, 13}, {3, 40}, {4, 60}};  // (world, batches per rank)
  for (const auto& [world, batches] : phases) {
    std::vector<DistributedSampler> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.emplace_back(b.size(), r, world, seed, /*shuffle=*/false);
      if (!state.empty()) ranks.back().load_state_json(state);
    }
    for (int k = 0; k < batches; ++k) {
      for (auto& s : ranks) {
        for (const int64_t i : s.next(batch)) drawn[{s.epoch(), i}] = b.at(s.epoch(), i, seed);
      }
    }
    state = ranks[0].state_json();
  }
  // Whole epochs of the blend drawn: every position of each.
  int64_t epochs = 0;
  while (true) {
    int64_t have = 0;
    for (int64_t i = 0; i < b.size(); ++i) have += drawn.count({epochs, i});
    if (have < b.size()) break;
    ++epochs;
  }
  ASSERT_GE(epochs, 3) << "the phases draw at least three epochs of the blend";
  for (int d = 0; d < 3; ++d) {
    const int64_t n = b.sources()[static_cast<size_t>(d)].size;
    std::map<int64_t, std::vector<int64_t>> by_epoch;  // the source's epoch -> its examples drawn
    for (const auto& [at, p] : drawn) {
      if (at.first < epochs && p.source == d) by_epoch[p.epoch].push_back(p.index);
    }
    const int64_t picks = epochs * (b.size() / b.slots()) * b.slots_of(d);
    const int64_t whole = picks / n;  // its epochs drawn whole
    ASSERT_GE(whole, 2) << "source " << d;
    for (int64_t q = 0; q < whole; ++q) {
      auto got = by_epoch[q];
      std::sort(got.begin(), got.end());
      std::vector<int64_t> all(static_cast<size_t>(n));
      std::iota(all.begin(), all.end(), 0);
      ASSERT_EQ(got, all) << "source " << d << " epoch " << q << ": not each example once";
    }
    if (whole >= 2) {
      EXPECT_NE(by_epoch[0], by_epoch[1]) << "source " << d << ": its epochs are not reshuffled";
    }
  }
}

}  // namespace blend_test
}  // namespace zeroshard
