// deferred_init.h — what a unit built under DeferredInit holds until fully_shard().
//
// The unit's parameters are laid out as fully_shard() will lay them out (for
// the shard group's size), and only this rank's shard of the flat buffer is
// kept; the parameter tensors hold placeholders. Owned by the unit's
// Sharded<> module (ShardedModule::deferred_) until fully_shard() adopts it.
// Used from the constructing thread only.
#pragma once

#include "zeroshard/flat_layout.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zeroshard::shard {

struct DeferredUnit {
  FlatLayout layout;                   // names relative to the unit; laid out for shard_size ranks
  int shard_rank = 0;                  // this rank's index in its shard group
  std::vector<ShardSegment> segments;  // parameter pieces inside this rank's shard
  std::vector<at::Tensor> tensors;     // the parameters, as layout.params (placeholders now)
  at::Tensor values;                   // this rank's shard [layout.shard_numel()], on the group's device; padding zero
  std::vector<uint64_t> hashes;        // per parameter: of its full value as last written

  // Keeps this rank's part of parameter i's full value `full`, and its hash.
  void keep_shard_of(size_t i, const at::Tensor& full);
  // Of every parameter's value: equal on every rank that built the same values.
  uint64_t hash() const;
};

}  // namespace zeroshard::shard
