// zeroshard/blend.h — several datasets sampled by weight as one, through DistributedSampler.
//
//   zeroshard::Blend blend({{books.size(), 0.7}, {wiki.size(), 0.3}});
//   zeroshard::DistributedSampler sampler(blend.size(), rank, world, seed, /*shuffle=*/false);
//   for (int64_t i : sampler.next(batch)) {
//     const auto pick = blend.at(sampler.epoch(), i, seed);  // source, its example, its epoch
//   }
//
// The blend is a stream of size() positions per epoch (a multiple of `slots`, at least the
// sources' sizes summed), taken in order: the sampler runs without its shuffle, and each
// source's own permutation shuffles. Positions run in blocks of `slots`; in each block source d
// has n_d slots, its weight's share of them (largest remainders), ordered as Megatron-LM's
// BlendedDataset orders its samples (each next slot to the source furthest below its share),
// so any n consecutive positions hold n n_d / slots of source d, within a sample or two, and
// every global batch is a blend. Source d's k-th slot of the run (over the blend's epochs)
// takes its example at position k mod size_d of its own permutation keyed by (seed, source,
// k / size_d), that source's epoch. So:
// - a pick is a pure function of (epoch, position, seed): restarts and world-size changes of
//   the sampler keep every guarantee the sampler gives;
// - each source sees each of its examples once per its own epoch (a source weighted above
//   its size's share repeats sooner, one below it later).
// A plain value; thread-safe to read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

struct BlendSource {
  int64_t size = 0;    // its examples; > 0
  double weight = 0;   // > 0; weights are normalised
};

class Blend {
 public:
  // REQUIRES: sources not empty. Throws naming the source when a size or weight is not
  // positive, or a weight is below 1 / slots (it would get no slot).
  explicit Blend(std::vector<BlendSource> sources, int64_t slots = 10000);

  struct Pick {
    int source = 0;     // index into the sources
    int64_t index = 0;  // the source's example
    int64_t epoch = 0;  // the source's epoch this pick belongs to
  };
  // REQUIRES: 0 <= position < size(), epoch >= 0.
  Pick at(int64_t epoch, int64_t position, uint64_t seed) const;

  int64_t size() const { return size_; }
  int64_t slots() const { return static_cast<int64_t>(order_.size()); }
  // Source d's slots per block: its share is slots_of(d) / slots().
  int64_t slots_of(int source) const { return per_block_[static_cast<size_t>(source)]; }
  const std::vector<BlendSource>& sources() const { return sources_; }
  // {"sources": [{"size", "weight", "slots"}...], "slots", "size"}: what a checkpoint records.
  std::string to_json() const;

 private:
  std::vector<BlendSource> sources_;
  std::vector<int64_t> per_block_;
  std::vector<int32_t> order_;  // the source of each slot of a block
  std::vector<int64_t> rank_;   // the slot's place among its source's slots of the block
  int64_t size_ = 0;
};

}  // namespace zeroshard
