// group.h — zeroshard-run's ranks of one attempt on this node: started with
// torchrun's environment protocol, their output prefixed, reaped, stopped (a
// signal, then SIGKILL after the grace period), watched for progress, and
// asked why they failed (their error files). Single-threaded: everything runs
// on the launcher's io_context.
#pragma once

#include "runtime/launcher/launcher.h"
#include "runtime/launcher/prefixed_pipe.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard::launcher {

// "zeroshard-run: <line>" on stderr, in one write.
void say(const std::string& line);
// Seconds as a person writes them: 5, 0.5, 2.25.
std::string seconds_str(double s);

struct Rank {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int64_t last_step = -1;  // from its progress file
  std::chrono::steady_clock::time_point last_change{};
  bool flagged = false;    // said to have stalled (until it moves again)
  int status = 0;
  std::shared_ptr<PrefixedPipe> out, err;
};

// One attempt: start every local rank, supervise until all are gone.
class Group {
 public:
  Group(boost::asio::io_context& io, const LaunchOptions& opt, int port, int attempt, std::string progress_dir)
      : io_(io), opt_(opt), port_(port), attempt_(attempt), progress_dir_(std::move(progress_dir)), kill_timer_(io) {}

  // Starts every local rank of this node: torchrun's environment protocol, and
  // a progress file and an error file of its own for each.
  void start();

  // Reaps exited children; returns true when every rank has exited.
  bool reap();

  // Sends `sig` to every running rank, then SIGKILL after the grace period.
  void stop(int sig);

  // Kills what is left (each rank's process group), the grace period's timer cancelled.
  void finish();

  bool pipes_open() const;
  void close_pipes();

  // Where local rank `local` writes its step (zeroshard::publish_step).
  std::string progress_file(int local) const;
  // Where local rank `local` writes why it failed (zeroshard::record_error; torchelastic's format).
  std::string error_file(int local) const;
  // Whether global rank `rank` (of this node) recorded why it failed.
  bool recorded(int rank) const;
  // The error recorded first among this node's ranks (the cause; the others' errors follow from
  // it, and the first rank to exit need not be the one that failed first): {global rank, message},
  // or {-1, ""} when none wrote one.
  std::pair<int, std::string> first_recorded_error() const;
  // The step local rank 0 last reported; -1 before any.
  int64_t reported_step(int local = 0) const;
  bool stopping() const { return stopping_; }

  // Flags every running rank whose reported step has not moved for
  // stall_timeout_s since it last did (ranks that never report are left alone).
  void check_progress();

  int first_failure() const { return first_failure_; }
  int status_of(int global_rank) const;
  // The first non-zero rank status in rank order, as an exit code; 0 if all succeeded.
  int exit_code() const;

 private:
  boost::asio::io_context& io_;
  const LaunchOptions& opt_;
  const int port_;
  const int attempt_;
  const std::string progress_dir_;
  std::vector<Rank> ranks_;
  boost::asio::steady_timer kill_timer_;
  bool kill_armed_ = false;
  bool stopping_ = false;
  int first_failure_ = -1;
};

// A private directory for the ranks' progress and error files, removed when it goes.
struct ProgressDir {
  std::string path;
  ProgressDir();
  ~ProgressDir();
  ProgressDir(const ProgressDir&) = delete;
  ProgressDir& operator=(const ProgressDir&) = delete;
};

}  // namespace zeroshard::launcher
