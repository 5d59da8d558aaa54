// zeroshard/sharded_state.h — what one rank of a sharded optimizer holds, as
// checkpoints save and load it (ShardedOptimizer::sharded_state()). The tensors
// are the optimizer's live ones: writing into them changes the optimizer. Plain values; use
// them where the optimizer is used (the training thread). Saved as: docs/checkpoint-format.md.
#pragma once

#include "zeroshard/flat_layout.h"

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zeroshard {

// One bucket (ZeRO-1/2) or unit (ZeRO-3) of this rank's part of the state.
struct ShardedBucketState {
  FlatLayout layout;           // the bucket's parameters and their offsets
  std::vector<size_t> params;  // index into the optimizer's parameter list, per layout entry
  int group = 0;               // param group
  Range shard;                 // the elements of the flat buffer this rank owns (stage 0: all)
  at::Tensor master;           // fp32 [shard.size()]: the parameters' master values
  at::Tensor exp_avg;          // fp32 [shard.size()]
  at::Tensor exp_avg_sq;       // fp32 [shard.size()]
  at::Tensor grad_shard;       // [shard.size()]: this step's reduced gradient so far (undefined: none)
};
struct ShardedState {
  int rank = 0;
  int world_size = 1;
  // 1, 2 or 3; 0: replicated (every rank holds every bucket whole, laid out
  // for one rank: layout.shard(0)).
  int zero_stage = 2;
  // Hybrid sharding (shard_size): each bucket is laid out for its shard group
  // (layout.world_size ranks) and this rank holds shard `shard_rank` of it, as
  // do the other ranks of its replica group (num_replicas of them, this one
  // being `replica_rank`). Sharded across every rank: shard_rank == rank and
  // num_replicas == 1.
  int shard_rank = 0;
  int num_replicas = 1;
  int replica_rank = 0;
  std::vector<ParamInfo> params;      // every parameter the optimizer trains, in model order
  std::vector<at::Tensor> param_tensors;  // the live parameter tensors, as `params`
  std::vector<int64_t> param_steps;   // AdamW step count of each (0: never updated)
  std::vector<ShardedBucketState> buckets;
  // Gradients of this step that are not in the shards: full, unreduced, in
  // p.grad() (stage 1, no_sync, reduce_every_backward=false). Checkpoints
  // refuse to save then. Reduced ones (grad_shard) are saved.
  bool local_gradients_pending = false;
  std::vector<char> had_grad;         // per parameter: got a gradient on this rank since the last step
  double loss_scale = 1;              // current dynamic loss scale (1 when off)
  int64_t loss_scale_clean_steps = 0; // steps since the last overflow or growth
  // Ranks holding each element: world_size when replicated (stage 0), else num_replicas.
  int replicas() const { return zero_stage == 0 ? world_size : num_replicas; }
};

}  // namespace zeroshard
