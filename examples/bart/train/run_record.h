// run_record.h — what a bart_pretrain run carries across restarts (in its
// checkpoints' extra JSON), and the step's statistical efficiency from it.
#pragma once

#include <zeroshard/noise_scale.h>
#include <zeroshard/sampler.h>
#include <zeroshard/sharded_optimizer.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <string>

namespace bart {

struct RunRecord {
  int64_t tokens = 0;
  double train_seconds = 0, checkpoint_stall_s = 0;
  double data_wait_s = 0;  // the training thread waiting for its batches
  double eval_seconds = 0;  // evaluating the validation sets
  double first_loss = NAN, first_val_loss = NAN;
  int64_t bytes_sent = 0;  // all ranks
  // The durable tier (--ckpt-dir s3://...): the newest step committed there, its upload's lag,
  // and the uploads abandoned so far.
  int64_t durable_step = -1, durable_abandoned = 0;
  double durable_lag_s = 0;
  nlohmann::json interruptions = nlohmann::json::array();  // {"step", "cause", "notice_unix_s"[, "to_first_step_s"]}
  // The interruption a checkpoint of `step` was saved for (the last one, after that
  // step); null when the checkpoint was not saved for one.
  nlohmann::json* interruption_at(int64_t step);
  zeroshard::GradientNoiseScale noise;
  double efficient_tokens = 0;   // Σ tokens × statistical efficiency, over the steps that had one
  double efficient_seconds = 0;  // and their time
  // Replica groups: each change of the live groups {"step", "groups", "generation", "pause_s",
  // "heal_bytes", "heal_s", "step_retaken"}, and the steps taken again after a group was lost.
  nlohmann::json replica_changes = nlohmann::json::array();
  int64_t steps_retaken = 0;
  // With the sampler's position; from_json restores both.
  nlohmann::json to_json(const zeroshard::DistributedSampler& sampler) const;
  void from_json(const nlohmann::json& j, zeroshard::DistributedSampler& sampler);
};

// A step's gradient noise sample taken into the run's estimate, and what the
// estimate gives at this step's batch (in target tokens).
struct Efficiency {
  double noise_scale = NAN, efficiency = NAN;
  std::string progress() const;  // "noise scale 1,234 tok | efficiency 0.62"; "" before the first estimate
};
Efficiency statistical_efficiency(RunRecord& record, const zeroshard::GradientNoiseSample& sample, double tokens,
                                  double reference_tokens);

}  // namespace bart
