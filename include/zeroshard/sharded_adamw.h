// zeroshard/sharded_adamw.h — ShardedAdamW, the drop-in ZeRO-1/2 optimizer
// (ZeRO-3: fully_shard.h; what both share: sharded_optimizer.h).
//
// Replace `torch::optim::AdamW opt(model->parameters(), AdamWOptions(3e-4));` by
//   zeroshard::ShardedAdamW opt(model->parameters(), comm, torch::optim::AdamWOptions(3e-4));
// and keep the loop (zero_grad, backward, step). A loop written for
// torch::optim::Adam keeps its AdamOptions with weight_decay 0 (Adam's L2
// decay is refused, naming AdamW's decoupled decay); docs/drop-in.md lists
// every idiom of a LibTorch loop. Every rank holds the whole
// model; each keeps the AdamW state (fp32 master, exp_avg, exp_avg_sq) only for
// its 1/N slice of the parameters (stage 1), and with stage 2 also only its
// slice of the gradients. Stage 0 shards nothing (DDP-style replication: every
// rank holds the whole state and runs the whole update), for comparison and
// for models small enough that memory is no concern. The result equals
// torch::optim::AdamW on the global batch (the mean of the ranks' gradients),
// to float rounding.
//
// How it works. At construction the parameters are grouped into buckets (in
// backward order, `bucket_bytes` each) and each bucket becomes one flat buffer
// (see flat_layout.h); every parameter tensor keeps its identity but its data
// becomes a slice of that buffer, and rank 0's values are broadcast so all
// ranks start equal. Ranks exchange a hash of the parameter names, shapes,
// dtypes and options first and refuse to start, naming the first difference,
// when they disagree.
//   stage 1: gradients stay in p.grad() (as slices of a flat gradient buffer);
//            step() reduce-scatters each bucket, so each rank gets the mean
//            gradient of its slice.
//   stage 2: a hook on each parameter's gradient accumulator copies the gradient
//            into its bucket and frees p.grad(), which then holds a stand-in
//            without values (code that reads it as the gradient, such as
//            torch::nn::utils::clip_grad_norm_, throws, naming the fix); a
//            full bucket is reduce-scattered at once, during backward, in
//            bucket order on every rank. Each
//            backward adds its reduced slice into the rank's gradient shard, so
//            accumulating micro-batches keeps gradient memory sharded.
//   stage 0: as stage 2, but each bucket is laid out for one rank and
//            all-reduced: every rank gets the whole mean gradient.
// step() then runs the fused AdamW kernel on the rank's slice of each bucket and
// all-gathers the updated parameters into the model's own tensors (stage 0:
// the slice is the whole bucket, and there is nothing to gather).
//
// Semantics kept from torch::optim::AdamW: a parameter is updated only when it
// had a gradient this step on at least one rank (its step count advances only
// then); per-group lr/betas/eps/weight_decay are read at every step, so an LR
// scheduler that writes param_groups()[i].options() works. Parameters with
// requires_grad() == false at construction are left out (never updated).
//
// Ownership and threads: the optimizer keeps the communicator alive. Use it
// from the training thread; backward hooks may run on autograd's threads and
// are synchronized internally. Not copyable.
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
  // 1: shard optimizer states (ZeRO-1). 2: also shard gradients (ZeRO-2).
  // 0: shard nothing (DDP-style: gradients all-reduced, every rank updates
  // everything). Default: 2.
  int zero_stage = 2;
  // Hybrid sharding (stages 1 and 2): the state is sharded across groups of
  // this many consecutive ranks and replicated across the groups. Gradients are
  // reduce-scattered inside a group, then each reduced shard is averaged across
  // the groups (an all-reduce of 1/shard_size of the gradient), and updated
  // parameters are gathered inside the group only: with a group per host, the
  // links between hosts carry 1/shard_size of the bytes. Memory: optimizer
  // states (and, at stage 2, gradients) shrink by shard_size, not by every rank.
  // 0: every rank (one group: flat ZeRO). kShardPerHost: the ranks of one host.
  // N: N ranks (it must divide the ranks). Default: 0.
  int shard_size = 0;
  // Gradient bucket size: the unit of reduce-scatter and all-gather. Default: 16 MiB.
  int64_t bucket_bytes = int64_t{16} << 20;
  // Stages 2 and 0: reductions in flight during backward before backward waits
  // for the oldest (bounds the transient memory to about this many buckets). Default: 2.
  int max_inflight_buckets = 2;
  // Stage 2 (and 0) gradient accumulation. true: every backward reduces its
  // gradients and adds them into this rank's fp32 shard (gradient memory stays
  // sharded; one reduce-scatter per micro-batch). false: gradients accumulate
  // in full in p.grad() and step() reduces them once, as if every backward ran
  // under no_sync(). Stage 1 always accumulates locally. Default: true.
  bool reduce_every_backward = true;
  // > 0: step() clips the gradient to this global L2 norm unless clip_grad_norm()
  // was already called this step. Default: 0 (no clipping).
  double max_grad_norm = 0;
  LossScaleOptions loss_scale;
};

// ZeRO-1/2 (see the top of this file).
class ShardedAdamW : public ShardedOptimizer {
 public:
  // `group`: a CPU communicator (init_communicator), or a device one with its
  // CPU control plane (init_nccl, stage_through_host).
  // `defaults` (and a param group's own options): torch::optim::AdamWOptions,
  // or AdamOptions with weight_decay 0 (as torch::optim::Adam; refused otherwise).
  // REQUIRES: every parameter on the group's device (group.data->device()),
  //           Float/BFloat16/Half; every rank passes the same parameters
  //           (names, shapes, dtypes) and options.
  ShardedAdamW(std::vector<torch::Tensor> params, ProcessGroup group,
               const torch::optim::OptimizerOptions& defaults = torch::optim::AdamWOptions(),
               ShardedAdamWOptions options = {});
  // Param groups with their own AdamWOptions (lr, weight_decay, ...).
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
