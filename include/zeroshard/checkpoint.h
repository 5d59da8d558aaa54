// zeroshard/checkpoint.h — sharded checkpoints that survive preemption: every rank writes its
// own pieces of the model and optimizer state, and any world size, ZeRO stage or number of
// pipeline stages loads any checkpoint of the same model.
//
//   zeroshard::Checkpointer ckpt(run_dir, comm);
//   if (auto p = ckpt.load(opt, *model)) start = p->step;   // the latest that verifies
//   ...
//   ckpt.save(opt, *model, {step, epoch, extra_json});
//
// A crash at any instant leaves the previous committed checkpoint loadable; a load verifies
// every file's size and checksum and falls back to the previous checkpoint when one does not
// match. Ownership: a Checkpointer owns its writer thread and joins it when destroyed.
// Thread-safety: use a Checkpointer from one thread; the calls marked collective need every rank.
// How it works: docs/checkpoints.md; the files: docs/checkpoint-format.md.
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/fully_shard.h"
#include "zeroshard/sharded_optimizer.h"

#include <torch/nn/module.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard {

struct CheckpointOptions {
  // Committed checkpoints kept; older ones are deleted after a commit. REQUIRES: >= 2. Default: 3.
  int keep = 3;
  // true: save() returns at once; a background thread copies the shards to host memory (the
  // optimizer's next step() waits for that copy), then writes and commits them. The next
  // save(), load(), wait() or the destructor waits for it, and a failed background save throws
  // there, on every rank. REQUIRES: no change to the parameters by hand before that step().
  // Default: false.
  bool async = false;
  // Also write step-N/model.h5, a view of every full parameter (and its AdamW moments) by name
  // over the rank files, for people and tools (h5py, h5dump). Loads never read it.
  // Default: true.
  bool write_model_view = true;
  // Pipelines: how many stages there are and this rank's. The Checkpointer's communicator then
  // holds every rank of every stage (pp_stages times each stage's data-parallel group), and
  // they save one checkpoint together. Default: no pipeline (the communicator is the
  // optimizer's group).
  int pp_stages = 1;
  int pp_stage = 0;
  // Parameters saved under another name: module name -> name in the checkpoint. For a pipeline
  // stage's copy of a tied parameter (PipelineExecutor::tie): saved under the original's name,
  // it is held once and loads into every copy, or into an unpipelined model. Default: none.
  std::map<std::string, std::string> saved_names;
  // A durable tier, "s3://bucket/prefix" (any S3-compatible store): every committed checkpoint
  // is also uploaded in the background, and a load copies what its disk lacks from it. A failed
  // upload never stops training. Settings and credentials as the AWS SDKs find them (AWS_*,
  // ~/.aws, instance metadata), checked by the constructor. Default: none.
  std::string durable_uri;
  // A step's durable copy is abandoned when some rank has not uploaded its files this long
  // after the upload began. Default: 30 minutes.
  std::chrono::seconds durable_upload_timeout{1800};
  // How long one request to the store is retried before the upload, or the fetch, fails.
  // Default: 3 minutes.
  std::chrono::seconds durable_retry_time{180};
  // Which line of checkpoints a load follows. Each launch that saves draws a line and its
  // manifests record the lines they descend from, so a rollback, a fallback or another job on
  // the same store never passes for this run's history: a load takes only the history of the
  // checkpoint `latest` names on this disk, else of the store's `latest`, and says so when the
  // store holds newer steps of other lines. A line's id (16 hex digits, from a manifest's
  // "lineage" or the store's step-N/commit-LINE.json) here follows that line instead.
  // Default: "" (this run's own).
  std::string durable_line;
};

// Where the durable tier stands (Checkpointer::durable_status()).
struct DurableStatus {
  int64_t durable_step = -1;    // the newest step this process saw committed in the store; -1: none
  int64_t uploading_step = -1;  // the step whose upload is in flight; -1: none
  double lag_seconds = 0;       // durable_step's upload, from its start to its commit
  int64_t durable_bytes = 0;    // what this rank uploaded for durable_step
  std::string last_error;       // why the last abandoned upload was abandoned ("" if none was)
  int64_t abandoned = 0;        // uploads abandoned so far
};

// How long the last save took.
struct SaveTimes {
  // The training loop's wait: the whole save (sync), or the time in save()
  // plus the next step()'s wait for the shards to be copied (async).
  double stall_seconds = 0;
  double write_seconds = 0;  // writing, verifying and committing (the background part when async)
  int64_t bytes = 0;         // all ranks' files
};

// Where training stands, saved with the shards and returned by a load.
struct TrainingProgress {
  int64_t step = 0;       // names the directory: step-%08d
  int64_t epoch = 0;
  std::string extra_json = "{}";  // anything else (LR schedule, sampler position), as a JSON object
  double save_seconds = 0;        // filled by load(): how long saving this checkpoint took
};

class Checkpointer {
 public:
  // `dir`: the run directory, created when missing; every rank passes the same path (on a
  // shared file system, or on each host's own disk). `comm`: every rank that saves the
  // checkpoint: the optimizer's group, or with pipeline stages the ranks of all of them.
  // Throws on every rank when the durable tier is misconfigured, naming what and the fix.
  // Collective.
  Checkpointer(std::string dir, std::shared_ptr<Communicator> comm, CheckpointOptions options = {});
  // Waits for a background save to commit; cancels a durable upload in flight (it ends within
  // about 1.5 s, last words to the store included), so a stalled store never holds an exit.
  // Call make_durable() first where the last step must be durable.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Saves and commits a checkpoint of step `progress.step` (async: commits it in the
  // background); returns its directory. `model` supplies the buffers, the parameters the
  // optimizer does not train, and the parameters' names. Collective.
  // Throws on every rank, naming the rank, file and reason, when a rank fails (unwritable
  // directory, full disk; `latest` still names the previous checkpoint), and when unreduced
  // gradients wait in p.grad() between a step's backwards (ZeRO-1, no_sync(),
  // reduce_every_backward = false); reduced ones are saved.
  std::string save(ShardedOptimizer& opt, torch::nn::Module& model, const TrainingProgress& progress);

  // Loads the checkpoint `latest` names, falling back to older committed ones that verify; or
  // `step`, with no fallback. nullopt when the run directory holds none. All or nothing: a
  // load that throws on any rank leaves the model, the optimizer and the generators as they
  // were. Throws naming the first difference when the checkpoint is of another model.
  // Collective.
  std::optional<TrainingProgress> load(ShardedOptimizer& opt, torch::nn::Module& model,
                                       std::optional<int64_t> step = std::nullopt);

  // A rank holding several pipeline stages (interleaved schedules) saves and loads each
  // stage's optimizer and module together, as save() and load() above; pp_stages and pp_stage
  // then count the pipeline's ranks. REQUIRES: every part's optimizer over the same group; the
  // stages' tensor names do not collide (the whole model's names, as BART's stages have).
  struct Part {
    ShardedOptimizer* optimizer = nullptr;
    torch::nn::Module* model = nullptr;
  };
  std::string save(const std::vector<Part>& parts, const TrainingProgress& progress);
  std::optional<TrainingProgress> load(const std::vector<Part>& parts, std::optional<int64_t> step = std::nullopt);

  // Blocks until a background save is committed; rethrows its error. Collective in effect.
  void wait();
  SaveTimes last_save_times() const;
  // Waits up to `timeout` for the durable upload in flight; true when none is in flight after
  // (at once without a durable tier). Not collective.
  bool wait_durable(std::chrono::milliseconds timeout);
  // Makes the newest step this Checkpointer saved durable within `timeout` (a preemption's
  // grace period, the end of training), uploading it if its own upload was skipped; true when
  // it is durable (at once without a durable tier). A step it loaded from this disk that the
  // store lacks (a run killed as it uploaded) counts as saved, when saved at this world size.
  // Collective.
  bool make_durable(std::chrono::milliseconds timeout);
  DurableStatus durable_status() const;

  const std::string& dir() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Options of export_safetensors(): parameters in `dtype` (Float or BFloat16), with `buffers`
// the floating buffers too, renamed by `names`.
struct SafetensorsExport {
  int64_t step = -1;                         // -1: the latest committed step
  at::ScalarType dtype = at::kFloat;
  bool buffers = false;
  std::map<std::string, std::string> names;  // ours -> the file's (unlisted: kept)
};
// Writes the full weights of a committed checkpoint (`checkpoint`: a run directory or one
// step's) to `out` as one safetensors file, streaming one tensor at a time (what
// `zeroshard-ckpt export --safetensors` writes). Returns the tensors written, in file order,
// with their shapes.
std::vector<std::pair<std::string, std::vector<int64_t>>> export_safetensors(const std::string& checkpoint,
                                                                             const std::string& out,
                                                                             const SafetensorsExport& options = {});

}  // namespace zeroshard
