// checkpointer_impl.h — the Checkpointer's internals, shared by its source
// files: common.cpp (names, files, hashes), save.cpp (snapshot, rank files,
// manifest, commit), load.cpp (verification, resharding reads) and
// checkpoint.cpp (the public class).
#pragma once

#include "zeroshard/checkpoint.h"

#include "checksum.h"
#include "durable.h"
#include "h5.h"
#include "host_copy.h"
#include "lineage.h"

#include <boost/asio/thread_pool.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace zeroshard {

namespace fs = std::filesystem;
using nlohmann::json;

namespace ckpt {

constexpr int kFormatVersion = 1;
constexpr const char* kFormat = "zeroshard-checkpoint";

std::string step_dir_name(int64_t step);               // step-00001200
std::string rank_file_name(int rank, int world);       // rank-00000-of-00004.h5
// The step of a step directory's name ("step-" and digits only), or none.
std::optional<int64_t> step_of_dir_name(const std::string& name);
// The step directory `latest` names in a run directory. Throws, naming the file
// and the fix, when it names anything but a step directory of this run (an
// edited or corrupt `latest` must not lead outside it).
fs::path latest_step_dir(const fs::path& run_dir);
void fsync_path(const fs::path& path, bool directory);
// A crash leaves either the old file or the new one: temporary file, fsync,
// rename, fsync of the directory.
void write_atomically(const fs::path& path, const std::string& content);
std::string read_text(const fs::path& path);
// manifest.json and its checksum, manifest.xxh3 (a file of its own, so a torn or
// edited manifest cannot also fix up its checksum).
void write_manifest(const fs::path& step_dir, const json& manifest);
// The manifest of a step directory, verified: its checksum (checkpoints written
// before manifest.xxh3 existed have none), its format, and pieces that cover
// every parameter's elements exactly once. Throws saying what is wrong.
json read_manifest(const fs::path& step_dir);
// The ZeRO stage a manifest was saved at ("zero_stage"; older manifests say "stage").
int zero_stage_of(const json& manifest);
// The commit protocol: the manifest into the temporary step directory, the
// directory renamed to its final name (a same-step one moved aside first),
// fsync of the run directory, then `latest`. A crash at any point leaves the
// previous commit loadable.
void commit_step_dir(const fs::path& tmp, const fs::path& final_dir, const json& manifest);
// How a tensor dtype is stored (16-bit floats as uint16); throws naming the
// tensor for dtypes checkpoints do not store.
checkpoint::h5::Type storage_type(c10::ScalarType t, const std::string& name);
// Model identity: every parameter's and buffer's name, shape and dtype. The
// optimizer's parameters take their shapes from its state (a resharded
// fully_shard parameter holds no elements).
struct ModelEntry {
  bool buffer;
  ParamInfo info;
};
// `names`: module_names()'s; `saved_names`: CheckpointOptions::saved_names.
std::vector<ModelEntry> model_entries(torch::nn::Module& model, const ShardedState& state,
                                      const std::vector<std::string>& names,
                                      const std::map<std::string, std::string>& saved_names);
// The model a manifest describes (its parameters and replicated tensors), as
// text: sorted by name, so it does not depend on how the ranks split the model.
std::string manifest_model_description(const json& manifest);
std::string hash_hex(const std::string& s);
// The name a module's tensor has in checkpoints: its own, or its entry in
// CheckpointOptions::saved_names.
std::string saved_name(const std::map<std::string, std::string>& saved_names, const std::string& module_name);
// Names of the state's parameters in checkpoints (as the module calls them, or saved_names' alias).
std::vector<std::string> module_names(const ShardedState& state, torch::nn::Module& model,
                                      const std::map<std::string, std::string>& saved_names);

// Where a rank sits when several data-parallel groups (pipeline stages) save
// one checkpoint: world rank = any order, but every (pp_stage, dp_rank) once.
struct Place {
  int pp_stage = 0, pp_stages = 1;
  int dp_rank = 0, dp_size = 1;  // the optimizer's group
};
// Collective over `world`: every rank's place must fit one grid (pp_stages
// stages of dp_size ranks each, every (stage, dp rank) exactly once; throws on
// every rank otherwise, naming the mismatch and the fix). Returns, for each
// of `flags`, whether any rank set it; and, with `places`, every rank's (stage, dp rank).
std::vector<char> agree_on_places(Communicator& world, const Place& mine, const std::vector<char>& flags,
                                  std::vector<std::pair<int, int>>* places = nullptr);

// Which ranks see the same run directory: every rank on a shared filesystem
// (or on one host); on hosts with disks of their own, each host's ranks. Found
// once, when the Checkpointer opens the directory (find_disks).
struct Disks {
  std::vector<int> leader;         // per rank: the lowest rank that sees the same directory
  std::vector<std::string> hosts;  // per rank: its host's name (messages, the manifest)
  bool shared() const {
    return std::all_of(leader.begin(), leader.end(), [](int l) { return l == 0; });
  }
  bool leads(int rank) const { return leader[static_cast<size_t>(rank)] == rank; }
  // The ranks whose run directory is `rank`'s.
  std::vector<int> members(int rank) const;
};

struct Snapshot;
// What one rank saves, as JSON: its place, its optimizer's parameters with the
// pieces it holds, and (the group's first rank) the replicated tensors and the
// flat layouts. Every rank's record makes the manifest.
json rank_record(const Snapshot& snap);
// Every rank's record merged (each rank computes the same).
struct Contents {
  json params = json::array();      // the manifest's "params": pieces as [world rank, begin, end]
  json replicated = json::array();  // with the world rank of the file holding each
  json groups = json::array();
  std::vector<std::pair<int, int>> places;  // (pp stage, dp rank) of each world rank
  std::set<std::string> skip;       // names `my_rank` holds that a lower stage writes (and it does not)
};
// keep_alternates (no shared filesystem): a tied parameter's pieces are written by
// every stage holding it, and those and the disks' copies of a replicated group's
// parameters are listed as "alternates" (complete sets of pieces each).
Contents merge_records(const std::vector<std::string>& records, int my_rank, bool keep_alternates = false);
json build_manifest(const Snapshot& snap, Contents contents, const std::vector<std::pair<int64_t, uint64_t>>& digests);

// Everything one save writes, copied out of the live model and optimizer so
// that training can go on while a background thread writes it.
struct Snapshot {
  TrainingProgress progress;
  int rank = 0, world = 1, zero_stage = 2;  // rank and size of the Checkpointer's communicator
  int replica = 0;                  // hybrid sharding: which copy of its shards this rank holds (0: the one saved)
  Place place;
  std::vector<ParamInfo> params;    // the optimizer's, as the module names them
  std::vector<std::string> names;
  std::vector<int64_t> steps;
  double loss_scale = 1;
  int64_t loss_scale_clean_steps = 0;
  struct Group {
    FlatLayout layout;
    std::vector<size_t> params;     // index into `params` per layout entry
  };
  std::vector<Group> groups;        // the flat layout (every rank's pieces follow from it)
  struct Owned {                    // this rank's piece of one parameter
    size_t param;
    int64_t begin;                  // first element of the flattened parameter
    at::Tensor master, exp_avg, exp_avg_sq;  // fp32 copies
    at::Tensor grad;                // fp32 copy of the reduced gradient so far (when `gradients`)
    bool copy = false;              // another rank's piece (a replicated group), copied onto this disk
  };
  // This rank writes the replicated tensors (buffers, untrained parameters): the
  // first rank of each stage's data-parallel group, and without a shared
  // filesystem also the stage's first rank on each other disk (a copy per disk).
  bool writes_replicated = true;
  bool gradients = false;           // saved in the middle of a step's accumulation
  std::vector<char> had_grad;       // per parameter, this rank (when `gradients`)
  std::vector<Owned> owned;         // host copies, or (deferred) views of the live tensors until copy() runs
  bool deferred = false;
  bool on_device = false;           // the views are device tensors: they must be copied to be written
  std::shared_ptr<HostCopier> host; // made by the training thread (host_copy.h)
  // Replaces the views by host copies (the writer thread does it for an async
  // save, while the training thread runs the next forward and backward).
  void copy() {
    if (!deferred) return;
    for (auto& o : owned) {
      o.master = host->copy(o.master);
      o.exp_avg = host->copy(o.exp_avg);
      o.exp_avg_sq = host->copy(o.exp_avg_sq);
    }
    host->finish();
    deferred = false;
  }
  struct Replicated {
    std::string name, kind;
    at::Tensor value;               // a copy (writes_replicated only; others keep just the names)
  };
  std::vector<Replicated> replicated;
  at::Tensor rng;                   // the CPU generator's state
  at::Tensor device_rng;            // the training device's generator (CUDA), when the state is there
  int64_t bytes = 0;                // host memory the copies take
};

// One rank's file of a snapshot, written and fsynced (the Checkpointer's save and
// zeroshard-ckpt import alike). `skip`: names this rank holds that another stage
// writes (the lowest stage holding a name writes it). No /rng datasets when the
// snapshot holds no generator state (an import).
// Returns where each dataset lies in the file, with (`digests`) the xxh3 of each one's
// bytes: durable.h's index of it.
std::vector<checkpoint::h5::Extent> write_rank_file(const fs::path& path, const Snapshot& snap,
                                                    const std::set<std::string>& skip, bool digests = false);

}  // namespace ckpt

struct Checkpointer::Impl {
  std::string dir;
  std::shared_ptr<Communicator> comm;     // the training thread's
  std::shared_ptr<Communicator> io_comm;  // the writer's: a split of the same ranks, so a background
                                          // save's collectives never interleave with training's
  CheckpointOptions options;
  boost::asio::thread_pool pool{1};
  std::future<std::string> pending;       // the save being written in the background
  // The last save's times, written by the writer thread too, and by the fence
  // the optimizer's next update runs, which may come after this Checkpointer is gone.
  struct LastSave {
    std::mutex mu;  // guards times
    SaveTimes times;
  };
  std::shared_ptr<LastSave> last = std::make_shared<LastSave>();
  // The step of the last save that committed (its writer sets it), or of a load of a step the
  // store lacks: what make_durable() makes durable.
  int64_t newest_saved = -1;

  // Every rank learns whether every rank succeeded at a phase: "" when all did, else
  // (on all of them) a line with this rank's own error or the failing ranks' numbers.
  static std::string agreed_failure(Communicator& c, const std::string& phase, const std::string& my_error) {
    const std::vector<int> failed = failed_ranks(c, !my_error.empty());
    if (failed.empty()) return "";
    std::string who;
    for (int r : failed) who += (who.empty() ? "" : ", ") + std::to_string(r);
    return "checkpoint: " + phase + " failed on rank(s) " + who +
           (my_error.empty() ? std::string(" (their logs say why)") : ": " + my_error);
  }
  // agreed_failure(), thrown on every rank when some rank failed.
  static void agree(Communicator& c, const std::string& phase, const std::string& my_error) {
    const std::string failure = agreed_failure(c, phase, my_error);
    TORCH_CHECK(failure.empty(), failure);
  }

  // Collective over `c`: every rank makes `dir` and a probe file in it with a
  // name no host has looked up before (an NFS client caches failed lookups by
  // name); then, lowest rank first, each rank not yet placed looks for the
  // candidate's probe: one round per disk.
  static ckpt::Disks find_disks(Communicator& c, const fs::path& dir);
  ckpt::Disks disks;

  // fence: registers a function the optimizer runs before its next update.
  std::string save(const ShardedState& state, torch::nn::Module& model, const TrainingProgress& progress,
                   const std::function<void(std::function<void()>)>& fence);
  // Blocks until the background save (if any) is committed; rethrows its error.
  void wait_pending();
  // The durable tier (CheckpointOptions::durable_uri), or null.
  std::unique_ptr<ckpt::DurableTier> durable;
  // This run's history's commits in the store (lineage.h), step -> line, as agree_on_candidates()
  // found them.
  std::map<int64_t, std::string> durable_steps;
  // The lineage the next save's manifest records: the loaded step's, branched onto a line of this
  // run's own; null until a load or the first save (which starts one).
  json lineage;
  // Collective on `c`, after the local commit of `step_dir`: starts its upload on every
  // rank, or on none (an upload still in flight somewhere). Sends nothing to the store.
  void start_durable_upload(Communicator& c, const fs::path& step_dir, int64_t step);
  // Collective: a disk that lacks the committed step `cand` copies its manifest from the
  // store (its leader does); the files its ranks read follow as they are read, each
  // verified (PieceReader). Returns this rank's failure ("" when none).
  std::string fetch_from_durable(const fs::path& cand);
  // Whether the step directory `cand`, whose manifest is `m`, is committed in the durable tier.
  bool fetchable(const fs::path& cand, const json& m) const;
  using Restore = std::function<void(const std::vector<int64_t>& steps, double scale, int64_t clean,
                                     const std::vector<at::Tensor>& grad_shards, const std::vector<char>& had_grad)>;
  std::optional<TrainingProgress> load(ShardedState state, torch::nn::Module& model, std::optional<int64_t> step,
                                       const Restore& restore);
  // defer_copies: keep views of the live master/moments (the caller copies
  // before the optimizer's next update); otherwise copy now.
  ckpt::Snapshot snapshot(const ShardedState& state, torch::nn::Module& model, const TrainingProgress& progress,
                    bool defer_copies = false);
  // Writes, verifies and commits a snapshot (collective on io_comm); returns the step directory.
  std::string write(const ckpt::Snapshot& snap);
  // Rank 0's manifest of the step being written in `tmp` (and its model view, when asked for).
  json manifest_of(const ckpt::Snapshot& snap, ckpt::Contents contents, const fs::path& tmp,
                   const std::vector<std::pair<int64_t, uint64_t>>& digests,
                   const std::vector<std::pair<int64_t, uint64_t>>& indexes, double save_seconds);
  // The save's time and size, in last_save_times() and the log.
  void report_saved(int64_t step, const fs::path& final_dir, const std::vector<std::pair<int64_t, uint64_t>>& digests,
                    std::chrono::steady_clock::duration took);
  void write_model_view(const fs::path& path, const json& manifest);
  // This rank's place: its stage (options) and its optimizer's group.
  ckpt::Place place_of(const ShardedState& state) const {
    return {options.pp_stage, options.pp_stages, state.rank, state.world_size};
  }
  void retain(const fs::path& keep_dir);
  // Committed checkpoints, newest first.
  std::vector<fs::path> committed() const;
  // Throws on every rank (collective) unless the ranks' models together are the
  // model `m` was saved from: every tensor of `mine` in it with its kind, shape
  // and dtype, and every tensor of it in some rank's model.
  void check_same_model(const json& m, const std::vector<ckpt::ModelEntry>& mine, const fs::path& cand) const;
  // Why this committed checkpoint cannot be trusted ("" when it can): the
  // files this rank checks (a share of those its directory holds) against the
  // manifest. `anywhere`: without a shared filesystem, files_anywhere()'s.
  std::string verify_share(const fs::path& step_dir, const json& m, const std::vector<char>& anywhere) const;
  // Collective: for each of the manifest's files (`m`; null where this rank has
  // none), whether some rank's directory holds it.
  std::vector<char> files_anywhere(const fs::path& step_dir, const json* m) const;
  // Whether this rank's directory holds one of a manifest's files.
  static bool here(const fs::path& step_dir, const json& file);
  // Why the committed checkpoint `cand` cannot be loaded ("" when it can): its
  // manifest (read into `m`) and this rank's share of its files. Collective
  // without a shared filesystem (files_anywhere).
  std::string check_candidate(const fs::path& cand, json& m) const;
  // Collective: the step directories to try, in order, the same on every rank:
  // `step`, or the oldest step a `latest` names, then the steps every disk holds,
  // newest first. Throws when some disks hold checkpoints and others none in common.
  // With a durable tier also the steps committed there (durable_steps). Only this run's
  // history (lineage.h) counts, on disk and in the store: the history of the checkpoint
  // `latest` names here, else of the store's `latest` (or of CheckpointOptions::durable_line).
  std::vector<fs::path> agree_on_candidates(std::optional<int64_t> step);
  // Rank 0's view of what to load: {"history": this run's lineage (null: none known), "commits":
  // [[step, line]...] of it in the store, newest first, one per step, "others": the rest}.
  json store_view(const fs::path& root);
  // The history of the commit the store's `latest` names (of its line's newest other commit when
  // that one cannot be read), or null. `all`: the store's commits.
  json latest_history(const std::vector<ckpt::Commit>& all);
};

}  // namespace zeroshard
