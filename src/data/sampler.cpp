// sampler.cpp — DistributedSampler, and LoaderSampler over it.
#include "zeroshard/sampler.h"

#include "zeroshard/comm.h"
#include "zeroshard/loader_sampler.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/serialize/archive.h>

#include <algorithm>

namespace zeroshard {

namespace {

// The shuffle's rule, recorded in the saved state: a position saved under another rule is not this epoch's.
constexpr const char* kShuffleRule = "feistel-6";

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

// A bijection of [0, size): a 6-round Feistel network on 2h bits (the fewest with
// 4^h >= size), keyed by (seed, epoch), applied again while the result is out of
// range (cycle walking: fewer than 4 rounds of it on average).
int64_t shuffled_position(int64_t k, int64_t size, uint64_t seed, int64_t epoch) {
  int h = 1;
  while ((int64_t{1} << (2 * h)) < size) ++h;
  const uint64_t mask = (uint64_t{1} << h) - 1;
  const uint64_t key = mix(seed ^ mix(static_cast<uint64_t>(epoch)));
  auto x = static_cast<uint64_t>(k);
  do {
    uint64_t left = x >> h, right = x & mask;
    for (uint64_t r = 0; r < 6; ++r) {
      const uint64_t t = left ^ (mix(right ^ mix(key + r)) & mask);
      left = right;
      right = t;
    }
    x = (left << h) | right;
  } while (x >= static_cast<uint64_t>(size));
  return static_cast<int64_t>(x);
}

int64_t DistributedSampler::permuted(int64_t k) const {
  return shuffle_ ? shuffled_position(k, size_, seed_, epoch_) : k;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int rank, int world_size, uint64_t seed, bool shuffle)
    : size_(dataset_size), rank_(rank), world_(world_size), seed_(seed), shuffle_(shuffle) {
  TORCH_CHECK_VALUE(dataset_size > 0, "DistributedSampler: dataset_size is ", dataset_size, "; it must be positive");
  TORCH_CHECK_VALUE(world_size > 0 && rank >= 0 && rank < world_size, "DistributedSampler: rank ", rank,
                    " is not in [0, world_size ", world_size, ")");
  start_epoch(0);
}

void DistributedSampler::start_epoch(int64_t epoch, int64_t start) {
  epoch_ = epoch;
  position_ = 0;
  start_ = start;
  per_rank_ = (size_ - start_ + world_ - 1) / world_;
}

void DistributedSampler::set_epoch(int64_t epoch) {
  TORCH_CHECK_VALUE(epoch >= 0, "DistributedSampler::set_epoch: epoch is ", epoch, "; it must be >= 0");
  start_epoch(epoch);
}

std::vector<int64_t> DistributedSampler::next(int64_t batch) {
  TORCH_CHECK_VALUE(batch > 0, "DistributedSampler::next: batch is ", batch, "; it must be positive");
  if (position_ >= per_rank_) start_epoch(epoch_ + 1);
  const int64_t end = std::min(per_rank_, position_ + batch);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(end - position_));
  // This rank's i-th sample of the epoch: position start + rank + i * world of the permutation, past its end
  // (the padding) its start again.
  for (int64_t i = position_; i < end; ++i) out.push_back(permuted((start_ + rank_ + i * world_) % size_));
  position_ = end;
  return out;
}

std::string DistributedSampler::state_json() const {
  nlohmann::json j{{"seed", seed_}, {"epoch", epoch_}, {"consumed", std::min(size_, start_ + position_ * world_)},
                   {"dataset_size", size_}, {"shuffle", shuffle_}, {"shuffle_rule", kShuffleRule}};
  return j.dump();
}

void DistributedSampler::load_state_json(const std::string& state) {
  const auto j = nlohmann::json::parse(state);
  TORCH_CHECK_VALUE(j.at("dataset_size").get<int64_t>() == size_, "DistributedSampler: the saved position is in a dataset "
                    "of ", j.at("dataset_size").get<int64_t>(), " examples but this sampler's has ", size_,
                    "; resume with the dataset the run was saved with (the same files, cut into examples the same way)");
  TORCH_CHECK_VALUE(j.at("seed").get<uint64_t>() == seed_, "DistributedSampler: the saved seed is ",
                    j.at("seed").get<uint64_t>(), " but this sampler's is ", seed_);
  TORCH_CHECK_VALUE(j.at("shuffle").get<bool>() == shuffle_, "DistributedSampler: the saved shuffle is ",
                    j.at("shuffle").get<bool>(), " but this sampler's is ", shuffle_);
  const std::string rule = j.value("shuffle_rule", "randperm");
  TORCH_CHECK_VALUE(!shuffle_ || rule == kShuffleRule, "DistributedSampler: the saved position is in an epoch "
                    "shuffled by the rule '", rule, "' (an older zeroshard's) and this one shuffles by '", kShuffleRule,
                    "': the rest of that epoch would repeat and skip samples; resume with the version that saved it, "
                    "or start the next epoch (set_epoch)");
  const int64_t consumed = j.at("consumed").get<int64_t>();
  TORCH_CHECK_VALUE(consumed >= 0 && consumed <= size_, "DistributedSampler: the saved position has ", consumed,
                    " samples of the epoch consumed, outside 0..", size_, " (the dataset's size); the state was "
                    "edited or belongs to another run");
  start_epoch(j.at("epoch").get<int64_t>(), consumed);
}

LoaderSampler::LoaderSampler(size_t dataset_size, const Communicator& comm, uint64_t seed, bool shuffle)
    : LoaderSampler(dataset_size, comm.rank(), comm.size(), seed, shuffle) {}

LoaderSampler::LoaderSampler(size_t dataset_size, int rank, int world_size, uint64_t seed, bool shuffle)
    : rank_(rank), world_(world_size), seed_(seed), shuffle_(shuffle),
      sampler_(static_cast<int64_t>(dataset_size), rank, world_size, seed, shuffle) {}

void LoaderSampler::reset(c10::optional<size_t> new_size) {
  if (new_size.has_value() && static_cast<int64_t>(*new_size) != sampler_.dataset_size()) {
    sampler_ = DistributedSampler(static_cast<int64_t>(*new_size), rank_, world_, seed_, shuffle_);
  } else if (!continue_epoch_) {
    sampler_.set_epoch(sampler_.epoch() + 1);
  }
  continue_epoch_ = false;
}

c10::optional<std::vector<size_t>> LoaderSampler::next(size_t batch_size) {
  if (sampler_.position() >= sampler_.samples_per_rank()) return c10::nullopt;
  const auto indices = sampler_.next(static_cast<int64_t>(batch_size));
  return std::vector<size_t>(indices.begin(), indices.end());
}

void LoaderSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("zeroshard_sampler", c10::IValue(sampler_.state_json()));
}

void LoaderSampler::load(torch::serialize::InputArchive& archive) {
  c10::IValue state;
  archive.read("zeroshard_sampler", state);
  sampler_.load_state_json(state.toStringRef());
  continue_epoch_ = true;
}

}  // namespace zeroshard
