// shard_group.h — the unit of sharded state both optimizers update: a ZeRO-1/2
// bucket or a ZeRO-3 unit.
//
// A shard group is one flat buffer's worth of parameters (FlatLayout) of which
// this rank owns the elements `shard`: their fp32 master, the AdamW moments and
// the reduced gradient of this step. `values` is the same slice in the
// parameters' dtype, which is what the all-gather after an update sends; for
// fp32 parameters it is the master itself. update_shard() is the one place the
// AdamW kernel is dispatched, by the tensors' device.
#pragma once

#include "optim/fused_adamw.h"
#include "optim/grad_norm.h"
#include "zeroshard/comm.h"
#include "zeroshard/flat_layout.h"

#include <ATen/ATen.h>

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard::shard {

struct ShardGroup {
  // The parameters and their offsets in the flat buffer. Laid out for one
  // rank on a communicator of more, the group is replicated (ZeRO stage 0):
  // every rank owns the whole buffer and its reductions are all-reduces.
  FlatLayout layout;
  std::vector<size_t> params;          // the optimizer's index of each layout entry's parameter
  Range shard;                         // the elements of the flat buffer this rank owns
  std::vector<ShardSegment> segments;  // parameter pieces inside `shard`
  at::Tensor values;                   // [shard.size()], parameter dtype: what gathers send
  at::Tensor master;                   // fp32 [shard.size()]; the same tensor as `values` for fp32
  at::Tensor exp_avg, exp_avg_sq;      // fp32 [shard.size()]; undefined until first needed
  at::Tensor grad_shard;               // this step's reduced gradient of `shard` (undefined: none yet)
  std::vector<char> had_grad;          // per layout entry: got a gradient on this rank this step
  // What this rank fed the group's reductions this step, before reducing (the
  // gradient noise measurement, noise_scale.h): how many inputs, and the sum
  // of their squared norms (CPU inputs summed here; device ones on the device,
  // read only with unreduced_sumsq()'s reader, so backward never waits for the host).
  int reductions = 0;
  double unreduced_host_sumsq = 0;
  at::Tensor unreduced_device_sumsq;
  // A late round this step (arrivals after the group's reduction launched): the rank's gradient
  // was reduced in two pieces, whose sum's norm is not known here; the sample is NaN (no sample).
  bool late_round = false;

  // Allocates exp_avg and exp_avg_sq (zeros) if they do not exist yet.
  void ensure_moments();
  // Adds a reduce-scatter's output into grad_shard: adopted when it is the
  // first, else accumulated in fp32.
  void accumulate_gradient(const at::Tensor& reduced);
  // Counts one reduction input: its squared norm joins this step's sum.
  void note_unreduced(const at::Tensor& in);
  // A late round's input: the step's sample is left out (unreduced_sumsq() is NaN).
  void note_late() { late_round = true; }
  // reductions × the sum of the inputs' squared norms: with `reductions` equal
  // parts of a rank's batch, the mean squared norm of one part's gradient
  // taken as a mean over its own examples (each input is 1/reductions of one).
  // Its device part stays there (optim::read_sums reads it).
  optim::PendingSum unreduced_sumsq() const;
  // Drops this step's gradient (and its measurement).
  void clear_gradient();
};

// Per layout entry: the kernel's coefficients, or nullopt to leave the entry
// unchanged this step.
using EntryCoefficients = std::vector<std::optional<optim::AdamWCoeffs>>;

// Runs AdamW over every piece of `group.shard` whose entry has coefficients:
// master and moments in place, and for 16-bit parameters the rounded value
// into `values` in the same pass.
// REQUIRES: coeffs.size() == group.layout.params.size(); grad_shard defined
//           when any entry has coefficients.
void update_shard(ShardGroup& group, const EntryCoefficients& coeffs);

// Gradient reductions in flight, oldest first (ZeRO-1/2 buckets, ZeRO-3
// units): reduce-scatters with kAvg into a fresh [shard] tensor (all-reduces
// for a replicated group), each added into its group's grad_shard when
// drained. With hybrid sharding (set_replicas) each reduced shard is then
// averaged across the replica group: that all-reduce starts once its
// reduce-scatter is done, in issue order (on a device, at once, ordered on the
// stream). Issue order is the caller's (the same on every rank); draining is
// in issue order.
class ReductionQueue {
 public:
  struct Entry {
    ShardGroup* group = nullptr;
    at::Tensor in, out;
    std::shared_ptr<Work> work;          // the reduce-scatter (or all-reduce) in the shard group
    std::shared_ptr<Work> replica_work;  // hybrid: the all-reduce of `out` across replicas, once started
    bool across_replicas = false;        // hybrid: `out` still needs that all-reduce
    std::string label;  // for the trace: "wait for reduction of <label>"
  };
  // Who else holds the same shards, and how they are reached:
  // kHybrid: the ranks of the other shard groups of one communicator (hybrid
  //   sharding). Replicated groups (ZeRO stage 0) are reduced over every rank
  //   already and skip it; a failure is the step's error, as any collective's.
  // kGroups: the same shard position of the other replica groups (each group a
  //   job of its own that can be lost: replica/). Every reduction takes it,
  //   replicated ones too. A failure ends this step's reductions across the
  //   groups without throwing: replicas_lost() says why, and the step must be
  //   abandoned (the optimizer's agreement does, on every rank of the group).
  // Null: none. Set between steps.
  enum class Replicas { kHybrid, kGroups };
  void set_replicas(std::shared_ptr<Communicator> replicas, Replicas kind = Replicas::kHybrid) {
    replicas_ = std::move(replicas);
    replicas_kind_ = kind;
  }
  // kGroups: why this step's first reduction across the groups failed ("" when none failed).
  const std::string& replicas_lost() const { return replicas_lost_; }
  void forget_replicas_lost() { replicas_lost_.clear(); }
  // What a reduction's input is to the gradient noise measurement: one part
  // of the rank's batch (counted: each backward's reduction), or more of a
  // part already counted (a late round: gradients that arrived after their
  // group's reduction of this backward had launched; not counted again).
  enum class Input { kPart, kLate };
  // Reduce-scatters `in` (the group's whole flat buffer, padded) on `comm`,
  // or all-reduces it when the group is replicated. At one rank the mean is
  // `in` itself, and in place the all-reduce's output is `in`: adopted when
  // the caller says `in` is scratch (nobody else writes it), else copied.
  // A late round's label gets " (late)". Returns the entry (the caller may
  // count its buffers' bytes).
  const Entry& launch(Communicator& comm, ShardGroup& group, at::Tensor in, bool in_is_scratch, std::string label,
                      Input kind = Input::kPart);
  // Waits for the oldest and adds it into its group; returns it (its tensors
  // are freed when the caller drops it). The wait counts in waited_seconds().
  Entry drain_oldest();
  // Drains the oldest until at most `max_inflight` remain.
  void drain_to(size_t max_inflight, const std::function<void(const Entry&)>& drained = nullptr);
  void drain_all(const std::function<void(const Entry&)>& drained = nullptr) { drain_to(0, drained); }
  // Forgets every reduction in flight (after a failed backward: the results are
  // not wanted; each Work keeps its own tensors until it finishes).
  void clear() { inflight_.clear(); }
  size_t size() const { return inflight_.size(); }
  double waited_seconds() const { return waited_; }

 private:
  // Starts the replica all-reduces of the oldest entries whose reduce-scatter
  // is done (all of them on a device), stopping at the first that is not.
  void start_replica_reductions();
  // Waits for `work`, counting the time (and a trace span named `what`).
  void wait_for(Work& work, const at::Tensor& out, const std::string& what);

  // kGroups: records the failure of a reduction across the groups (and starts no more).
  void lose_replicas(const std::exception& e);

  std::deque<Entry> inflight_;
  std::shared_ptr<Communicator> replicas_;
  Replicas replicas_kind_ = Replicas::kHybrid;
  std::string replicas_lost_;
  double waited_ = 0;
};

}  // namespace zeroshard::shard
