// zeroshard/sampler.h — a deterministic distributed sampler whose position is saved in
// checkpoints, so a resumed run, on any number of ranks, sees exactly the samples it would have.
//
//   zeroshard::DistributedSampler sampler(dataset_size, comm->rank(), comm->size(), seed);
//   auto ids = sampler.next(batch);            // this rank's part of the global batch
//   ... save sampler.state_json() with the checkpoint; load_state_json() on resume
//
// Each epoch is one permutation of the dataset keyed by (seed, epoch), the same on every rank,
// padded to a multiple of the world size; rank r takes positions r, r + world, ... (PyTorch's
// DistributedSampler rule). Across any shrinks and grows of the world every sample of an epoch
// is taken once, plus at most world - 1 samples of padding at its end. Not thread-safe; a plain
// value. As the sampler of torch's data loader: loader_sampler.h.
// How it works: docs/checkpoints.md ("Where the data stands").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

class DistributedSampler {
 public:
  // REQUIRES: dataset_size > 0, 0 <= rank < world_size.
  DistributedSampler(int64_t dataset_size, int rank, int world_size, uint64_t seed = 0, bool shuffle = true);

  // This rank's next `batch` sample indices. An epoch ends after ceil(dataset_size /
  // world_size) samples per rank; a batch that would cross the end is cut short there, and the
  // next call starts the next epoch.
  std::vector<int64_t> next(int64_t batch);

  int64_t epoch() const { return epoch_; }
  int64_t dataset_size() const { return size_; }
  // Starts `epoch` from its beginning (PyTorch's DistributedSampler.set_epoch).
  void set_epoch(int64_t epoch);
  // Samples each rank takes in this epoch from where this world size took it up.
  int64_t samples_per_rank() const { return per_rank_; }
  // Samples this rank has taken this epoch.
  int64_t position() const { return position_; }

  // {"seed":…, "epoch":…, "consumed":… (all ranks), "dataset_size":…, "shuffle":…,
  //  "shuffle_rule":…}
  std::string state_json() const;
  // Continues from state_json(), on this sampler's world size (any). Throws
  // (naming the field) when the dataset size, seed or shuffle differ.
  void load_state_json(const std::string& state);

 private:
  int64_t size_, per_rank_;
  int rank_, world_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = 0, position_ = 0;
  int64_t start_ = 0;           // the epoch's samples consumed before this world size took it up
  void start_epoch(int64_t epoch, int64_t start = 0);
  int64_t permuted(int64_t k) const;  // the epoch's permutation at position k < size
};

// Position k of a permutation of [0, size) keyed by (seed, epoch): the shuffle of
// DistributedSampler's epochs (and of Blend's sources). REQUIRES: 0 <= k < size.
int64_t shuffled_position(int64_t k, int64_t size, uint64_t seed, int64_t epoch);

}  // namespace zeroshard
