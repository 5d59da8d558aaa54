// zeroshard/pipeline_executor.h — runs a pipeline schedule's actions on this rank.
//
// The executor of rank r of a pipeline group runs r's list of a lowered,
// validated schedule (pipeline_schedule.h) once per optimizer step:
//   RECV_F / RECV_B   post the receive of a stage's input / of the gradient of its output
//   F                 wait for the input, run the stage (its float inputs as
//                     leaves that collect gradients), keep both for the backward;
//                     on the last stage, also the microbatch's loss
//   SEND_F            send the output (detached; the graph stays here)
//   B                 wait for the output's gradient and run the backward from
//                     the output (from the loss on the last stage), freeing the graph
//   SEND_B            send the gradient of the input
//   UNSHARD, RESHARD  a ZeRO-3 stage's units held gathered between them
//   REDUCE_GRAD       a sharded stage's gradients reduced (see below)
// Sends are posted; the executor waits for all of them at the end of the step.
//
// ZeRO inside each stage. Given each of its stages' StageShards (an optimizer
// over the grid's data-parallel group), the executor makes run_step() one
// optimizer step: every stage's gradients accumulate locally over the
// microbatches and are reduce-scattered during the stage's last backward
// (ZeRO-2 and 3; ZeRO-1 reduces at REDUCE_GRAD), so no data-parallel traffic
// happens before it; a ZeRO-3 stage is gathered once per step when the
// schedule has UNSHARD/RESHARD (LoweringOptions::unshard), else per pass. Then
// one all-reduce over the world, agreement(), carries the step: the loss, and
// every stage's optimizer's own part, as in a flat run (its gradient norms,
// summed over the stages, and its flags; a tied parameter's gradient counted
// once, see tie()): every rank gets the loss, the global gradient norm and
// whether anything was not finite, clips by the same factor and updates, or
// skips the step everywhere. The stages' optimizers issue no collective of
// their own.
//
// A "forward" schedule (ScheduleKind::kForward) evaluates: each F runs
// without gradients and keeps nothing, and run_step() returns the loss
// function's sum over the microbatches (a validation loss, say), on every rank.
//
// Before the first step the ranks of the pipeline group compare the
// schedule's hash: a rank given another schedule is an error on every rank.
//
// Thread-safety: one thread runs an executor.
#pragma once

#include "zeroshard/pipeline_grid.h"
#include "zeroshard/pipeline_payload.h"
#include "zeroshard/pipeline_schedule.h"
#include "zeroshard/fully_shard.h"
#include "zeroshard/sharded_optimizer.h"

#include <functional>
#include <memory>

namespace zeroshard::pipeline {

struct StageFunctions {
  // Stage `stage`'s forward of microbatch `microbatch`: its input (empty on
  // stage 0, which reads its own data) to its output (on the last stage, what
  // `loss` takes).
  std::function<Payload(int stage, int microbatch, const Payload& input)> forward;
  // The spec of stage `stage`'s input for microbatch `microbatch` (stage > 0),
  // which both sides of the boundary know: the previous stage's output must
  // match it, and the receive is allocated for it.
  std::function<PayloadSpec(int stage, int microbatch)> input_spec;
  // On the last stage: the scalar loss of a microbatch from that stage's
  // output; its backward starts there.
  std::function<at::Tensor(int microbatch, const Payload& output)> loss;
  // Optional: called at each UNSHARD, RESHARD and REDUCE_GRAD of a stage,
  // after what the executor does for StageShards.
  std::function<void(Op op, int stage)> stage_hook;
};

// One of this rank's stages sharded over the grid's data-parallel group.
struct StageShards {
  // ShardedAdamW over the stage's parameters (ZeRO-1/2), or the
  // FullyShardedAdamW of `model` (ZeRO-3).
  std::shared_ptr<ShardedOptimizer> optimizer;
  // ZeRO-3: the stage's module under fully_shard(), which UNSHARD gathers and RESHARD releases.
  std::shared_ptr<FullyShardedModel> model;
};

struct ExecutorOptions {
  // > 0: with StageShards, the mean gradient is clipped to this global L2
  // norm (over every stage). Default: 0 (the stages' optimizers' own
  // max_grad_norm, by the same global norm; theirs default to no clipping).
  double max_grad_norm = 0;
  // Optional: the bytes this rank holds now, by its allocator's count (e.g.
  // zeroshard::heap_bytes_in_use() on the CPU, the caching allocator's on a
  // GPU), less whatever the caller does not want counted (gradients, say).
  // run_step() samples it before the step and after each forward pass, and
  // reports the largest rise: what the step's in-flight microbatches hold.
  std::function<int64_t()> memory_probe;
};

struct StepResult {
  // The last stage's losses, summed over the step's microbatches and averaged
  // over its data-parallel ranks. The same on every rank.
  double loss = 0;
  // With StageShards: the global L2 norm of the mean gradient over every
  // stage, before clipping (0 without).
  double grad_norm = 0;
  // With StageShards: the gradient noise sample of the whole model
  // (sharded_optimizer.h), from the same all-reduce as grad_norm. A parameter
  // tied across stages enters the small norm as each stage's part of its
  // gradient, without the cross terms between the parts.
  GradientNoiseSample noise;
  // The loss and the gradient norm were finite.
  bool finite = true;
  // With StageShards: every stage's optimizer updated. false: a non-finite
  // loss or gradient skipped the step on every rank (gradients discarded; with
  // loss scaling the scale shrinks).
  bool updated = false;
  // This rank: most (stage, microbatch) pairs forwarded and not yet
  // backwarded at once (what its activation memory is proportional to); time
  // spent in F and B passes, and the whole step. 1 − compute/step is its
  // idle share (the trace shows the passes as "0F3", "0B3").
  int peak_in_flight = 0;
  // With ExecutorOptions::memory_probe: its largest rise over the step's start, after a forward pass.
  int64_t peak_memory_bytes = 0;
  double compute_seconds = 0;
  double step_seconds = 0;
  // From the step's start to the end of this rank's last F or B: over a
  // pipeline group started together, 1 − Σ compute / (pp · the largest) is
  // the schedule's bubble as it ran (the reductions and update after it excluded).
  double passes_seconds = 0;
};

class PipelineExecutor {
 public:
  // REQUIRES: `schedule` has grid.pp() ranks (validated here); grid's pipeline
  // group carries the payloads. Collective over the pipeline group.
  PipelineExecutor(const PipelineGrid& grid, Schedule schedule, StageFunctions functions,
                   ExecutorOptions options = {});
  ~PipelineExecutor();
  PipelineExecutor(const PipelineExecutor&) = delete;
  PipelineExecutor& operator=(const PipelineExecutor&) = delete;

  // Makes `stage` (one of this rank's) a sharded stage. Either every stage on
  // every rank has StageShards or none (checked at the first step).
  // REQUIRES: the optimizer's communicator is the grid's data-parallel group.
  void shard_stage(int stage, StageShards shards);

  // `param` is stage `stage`'s copy of the parameter tied across the grid's
  // tie set `set` (GridOptions::ties[set]; one copy per stage of the set, used
  // by each). The first step makes every copy equal the set's first stage's;
  // each step then adds the copies' gradients on the shard each rank owns (an
  // all-reduce of 1/dp of the parameter over the tie group), so the copies
  // stay identical, and counts the tied gradient once in the norm.
  // REQUIRES: shard_stage(stage) first, and `param` trained by that stage's
  // optimizer in a layout that gives each data-parallel rank the same
  // elements of it on every stage of the set: a param group of its own
  // (ZeRO-1/2) or a unit of its own (ZeRO-3). Checked at the first step.
  void tie(size_t set, int stage, const at::Tensor& param);

  // One step: this rank's actions, in order, then the world all-reduce of the
  // loss (and with StageShards the gradient norm, clipping and every stage's
  // optimizer step; the gradients are cleared first). Without StageShards the
  // gradients accumulate into the stages' parameters as autograd leaves them.
  // Collective over the world.
  StepResult run_step();

  const Schedule& schedule() const;
  // The step's one world agreement (run_step()'s all-reduce): join a
  // PreemptionGuard to it, or add slots, and their values travel with the
  // step's (step_agreement.h). Every rank must join the same things.
  std::shared_ptr<StepAgreement> agreement() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard::pipeline
