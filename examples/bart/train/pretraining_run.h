// pretraining_run.h — bart_pretrain's training run (run_pretraining() drives it):
// pretraining.cpp builds, resumes and trains; pretraining_report.cpp logs the
// start, saves --save-logits and prints the summary. Internal to those files.
#pragma once

#include "model/bart_model.h"
#include "data/packed_examples.h"
#include "data/training_data.h"
#include "data/noise.h"
#include "train/pipeline_training.h"
#include "train/run.h"
#include "train/run_record.h"
#include "tokenizer/tokenizer.h"
#include "train/training.h"

#include <zeroshard/checkpoint.h>
#include <zeroshard/comm.h>
#include <zeroshard/lr_schedule.h>
#include <zeroshard/metrics.h>
#include <zeroshard/prefetcher.h>
#include <zeroshard/preemption.h>
#include <zeroshard/rank_times.h>
#include <zeroshard/replica_groups.h>
#include <zeroshard/sampler.h>
#include <zeroshard/sharded_optimizer.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace bart {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// Seconds since `t`.
double since(Clock::time_point t);
// Unix time in seconds (the system clock: comparable across restarts, as PreemptionGuard::notice_time() is).
double unix_now();
// trace-rank-N.json; a restarted run's: trace-rank-N.restart-K.json (each process traces its own part).
std::string trace_path(const std::string& run_dir, int rank, int k);

// One step's data: this rank's sample indices (epochs[i] is the epoch of
// indices[i]) and their micro-batches, built on the CPU (in pinned memory when
// the model is on a GPU).
struct StepPlan {
  std::vector<int64_t> indices, epochs;
};
struct StepBatches {
  StepPlan plan;
  std::vector<Batch> micro;
};

// What one optimizer step did, for its metrics.
struct StepResult {
  double lr = 0, global_tokens = 0, loss = NAN, grad_norm = 0;
  double fb_s = 0, fb_wait = 0, opt_s = 0, opt_wait = 0, bubble_s = -1;
  int64_t world_all_reduces = 0;  // issued on the world communicator during the step
  double data_wait = 0;  // waiting for the step's batches
  zeroshard::GradientNoiseSample noise;
  bool skipped = false;
  std::vector<int64_t> by_dataset;  // the global batch's examples from each dataset
};

class PretrainingRun {
 public:
  explicit PretrainingRun(const RunOptions& o);
  void resume();
  std::optional<int> train();  // an exit code when preempted
  void finish();
  void summarize();

 private:
  void build_model();
  std::unique_ptr<PackedExamples> pack_examples(const std::string& dataset, size_t index) const;
  void log_start() const;
  StepResult step_once(int64_t step);
  StepBatches build_batches(const StepPlan& plan) const;  // thread-safe
  StepBatches next_batches(double& waited);  // the step's, from the loader (or built here without one)
  // After step `step` (counted): metrics, saves, validation. True at the last step.
  bool record_step(const StepResult& r, Clock::time_point t_step, double waited0);
  // The validation loss at step `at` (an event in the metrics, a log line): on the examples
  // eval_limit() keeps; at the end of the run (`end`) on the whole set too, when that kept fewer.
  double evaluate(int64_t at, bool end = false);
  // Examples of each validation set an evaluation during the run takes (0: all of them).
  int64_t eval_limit() const;
  double save(int64_t at, const char* why);
  void note_resume(bool stepped);
  void note_durable(json& extra);  // the durable tier's progress into the step's line and the events
  double wait_durable();           // a preemption's step made durable (Checkpointer::make_durable); its seconds
  // Replica groups: sampler_ and peers_ at `state` (a sampler's state_json) for dp_ and dp_rank_.
  void place_samplers(const std::string& state);
  // Replica groups, before a step: meets the groups when they changed (a heal may move step_) and
  // splits the global batch over the live groups' ranks (dp_, dp_rank_, local_batch_, the samplers).
  void follow_groups();
  void start_loader();  // the loader thread, from the sampler as it stands (with --loader-threads)
  int64_t bytes_sent() const;  // the optimizers' communicators, and the pipeline's sends
  int64_t peak_model_states() const;
  int64_t world_all_reduces() const;  // so far, on the world communicator
  double waited() const;
  std::string trace_file() const { return trace_path(o_.run_dir, rank_, dist_.restart_count); }

  // Built once.
  const RunOptions& o_;
  const Clock::time_point run_start_ = Clock::now();
  zeroshard::DistEnv dist_;
  std::shared_ptr<zeroshard::Communicator> comm_;
  int rank_ = 0, world_ = 1, dp_ = 1, dp_rank_ = 0;  // the grid: rank = stage * dp + data-parallel index
  // With replica groups, dp_ counts the live groups' ranks (this group's world_ each) and dp_rank_ is
  // this rank's place among them; they change when the groups do (groups_, below).
  int shard_size_ = 0;  // --shard-size as ShardedAdamWOptions / FullyShardOptions::shard_size
  int64_t local_batch_ = 0;
  ByteLevelBpe tokenizer_;
  std::string dataset_;                      // --dataset (the first of a blend), or RUN_DIR/dataset
  std::unique_ptr<TrainingData> data_;       // the datasets' examples, packed; blended when several
  const PackedExamples* examples_ = nullptr;  // the first dataset's (samples, logits)
  NoiseOptions noise_;
  int64_t pad_ = 0;
  BartConfig config_;
  torch::Device device_ = torch::kCPU;
  int64_t numel_ = 0;
  BartForConditionalGeneration model_{nullptr};  // without a pipeline
  std::unique_ptr<PipelinedBart> pipe_;          // with one: this rank's stages
  std::vector<std::shared_ptr<zeroshard::ShardedOptimizer>> opts_;  // every optimizer of this rank
  std::vector<zeroshard::Checkpointer::Part> parts_;  // what checkpoints save
  std::vector<zeroshard::LrSchedule> schedules_;      // one per optimizer

  // Where training stands.
  std::unique_ptr<zeroshard::DistributedSampler> sampler_;  // where training stands: the batches taken
  // The other data-parallel ranks' samplers, drawn in step with sampler_: every rank knows the global batch's
  // target tokens (the loss's divisor) without a collective.
  std::vector<zeroshard::DistributedSampler> peers_;
  bool tokens_checked_ = false;  // the first step checks the count against the ranks' sum
  std::unique_ptr<zeroshard::Prefetcher<StepPlan, StepBatches>> loader_;  // its own sampler, ahead
  RunRecord record_;
  int64_t step_ = 0;
  std::unique_ptr<zeroshard::Checkpointer> ckpt_;
  bool durable_ = false;  // --ckpt-dir s3://...
  int64_t durable_seen_ = -1, abandoned_seen_ = 0;
  json resumed_ = nullptr;  // {"step", "load_s", "restart", "after"[, "to_first_step_s"]} after a resume
  // The metrics line of the last step (MetricsLog::step_line), which a save of
  // that step carries; and the one the checkpoint resumed from carried.
  std::string step_line_, carried_line_;
  bool resume_noted_ = false;
  std::unique_ptr<zeroshard::PreemptionGuard> guard_;
  std::unique_ptr<zeroshard::RankTimes> rank_times_;  // every rank's figures of the step, stragglers named
  std::shared_ptr<zeroshard::StepAgreement> agreement_;  // the step's one blocking collective
  // With --replica-group (after the optimizer and the agreement: it goes first).
  std::unique_ptr<zeroshard::ReplicaGroups> groups_;
  int64_t generation_ = -1;  // the groups' membership the batch is split for
  torch::Tensor loss_sum_;    // this rank's summed token loss this step, on the device
  double agreed_loss_ = 0;    // the ranks' sum of it, from the step's agreement
  zeroshard::MetricsLog metrics_;
  std::unique_ptr<zeroshard::ProgressLine> progress_;
  double last_val_ = NAN, loss_ = NAN;
  double whole_val_ = NAN;       // the end's loss on the whole validation set, when evaluations took part of it
  int64_t whole_val_tokens_ = 0;
  nlohmann::json last_val_by_source_;  // a blend's last validation losses, by dataset
  int64_t bytes_before_ = 0;
};

}  // namespace bart
