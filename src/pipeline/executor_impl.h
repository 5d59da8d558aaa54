// executor_impl.h — a PipelineExecutor's state: the schedule, its stages'
// shards and ties, the payloads in flight, and its part of the step's
// agreement. executor.cpp runs the actions; executor_step.cpp does what a
// step adds around them (tied gradients, the agreement, the update).
#pragma once

#include "zeroshard/pipeline_executor.h"
#include "zeroshard/log.h"

#include "comm/work.h"
#include "optim/grad_norm.h"
#include "pipeline/payload.h"
#include "shard/optimizer/gradient_norms.h"
#include "shard/optimizer/optimizer_access.h"
#include "runtime/rank_agreement.h"
#include "zeroshard/trace.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>


namespace zeroshard::pipeline {

struct PipelineExecutor::Impl {
  const PipelineGrid& grid;
  Schedule schedule;
  StageFunctions fns;
  ExecutorOptions options;
  Communicator& pipe;  // the pipeline group's data plane: rank i is stage i mod pp
  const bool training;  // the schedule has backwards (else: forwards without gradients, nothing kept)

  struct Sharding {  // a stage given StageShards
    StageShards shards;
    size_t last_backward = 0;  // index of the stage's last B in this rank's list
    // Per step: gradients accumulate locally until the last backward; ZeRO-3
    // units held gathered from UNSHARD to RESHARD; REDUCE_GRAD done.
    std::optional<ShardedOptimizer::NoSyncGuard> local;
    std::optional<FullyShardedModel::KeepGatheredGuard> gathered;
    bool reduced = false;
  };
  std::map<int, Sharding> sharded;
  // The step's agreement over the world: the header's slot (the loss), what
  // others joined, then, laid out at the first step, the stages' gradient
  // norms (one slot every stage's optimizer fills on every rank) and each
  // stage's flags (its optimizer's slot on its ranks, zeros elsewhere).
  std::shared_ptr<StepAgreement> agreement;
  std::vector<int64_t> slots;  // this executor's: the header, the other ranks' stages' flags
  static constexpr size_t kHeader = 2;
  std::vector<double> header;  // of the last agree(): [loss sum, ranks whose loss was not finite]
  std::shared_ptr<shard::GradientNorms> norms;  // with StageShards, from the first step
  // What the pipeline adds to the norms: each tied gradient counted once (reduce_ties()).
  std::vector<shard::GradientNorms::Part::Term> tie_terms;
  bool laid_out = false;

  struct Tie {  // this rank's copy of a parameter tied across stages
    size_t set;
    int stage;
    at::Tensor param;
    ProcessGroup group;  // the set's tie group: rank i is its i-th stage
  };
  std::vector<Tie> ties;  // in set order
  bool ties_synced = false;

  using Key = std::pair<int, int>;  // (stage, microbatch)
  std::map<Key, PayloadRecv> inputs, output_grads;  // posted receives
  struct Live {                                      // a forward awaiting its backward
    Payload input;                                   // its float tensors collect the input's gradient
    Payload output;
    at::Tensor loss;                                 // the last stage's
  };
  std::map<Key, Live> live;
  std::map<Key, Payload> to_send;                    // results whose SEND comes next
  std::vector<std::shared_ptr<Work>> sends;
  double loss_sum = 0;
  int peak_in_flight = 0;
  int64_t memory_base = 0, memory_peak = 0;  // ExecutorOptions::memory_probe's, this step
  std::chrono::steady_clock::time_point step_start, passes_end;
  double compute_seconds = 0;                           // in F and B, from their data's arrival
  std::chrono::steady_clock::time_point pass_start;     // of the current F or B, its data arrived

  Impl(const PipelineGrid& g, Schedule s, StageFunctions f, ExecutorOptions o)
      : grid(g), schedule(std::move(s)), fns(std::move(f)), options(o), pipe(*g.pp_group().data),
        training(!forward_only(schedule)), agreement(std::make_shared<StepAgreement>(g.world().control)) {
    add_header();
  }
  ~Impl() {
    for (int64_t id : slots) agreement->remove(id);
    // The stages' optimizers outlive the executor: back to agreements of their own.
    if (norms == nullptr) return;
    for (auto& [stage, sh] : sharded) shard::OptimizerAccess::join(*sh.shards.optimizer, nullptr, {});
  }

  const std::vector<Action>& my_actions() const { return schedule.actions[static_cast<size_t>(pipe.rank())]; }

  int last_stage() const { return schedule.stages - 1; }
  std::string name(int stage, int mb) const {
    return "stage " + std::to_string(stage) + " (microbatch " + std::to_string(mb) + ")";
  }

  void forward(const Action& a);

  void backward(const Action& a);

  void run(const Action& a);

  // Sends that finished: their errors surface now and their buffers go,
  // rather than at the end of the step.
  void retire_sends();

  // The stage's gradients reduced over its data-parallel group: those of the
  // backwards since the last one that did not communicate, ZeRO-1's all.
  void reduce(Sharding& sh);

  // The elements of a tied parameter this rank owns in its stage's shards.
  shard::OptimizerAccess::Owned owned(const Tie& t);
  std::string tie_name(const Tie& t) const {
    return "the parameter tied across stages " + c10::Join(", ", grid_ties()[t.set]) + " (set " +
           std::to_string(t.set) + ")";
  }
  const std::vector<std::vector<int>>& grid_ties() const { return grid.options().ties; }

  // First step: every copy takes the set's first stage's values (a broadcast
  // of each owned piece's master over the tie group, then each changed stage
  // brings its parameters to the masters over its data-parallel group).
  void sync_ties();

  // After every stage's reduction: each copy's owned gradient becomes the sum
  // over the copies; the norm counts it on the set's first stage only (each
  // stage's optimizer counts its copy, now the sum: a term takes it out again
  // on the other stages).
  void reduce_ties();

  void begin_step();

  // Runs f; an error it raises names this pipeline rank and `where` in the step.
  template <typename F>
  void in_context(const std::string& where, F&& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "pipeline rank ", pipe.rank(), ", ", where, ": ", e.what_without_backtrace());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "pipeline rank ", pipe.rank(), ", ", where, ": ", error_message(e));
    }
  }

  void run_actions();

  // First step: every stage's parameter count, to lay out the stages' slots
  // of the step's agreement (one exchange over the world, once); checks that
  // every stage on every rank has StageShards, or none does. Then the stages'
  // optimizers join the world agreement: one gradient norms slot that all
  // fill (with what the pipeline adds: tied gradients counted once, a
  // non-finite loss as an overflow), and each stage's flags side by side.
  void lay_out();

  // The step's header in the agreement: [loss, non-finite loss].
  void add_header();

  // The step's one world all-reduce (StepAgreement): the header, the stages'
  // norms and flags, and whatever else joined it (a PreemptionGuard's vote).
  // Every stage's optimizer read its part there, so its step() issues no
  // collective of its own; then every stage updates, or none does.
  StepResult finish_step();
};

}  // namespace zeroshard::pipeline
