// zeroshard/loader_sampler.h — DistributedSampler (sampler.h) as the sampler
// of torch's data loader, so that N ranks take, together, the batches one
// process would. Not thread-safe (as torch's samplers). Why: docs/drop-in.md (the data loader).
#pragma once

#include "zeroshard/sampler.h"

#include <torch/data/samplers/base.h>

#include <cstdint>
#include <vector>

namespace zeroshard {

class Communicator;

// In place of torch's RandomSampler or DistributedRandomSampler:
//   auto loader = torch::data::make_data_loader(std::move(dataset),
//       zeroshard::LoaderSampler(dataset_size, *comm), batch_size / comm->size());
// With a per-rank batch of B / world, the ranks' batches together are the batch of B one
// process would take: the same training at any number of ranks (torch's
// DistributedRandomSampler gives each rank a contiguous part instead, so its global batches
// change with the world size). Each reset() (the loader's begin(), once per epoch) starts the
// next epoch, except the first and the first after load(), which continue where the sampler
// is. save()/load() (torch::save/torch::load of the sampler) keep state_json(), so a resumed
// run continues in the epoch, on any world size.
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
