// DistributedSampler: every epoch is a permutation split across ranks, and its
// saved position continues exactly, on the same or another number of ranks.
// LoaderSampler: the same in torch's data loader.
#include "test_util.h"

#include <zeroshard/loader_sampler.h>
#include <zeroshard/sampler.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <string>
#include <vector>

namespace zeroshard {
namespace sampler_test {

// The shuffle is computed per position: a permutation at every size (powers of 4
// and their neighbours included), a different one each epoch and seed, and not
// the identity; a position saved under another shuffle rule is refused.
TEST(Sampler, TheComputedShuffleIsAPermutationAtEverySize) {
  for (int64_t size : {1, 2, 3, 4, 5, 15, 16, 17, 63, 64, 65, 1000, 4097}) {
    DistributedSampler s(size, 0, 1, /*seed=*/9);
    std::vector<std::vector<int64_t>> epochs;
    for (int e = 0; e < 3; ++e) {
      auto got = s.next(size);
      auto sorted = got;
      std::sort(sorted.begin(), sorted.end());
      std::vector<int64_t> all(static_cast<size_t>(size));
      std::iota(all.begin(), all.end(), 0);
      ASSERT_EQ(sorted, all) << "size " << size << " epoch " << e;
      epochs.push_back(got);
    }
    if (size >= 15) {
      EXPECT_NE(epochs[0], epochs[1]) << size;
      std::vector<int64_t> identity(static_cast<size_t>(size));
      std::iota(identity.begin(), identity.end(), 0);
      EXPECT_NE(epochs[0], identity) << size;
      EXPECT_NE(DistributedSampler(size, 0, 1, /*seed=*/10).next(size), epochs[0]) << size;
    }
  }
  DistributedSampler s(100, 0, 2, 1);
  const auto err = testing::error_of([&] {
    s.load_state_json(R"({"seed":1,"epoch":0,"consumed":10,"dataset_size":100,"shuffle":true})");
  });
  EXPECT_NE(err.find("shuffled by the rule 'randperm'"), std::string::npos) << err;
}

TEST(Sampler, EachEpochIsAPermutationSplitAcrossRanks) {
  constexpr int64_t kSize = 23;
  for (int world_size : {1, 2, 3, 4}) {
    std::vector<int64_t> seen;
    std::vector<std::vector<int64_t>> epoch1(static_cast<size_t>(world_size));
    for (int r = 0; r < world_size; ++r) {
      DistributedSampler s(kSize, r, world_size, /*seed=*/5);
      const auto e0 = s.next(1000);  // cut at the epoch's end
      EXPECT_EQ(static_cast<int64_t>(e0.size()), (kSize + world_size - 1) / world_size);
      seen.insert(seen.end(), e0.begin(), e0.end());
      epoch1[static_cast<size_t>(r)] = s.next(1000);
      EXPECT_EQ(s.epoch(), 1);
    }
    // Padding repeats the permutation's start: every index at least once, at most twice.
    std::set<int64_t> distinct(seen.begin(), seen.end());
    EXPECT_EQ(static_cast<int64_t>(distinct.size()), kSize) << world_size << " ranks";
    EXPECT_EQ(static_cast<int64_t>(seen.size()), ((kSize + world_size - 1) / world_size) * world_size);
  }
  DistributedSampler a(kSize, 0, 1, 5), b(kSize, 0, 1, 5), c(kSize, 0, 1, 6);
  const auto a0 = a.next(kSize), b0 = b.next(kSize), c0 = c.next(kSize);
  EXPECT_EQ(a0, b0) << "deterministic";
  EXPECT_NE(a0, c0) << "the seed matters";
  EXPECT_NE(a0, a.next(kSize)) << "each epoch reshuffles";
}

TEST(Sampler, SavedPositionContinuesOnTheSameOrAnotherWorldSize) {
  constexpr int64_t kSize = 48;
  // Reference: two ranks, 5 batches of 3 each, then 3 more.
  std::vector<int64_t> global_after;  // what all ranks see after the save point, in global order
  std::string state;
  {
    DistributedSampler r0(kSize, 0, 2, 9), r1(kSize, 1, 2, 9);
    for (int k = 0; k < 5; ++k) {
      r0.next(3);
      r1.next(3);
    }
    state = r0.state_json();
    EXPECT_EQ(state, r1.state_json());
    for (int k = 0; k < 3; ++k) {
      for (auto i : r0.next(3)) global_after.push_back(i);
      for (auto i : r1.next(3)) global_after.push_back(i);
    }
  }
  // Same world size: exactly the same batches.
  DistributedSampler s0(kSize, 0, 2, 9), s1(kSize, 1, 2, 9);
  s0.load_state_json(state);
  s1.load_state_json(state);
  std::vector<int64_t> again;
  for (int k = 0; k < 3; ++k) {
    for (auto i : s0.next(3)) again.push_back(i);
    for (auto i : s1.next(3)) again.push_back(i);
  }
  EXPECT_EQ(again, global_after);
  // Three ranks (30 consumed divides by 3): the same samples come next.
  std::multiset<int64_t> want(global_after.begin(), global_after.end()), got;
  for (int r = 0; r < 3; ++r) {
    DistributedSampler t(kSize, r, 3, 9);
    t.load_state_json(state);
    for (auto i : t.next(6)) got.insert(i);
  }
  EXPECT_EQ(got, want);
  // Four ranks (30 consumed does not divide by 4): the epoch's other 18 samples, split 5 + 5 + 4 + 4,
  // and two of the permutation's first samples again as padding at the epoch's end.
  std::multiset<int64_t> rest;
  for (int r = 0; r < 4; ++r) {
    DistributedSampler t(kSize, r, 4, 9);
    t.load_state_json(state);
    EXPECT_EQ(t.samples_per_rank(), 5);
    for (auto i : t.next(100)) rest.insert(i);
  }
  DistributedSampler first(kSize, 0, 1, 9);
  const auto perm = first.next(kSize);
  std::multiset<int64_t> want_rest(perm.begin() + 30, perm.end());
  want_rest.insert(perm[0]);
  want_rest.insert(perm[1]);
  EXPECT_EQ(rest, want_rest);
  DistributedSampler other(kSize + 1, 0, 2, 9);
  const auto size_error = testing::error_of([&] { other.load_state_json(state); });
  EXPECT_NE(size_error.find("a dataset of " + std::to_string(kSize) + " examples but this sampler's has " +
                            std::to_string(kSize + 1) + "; resume with the dataset the run was saved with"),
            std::string::npos)
      << size_error;
}

// An elastic run: 4 ranks, then 3 after a host is lost, then 4 again when it
// returns, each resuming from the saved state in the middle of the epoch. Every
// sample of the epoch is taken exactly once (the remainders divide), the next
// epoch starts where a run that never changed would start it, and a rank's
// saved state is the same on every rank at every point.
TEST(Sampler, ShrinkAndGrowMidEpochTakesEverySampleOnce) {
  constexpr int64_t kSize = 120;
  std::vector<int64_t> taken;
  std::string state;
  auto run = [&](int world_size, int steps, int64_t per_rank_batch) {
    std::vector<DistributedSampler> ranks;
    for (int r = 0; r < world_size; ++r) {
      ranks.emplace_back(kSize, r, world_size, /*seed=*/3);
      if (!state.empty()) ranks.back().load_state_json(state);
    }
    for (int k = 0; k < steps; ++k) {
      for (auto& s : ranks) {
        const auto got = s.next(per_rank_batch);
        EXPECT_EQ(s.epoch(), 0);
        taken.insert(taken.end(), got.begin(), got.end());
      }
    }
    state = ranks[0].state_json();
    for (auto& s : ranks) EXPECT_EQ(s.state_json(), state) << "every rank saves the same position";
  };
  run(4, 6, 2);  // 48 samples
  run(3, 4, 2);  // 24 more: 72
  run(4, 6, 2);  // the last 48
  ASSERT_EQ(taken.size(), static_cast<size_t>(kSize));
  EXPECT_EQ(std::set<int64_t>(taken.begin(), taken.end()).size(), static_cast<size_t>(kSize)) << "each sample once";
  EXPECT_EQ(nlohmann::json::parse(state).at("consumed").get<int64_t>(), kSize);
  DistributedSampler next(kSize, 0, 4, 3), never_changed(kSize, 0, 4, 3);
  next.load_state_json(state);
  never_changed.next(kSize);
  EXPECT_EQ(next.next(5), never_changed.next(5)) << "the next epoch is the same as without the changes";
  EXPECT_EQ(next.epoch(), 1);
}

// The indices of a dataset, as torch's data loader hands them out.
struct Indices : torch::data::datasets::Dataset<Indices, int64_t> {
  explicit Indices(size_t n) : n(n) {}
  int64_t get(size_t index) override { return static_cast<int64_t>(index); }
  c10::optional<size_t> size() const override { return n; }
  size_t n;
};

// Every batch of `epochs` epochs of torch's data loader over LoaderSampler(rank, world).
std::vector<std::vector<int64_t>> loader_batches(size_t n, int rank, int world, size_t batch, int epochs) {
  auto loader = torch::data::make_data_loader(Indices(n), LoaderSampler(n, rank, world, /*seed=*/9), batch);
  std::vector<std::vector<int64_t>> out;
  for (int e = 0; e < epochs; ++e) {
    for (auto& b : *loader) out.push_back(b);
  }
  return out;
}

// In torch's data loader with a per-rank batch of B / world, the ranks'
// batches together are the batch of B one rank takes; each epoch is a new
// permutation that the loader's begin() starts.
TEST(Sampler, InTorchsDataLoaderRanksTogetherTakeOneRanksBatches) {
  constexpr size_t kSize = 48, kBatch = 12;
  const auto one = loader_batches(kSize, 0, 1, kBatch, 2);
  ASSERT_EQ(one.size(), 2 * kSize / kBatch);
  std::set<int64_t> epoch0, epoch1;
  for (size_t k = 0; k < one.size(); ++k) (k < one.size() / 2 ? epoch0 : epoch1).insert(one[k].begin(), one[k].end());
  EXPECT_EQ(epoch0.size(), kSize);
  EXPECT_EQ(epoch1.size(), kSize);
  EXPECT_NE(one[0], one[one.size() / 2]) << "the second epoch is another permutation";
  for (int world : {2, 3, 4}) {
    std::vector<std::vector<std::vector<int64_t>>> ranks;
    for (int r = 0; r < world; ++r) ranks.push_back(loader_batches(kSize, r, world, kBatch / world, 2));
    for (size_t k = 0; k < one.size(); ++k) {
      std::multiset<int64_t> together, want(one[k].begin(), one[k].end());
      for (const auto& batches : ranks) {
        ASSERT_EQ(batches.size(), one.size()) << world << " ranks";
        together.insert(batches[k].begin(), batches[k].end());
      }
      EXPECT_EQ(together, want) << "batch " << k << " at " << world << " ranks";
    }
  }
}

// torch::save of the sampler mid-epoch, torch::load into one of another world
// size: the loader goes on with the rest of the epoch, each sample once.
TEST(Sampler, LoaderSamplerSavedWithTorchSaveContinuesTheEpoch) {
  constexpr size_t kSize = 40;
  LoaderSampler before(kSize, 0, 1, /*seed=*/4);
  before.reset();
  std::multiset<int64_t> seen;
  for (int k = 0; k < 4; ++k) {  // 20 of 40: what is left splits evenly (no padding)
    const auto b = before.next(5);
    ASSERT_TRUE(b.has_value());
    seen.insert(b->begin(), b->end());
  }
  const auto path = testing::make_temp_dir("loader_sampler") + "/sampler.pt";
  torch::save(before, path);
  for (int r = 0; r < 2; ++r) {
    LoaderSampler after(kSize, r, 2, /*seed=*/4);
    torch::load(after, path);
    after.reset();  // the loader's begin(): the loaded position stays
    while (auto b = after.next(4)) seen.insert(b->begin(), b->end());
  }
  EXPECT_EQ(seen.size(), kSize) << "the epoch's samples, on 1 rank then on 2";
  EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), kSize) << "each once";
}

}  // namespace sampler_test
}  // namespace zeroshard
