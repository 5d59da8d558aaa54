// zeroshard/sharded_adamw.h — ShardedAdamW, the drop-in ZeRO-1/2 optimizer (ZeRO-3:
// fully_shard.h; what both share: sharded_optimizer.h). Every rank holds the whole model and
// keeps the AdamW state (fp32 master, exp_avg, exp_avg_sq) for its 1/N slice of the parameters
// only; stage 2 also shards the gradients; stage 0 shards nothing (DDP-style replication).
//
//   // was: torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4));
//   zeroshard::ShardedAdamW opt(model->parameters(), comm, torch::optim::AdamWOptions(3e-4));
//   // the loop stays: opt.zero_grad(); loss.backward(); opt.step();
//
// Trains as torch::optim::AdamW on the global batch, to float rounding. Param groups' lr, betas,
// eps and weight_decay are read at every step (LR schedulers work); parameters with
// requires_grad() == false at construction are never updated. REQUIRES: load weights and move
// the model before constructing the optimizer (a parameter replaced afterwards is refused at
// step(), naming it). Ownership: keeps the communicator alive; not copyable. Thread-safety: the
// training thread (backward hooks are synchronized internally).
// How it works, and each LibTorch idiom with it: docs/drop-in.md.
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/sharded_optimizer.h"

#include <torch/optim/adamw.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace zeroshard {

struct ShardedAdamWOptions {
  // 1: shard optimizer states (ZeRO-1). 2: also shard gradients (ZeRO-2). 0: shard nothing
  // (gradients all-reduced, every rank updates everything). Others throw. At 2 and 0 a reduced
  // p.grad() holds a stand-in without values (reading it throws, naming the fix). Default: 2.
  int zero_stage = 2;
  // Hybrid sharding (stages 1 and 2): shard the state across groups of this many consecutive
  // ranks and replicate it across the groups; memory shrinks by shard_size, not by every rank.
  // 0: every rank (flat ZeRO). kShardPerHost: the ranks of one host. N: N ranks;
  // REQUIRES: N divides the world size. Default: 0.
  int shard_size = 0;
  // Gradient bucket size: the unit of reduce-scatter and all-gather. Default: 16 MiB.
  int64_t bucket_bytes = int64_t{16} << 20;
  // Stages 2 and 0: reductions in flight during backward before backward waits for the oldest
  // (bounds the transient memory to about this many buckets). Default: 2.
  int max_inflight_buckets = 2;
  // Stages 2 and 0. true: every backward reduces its gradients into this rank's fp32 shard
  // (gradient memory stays sharded). false: gradients accumulate in full in p.grad() and step()
  // reduces them once, as under no_sync(). Stage 1 always accumulates locally. Default: true.
  bool reduce_every_backward = true;
  // > 0: step() clips the gradient to this global L2 norm unless clip_grad_norm()
  // was already called this step. Default: 0 (no clipping).
  double max_grad_norm = 0;
  // Dynamic loss scaling. Default: on when a parameter is Half.
  LossScaleOptions loss_scale;
};

// ZeRO-0/1/2 over `params`, which keep their tensor identity (their data becomes a slice of
// the optimizer's flat buffers). Construction is collective: every rank starts from rank 0's
// values, and the constructor throws on every rank, naming the first difference, when the
// ranks' parameters (names, shapes, dtypes) or options differ.
class ShardedAdamW : public ShardedOptimizer {
 public:
  // `group`: a CPU communicator (init_communicator), or a device one with its CPU control
  // plane (init_nccl, stage_through_host, device_group).
  // `defaults` (and a param group's own options): torch::optim::AdamWOptions, or AdamOptions
  // with weight_decay 0 (as torch::optim::Adam); amsgrad is refused.
  // REQUIRES (each throws naming the parameter and the fix): every parameter on the group's
  //           device (group.data->device()), Float, BFloat16 or Half, in one param group only;
  //           at least one trainable parameter; tied weights as one tensor.
  ShardedAdamW(std::vector<torch::Tensor> params, ProcessGroup group,
               const torch::optim::OptimizerOptions& defaults = torch::optim::AdamWOptions(),
               ShardedAdamWOptions options = {});
  // Param groups with their own AdamWOptions (lr, weight_decay, ...); a group with another
  // optimizer's options throws, naming the group.
  ShardedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups, ProcessGroup group,
               const torch::optim::OptimizerOptions& defaults = torch::optim::AdamWOptions(),
               ShardedAdamWOptions options = {});
  // From module->named_parameters(): errors and checkpoints use these names.
  ShardedAdamW(const torch::OrderedDict<std::string, torch::Tensor>& named_params,
               ProcessGroup group,
               const torch::optim::OptimizerOptions& defaults = torch::optim::AdamWOptions(),
               ShardedAdamWOptions options = {});
  ~ShardedAdamW() override;

  const ShardedAdamWOptions& sharded_options() const;

 private:
  struct Impl;
  ShardedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups, ProcessGroup group,
               const torch::optim::OptimizerOptions& defaults, ShardedAdamWOptions options,
               const torch::OrderedDict<std::string, torch::Tensor>* names);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
