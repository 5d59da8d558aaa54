// zeroshard/sharded_optimizer.h — ShardedOptimizer, what ZeRO-1, 2 and 3 share,
// and ShardedAdamW, the drop-in ZeRO-1/2 optimizer (ZeRO-3: fully_shard.h).
//
// Replace `torch::optim::AdamW opt(model->parameters(), AdamWOptions(3e-4));` by
//   zeroshard::ShardedAdamW opt(model->parameters(), comm, torch::optim::AdamWOptions(3e-4));
// and keep the loop (zero_grad, backward, step). Every rank holds the whole
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
//            into its bucket and frees p.grad(); a full bucket is reduce-scattered
//            at once, during backward, in bucket order on every rank. Each
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
#include "zeroshard/flat_layout.h"

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

// Dynamic loss scaling, for fp16 parameters (bf16 and fp32 do not need it).
// The loss is multiplied by scale() before backward; a step whose gradients
// hold an inf/NaN on any rank is skipped on every rank and the scale shrinks.
struct LossScaleOptions {
  // Default: -1 = on when any parameter is Half. 0 = off, 1 = on.
  int enabled = -1;
  double init_scale = 65536.0;     // Default: 2^16
  double growth_factor = 2.0;      // after growth_interval clean steps. Default: 2
  double backoff_factor = 0.5;     // after an overflow. Default: 0.5
  int64_t growth_interval = 2000;  // Default: 2000 steps
  double min_scale = 1.0;          // the scale never falls below this. Default: 1
};

// The instruction set of the AdamW kernel every sharded optimizer of this
// process runs: "avx512", "avx2" or "scalar" (each gives the same bits), or ""
// (the default) for the best this CPU has. Throws for a name it does not know
// or a set the CPU lacks. For comparing the paths, or working around a CPU.
void set_adamw_simd(const std::string& isa);

// shard_size for hybrid sharding with one shard group per host (the ranks of
// one host, found by host name; every host must hold as many consecutive ranks).
constexpr int kShardPerHost = -1;

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

// The rank's part of the optimizer state, for checkpoints. Tensors are the live
// ones (writing into them changes the optimizer).
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

// Communication the training thread waited for: exposed, not hidden behind
// compute. Seconds, cumulative since construction.
struct CommWaits {
  double gathers = 0;     // all-gathers of parameters (ZeRO-3: unsharding a unit; ZeRO-1/2: after the update)
  double reductions = 0;  // gradient reduce-scatters (in backward and in step())
  double total() const { return gathers + reductions; }
};

// Bytes held by this rank, measured from the tensors' storages. One type for
// ZeRO-1, 2 and 3.
struct ShardedMemory {
  int64_t params = 0;        // full-size parameters held now: ZeRO-1/2 the whole (replicated)
                             // model; ZeRO-3 the root unit and the units gathered right now
  int64_t param_shards = 0;  // ZeRO-3: the units' shards in the parameters' dtype (ZeRO-1/2's
                             // shards are slices of `params`)
  int64_t grads = 0;         // full-size gradients (stage 1; stages 2 and 3 under no_sync)
  int64_t grad_shards = 0;   // reduced gradient shards (stages 2 and 3, between backward and step)
  int64_t master = 0;        // fp32 master shard when parameters are 16-bit (fp32 parameters are their own master)
  int64_t moments = 0;       // exp_avg + exp_avg_sq shards
  // Most bytes of communication buffers alive at once since construction:
  // ZeRO-1/2 gradient buckets being filled or reduced; ZeRO-3 units gathered
  // (the root excluded).
  int64_t peak_transient = 0;
  // Largest total() seen since construction; sampled inside step() once every
  // gradient is reduced, which is when all of the above exist together.
  int64_t peak_model_states = 0;
  int64_t total() const { return params + param_shards + grads + grad_shards + master + moments; }
};

// What a sharded optimizer holds, waited for and sent.
struct ShardedStats {
  ShardedMemory memory;
  CommWaits waits;
  // Traffic of every communicator the sharding uses (ZeRO-3: the model's
  // gathers and its reductions' own communicator), since construction.
  CommStats traffic;
  // Of `traffic`, what went between shard groups (hybrid sharding: the
  // all-reduces of reduced gradient shards, which cross hosts when a shard
  // group is a host). Zero when the state is sharded across every rank.
  CommStats replica_traffic;
};

// The two squared gradient norms a step's gradient noise scale is estimated
// from (noise_scale.h), measured by every step() with no collective of its
// own: the reduction inputs are summed before they are reduced, and both
// norms ride on the all-reduce step() runs anyway (the agreement on which
// parameters had gradients). Unscaled (loss scaling divided out).
struct GradientNoiseSample {
  // |G_big|²: the step's mean gradient (all ranks, every backward), this optimizer's parameters.
  double big_sumsq = std::numeric_limits<double>::quiet_NaN();
  // |G_small|²: the mean, over the ranks and their reductions, of the squared
  // norm of what one rank reduced once, rescaled to a mean over its own
  // examples (× `rounds`): a batch of step batch / parts().
  double small_sumsq = std::numeric_limits<double>::quiet_NaN();
  int ranks = 0;   // of the communicator
  // How often each rank reduced its gradients in the step: ZeRO-1 once;
  // ZeRO-2/3 once per backward (once in all under no_sync or
  // reduce_every_backward = false). Assumes equal parts of the rank's batch.
  int rounds = 0;
  // The step's batch over the small one; the estimate needs parts() > 1 (at
  // one rank: several backwards that each reduce).
  int parts() const { return ranks * rounds; }
};

namespace shard {
struct Shards;           // src/shard/front_end.h
struct OptimizerAccess;  // src/shard/optimizer_access.h
}

// What ZeRO-1, 2 and 3 have in common: an AdamW over shard groups (ZeRO-1/2
// buckets, ZeRO-3 units), each rank updating its 1/N of every group. The
// front-ends (ShardedAdamW, FullyShardedAdamW) decide how gradients reach the
// shards and how updated values reach the parameters; everything else is here,
// once: the agreement on which parameters had gradients, clipping, loss
// scaling, the update, discarding, checkpoint state.
//
// Collective: every rank calls step(), clip_grad_norm(), discard_gradients()
// and restore_sharded_state() in the same order.
class ShardedOptimizer : public torch::optim::Optimizer {
 public:
  ~ShardedOptimizer() override;
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  // Finishes the gradient reductions, updates this rank's shards (skipped on
  // every rank when loss scaling found an inf/NaN gradient on any rank) and
  // brings the parameters up to date. Collective.
  torch::Tensor step(LossClosure closure = nullptr) final;

  // Clips the mean gradient to `max_norm` in the next step() (global L2 norm
  // over all ranks and parameters, after unscaling) and returns the norm
  // before clipping. Call between the last backward and step(). Collective.
  double clip_grad_norm(double max_norm);
  // The same in two halves, for callers whose norm spans more than this
  // optimizer's ranks (pipeline stages): local_sumsq() finishes this rank's
  // reductions and returns the sum of squares of its shard of the mean
  // gradient, unscaled (no communication beyond the reductions; the sum over
  // the ranks of the communicator is the squared global norm). apply_clip()
  // then clips the next step() to `max_norm` given the global norm the caller
  // summed; an inf/NaN norm skips the step when loss scaling is on. The norm
  // must be the same on every rank.
  double local_sumsq();
  void apply_clip(double max_norm, double global_norm);
  // For a caller that agrees the step over more ranks than this optimizer's
  // (pipeline stages: one world all-reduce for every stage), the rest of the
  // agreement, so that step() issues no collective of its own. After
  // local_sumsq(), local_had_grad() is this rank's part (per parameter, in
  // sharded_state().params order: 1 if it had a gradient this step);
  // apply_agreement() then takes `had_grad` summed over this optimizer's
  // ranks, the global norm and max_norm as apply_clip() takes them, and the
  // gradient noise sample the caller composed (last_gradient_noise() returns it).
  std::vector<char> local_had_grad();
  void apply_agreement(const std::vector<double>& had_grad, double max_norm, double global_norm,
                       const GradientNoiseSample& noise);
  // The same split for the gradient noise sample: after local_sumsq(), this
  // rank's reductions × the squared norms of what it fed them this step
  // (unscaled), and its most reductions of one group (the sample's rounds).
  double unreduced_sumsq();
  int reduction_rounds() const;
  // What the last step() measured (NaNs before the first).
  GradientNoiseSample last_gradient_noise() const;

  // While the returned guard lives, backward does not communicate: gradients
  // accumulate in full in p.grad() and are reduced by the first backward after
  // the guard ends (or by step()). ZeRO-1 never communicates during backward,
  // so there it changes nothing. The one no_sync() of every stage (ZeRO-3's
  // too: FullyShardedAdamW's, for the model it trains).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(ShardedOptimizer* opt);
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&& other) noexcept;
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    ShardedOptimizer* opt_;
  };
  NoSyncGuard no_sync();

  // Drops this step's gradients, reduced or not (e.g. to skip a step whose loss
  // was not finite). zero_grad() alone cannot with ZeRO-2 and 3: the gradients
  // already live in the shards, not in p.grad(). Collective (waits for
  // in-flight reductions).
  void discard_gradients();

  // loss * loss_scale() when loss scaling is on, else loss.
  torch::Tensor scale_loss(const torch::Tensor& loss) const;
  double loss_scale() const;
  // Whether dynamic loss scaling is on (then an inf/NaN norm skips the step).
  bool loss_scaling() const;
  // Whether the last step() was skipped because a gradient overflowed.
  bool last_step_skipped() const;
  // 0 (replicated), 1, 2 or 3.
  int zero_stage() const;
  // Memory now (and its peaks), exposed communication, traffic.
  ShardedStats stats() const;
  // The data-parallel communicator the shards are split over.
  Communicator& communicator() const;

  // This rank's part of the state, for checkpoints. Tensors are the live ones
  // (writing into them changes the optimizer); the moments are allocated here
  // if no step ran yet. Waits for in-flight gradient reductions first, so
  // grad_shard is complete.
  ShardedState sharded_state();
  // After a checkpoint load wrote into the master/exp_avg/exp_avg_sq tensors of
  // sharded_state(): installs the step counts (one per sharded_state().params
  // entry) and the loss scale, brings the parameters to the masters' values,
  // and replaces this step's gradients with `grad_shards` (one per group, or
  // undefined) and `had_grad` (per parameter; empty: none). Collective.
  void restore_sharded_state(const std::vector<int64_t>& param_steps, double loss_scale,
                             int64_t loss_scale_clean_steps, const std::vector<at::Tensor>& grad_shards = {},
                             const std::vector<char>& had_grad = {});
  // Runs `fn` once at the start of the next step() (or restore), before the
  // state changes: an async checkpoint finishes copying what it saves there.
  void call_before_next_update(std::function<void()> fn);

  // torch::optim serialization would save nothing of the sharded state: refused.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  friend struct shard::OptimizerAccess;

 private:
  // The front-ends (ShardedAdamW, FullyShardedAdamW) are the only subclasses.
  friend class ShardedAdamW;
  friend class FullyShardedAdamW;
  struct Core;

  // `name` prefixes errors and logs ("ShardedAdamW").
  ShardedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults,
                   std::string name, int zero_stage);
  // Param group `g`'s options, checked to be AdamW's without amsgrad.
  const torch::optim::AdamWOptions& adamw_options(size_t g);
  // Once the front-end's shard groups exist (shard::Shards, src/shard/front_end.h).
  void attach_shards(shard::Shards shards);
  // The front-end's destructor, under the round's mutex: the round is about to go.
  void detach_shards();
  void reduce_and_freeze();

  std::unique_ptr<Core> core_;
};

// ZeRO-1/2 (see the top of this file).
class ShardedAdamW : public ShardedOptimizer {
 public:
  // `group`: a CPU communicator (init_communicator), or a device one with its
  // CPU control plane (init_nccl, stage_through_host).
  // REQUIRES: every parameter on the group's device (group.data->device()),
  //           Float/BFloat16/Half; every rank passes the same parameters
  //           (names, shapes, dtypes) and options.
  ShardedAdamW(std::vector<torch::Tensor> params, ProcessGroup group,
               torch::optim::AdamWOptions defaults = torch::optim::AdamWOptions(),
               ShardedAdamWOptions options = {});
  // Param groups with their own AdamWOptions (lr, weight_decay, ...).
  ShardedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups, ProcessGroup group,
               torch::optim::AdamWOptions defaults = torch::optim::AdamWOptions(),
               ShardedAdamWOptions options = {});
  // From module->named_parameters(): errors and checkpoints use these names.
  ShardedAdamW(const torch::OrderedDict<std::string, torch::Tensor>& named_params,
               ProcessGroup group,
               torch::optim::AdamWOptions defaults = torch::optim::AdamWOptions(),
               ShardedAdamWOptions options = {});
  ~ShardedAdamW() override;

  // Clears the gradients before the next backward. Stage 1 keeps p.grad() as
  // views of its flat reduction buffers and zeroes them in place, whatever
  // `set_to_none` says; stage 2 sets them to none or zeroes them, as asked.
  // (Hides, not overrides, the base class's, which is not virtual. Clearing
  // through the base class or Module::zero_grad() works too: with stage 1 a
  // gradient backward allocates afresh is moved into the flat buffer as soon
  // as it is complete.)
  void zero_grad(bool set_to_none = true);

  const ShardedAdamWOptions& sharded_options() const;

 private:
  struct Impl;
  ShardedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups, ProcessGroup group,
               torch::optim::AdamWOptions defaults, ShardedAdamWOptions options,
               const torch::OrderedDict<std::string, torch::Tensor>* names);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
