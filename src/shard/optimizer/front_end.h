// front_end.h — what a front-end of the sharding core provides: ShardedAdamW
// (ZeRO-0/1/2, buckets) and FullyShardedAdamW (ZeRO-3, the model's units)
// decide how gradients reach the shards and how updated values reach the
// parameters; ShardedOptimizer (the core) does the rest, calling these.
#pragma once

#include "shard/core/shard_topology.h"
#include "zeroshard/sharded_optimizer.h"

#include <vector>

namespace zeroshard::shard {

struct ShardGroup;
class BackwardRound;

// Every method runs under the round's mutex, called by the core.
class FrontEnd {
 public:
  virtual ~FrontEnd() = default;
  // Before step/clip (after the round's own checks): throws if the gradients cannot be used now.
  virtual void check_ready(const char* op) = 0;
  // Every group's grad_shard holds this step's reduced gradient (and had_grad
  // is complete). The core then freezes the round: backward is refused until the step ends.
  virtual void reduce_gradients() = 0;
  // Group `k` was updated (`changed`: some entry of it was): start bringing
  // its parameters up to date.
  virtual void group_updated(size_t k, bool changed) = 0;
  // After every group_updated(): wait for what they started.
  virtual void finish_update() = 0;
  // The step is over (or skipped): per-step state of the front-end.
  virtual void end_step() = 0;
  // discard_gradients(): wait for reductions in flight and drop every gradient
  // not yet in a shard (buffers being filled, p.grad()).
  virtual void drop_unreduced_gradients() = 0;
  // Waits for reductions in flight, adding them into the shards.
  virtual void drain_reductions() = 0;
  // Gradients of this step that are not in the shards (full, in p.grad()).
  virtual bool local_gradients_pending() const = 0;
  // restore: the masters were loaded; make the parameters equal them.
  virtual void install_masters() = 0;
  // restore: the checkpoint holds reduced gradients of a step in progress; throws if they cannot be taken.
  virtual void accept_restored_gradients() = 0;
  // stats(): what the core does not know (params, param_shards, grads,
  // peak_transient, waits, traffic).
  virtual void add_stats(ShardedStats& stats) const = 0;
  // Whether its reductions depend on how many times a gradient arrives in one backward
  // (ZeRO-0/2): the step's agreement then carries step_arrivals() and hands back the
  // counts every rank agrees on, so that no rank decides its collectives from its own graph.
  virtual bool counts_arrivals() const { return false; }
  // Per parameter: the most times its gradient arrived in one backward of this step, here (0: none).
  virtual std::vector<int> step_arrivals() const { return {}; }
  // Per parameter: the count every rank that had its gradient saw (-1: no rank had it). The same on every rank.
  virtual void agreed_arrivals(const std::vector<int>& /*counts*/) {}
  // Gradients that arrived beyond the agreed count (ZeRO-0/2) are held here until the step's
  // agreement says whether any rank got some; then every rank reduces its late rounds alike
  // (reduce_late(): collective; zeros where none are held) and the gradient norms are summed again.
  virtual bool holds_late() const { return false; }
  virtual void reduce_late() {}
};

// What a front-end hands the core once its shard groups exist.
struct Shards {
  FrontEnd* front_end = nullptr;           // outlives the core's use of it (detach_shards() ends that)
  ProcessGroup process_group;              // data: every data-parallel rank; control: the per-step agreement
  ShardTopology topology;                  // the shard and replica groups (flat: one group of every rank)
  BackwardRound* round = nullptr;          // the front-end's backward protocol (its mutex: the hooks' one)
  std::vector<ShardGroup*> groups;         // sharded_state() order
  std::vector<size_t> update_order;        // order step() updates groups in (empty: as `groups`)
  std::vector<ParamInfo> infos;            // per parameter (the index ShardGroup::params uses)
  std::vector<at::Tensor> tensors;         // the live parameter tensors, as `infos`
  std::vector<int> group_of;               // param group per parameter; -1: never updated
  double max_grad_norm = 0;
  LossScaleOptions loss_scale;
  bool loss_scaling = false;               // resolved from loss_scale.enabled
};

}  // namespace zeroshard::shard
