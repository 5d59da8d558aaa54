// zeroshard/sharded_optimizer.h — ShardedOptimizer, the one interface of ZeRO-1, 2 and 3: the
// AdamW update of this rank's shards, clipping, loss scaling, no_sync, checkpoint state and
// statistics. Its front-ends are ShardedAdamW (ZeRO-0/1/2, sharded_adamw.h) and
// FullyShardedAdamW (ZeRO-3, fully_shard.h); code that takes either holds a ShardedOptimizer.
//
//   std::unique_ptr<zeroshard::ShardedOptimizer> opt = ...;   // either front-end
//   opt->zero_grad(); loss.backward(); opt->clip_grad_norm(1.0); opt->step();
//
// Ownership: the optimizer keeps its communicators alive. Not copyable. Thread-safety: use it
// from the training thread; backward hooks may run on autograd's threads and are synchronized
// internally. How it works: docs/drop-in.md.
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/optim_options.h"
#include "zeroshard/sharded_state.h"
#include "zeroshard/sharded_stats.h"
#include "zeroshard/step_agreement.h"

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace zeroshard {

// shard_size for hybrid sharding with one shard group per host (the ranks of one host, by
// host name). REQUIRES: every host holds as many consecutive ranks.
constexpr int kShardPerHost = -1;

namespace shard {
struct OptimizerAccess;  // internal
}

// Thrown by step() and clip_grad_norm() of an optimizer whose group trains beside other replica
// groups (replica_groups.h) when the step's reductions across the groups failed on any rank of
// this group (a group was lost mid-step): nothing of the step was applied, on any rank of the
// group. Call discard_gradients() and take the step again in the membership that follows.
class ReplicaGroupLost : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An AdamW over shard groups (ZeRO-1/2 buckets, ZeRO-3 units), each rank updating its 1/N of
// every group. The result equals torch::optim::AdamW on the global batch, to float rounding.
// Collective: every rank calls step(), zero_grad(), clip_grad_norm(), discard_gradients() and
// restore_sharded_state() in the same order.
class ShardedOptimizer : public torch::optim::Optimizer {
 public:
  ~ShardedOptimizer() override;
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  // Finishes the gradient reductions, updates this rank's shards and brings the parameters up
  // to date. A parameter with no gradient on any rank this step is not updated (its step count
  // stays). With loss scaling, an inf/NaN gradient on any rank skips the step on every rank.
  // Throws right after a backward that threw part-way (call zero_grad() and run the step's
  // backwards again). Collective.
  torch::Tensor step(LossClosure closure = nullptr) final;

  // Drops every gradient of the step so far, as discard_gradients(): p.grad() (set to none
  // whatever `set_to_none` says; ZeRO-1 zeroes its flat buffers' views) and, at ZeRO-0, 2 and
  // 3, what backward already reduced into the shards. Module::zero_grad() and
  // torch::optim::Optimizer::zero_grad() (not virtual) clear p.grad() only: call this one where
  // a backward ran that step() must not use (a GAN's discriminator during the generator's).
  // Collective (waits for reductions in flight).
  void zero_grad(bool set_to_none = true);

  // Clips the mean gradient to `max_norm` in the next step() (global L2 norm over all ranks and
  // parameters, after unscaling) and returns the norm before clipping. Collective.
  // REQUIRES: after the step's last backward (a backward after it throws), before step().
  double clip_grad_norm(double max_norm);
  // Puts the step's agreement (which parameters had a gradient, the norms) in a slot of
  // `agreement` instead of an all-reduce of its own (step_agreement.h). clip_grad_norm() and
  // step() run agreement->agree() unless it ran since this step's backward. Several optimizers
  // may join one agreement (a GAN): the agree() one optimizer's clip_grad_norm() or step() runs
  // is that optimizer's alone (the other optimizers' slots sit it out; other slots take part);
  // an agree() the trainer calls is every joined optimizer's, so call it after all their
  // backwards. Keeps `agreement` alive.
  // REQUIRES: `agreement` over this optimizer's ranks (its control group).
  void join(std::shared_ptr<StepAgreement> agreement);
  // What the last step() measured (NaNs before the first).
  GradientNoiseSample last_gradient_noise() const;

  // While the returned guard lives, backward does not communicate: gradients accumulate in full
  // in p.grad() and are reduced by the first backward after the guard ends (or by step()).
  // Changes nothing at ZeRO-1, which never communicates during backward.
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

  // Drops this step's gradients, reduced or not (e.g. to skip a step whose loss was not
  // finite): zero_grad() by its purpose's name. Collective (waits for reductions in flight).
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

  // This rank's part of the state, for checkpoints: the live tensors (writing into them changes
  // the optimizer); the moments are allocated if no step ran yet. Waits for gradient reductions
  // in flight first, so grad_shard is complete.
  ShardedState sharded_state();
  // After a checkpoint load wrote into the master/exp_avg/exp_avg_sq tensors of
  // sharded_state(): installs the step counts (one per sharded_state().params entry) and the
  // loss scale, brings the parameters to the masters' values, and replaces this step's
  // gradients with `grad_shards` (one per group, or undefined) and `had_grad` (per parameter;
  // empty: none). Collective.
  void restore_sharded_state(const std::vector<int64_t>& param_steps, double loss_scale,
                             int64_t loss_scale_clean_steps, const std::vector<at::Tensor>& grad_shards = {},
                             const std::vector<char>& had_grad = {});
  // Runs `fn` once at the start of the next step() (or restore), before the state changes
  // (where an async checkpoint finishes copying what it saves).
  void call_before_next_update(std::function<void()> fn);

  // Throw, naming zeroshard::Checkpointer: torch::optim serialization would save nothing of the
  // sharded state.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // internal: access for the library's own layers (the front-ends, the pipeline executor).
  friend struct shard::OptimizerAccess;

 private:
  // The front-ends (ShardedAdamW, FullyShardedAdamW) are the only subclasses.
  friend class ShardedAdamW;
  friend class FullyShardedAdamW;
  struct Core;

  // `name` prefixes errors and logs ("ShardedAdamW"). `defaults` and the
  // groups' options: AdamWOptions, or AdamOptions with weight_decay 0 (taken
  // as AdamWOptions with the same lr, betas and eps); others are refused.
  ShardedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                   const torch::optim::OptimizerOptions& defaults, std::string name, int zero_stage);
  // Param group `g`'s options, checked to be AdamW's without amsgrad.
  const torch::optim::AdamWOptions& adamw_options(size_t g);
  void reduce_and_freeze();

  std::unique_ptr<Core> core_;
};

}  // namespace zeroshard
