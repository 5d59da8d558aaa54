// zeroshard/sampler.h — a deterministic distributed sampler whose position is
// saved in checkpoints, so a resumed run sees exactly the samples it would
// have seen.
//
// Each epoch the dataset's indices are shuffled with a generator seeded by
// (seed, epoch): the same permutation on every rank. The permutation is padded
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
// LoaderSampler is the same sampler as the sampler of torch's data loader.
#pragma once

#include <torch/data/samplers/base.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

class Communicator;

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

  // {"seed":…, "epoch":…, "consumed":… (all ranks), "dataset_size":…, "shuffle":…}
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
  std::vector<int64_t> order_;  // this epoch's permutation (padded)
  void start_epoch(int64_t epoch, int64_t start = 0);
};

// DistributedSampler as the sampler of torch's data loader, in place of its
// RandomSampler or DistributedRandomSampler:
//   auto loader = torch::data::make_data_loader(std::move(dataset),
//       zeroshard::LoaderSampler(dataset_size, *comm), batch_size / comm->size());
// With a per-rank batch of B / world, the ranks' batches together are the
// batch of B one process would take (positions r, r + world, ... of the same
// permutation): the same training at any number of ranks. torch's
// DistributedRandomSampler hands each rank a contiguous part of the
// permutation instead, so its global batches change with the world size.
// Each reset() (the loader's begin(), once per epoch) starts the next epoch,
// except the first and the first after load(), which continue where the
// sampler is. save()/load() (torch::save/torch::load of the sampler) keep
// state_json(), so a resumed run continues in the epoch, on any world size.
class LoaderSampler : public torch::data::samplers::Sampler<> {
 public:
  // comm: the data-parallel ranks (rank() and size()).
  LoaderSampler(size_t dataset_size, const Communicator& comm, uint64_t seed = 0, bool shuffle = true);
  LoaderSampler(size_t dataset_size, int rank, int world_size, uint64_t seed = 0, bool shuffle = true);

  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  // This rank's next `batch_size` indices (fewer at the end of the epoch),
  // or none when the epoch is over.
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  const DistributedSampler& sampler() const { return sampler_; }

 private:
  int rank_, world_;
  uint64_t seed_;
  bool shuffle_;
  DistributedSampler sampler_;
  bool continue_epoch_ = true;  // the next reset() keeps the epoch and position
};

}  // namespace zeroshard
