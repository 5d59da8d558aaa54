// sharded_adamw_impl.h — ShardedAdamW's state, shared by its two source files:
// sharded_adamw.cpp (construction, step, clipping, state) and
// grad_reduction.cpp (backward hooks and the bucketed reduce-scatter).
#pragma once

#include "shard/backward/backward_round.h"
#include "shard/optimizer/front_end.h"
#include "shard/core/shard_group.h"
#include "zeroshard/sharded_adamw.h"

#include "compat/autograd_hooks.h"

#include <algorithm>
#include <memory>

namespace zeroshard {
namespace shard {

// One bucket: a flat buffer of parameters of one dtype and one param group.
// Its shard group's `values` is flat_params' slice `shard`; `master` is that
// same view when the dtype is Float.
struct Bucket : ShardGroup {
  int group = 0;           // param group
  at::Tensor flat_params;  // [padded_numel], the model's parameters alias it
  at::Tensor flat_grads;   // stage 1: [padded_numel], p.grad() aliases it (created at the first step)
  at::Tensor rs_in;        // stages 2 and 0: this backward's gradients, filling up
  at::Tensor late_in;      // stages 2 and 0: this backward's arrivals beyond the agreed count (a late round)
  at::Tensor late_held;    // the step's late_in of the backwards that ended, reduced at the step's agreement
  size_t ready = 0;        // parameters with every expected arrival of this backward in rs_in
};

}  // namespace shard

// The core's front-end for ZeRO-0/1/2, and the backward round's client: what
// they do at each moment of a pass.
struct ShardedAdamW::Impl : shard::BackwardRound::Client, shard::FrontEnd {
  Impl(ShardedAdamW& owner, ProcessGroup group, ShardedAdamWOptions options);

  ShardedAdamW& owner;
  ProcessGroup group;
  shard::ShardTopology topology;       // the shard and replica groups
  std::shared_ptr<Communicator> comm;  // topology.shard: the buckets' collectives (group.data when not hybrid)
  ShardedAdamWOptions options;
  int rank = 0, world = 1;             // in the shard group
  // Stages 2 and 0 move gradients out of p.grad() into buckets that backward
  // reduces; stage 1 leaves them there until step().
  bool reduce_in_backward() const { return options.zero_stage != 1; }

  std::vector<torch::Tensor> params;  // trained parameters, model order
  std::vector<ParamInfo> infos;
  std::vector<int> group_of;
  std::vector<std::pair<size_t, size_t>> location;  // parameter -> (bucket, layout entry)
  std::vector<shard::Bucket> buckets;               // backward order
  std::vector<size_t> group_sizes;                  // to notice param groups changed after construction

  // Per optimizer step (the round is frozen once every bucket's grad_shard holds the mean gradient).
  // Got a gradient on this rank since the last step (kept in its bucket's had_grad).
  char& had_grad(size_t param) { return buckets[location[param].first].had_grad[location[param].second]; }
  bool any_had_grad() const;

  // Per backward (the round's protocol: syncs(), the launch order, the reductions in flight).
  // Stages 2 and 0: how many times each parameter's gradient arrived in this
  // backward, the most in one backward of this step, and the count the ranks
  // agreed on at the last step (the step's agreement: the same on every rank,
  // following the graph as it changes). Each arrival is one call of its
  // accumulator: one per backward, plus one per nested backward of a
  // checkpointed segment that uses it (a parameter in two segments, or in one
  // and outside it). A bucket launches once every parameter in it had the
  // expected number; an arrival beyond that goes into the bucket's late_in,
  // whether or not the bucket launched (whether it has depends on the rank's
  // own graph: a parameter unused on some ranks). Whether a rank has late
  // gradients is its own, so they are held until the step's agreement, which
  // tells every rank whether any has some; then every rank reduces a late
  // round of every bucket (GradientNorms, reduce_late()). Until the first
  // agreement every bucket launches at the end of the pass, so the first
  // backward, which shows the reuse, has no late gradient at all.
  std::vector<int> arrivals, step_max_arrivals, expected_arrivals;
  bool counts_agreed = false;  // a step's agreement has set expected_arrivals (before it: every bucket at the end)
  int expected(size_t param) const { return std::max(1, expected_arrivals[param]); }
  bool counts_arrivals() const override { return reduce_in_backward(); }
  std::vector<int> step_arrivals() const override { return step_max_arrivals; }
  void agreed_arrivals(const std::vector<int>& counts) override;
  bool holds_late() const override;
  void reduce_late() override;
  double gather_seconds = 0;           // exposed: the training thread blocked on the update's all-gathers
  bool flushed_since_step = false;

  int64_t transient_bytes = 0, peak_transient = 0;

  std::vector<std::shared_ptr<Work>> gathers;  // all-gathers of updated buckets, in flight

  std::vector<compat::GradReadyHook> hooks;
  // Stages 2 and 0: what p.grad() holds once a gradient is in a bucket
  // (shard::make_reduced_grad_marker), one per parameter; removed by a pre
  // hook before the next backward accumulates into p.grad().
  std::vector<at::Tensor> grad_markers;

  // grad_reduction.cpp
  void register_hooks();
  void remove_hooks();
  void on_grad_ready(size_t param);   // from a grad-accumulator post hook
  void begin_pass() override;
  void end_pass() override;           // launch what is left
  void abandon_pass() override;       // drop the buckets being filled
  void flush_backward();              // launch what is left, zeros for missing gradients
  void check_params_in_place() const;
  void reduce_gradients() override;   // every bucket's mean gradient in grad_shard
  void drain_reductions() override;   // every reduce-scatter in flight added into its grad_shard
  void end_step() override;           // per-step state, once the step is over

  // sharded_adamw.cpp: the rest of the front-end
  void check_ready(const char* op) override;  // param groups and aliases unchanged
  void group_updated(size_t k, bool changed) override;
  void finish_update() override;
  void drop_unreduced_gradients() override;
  bool local_gradients_pending() const override;
  void install_masters() override;
  void accept_restored_gradients() override;
  void add_stats(ShardedStats& stats) const override;

  void track(int64_t bytes);
  void check_groups_unchanged() const;

  // Construction (sharded_adamw.cpp): the trained parameters (returns whether
  // any is Half), then, once the topology is known, the buckets.
  bool collect_params(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                      const torch::OrderedDict<std::string, torch::Tensor>* names);
  void build_buckets();

  // Last: destroyed first, so no hook reaches the rest of Impl while it goes.
  std::unique_ptr<shard::BackwardRound> round;

 private:
  // Moves p.grad() into its slot of `into` (allocated with zeros when
  // undefined): copied when `first`, else added; p.grad() becomes the stand-in.
  void move_grad_into(size_t param, const shard::Bucket& b, at::Tensor& into, bool first);
  void grad_into_flat(size_t param);  // stage 1: p.grad() becomes its slot of the bucket's flat_grads
  void launch(size_t bucket, at::Tensor in, shard::ReductionQueue::Input kind);
  void hold_late();  // this backward's late_in into late_held
  void untrack(const shard::ReductionQueue::Entry& e);  // a drained reduction's buffers are gone
  void launch_ready_in_order(bool force);
};

}  // namespace zeroshard
