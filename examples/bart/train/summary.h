// summary.h — the closing report of a bart_pretrain run, for a person (text)
// and for tools (JSON, the last line of metrics.jsonl).
#pragma once

#include "train/training.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace bart {

struct Summary {
  std::string config, precision, run_dir, plot;
  int world = 1, stage = 3, pp = 1;  // pp: pipeline stages (world / pp data-parallel ranks each)
  std::string shard_size = "0";       // --shard-size: hybrid sharding's groups ("0": every data-parallel rank)
  int64_t params = 0, steps = 0, tokens = 0, bytes_sent = 0;
  double first_loss = 0, last_loss = 0, first_val_loss = 0, last_val_loss = 0;
  double train_seconds = 0, wall_seconds = 0, checkpoint_stall_s = 0, data_wait_s = 0;
  double eval_seconds = 0;                    // evaluating, beside train_seconds
  double whole_val_loss = NAN;                // the end's loss on the whole validation set, when evaluations took part
  int64_t whole_val_tokens = 0;
  // The gradient noise scale at the end (target tokens), the statistical
  // efficiency of the mean step's batch against `reference_batch` sequences,
  // and goodput (target tokens/s × efficiency) over the steps that had one.
  // NaN when no step could measure it (one rank, one reduction per step).
  double noise_scale = NAN, efficiency = NAN, goodput = NAN, reference_batch = 1;
  std::vector<int64_t> peak_rss, model_states;  // per rank
  std::string interruptions = "[]";  // JSON array of {"step", "cause", "notice_unix_s"[, "to_first_step_s"]}
  std::string resumed;               // JSON {"step", "load_s", "restart", "after", ...} when this process resumed; "" when not
  std::string durable;               // JSON {"uri", "step", "lag_s", "abandoned"} with a durable tier; "" without
  std::string val_loss_by_dataset;   // a blend's: JSON {dataset: its last validation loss}; "" for one dataset
  std::string replica_changes;       // replica groups: JSON array of RunRecord::replica_changes; "" without
  int64_t steps_retaken = 0;         // replica groups: steps taken again after a group was lost
  std::string stragglers = "[]";     // JSON array of this process's StragglerEpisode::json()
  bool has_sample = false;
  DenoisingAccuracy denoising;  // greedy reconstruction of held-out sentences, and one of them

  // Bytes a single process holds for the same model and AdamW: fp32
  // parameters, gradients and the two moments (16 bytes per parameter).
  int64_t unsharded_model_states() const { return 16 * params; }
  // Evaluation's share of the time spent in steps and evaluations.
  double eval_share() const { return eval_seconds > 0 ? eval_seconds / (eval_seconds + train_seconds) : 0.0; }
  std::string text() const;
  std::string to_json() const;  // a JSON object
};

}  // namespace bart
