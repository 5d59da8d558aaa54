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
//   UNSHARD, RESHARD, REDUCE_GRAD
//                     the stage's hooks (StageHooks), when given
// Sends are posted; the executor waits for all of them at the end of the step.
//
// Before the first step the ranks of the pipeline group compare the
// schedule's hash: a rank given another schedule is an error on every rank.
//
// Thread-safety: one thread runs an executor.
#pragma once

#include "zeroshard/pipeline_grid.h"
#include "zeroshard/pipeline_payload.h"
#include "zeroshard/pipeline_schedule.h"

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
  // Optional: UNSHARD, RESHARD and REDUCE_GRAD of a stage.
  std::function<void(Op op, int stage)> stage_hook;
};

class PipelineExecutor {
 public:
  // REQUIRES: `schedule` has grid.pp() ranks (validated here); grid's pipeline
  // group carries the payloads. Collective over the pipeline group.
  PipelineExecutor(const PipelineGrid& grid, Schedule schedule, StageFunctions functions);
  ~PipelineExecutor();
  PipelineExecutor(const PipelineExecutor&) = delete;
  PipelineExecutor& operator=(const PipelineExecutor&) = delete;

  // One step: this rank's actions, in order. Returns the sum of the losses
  // computed on this rank (the last stage's; 0 elsewhere). Gradients
  // accumulate into the stages' parameters as autograd leaves them.
  double run_step();

  const Schedule& schedule() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard::pipeline
