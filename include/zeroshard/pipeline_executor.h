// zeroshard/pipeline_executor.h — runs this rank's list of a pipeline schedule
// (pipeline_schedule.h) once per optimizer step, over a model given as per-stage functions.
//
//   PipelineExecutor ex(grid, make_schedule(ScheduleKind::k1F1B, grid.pp(), m), functions);
//   ex.shard_stage(s, {std::make_shared<ShardedAdamW>(stage_params, grid.dp_group(), adamw)});
//   StepResult r = ex.run_step();   // microbatches, reductions, one world all-reduce, update
//
// With StageShards, run_step() is one optimizer step of every stage, with one world all-reduce
// (agreement()). A "forward" schedule (ScheduleKind::kForward) evaluates: no gradients kept.
// Ownership: the executor keeps the StageShards' optimizers and models alive.
// Thread-safety: one thread runs an executor. How it works: docs/pipeline.md.
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
  // Stage `stage`'s forward of microbatch `microbatch`: its input (empty on stage 0, which
  // reads its own data) to its output (on the last stage, what `loss` takes). The input's
  // float tensors are leaves that collect gradients.
  std::function<Payload(int stage, int microbatch, const Payload& input)> forward;
  // The spec of stage `stage`'s input for microbatch `microbatch` (stage > 0), which both sides
  // of the boundary compute: the receive is allocated for it, and a previous stage's output
  // that does not match it throws, naming both, before it is sent.
  std::function<PayloadSpec(int stage, int microbatch)> input_spec;
  // On the last stage: the scalar loss of a microbatch from that stage's output; its backward
  // starts there.
  std::function<at::Tensor(int microbatch, const Payload& output)> loss;
  // Optional: called at each UNSHARD, RESHARD and REDUCE_GRAD of a stage, after what the
  // executor does for StageShards.
  std::function<void(Op op, int stage)> stage_hook;
};

// One of this rank's stages sharded over the grid's data-parallel group.
struct StageShards {
  // ShardedAdamW over the stage's parameters (ZeRO-1/2), or the FullyShardedAdamW of `model`
  // (ZeRO-3).
  std::shared_ptr<ShardedOptimizer> optimizer;
  // ZeRO-3: the stage's fully_shard() model, which UNSHARD gathers and RESHARD releases.
  std::shared_ptr<FullyShardedModel> model;
};

struct ExecutorOptions {
  // > 0: with StageShards, clip the mean gradient to this global L2 norm (over every stage).
  // Default: 0 (the stages' optimizers' own max_grad_norm, applied to the same global norm).
  double max_grad_norm = 0;
  // Optional: the bytes this rank holds now (e.g. heap_bytes_in_use() on the CPU, the caching
  // allocator's count on a GPU), less what the caller does not want counted. run_step()
  // samples it before the step and after each forward pass (StepResult::peak_memory_bytes).
  std::function<int64_t()> memory_probe;
};

struct StepResult {
  // The last stage's losses, summed over the step's microbatches and averaged over its
  // data-parallel ranks. The same on every rank.
  double loss = 0;
  // With StageShards: the global L2 norm of the mean gradient over every stage, before
  // clipping (0 without).
  double grad_norm = 0;
  // With StageShards: the gradient noise sample of the whole model (sharded_stats.h).
  GradientNoiseSample noise;
  // The loss and the gradient norm were finite.
  bool finite = true;
  // With StageShards: every stage's optimizer updated. false: a non-finite loss or gradient
  // skipped the step on every rank (gradients discarded; with loss scaling the scale shrinks).
  bool updated = false;
  // This rank: most (stage, microbatch) pairs forwarded and not yet backwarded at once (what its
  // activation memory is proportional to); time in F and B passes, and the whole step.
  int peak_in_flight = 0;
  // With ExecutorOptions::memory_probe: its largest rise over the step's start.
  int64_t peak_memory_bytes = 0;
  double compute_seconds = 0;
  double step_seconds = 0;
  // From the step's start to the end of this rank's last F or B: over a pipeline group,
  // 1 − Σ compute / (pp · the largest) is the bubble as it ran.
  double passes_seconds = 0;
};

class PipelineExecutor {
 public:
  // REQUIRES: `schedule` has grid.pp() ranks and passes validate() (throws otherwise).
  // The grid's pipeline group carries the payloads. Collective over the pipeline group.
  PipelineExecutor(const PipelineGrid& grid, Schedule schedule, StageFunctions functions,
                   ExecutorOptions options = {});
  ~PipelineExecutor();
  PipelineExecutor(const PipelineExecutor&) = delete;
  PipelineExecutor& operator=(const PipelineExecutor&) = delete;

  // Makes `stage` (one of this rank's) a sharded stage.
  // REQUIRES: the optimizer's communicator is the grid's data-parallel group; every stage on
  // every rank has StageShards, or none (checked at the first step).
  void shard_stage(int stage, StageShards shards);

  // `param` is stage `stage`'s copy of the parameter tied across tie set `set`
  // (GridOptions::ties[set]). The first step makes every copy equal the set's first stage's;
  // every step adds the copies' gradients, so they stay identical, and counts the tied gradient
  // once in the norm.
  // REQUIRES: shard_stage(stage) first; `param` in a param group of its own (ZeRO-1/2) or a unit
  // of its own (ZeRO-3) of that stage's optimizer (checked at the first step, naming the fix).
  void tie(size_t set, int stage, const at::Tensor& param);

  // One step: this rank's actions, in order, then the world all-reduce of the loss (with
  // StageShards also the gradient norm, clipping and every stage's optimizer step; the
  // gradients are cleared first). Without StageShards the gradients accumulate into the
  // stages' parameters as autograd leaves them. The first step compares the schedule across
  // the pipeline group and throws on every rank when one differs. Collective over the world.
  StepResult run_step();

  const Schedule& schedule() const;
  // The step's one world agreement (run_step()'s all-reduce): join a PreemptionGuard to it, or
  // add slots, and their values travel with the step's (step_agreement.h).
  // REQUIRES: every rank joins the same things.
  std::shared_ptr<StepAgreement> agreement() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard::pipeline
