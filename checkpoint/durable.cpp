// durable.cpp — uploads, commits, retention and fetches of the durable tier (durable.h).
#include "durable.h"

#include "checkpointer_impl.h"
#include "lineage.h"
#include "zeroshard/log.h"
#include "zeroshard/trace.h"

#include <boost/asio/post.hpp>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <functional>
#include <set>
#include <thread>

namespace zeroshard::ckpt {

namespace fs = std::filesystem;
using Steady = std::chrono::steady_clock;

namespace {

std::string attempt_hex(uint64_t attempt) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%012llx", static_cast<unsigned long long>(attempt));
  return buf;
}

// Where one upload attempt of a step keeps its reports: an attempt's own directory, so that
// what an earlier attempt at the same step left (a failure report, files of a run that went
// another way since) is never taken for this one's.
std::string reports_dir(const std::string& step_name, uint64_t attempt) {
  return step_name + "/.ranks/" + attempt_hex(attempt) + "/";
}

std::string report_name(const std::string& reports, int rank, bool ok) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank-%05d.%s", rank, ok ? "ok" : "failed");
  return reports + buf;
}

// Put by rank 0 when a step's upload fails anywhere, with the cause: what the other ranks wait for
// instead of the commit.
constexpr const char* kAbandoned = "abandoned";

// What an ending job's upload may still say once its requests are cancelled (its failure report,
// rank 0's `abandoned`, the multipart upload's abort): one attempt each, all within this.
constexpr std::chrono::milliseconds kLastWords{500};

double seconds_since(Steady::time_point t) { return std::chrono::duration<double>(Steady::now() - t).count(); }

}  // namespace

std::unique_ptr<checkpoint::h5::Readable> DurableTier::open_ranged(const Commit& c, const json& file) {
  return open_store_file(*client_, objects_prefix(c) + file.at("name").get<std::string>(), file);
}

DurableTier::DurableTier(s3::Location where, s3::Environment env, int rank, int world, DurableOptions options)
    : client_(std::make_unique<s3::Client>(std::move(where), std::move(env), options.client)),
      rank_(rank),
      world_(world),
      options_(options) {}

DurableTier::~DurableTier() {
  stopping_ = true;  // an upload in flight stops waiting for the other ranks,
  client_->cancel(kLastWords);  // and its requests end now: the store may be stalled
  thread_.join();
}

bool DurableTier::pause_unless_stopping(std::chrono::milliseconds pause) {
  for (auto left = pause; left.count() > 0 && !stopping_; left -= std::chrono::milliseconds(50)) {
    std::this_thread::sleep_for(std::min(left, std::chrono::milliseconds(50)));
  }
  return !stopping_;
}

bool DurableTier::busy() {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_.valid() && in_flight_.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
}

void DurableTier::start_upload(const fs::path& step_dir, int64_t step, uint64_t attempt) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!in_flight_.valid() || in_flight_.wait_for(std::chrono::seconds(0)) == std::future_status::ready,
              "durable tier: an upload is in flight");
  pinned_ = step_dir;
  status_.uploading_step = step;
  auto task = std::make_shared<std::packaged_task<void()>>([this, step_dir, step, attempt] { upload(step_dir, step, attempt); });
  in_flight_ = task->get_future();
  boost::asio::post(thread_, [task] { (*task)(); });
}

bool DurableTier::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!in_flight_.valid()) return true;
  auto f = std::move(in_flight_);
  lock.unlock();
  bool done = f.wait_for(timeout) == std::future_status::ready;
  lock.lock();
  if (!done) in_flight_ = std::move(f);
  return done;
}

DurableStatus DurableTier::status() {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

void DurableTier::note_committed(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  status_.durable_step = std::max(status_.durable_step, step);
}

fs::path DurableTier::pinned() {
  std::lock_guard<std::mutex> lock(mu_);
  return pinned_;
}

namespace {

constexpr const char* kCommitFormat = "zeroshard-durable-commit";

// Whether two manifests describe the same saved state: the same files, byte for byte (the
// time a save took and the hosts that wrote it may differ).
bool same_state(const json& a, const json& b) {
  auto files = [](const json& m) {
    json out = json::array();
    for (const auto& f : m.at("files")) out.push_back({f.at("name"), f.at("bytes"), f.at("xxh3")});
    return out;
  };
  auto view = [](const json& m) { return m.contains("model_view") ? m.at("model_view").at("xxh3") : json(); };
  return a.at("step") == b.at("step") && files(a) == files(b) && view(a) == view(b);
}

}  // namespace

std::string commit_key(const Commit& c) {
  return step_dir_name(c.step) + (c.line.empty() ? "/manifest.json" : "/commit-" + c.line + ".json");
}

std::string objects_prefix(const Commit& c) { return step_dir_name(c.step) + "/" + (c.line.empty() ? "" : c.line + "/"); }

void DurableTier::upload(const fs::path& step_dir, int64_t step, uint64_t attempt) {
  const auto t0 = Steady::now();
  const std::string step_name = step_dir_name(step);
  const std::string reports = reports_dir(step_name, attempt);
  std::string why;
  std::atomic<int64_t> bytes{0};  // added to by the client's part uploads, several at once
  // This rank's files: its rank file and the file's index; rank 0 also what rank 0 alone writes.
  const std::string own = rank_file_name(rank_, world_);
  std::vector<std::string> mine{own, index_path(own).string()};
  if (rank_ == 0) mine.push_back("model.h5");
  Commit c{step, ""};
  json manifest;
  try {
    manifest = read_manifest(step_dir);
    c.line = line_of(manifest);
    TORCH_CHECK(!c.line.empty(), "'", (step_dir / "manifest.json").string(), "' names no line of checkpoints (it was ",
                "saved by an earlier version); a step saved now is uploaded instead");
    // The files go where only this save's commit points: a save of the same step on another line
    // (a rollback, another job) never touches them, nor they its.
    for (const auto& name : mine) {
      TORCH_CHECK(!stopping_, "the job ended before this rank's files were uploaded");
      std::error_code ec;
      if (!fs::exists(step_dir / name, ec)) {
        TORCH_CHECK(name != own, "'", (step_dir / name).string(), "' is missing");
        continue;  // model.h5 without CheckpointOptions::write_model_view; no index (zeroshard-ckpt import)
      }
      trace::Span span("checkpoint", "checkpoint upload " + name);
      client_->upload_file(objects_prefix(c) + name, (step_dir / name).string(), false,
                           [&bytes](int64_t n) { bytes += n; });
    }
    client_->put(report_name(reports, rank_, true), std::to_string(bytes.load()));
  } catch (const std::exception& e) {
    why = error_message(e);
    try {  // tell rank 0 at once, rather than at its deadline
      client_->put(report_name(reports, rank_, false), why);
    } catch (const std::exception&) {
    }
  }
  if (why.empty() || rank_ == 0) {
    try {
      if (rank_ == 0) {  // every rank's files up: the commit
        if (why.empty()) why = await_reports(reports, t0 + options_.upload_timeout);
        if (why.empty()) commit(step_dir, c, manifest, attempt);
      } else {  // the commit, or rank 0's word that the step is abandoned (a margin past its deadline)
        why = await_commit(c, manifest, reports, t0 + options_.upload_timeout + std::chrono::minutes(1));
      }
    } catch (const std::exception& e) {
      why = error_message(e);
      if (rank_ == 0) why = "committing failed: " + why;
    }
  }
  if (!why.empty() && rank_ == 0) {  // the others wait for the commit or this: tell them at once
    try {
      client_->put(reports + kAbandoned, why);
    } catch (const std::exception&) {
    }
  }
  const double lag = seconds_since(t0);
  std::lock_guard<std::mutex> lock(mu_);
  status_.uploading_step = -1;
  pinned_.clear();
  if (why.empty()) {
    status_.durable_step = step;
    status_.lag_seconds = lag;
    status_.durable_bytes = bytes;
    char msg[160];
    std::snprintf(msg, sizeof(msg), "checkpoint: step %lld is durable in %.1f s (%.1f MB from rank 0) at ",
                  static_cast<long long>(step), lag, bytes / 1e6);
    log_info(msg + client_->location().uri());
  } else if (stopping_) {  // the job is ending: one line, naming the store and what it holds
    status_.last_error = why;
    ++status_.abandoned;
    log_error("checkpoint: the job ended while step " + std::to_string(step) + " was uploading to " +
              client_->location().uri() + " (" + std::to_string(static_cast<int>(lag)) + " s in): its durable copy " +
              "is abandoned; " +
              (status_.durable_step >= 0 ? "the newest step this job made durable there is " +
                                               std::to_string(status_.durable_step)
                                         : std::string("this job made no step durable there")) +
              " (" + why + ")");
  } else {
    status_.last_error = why;
    ++status_.abandoned;
    log_error("checkpoint: the durable copy of step " + std::to_string(step) + " is abandoned (training goes on; the " +
              "next save tries again): " + why);
  }
}

std::string DurableTier::await_reports(const std::string& reports, Steady::time_point deadline) {
  auto pause = std::chrono::milliseconds(200);
  while (true) {
    std::set<int> ok;
    for (const auto& o : client_->list(reports)) {
      int r = -1;
      char kind[8] = {0};
      if (std::sscanf(o.name.c_str() + reports.size(), "rank-%05d.%7s", &r, kind) != 2) continue;
      if (std::string(kind) == "failed") {
        std::string cause = client_->get(o.name).value_or("(no reason given)");
        return "rank " + std::to_string(r) + ": " + cause;
      }
      ok.insert(r);
    }
    if (static_cast<int>(ok.size()) >= world_) return "";
    if (Steady::now() >= deadline) {
      std::string missing;
      for (int r = 0; r < world_ && missing.size() < 200; ++r) {
        if (!ok.count(r)) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      return "rank(s) " + missing + " did not report their files uploaded within " +
             std::to_string(std::chrono::duration_cast<std::chrono::seconds>(options_.upload_timeout).count()) + " s";
    }
    if (!pause_unless_stopping(pause)) return "the job ended before every rank reported its files uploaded";
    pause = std::min(pause * 2, std::chrono::milliseconds(2000));
  }
}

std::string DurableTier::await_commit(const Commit& c, const json& manifest, const std::string& reports,
                                      Steady::time_point deadline) {
  // Two requests a poll, whatever the world size (a listing of the reports grows with it), and
  // polls further apart than rank 0's: thousands of ranks wait here at once.
  auto pause = std::chrono::milliseconds(250);
  while (true) {
    if (client_->head(commit_key(c))) return not_ours(c, manifest);
    if (auto cause = client_->get(reports + kAbandoned)) return *cause;
    if (Steady::now() >= deadline) return "rank 0 did not commit " + step_dir_name(c.step) + " by its deadline";
    if (!pause_unless_stopping(pause)) return "the job ended before rank 0 committed " + step_dir_name(c.step);
    pause = std::min(pause * 2, std::chrono::milliseconds(5000));
  }
}

std::string DurableTier::not_ours(const Commit& c, const json& manifest) {
  const json theirs = json::parse(commit_manifest(c));
  if (same_state(theirs, manifest)) return "";
  return client_->location().uri() + "/" + commit_key(c) + " was committed by another writer with other files (" +
         "two jobs on one line of checkpoints?): this save of step " + std::to_string(c.step) +
         " is not durable there";
}

void DurableTier::commit(const fs::path& step_dir, const Commit& c, const json& manifest, uint64_t attempt) {
  const std::string text = read_text(step_dir / "manifest.json");
  // The commit: the manifest and its checksum in one object, written once (If-None-Match: *). A
  // writer that finds it written compares the states: the same files, or this save is not durable.
  const json record{{"format", kCommitFormat}, {"format_version", 1},  {"step", c.step},
                    {"line", c.line},          {"attempt", attempt_hex(attempt)},
                    {"manifest_xxh3", hash_hex(text)}, {"manifest", text}};
  if (!client_->put_if_absent(commit_key(c), record.dump())) {
    const std::string why = not_ours(c, manifest);
    TORCH_CHECK(why.empty(), why);
    log_warn("checkpoint: " + client_->location().uri() + "/" + commit_key(c) +
             " was committed first by another writer of the same files; it stands");
  }
  const json lineage = lineage_of(manifest);
  move_latest(c, lineage);
  retain(lineage, c.step);
}

void DurableTier::move_latest(const Commit& c, const json& lineage) {
  // Forward along this run's history only: never back to an older step of it (a slower writer), never
  // from a newer one of it; over another line's (an abandoned timeline, another job's), yes.
  if (auto now = latest(); now && in_history(lineage, now->step, now->line) && now->step >= c.step) return;
  client_->put("latest", json{{"step", c.step}, {"line", c.line}}.dump() + "\n");
}

std::optional<Commit> DurableTier::latest() {
  auto text = client_->get("latest");
  if (!text) return std::nullopt;
  std::string t = *text;
  t.erase(t.find_last_not_of(" \n\r\t") + 1);
  if (auto legacy = step_of_dir_name(t)) return Commit{*legacy, ""};  // "step-00001200" (before lines)
  try {
    const json j = json::parse(t);
    return Commit{j.at("step").get<int64_t>(), j.at("line").get<std::string>()};
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "checkpoint: ", client_->location().uri(), "/latest is neither a step name nor ",
                "{\"step\", \"line\"}: ", t.substr(0, 120));
  }
}

std::vector<Commit> DurableTier::commits() {
  // The step directories, then the commits directly in each: requests grow with the steps kept,
  // not with their files.
  std::vector<Commit> out;
  for (const auto& d : client_->list_directories("step-")) {
    auto s = step_of_dir_name(d.substr(0, d.size() - 1));
    if (!s) continue;
    for (const auto& o : client_->list_here(d)) {
      const std::string name = o.name.substr(d.size());
      if (name == "manifest.json") {
        out.push_back({*s, ""});
      } else if (name.rfind("commit-", 0) == 0 && name.size() > 12 && name.substr(name.size() - 5) == ".json") {
        out.push_back({*s, name.substr(7, name.size() - 12)});
      }
    }
  }
  std::sort(out.begin(), out.end(), [](const Commit& a, const Commit& b) {
    return a.step != b.step ? a.step > b.step : a.line > b.line;
  });
  return out;
}

std::string DurableTier::commit_manifest(const Commit& c, std::string* xxh3) {
  const std::string where = client_->location().uri() + "/" + commit_key(c);
  std::string text, want;
  if (c.line.empty()) {  // before lines: the manifest and its checksum side by side
    auto manifest = client_->get(commit_key(c));
    auto digest = client_->get(step_dir_name(c.step) + "/manifest.xxh3");
    TORCH_CHECK(manifest && digest, "checkpoint: ", where, " or manifest.xxh3 is gone (removed by a newer job's ",
                "retention?)");
    text = *manifest;
    want = *digest;
    want.erase(want.find_last_not_of(" \n\r\t") + 1);
  } else {
    auto record = client_->get(commit_key(c));
    TORCH_CHECK(record, "checkpoint: ", where, " is gone (removed by a newer job's retention?)");
    try {
      const json r = json::parse(*record);
      TORCH_CHECK(r.at("format") == kCommitFormat && r.at("step") == c.step && r.at("line") == c.line, "not the ",
                  "commit of step ", c.step, " on line ", c.line);
      text = r.at("manifest").get<std::string>();
      want = r.at("manifest_xxh3").get<std::string>();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "checkpoint: ", where, " is not a commit record: ", error_message(e));
    }
  }
  TORCH_CHECK(hash_hex(text) == want, "checkpoint: ", where, ": the manifest's xxh3 is ", hash_hex(text),
              " and its commit says ", want, ": the store's copy is damaged");
  if (xxh3) *xxh3 = want;
  return text;
}

json DurableTier::lineage(const Commit& c) { return lineage_of(json::parse(commit_manifest(c))); }

void DurableTier::retain(const json& lineage, int64_t newest) {
  // This run's history alone: its newest `keep` commits stay; older ones go, each commit before its
  // files. Commits of other lines (an abandoned timeline, another job) are not this run's to delete.
  const auto all = commits();
  std::vector<Commit> mine;
  for (const auto& c : all) {
    if (in_history(lineage, c.step, c.line)) mine.push_back(c);
  }
  const size_t keep = static_cast<size_t>(std::max(options_.keep, 2));
  const int64_t oldest_kept = mine.empty() ? -1 : mine[std::min(keep, mine.size()) - 1].step;
  std::set<int64_t> removed;
  for (size_t i = keep; i < mine.size(); ++i) {
    const Commit& c = mine[i];
    if (c.step >= newest) continue;
    client_->remove(commit_key(c));  // first: a removal cut short leaves files of no commit, never a commit without files
    if (c.line.empty()) {            // before lines: the files lie beside the manifest
      for (const auto& o : client_->list_here(step_dir_name(c.step) + "/")) client_->remove(o.name);
    } else {
      client_->remove_all(objects_prefix(c));
    }
    removed.insert(c.step);
  }
  // Below every kept commit, a step directory that holds no commit of any line any more is what
  // abandoned uploads and removed commits left (their reports, files, unfinished multipart
  // uploads). One between kept steps may be committing now: ranks commit from their own threads.
  std::set<int64_t> committed;
  for (const auto& c : all) {
    if (!(removed.count(c.step) && in_history(lineage, c.step, c.line))) committed.insert(c.step);
  }
  for (const auto& d : client_->list_directories("step-")) {
    auto s = step_of_dir_name(d.substr(0, d.size() - 1));
    if (s && *s < oldest_kept && !committed.count(*s)) client_->remove_all(d);
  }
  // Uploads a job killed mid-file left below every kept commit: a directory with no finished
  // object is in no listing above, and their parts are billed until aborted.
  for (const auto& u : client_->uploads("step-")) {
    auto s = step_of_dir_name(u.name.substr(0, u.name.find('/')));
    if (s && *s < oldest_kept) client_->abort_upload(u);
  }
}

void DurableTier::fetch_manifest(const Commit& c, const fs::path& run_dir) {
  std::string xxh3;
  const std::string text = commit_manifest(c, &xxh3);
  const fs::path dir = run_dir / step_dir_name(c.step);
  std::error_code ec;
  fs::create_directories(dir, ec);
  TORCH_CHECK(!ec, "checkpoint: cannot create '", dir.string(), "': ", ec.message());
  write_atomically(dir / "manifest.xxh3", xxh3 + "\n");
  write_atomically(dir / "manifest.json", text);  // last: read_manifest checks it against the checksum
}

int64_t DurableTier::fetch_file(const fs::path& step_dir, const std::string& line, const json& file, bool verify) {
  const std::string name = file.at("name").get<std::string>();
  const fs::path final_path = step_dir / name;
  const auto step = step_of_dir_name(step_dir.filename().string());
  TORCH_CHECK(step, "checkpoint: '", step_dir.string(), "' is not a step directory");
  const std::string key = objects_prefix({*step, line}) + name;
  // Ranks sharing the directory may want the same file at once (their own, or another's that
  // holds what they read): one copies it while the others wait on its lock, then find it there.
  const fs::path lock_path = step_dir / (name + ".fetch-lock");
  const int lock_fd = ::open(lock_path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  TORCH_CHECK(lock_fd >= 0, "checkpoint: cannot create '", lock_path.string(), "': ", std::strerror(errno));
  struct Held {
    int fd;
    ~Held() { ::close(fd); }  // releases the lock
  } held{lock_fd};
  while (::flock(lock_fd, LOCK_EX) != 0) {
    TORCH_CHECK(errno == EINTR, "checkpoint: cannot lock '", lock_path.string(), "': ", std::strerror(errno));
  }
  struct Unlink {  // the lock's file goes when its holder is done (a rank waiting on it holds it still)
    fs::path path;
    ~Unlink() {
      std::error_code ec;
      fs::remove(path, ec);
    }
  } unlink{lock_path};
  {
    std::error_code ec;
    const auto size = fs::file_size(final_path, ec);
    if (!ec && static_cast<int64_t>(size) == file.at("bytes").get<int64_t>()) return 0;  // another rank copied it
  }
  // A name of this process and thread for the copy in progress.
  const fs::path tmp = step_dir / (name + ".fetch-" + std::to_string(::getpid()) + "-" +
                                   std::to_string(std::hash<std::thread::id>()(std::this_thread::get_id())));
  trace::Span span("checkpoint", "checkpoint fetch " + name);
  const auto t0 = Steady::now();
  uint64_t xxh3 = 0;  // hashed as the parts land
  const int64_t bytes = client_->download_file(key, tmp.string(), verify ? &xxh3 : nullptr);
  std::error_code ec;
  if (verify && (bytes != file.at("bytes").get<int64_t>() ||
                 checkpoint::to_hex(xxh3) != file.at("xxh3").get<std::string>())) {
    fs::remove(tmp, ec);
    TORCH_CHECK(false, "checkpoint: ", client_->location().uri(), "/", key, " has ", bytes, " bytes and xxh3 ",
                checkpoint::to_hex(xxh3), "; the manifest says ", file.at("bytes").get<int64_t>(), " and ",
                file.at("xxh3").get<std::string>(), ": the store's copy is damaged");
  }
  fs::rename(tmp, final_path, ec);
  TORCH_CHECK(!ec, "checkpoint: cannot move '", tmp.string(), "' to '", final_path.string(), "': ", ec.message());
  char msg[200];
  std::snprintf(msg, sizeof(msg), "checkpoint: copied %.1f MB of %s/%s from the durable tier in %.2f s", bytes / 1e6,
                step_dir.filename().string().c_str(), name.c_str(), seconds_since(t0));
  log_warn(msg);
  return bytes;
}

int64_t DurableTier::fetch(const Commit& c, const fs::path& run_dir, bool verify) {
  fetch_manifest(c, run_dir);
  const fs::path dir = run_dir / step_dir_name(c.step);
  const json m = read_manifest(dir);
  int64_t bytes = 0;
  for (const auto& f : m.at("files")) {
    std::error_code ec;
    const fs::path here = dir / f.at("name").get<std::string>();
    if (fs::exists(here, ec) && static_cast<int64_t>(fs::file_size(here, ec)) == f.at("bytes").get<int64_t>()) continue;
    bytes += fetch_file(dir, c.line, f, verify);
  }
  return bytes;
}

}  // namespace zeroshard::ckpt
