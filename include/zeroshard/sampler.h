// zeroshard/sampler.h — a deterministic distributed sampler whose position is
// saved in checkpoints, so a resumed run sees exactly the samples it would
// have seen.
//
// Each epoch the dataset's indices are shuffled with a generator seeded by
// (seed, epoch): the same permutation on every rank. The permutation is padded
// (by repeating its start) to a multiple of the world size, and rank r takes
// positions r, r + world, r + 2·world, … (PyTorch's DistributedSampler rule).
// State is global (samples consumed by all ranks this epoch), so a run
// resumed on another number of ranks continues at the same place in the
// epoch, when that place is a multiple of the new world size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

class DistributedSampler {
 public:
  // REQUIRES: dataset_size > 0, 0 <= rank < world_size.
  DistributedSampler(int64_t dataset_size, int rank, int world_size, uint64_t seed = 0, bool shuffle = true);

  // This rank's next `batch` sample indices. An epoch ends after
  // ceil(dataset_size / world_size) samples per rank; a batch that would cross
  // the end is cut short there, and the next call starts the next epoch.
  std::vector<int64_t> next(int64_t batch);

  int64_t epoch() const { return epoch_; }
  int64_t samples_per_rank() const { return per_rank_; }
  // Samples this rank has taken this epoch.
  int64_t position() const { return position_; }

  // {"seed":…, "epoch":…, "consumed":… (all ranks), "dataset_size":…, "shuffle":…}
  std::string state_json() const;
  // Continues from state_json(). Throws (naming the field) when the dataset
  // size, seed or shuffle differ, or when the consumed count does not divide
  // by this world size.
  void load_state_json(const std::string& state);

 private:
  int64_t size_, per_rank_;
  int rank_, world_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = 0, position_ = 0;
  std::vector<int64_t> order_;  // this epoch's permutation (padded)
  void start_epoch(int64_t epoch);
};

}  // namespace zeroshard
