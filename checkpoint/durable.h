// durable.h — the durable tier (DESIGN.md §7): committed local steps copied to
// an S3-compatible store and committed there, so that a host lost with its disk
// takes nothing the run needs; and steps copied back for a resume.
//
// In the store, under s3://bucket/prefix (lines: lineage.h):
//   latest                   {"step": N, "line": L}: the commit the last writer of a history named,
//                            moved forward along that history only
//   step-00001200/
//     commit-LINE.json       the commit of step 1200 on line LINE, put last, once (If-None-Match: *):
//                            the manifest, its xxh3 and the upload attempt, in one object
//     LINE/rank-00000-of-00004.h5, its .index, model.h5   that save's files, and nobody else's
//     .ranks/ATTEMPT/        one upload attempt's reports (ATTEMPT: 12 hex digits rank 0 drew):
//       rank-00003.ok        each rank's report that its files are up (or .failed, with why)
//       abandoned            rank 0's word that the step will not be committed, with why
//     manifest.json, manifest.xxh3, rank-*.h5 ...   a commit of an earlier version (line "")
// Several lines may hold the same step number (a rollback, a fallback, two jobs): a step is a
// (step, line) pair, and a run reads, keeps and reports durable only its own history's. A step
// directory without a commit does not exist for a load; retention removes the run's own commits
// beyond the newest `keep` (each commit before its files), and, below them, directories that
// hold no commit of any line and unfinished multipart uploads (a job killed mid-file).
//
// An upload runs on this object's thread while training goes on: each rank puts
// its own files, then its report; rank 0 waits for every report (bounded by
// `upload_timeout`), then commits; the other ranks wait for the commit, or for rank
// 0's word that the step is abandoned, so every rank knows the step's fate. A writer
// that finds the commit written by another compares the two states: other files
// and the step is not durable. A failure or a stall abandons the step's
// durable copy (one line naming the rank and the cause; training goes on) and
// the next save tries again. Thread-safe; one upload at a time.
#pragma once

#include "checksum.h"
#include "h5.h"
#include "s3_client.h"
#include "store_file.h"
#include "zeroshard/checkpoint.h"

#include <boost/asio/thread_pool.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard::ckpt {

// A commit in the store: step `step` of line `line` ("": of an earlier version, before lines).
struct Commit {
  int64_t step = -1;
  std::string line;
};
std::string commit_key(const Commit& c);      // step-N/commit-LINE.json (step-N/manifest.json)
std::string objects_prefix(const Commit& c);  // step-N/LINE/ (step-N/): where its files are

struct DurableOptions {
  // Committed steps kept in the store. Default: CheckpointOptions::keep.
  int keep = 3;
  // Rank 0 waits this long, from the start of an upload, for every rank's report. Default: 30 minutes.
  std::chrono::milliseconds upload_timeout{30 * 60 * 1000};
  s3::ClientOptions client;
};

class DurableTier {
 public:
  // `env`: where credentials and settings come from (s3_credentials.h).
  DurableTier(s3::Location where, s3::Environment env, int rank, int world, DurableOptions options);
  // Cancels the upload in flight and waits for it to end: its requests end at once (a stalled
  // store must not hold a preempted job past its grace period: within about 1 s), then it
  // says what it can within 0.5 s more, one attempt each (the multipart upload aborted, this
  // rank's failure report, rank 0's `abandoned`), and logs one line naming the store. Wait first (wait(), or
  // Checkpointer::make_durable) for a step that must be durable.
  ~DurableTier();
  DurableTier(const DurableTier&) = delete;
  DurableTier& operator=(const DurableTier&) = delete;

  // Lists, puts and deletes a probe: throws one line naming what is wrong (s3_client.h).
  void check_access() { client_->check_access(); }
  std::string describe() { return client_->describe(); }
  s3::Client& client() { return *client_; }

  bool busy();
  // Starts uploading this rank's files of the committed step directory `step_dir`
  // (rank 0: also model.h5, then the commit, `latest` and retention) under the line its
  // manifest names. Returns at once.
  // `attempt`: the same on every rank, and new for each upload (its reports' directory).
  // REQUIRES: !busy().
  void start_upload(const std::filesystem::path& step_dir, int64_t step, uint64_t attempt);
  // Waits up to `timeout` for the upload in flight; true when none is in flight.
  bool wait(std::chrono::milliseconds timeout);
  DurableStatus status();
  // The store holds a commit of `step` (a load found it there): status().durable_step is at least it.
  void note_committed(int64_t step);
  // The directory being uploaded (local retention must not delete it), or empty.
  std::filesystem::path pinned();

  // Every commit in the store, newest step first.
  std::vector<Commit> commits();
  // The commit `latest` names, if the store has a `latest`.
  std::optional<Commit> latest();
  // The lineage (lineage.h) of a commit's manifest, read from the store.
  nlohmann::json lineage(const Commit& c);
  // A commit's manifest text, verified against the xxh3 its commit holds (`xxh3`: that hash).
  std::string commit_manifest(const Commit& c, std::string* xxh3 = nullptr);
  // Copies a commit's manifest (and its checksum) into `run_dir/step-N`.
  void fetch_manifest(const Commit& c, const std::filesystem::path& run_dir);
  // Copies one file of a fetched manifest (`file`: its entry) of line `line` into the step directory
  // `step_dir`, verified against the entry's size and xxh3 before it takes its name
  // (a damaged copy throws, naming the file). Returns the bytes copied.
  // verify false: copied as the store holds it (zeroshard-ckpt verify checks it after).
  int64_t fetch_file(const std::filesystem::path& step_dir, const std::string& line, const nlohmann::json& file,
                     bool verify = true);
  // The whole commit into `run_dir/step-N` (the manifest, then every file it
  // lacks). Returns the bytes copied.
  int64_t fetch(const Commit& c, const std::filesystem::path& run_dir, bool verify = true);
  // One rank file of commit `c` (`file`: its manifest entry, which names an index), read
  // where it is: each dataset by one ranged GET when first read, verified against the
  // index (itself verified against the entry) before it is used. Logs what it read when destroyed.
  std::unique_ptr<checkpoint::h5::Readable> open_ranged(const Commit& c, const nlohmann::json& file);

 private:
  void upload(const std::filesystem::path& step_dir, int64_t step, uint64_t attempt);
  // Rank 0: waits for every rank's report in `reports` (the attempt's directory); "" when all
  // came, else why not (a rank's failure report, or the deadline).
  std::string await_reports(const std::string& reports, std::chrono::steady_clock::time_point deadline);
  // The other ranks: waits for the commit `c`; "" when it came and holds this rank's state
  // (`manifest`), else why not (another writer's state, rank 0's `abandoned` in `reports`, the deadline).
  std::string await_commit(const Commit& c, const nlohmann::json& manifest, const std::string& reports,
                           std::chrono::steady_clock::time_point deadline);
  // "" when the commit `c` in the store holds the state `manifest` describes; else why not.
  std::string not_ours(const Commit& c, const nlohmann::json& manifest);
  void commit(const std::filesystem::path& step_dir, const Commit& c, const nlohmann::json& manifest,
              uint64_t attempt);
  // Points `latest` at `c`, unless it names a step of the history `lineage` as new or newer.
  void move_latest(const Commit& c, const nlohmann::json& lineage);
  // Sleeps `pause`, or less when the tier is being destroyed; false then.
  bool pause_unless_stopping(std::chrono::milliseconds pause);
  // The commits of the history `lineage` beyond the newest `keep`, below `newest`; then leftovers.
  void retain(const nlohmann::json& lineage, int64_t newest);

  std::unique_ptr<s3::Client> client_;
  int rank_, world_;
  DurableOptions options_;
  boost::asio::thread_pool thread_{1};
  std::atomic<bool> stopping_{false};
  std::mutex mu_;  // guards in_flight_, status_, pinned_
  std::future<void> in_flight_;
  DurableStatus status_;
  std::filesystem::path pinned_;
};

}  // namespace zeroshard::ckpt
