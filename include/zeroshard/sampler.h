// zeroshard/sampler.h — a deterministic distributed sampler whose position is
// saved in checkpoints, so a resumed run sees exactly the samples it would
// have seen.
//
// Each epoch the dataset's indices are shuffled by a bijection keyed by (seed,
// epoch) and computed per position (a Feistel network, cycle-walked into
// [0, size)): the same permutation on every rank, with no memory and no
// start-up cost at any dataset size. The permutation is padded
// (by repeating its start) to a multiple of the world size, and rank r takes
// positions r, r + world, r + 2·world, … (PyTorch's DistributedSampler rule).
// State is global (samples consumed by all ranks this epoch), so a run resumed
// on any number of ranks continues at the same place in the epoch (elastic
// runs): the rest of the permutation, from position `consumed`, is split the
// same way over the new ranks (rank r takes consumed + r, consumed + r +
// world, …), so across any shrinks and grows every sample of the epoch is
// taken once, plus the padding at its end (at most world - 1 samples of the
// permutation's start, taken twice, when what is left does not divide).
//
// The same as the sampler of torch's data loader: loader_sampler.h.
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
  int64_t dataset_size() const { return size_; }
  // Starts `epoch` from its beginning (PyTorch's DistributedSampler.set_epoch).
  void set_epoch(int64_t epoch);
  // Samples each rank takes in this epoch from where this world size took it up.
  int64_t samples_per_rank() const { return per_rank_; }
  // Samples this rank has taken this epoch.
  int64_t position() const { return position_; }

  // {"seed":…, "epoch":…, "consumed":… (all ranks), "dataset_size":…, "shuffle":…, "shuffle_rule":…}
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

}  // namespace zeroshard
