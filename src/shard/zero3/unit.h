// unit.h — one ZeRO-3 unit: a group of parameters sharded together.
//
// States of a unit's parameters:
//   gathered:  `gathered` holds the full flat buffer; each parameter tensor is
//              a (non-autograd) alias of its slice.
//   resharded: the buffer's storage is resized to 0 bytes (the StorageImpl is
//              kept, so views autograd saved during forward see the data again
//              after the next gather) and each parameter tensor holds an empty
//              tensor, so misuse fails instead of reading freed memory.
// `values` (this rank's 1/N) always exists; it is what the optimizer
// updates and what the next gather reads.
//
// All methods run under the model's mutex (ShardedModel::mu).
#pragma once

#include "zeroshard/fully_shard.h"

#include "compat/autograd_hooks.h"
#include "shard/backward/backward_round.h"
#include "shard/zero3/deferred_init.h"
#include "shard/optimizer/front_end.h"
#include "shard/zero3/quantized_gather.h"
#include "shard/core/shard_group.h"
#include "shard/core/shard_topology.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>

namespace zeroshard::shard {

struct ShardedModel;

// The unit's shard group (shard_group.h): its `values` are what gathers send
// (the root's are a slice of its gathered buffer); `params` index the
// parameters in the model's order over all units (FullyShardedAdamW's order).
class Unit : public ShardGroup {
 public:
  // `deferred`: the unit was built under DeferredInit, its parameters hold
  // placeholders and `deferred` their shapes and this rank's shard; the unit
  // then holds no gathered buffer (at one rank, the shard as its buffer).
  Unit(ShardedModel& model, size_t index, std::string name, std::vector<std::string> names,
       std::vector<at::Tensor> tensors, bool is_root, const DeferredUnit* deferred = nullptr);
  ~Unit();

  // Forward (from Sharded<>::forward).
  void before_forward();
  at::Tensor after_forward(at::Tensor out);
  void end_forward();

  // Backward.
  void pre_backward();                 // a hook on an output: gather before this unit's backward
  void on_grad_ready(size_t param);    // grad-accumulator post hook
  void complete_gradients();           // pack this backward's gradients into rs_in, free them, reshard
  bool complete() const { return complete_; }
  bool late_round() const { return late_round_; }  // a second round of gradients is being collected
  void finish_round();                 // launch in order, or at once for a late round
  at::Tensor take_packed_gradients();  // what complete_gradients() packed, for the reduce-scatter
  std::string label() const;           // for logs and the trace: its name, "(root)" for the root
  void start_backward();               // reset per-backward state

  // Gathers in a narrower dtype than the parameters' (FullyShardOptions::
  // gather_dtype): `gather_values` is the shard rounded to it (refreshed after
  // every update), and `gather_buffer` the narrow gathered buffer, whose
  // storage exists only while a gather is in flight. Undefined otherwise.
  // With gather_dtype Char both are uint8: the shard block-quantized and packed
  // by `quantized` (quantized_gather.h), and the ranks' packed shards.
  at::Tensor gather_values, gather_buffer;
  std::optional<QuantizedGather> quantized;
  bool narrow_gather() const { return gather_values.defined(); }
  // The shard changed (an update, a load): round it again for the next gathers.
  void refresh_gather_values();

  // Its shard is a slice of `gathered`, which is never freed: the root, and
  // every unit at one rank (where the shard is the whole buffer, so
  // unsharding is only giving the parameters their views back: no copy).
  bool keeps_buffer() const;
  void start_unshard();                // issue the all-gather (prefetch); unshard() finishes it
  void unshard();
  void reshard();
  void register_hooks();
  void remove_hooks();
  // What p.grad() holds once tensor `param`'s gradient is in the reduction buffer.
  at::Tensor reduced_grad_marker(size_t param) const;

  ShardedModel& model;
  const size_t index;
  const std::string name;
  const bool is_root;
  std::vector<at::Tensor> tensors;     // the parameters, as layout.params
  std::vector<char> trainable;         // requires_grad at construction
  at::Tensor gathered;                 // [padded_numel]; storage 0 bytes while resharded
  bool is_gathered = true;

 private:
  std::vector<at::Tensor> views_;      // the parameters' aliases of `gathered`
  std::vector<at::Tensor> empties_;    // what parameters hold while resharded
  std::vector<char> ready_;            // gradient in, this backward
  size_t ready_count_ = 0;
  size_t trainable_count_ = 0;
  bool complete_ = false;
  bool late_round_ = false;
  bool pre_backward_done_ = false;
  // Forwards with gradients since the last backward began (recomputations not counted), and
  // whether this backward holds the unit to its end: the root, or a unit run more than once
  // (a reused layer). Both are the same on every rank, unlike whether a unit's gradients are
  // complete (a parameter unused on some ranks), so holding never makes a rank regather or
  // reduce late where another does not.
  int forward_uses_ = 0;
  long long segments_at_forward_ = 0;  // shard::checkpointed_segments() when its forward began
  bool ran_segment_ = false;           // a checkpointed segment began inside its forward since the last backward
  bool hold_ = false;
  std::shared_ptr<Work> gather_work_;  // an all-gather in flight into `gathered`
  std::chrono::steady_clock::time_point forward_start_, backward_start_;  // for the trace
  at::Tensor rs_in_;                   // packed gradients, until launched
  std::vector<compat::GradReadyHook> hooks_;
  // What p.grad() holds once a gradient is in rs_in_ (shard::make_reduced_grad_marker), per tensor.
  std::vector<at::Tensor> grad_markers_;
};

// Shared by the units of one fully_shard() call (FullyShardedModel's state);
// the backward round's client (what ZeRO-3 does at each moment of a pass) and
// the core's front-end for FullyShardedAdamW.
struct ShardedModel : BackwardRound::Client, FrontEnd {
  ProcessGroup group;
  ShardTopology topology;              // the shard and replica groups
  std::shared_ptr<Communicator> comm;  // topology.shard: gathers, and the device of every buffer
  FullyShardOptions options;
  int rank = 0, world = 1;             // in the shard group
  std::vector<std::shared_ptr<Unit>> units;           // registration order, root last
  std::vector<size_t> launch_order;                   // reductions issue in this order on every rank
  std::vector<std::weak_ptr<torch::nn::Module>> unit_modules;  // the Sharded<> modules, to detach at the end

  // Everything here runs under the round's mutex (autograd's hooks hold it too).
  std::recursive_mutex& mu() const { return round->mutex(); }

  // Execution order, recorded in the first forward and backward and checked
  // equal across ranks; afterwards it drives prefetching.
  std::vector<size_t> forward_order, backward_order;
  bool recording_forward = true, recording_backward = true;
  size_t forward_pos = 0, backward_pos = 0;
  bool forward_prefetch_off = false, backward_prefetch_off = false;  // this pass deviated
  bool warned_order = false;
  void on_forward(size_t unit);
  void on_pre_backward(size_t unit);
  void check_order_across_ranks(const std::vector<size_t>& order, const std::string& what);
  void prefetch(const std::vector<size_t>& order, size_t next);
  // `unit` just ended the last forward of an in-order pass with gradients:
  // its backward is next, keep it gathered (keep_last_unit_for_backward).
  bool backward_comes_next(size_t unit) const;
  // After an update: start gathering the first unit of the recorded forward order.
  void prefetch_first_forward_unit();

  // Time the training thread spent blocked on all-gathers (not hidden behind
  // compute); the reductions' is reductions.waited_seconds().
  double exposed_gather_seconds = 0;

  // Bytes of non-root units gathered at once, now and at most.
  int64_t gathered_bytes = 0, peak_gathered = 0;
  void track_gathered(int64_t delta) {
    gathered_bytes += delta;
    peak_gathered = std::max(peak_gathered, gathered_bytes);
  }

  // Units held gathered (keep_gathered): forwards and backwards do not reshard.
  int keep_gathered_depth = 0;

  void reduce_local_gradients();       // step() after no_sync backwards: reduce them now

  // The optimizer's side (FullyShardedAdamW's front-end, fully_sharded_adamw.cpp), under the mutex.
  std::vector<std::shared_ptr<Work>> update_gathers;  // the root's all-gather after an update
  void check_ready(const char*) override {}
  void reduce_gradients() override;    // every unit's grad_shard complete
  void group_updated(size_t unit, bool changed) override;  // root all-gathered, others resharded
  void finish_update() override;       // waits for the root's gather, prefetches the first unit
  void end_step() override {}
  void drop_unreduced_gradients() override;  // reductions in flight, shards and p.grad() leftovers
  void drain_reductions() override;
  bool local_gradients_pending() const override;
  void install_masters() override;     // after a load: shards from the masters, the root gathered
  void accept_restored_gradients() override {}
  void add_stats(ShardedStats& stats) const override;

  // Per backward: the protocol (first hook, no_sync, launch order, end,
  // recovery) and the reduce-scatters in flight are the round's.
  // Reductions run on a communicator of their own (a split of the same ranks,
  // with its own thread): gathers and reductions then form two streams, each
  // in the same order on every rank even when ranks finish units' gradients
  // at different points of backward (unused parameters on some ranks).
  std::shared_ptr<Communicator> reduce_comm;
  // Where agreements on host values go during training: the control plane
  // when the group has one of its own; for a CPU communicator (its own control
  // plane) the reductions' split, so that the gathers' carries parameters only.
  // Hybrid: the control plane, which spans every rank and carries no gathers.
  Communicator& check_comm() const {
    return group.control == group.data && !topology.hybrid() ? *reduce_comm : *group.control;
  }
  void launch(size_t unit, ReductionQueue::Input kind = ReductionQueue::Input::kPart);

  void begin_pass() override;         // the first hook of a backward
  void end_pass() override;           // launch what is left, reshard
  void abandon_pass() override;       // free what the failed pass gathered
  void try_launch();

  // Last: destroyed first, so no hook reaches the rest while it goes.
  std::unique_ptr<BackwardRound> round;
};

}  // namespace zeroshard::shard

namespace zeroshard {
// What a FullyShardedModel holds (fully_shard.h names it only).
struct FullyShardedModel::State : shard::ShardedModel {};
}  // namespace zeroshard
