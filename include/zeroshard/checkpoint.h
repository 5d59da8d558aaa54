// zeroshard/checkpoint.h — sharded checkpoints that survive preemption.
//
//   run_dir/
//     latest                   names the last committed step directory (replaced atomically)
//     step-00001200/
//       manifest.json          written last: world size, ZeRO stage, topology (pipeline stages,
//                              data-parallel size), parameters and which rank holds which piece,
//                              each file's size and xxh3, training progress
//       rank-00000-of-00004.h5 this rank's pieces: fp32 master, exp_avg, exp_avg_sq per parameter;
//                              its RNG state; the first rank of each stage's data-parallel group
//                              also that stage's buffers and untrained parameters
//
// Every rank writes its own file into step-N.tmp/, fsyncs it and reports its
// size and checksum; rank 0 writes the manifest, fsyncs it, renames the
// directory to step-N/ and then replaces `latest`. A crash at any instant
// leaves the previous checkpoint loadable. Hosts with disks of their own (no
// shared filesystem) each keep their ranks' files, the manifest and `latest`,
// and a resume at the same topology reads only its own disk. A load verifies
// every file's size and checksum against the manifest and falls back to the
// previous committed checkpoint (saying why) when one does not match. Any world size, ZeRO stage
// and number of pipeline stages can load any checkpoint of the same model:
// each rank reads only the pieces it now owns (HDF5 hyperslab reads), from
// whichever files hold them. Format: docs/checkpoint-format.md.
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
  // Committed checkpoints kept; older ones are deleted after a commit. At least 2. Default: 3.
  int keep = 3;
  // true: save() copies the shards to host memory and returns; a background
  // thread writes and commits them while training goes on. The next save(), a
  // load(), wait() or the Checkpointer's destruction waits for it (and a failed
  // background save throws there, on every rank). Default: false.
  bool async = false;
  // Also write step-N/model.h5: HDF5 virtual datasets presenting every full
  // parameter (and its AdamW moments, under optimizer/) by name over the rank
  // files, for people and tools (h5py, h5dump). Loads never read it. Default: true.
  bool write_model_view = true;
  // Pipelines: this rank's stage and how many there are. Each stage's
  // optimizer shards that stage's parameters over its own data-parallel group;
  // the Checkpointer's communicator holds every rank of every stage (pp_stages
  // times the group's size), and together they save one checkpoint, which
  // loads at any other (pipeline stages, data-parallel size, ZeRO stage).
  // Default: no pipeline (the communicator is the optimizer's group).
  int pp_stages = 1;
  int pp_stage = 0;
  // Parameters saved under another name: module name -> name in the
  // checkpoint. For a pipeline stage's copy of a parameter tied across stages
  // (PipelineExecutor::tie): saved under the original's name, the checkpoint
  // holds it once (written by the lowest stage holding it) and loads it into
  // every copy, at any number of stages, or into an unpipelined model where
  // the copies are one tensor. Default: none.
  std::map<std::string, std::string> saved_names;
  // The durable tier: an S3-compatible store, "s3://bucket/prefix" (AWS S3, GCS's
  // S3 interface, MinIO, Ceph, SeaweedFS, R2). The run directory stays the first
  // tier; every committed checkpoint is also uploaded in the background (each rank
  // its own files) and committed in the store by a conditional put of its manifest,
  // so a host lost with its disk loses nothing: a load copies what its disk lacks
  // from the store. Settings and credentials as the AWS SDKs find them (AWS_*,
  // ~/.aws, EKS web identity, EC2 instance metadata; AWS_ENDPOINT_URL for other
  // stores); checked when the Checkpointer is made. docs/checkpoints.md. Default: none.
  std::string durable_uri;
  // Rank 0 abandons a step's durable copy when some rank has not uploaded its files
  // this long after the upload began. Default: 30 minutes.
  std::chrono::seconds durable_upload_timeout{1800};
  // How long one request to the store is retried (backoff with jitter) before the
  // upload, or the fetch, fails. Default: 3 minutes.
  std::chrono::seconds durable_retry_time{180};
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
  // `dir`: the run directory (created when missing). `comm`: every rank that
  // saves the checkpoint: the optimizer's group, or with pipeline stages the
  // ranks of all of them. Collective: every rank passes the same directory, on
  // a file system they all see.
  Checkpointer(std::string dir, std::shared_ptr<Communicator> comm, CheckpointOptions options = {});
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Saves and commits a checkpoint of step `progress.step` (with `async`:
  // commits it in the background); returns its directory. `model` supplies the buffers and the parameters the optimizer
  // does not train (and names parameters). Collective. On failure (unwritable
  // directory, full disk) every rank throws, naming the rank, file and reason;
  // `latest` still names the previous checkpoint.
  std::string save(ShardedOptimizer& opt, torch::nn::Module& model, const TrainingProgress& progress);

  // Loads the checkpoint `latest` names (or, when `step` is given, that one),
  // falling back to older committed ones that verify. nullopt when the run
  // directory holds none. Collective. All or nothing: every rank reads
  // everything it needs into host memory first, and only when every rank has
  // succeeded do the model, the optimizer and the generators change; a load
  // that throws (on any rank) leaves all of them as they were.
  std::optional<TrainingProgress> load(ShardedOptimizer& opt, torch::nn::Module& model,
                                       std::optional<int64_t> step = std::nullopt);

  // A rank holding several pipeline stages (interleaved schedules): each
  // stage's optimizer and module, saved and loaded together as this rank's
  // part of the checkpoint. CheckpointOptions::pp_stages and pp_stage then
  // count the pipeline's ranks, and every part's optimizer shards over the
  // same group. The stages' tensor names must not collide (the whole model's
  // names, as BART's stages have). Otherwise as save() and load() above.
  struct Part {
    ShardedOptimizer* optimizer = nullptr;
    torch::nn::Module* model = nullptr;
  };
  std::string save(const std::vector<Part>& parts, const TrainingProgress& progress);
  std::optional<TrainingProgress> load(const std::vector<Part>& parts, std::optional<int64_t> step = std::nullopt);

  // Blocks until a background save is committed; rethrows its error. Collective
  // in effect (the save it waits for is).
  void wait();
  SaveTimes last_save_times() const;
  // The durable tier (durable_uri): waits up to `timeout` for the upload in flight
  // (e.g. within a preemption's grace period); true when none is in flight after.
  // Without a durable tier: true at once. Not collective.
  bool wait_durable(std::chrono::milliseconds timeout);
  // The durable tier: makes the newest step this Checkpointer saved durable within
  // `timeout` (a preemption's grace period, the end of training): waits for the upload
  // in flight, then uploads that step when its own upload was skipped (an upload was
  // still in flight when it was saved) and waits for it. True when it is durable.
  // Collective: every rank calls it. Without a durable tier: true at once.
  bool make_durable(std::chrono::milliseconds timeout);
  DurableStatus durable_status() const;

  const std::string& dir() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The full weights of a committed checkpoint as one safetensors file (what
// `zeroshard-ckpt export --safetensors` writes), for Hugging Face and every
// other reader of the format. Streams one tensor at a time; parameters in
// `dtype` (Float or BFloat16), with `buffers` the floating buffers too.
struct SafetensorsExport {
  int64_t step = -1;                         // -1: the latest committed step
  at::ScalarType dtype = at::kFloat;
  bool buffers = false;
  std::map<std::string, std::string> names;  // ours -> the file's (unlisted: kept)
};
// `checkpoint`: a checkpoint directory or one step's. Returns the tensors
// written, in file order, with their shapes.
std::vector<std::pair<std::string, std::vector<int64_t>>> export_safetensors(const std::string& checkpoint,
                                                                             const std::string& out,
                                                                             const SafetensorsExport& options = {});

}  // namespace zeroshard
