// pipeline_training.h — BART trained as pipeline stages with ZeRO inside each.
//
// PipelinedBart holds what one rank of a pipelined run needs: the grid
// (pp × dp over the world), this rank's stages (bart_pipeline.h) of the
// chosen partition with their sharded optimizers, the training executor and
// the evaluation executors (forward schedules), and the checkpoint options
// that save every stage as one model (the head's copy of the tied embedding
// under model.shared.weight), loadable by any other (pp, dp, ZeRO stage) or
// by the whole model.
//
// Every rank of a data-parallel index builds the same microbatches from the
// data (ids, masks and labels never travel); stage 0 embeds them, the last
// stage takes the loss.
#pragma once

#include "model/bart_pipeline.h"

#include <zeroshard/checkpoint.h>
#include <zeroshard/pipeline_executor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace bart {

struct PipelineOptions {
  int pp = 2;                          // pipeline ranks (dp = world / pp). REQUIRES: >= 2
  std::string schedule = "1f1b";       // gpipe, 1f1b or interleaved-1f1b
  int chunks = 1;                      // stages per pipeline rank: 1, or >= 2 with interleaved-1f1b
  int micro_batches = 4;               // per step and data-parallel rank
  // uniform, balanced (by parameters), timed (by the measured forward +
  // backward time of each kind of block on a timing_rows x timing_length
  // microbatch), or a layout over "E e d L"
  std::string partition = "uniform";
  int64_t timing_rows = 2, timing_length = 64;
  int zero_stage = 2;                  // inside each stage, over its data-parallel group
  int shard_size = 0;                  // hybrid sharding inside each stage's group (FullyShardOptions::shard_size)
  c10::ScalarType gather_dtype = c10::ScalarType::Undefined;  // ZeRO-3 (FullyShardOptions::gather_dtype)
  bool unshard_per_step = true;        // ZeRO-3: gather each stage once per step (false: per pass)
  torch::optim::AdamWOptions adamw{1e-3};
  double max_grad_norm = 0;            // > 0: clip the global norm (every stage) to it
  torch::ScalarType dtype = torch::kFloat;
  torch::Device device = torch::kCPU;
  uint64_t seed = 1;                   // parameter initialisation (init_bart_parameters)
  std::function<int64_t()> memory_probe;  // ExecutorOptions::memory_probe
};

// A microbatch of this data-parallel rank, as every stage rebuilds it.
struct Microbatch {
  StageBatch batch;
  torch::Tensor labels;  // [B, T], pad_token_id ignored by the loss
};

class PipelinedBart {
 public:
  // Collective over `world`. Throws naming the option for a pipeline that
  // cannot be built (pp not dividing the world, a partition with another
  // number of stages, interleaving without chunks, ...).
  PipelinedBart(zeroshard::ProcessGroup world, const BartConfig& config, const PipelineOptions& options);
  ~PipelinedBart();

  // One optimizer step over this data-parallel rank's micro_batches
  // microbatches; each one's summed token loss is scaled by dp /
  // global_tokens, so the step's loss is the mean over the global batch's
  // target tokens. Collective over the world.
  zeroshard::pipeline::StepResult train_step(std::vector<Microbatch> micro, double global_tokens);

  // Evaluation through the stages (a forward schedule, dropout off): the
  // summed token loss of every microbatch with weight[i] != 0, times its
  // weight, over every data-parallel rank. The same number of microbatches
  // on every rank. Collective over the world.
  double evaluate(std::vector<Microbatch> micro, const std::vector<double>& weights);
  // train_step()'s one blocking world collective (its executor's): the
  // preemption vote joins it.
  std::shared_ptr<zeroshard::StepAgreement> agreement() const;

  const BartConfig& config() const;
  const zeroshard::pipeline::PipelineGrid& grid() const;
  const zeroshard::pipeline::Partition& partition() const;
  // partition "timed": every block with its measured cost in microseconds (in
  // Block::params); else empty.
  const std::vector<zeroshard::pipeline::Block>& timed_blocks() const;
  const zeroshard::pipeline::Schedule& schedule() const;
  // This rank's stages (pipeline stage index, module, optimizer), ascending.
  struct Stage {
    int index = 0;
    BartStage module{nullptr};
    std::shared_ptr<zeroshard::ShardedOptimizer> optimizer;
    std::shared_ptr<zeroshard::FullyShardedModel> sharded;  // ZeRO-3
  };
  const std::vector<Stage>& stages() const;
  // Bytes this rank sent between stages (activations, their gradients, the
  // tied parameter's reductions) since construction; the optimizers count
  // their own.
  int64_t bytes_sent() const;
  // A Checkpointer's options for this rank (pp_stages: the pipeline's ranks,
  // pp_stage: this one; the head's copy of the embedding saved as
  // model.shared.weight), and what it saves: every stage of this rank.
  zeroshard::CheckpointOptions checkpoint_options(zeroshard::CheckpointOptions base = {}) const;
  std::vector<zeroshard::Checkpointer::Part> checkpoint_parts() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bart
