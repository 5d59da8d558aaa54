// zeroshard/preemption.h — stop every rank after the same step when any of
// them is told the machine is going away, so the run can save and exit.
//
//   zeroshard::PreemptionGuard guard(comm);              // SIGTERM, SIGINT, SIGUSR1
//   for (int64_t step = start; step < steps; ++step) {
//     train_one_step();
//     if (guard.should_stop()) {                          // collective: all ranks agree
//       ckpt.save(opt, *model, {step + 1, epoch, sampler.state_json()});
//       return guard.exit_code();                         // kPreemptedExitCode
//     }
//   }
//
// A signal to any rank, or a notice (file or URL), makes should_stop() true on every rank at the
// same step boundary. The guard handles the signals from construction to destruction (on a
// thread of its own), so they no longer kill the process: call should_stop() at every step.
// Ownership: the guard keeps its communicator alive. Thread-safety: use it from the training
// thread (signaled() from any). How it works: docs/checkpoints.md ("Preemption").
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/step_agreement.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <csignal>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

// The exit status of a rank that stopped for a preemption after saving.
// zeroshard-run treats it like any failure: it restarts the group while
// --max-restarts allows, and the program resumes from `latest`.
constexpr int kPreemptedExitCode = 75;  // EX_TEMPFAIL: try again later

struct PreemptionOptions {
  // The signals that are notices. Default: SIGTERM, SIGINT, SIGUSR1.
  std::vector<int> signals{SIGTERM, SIGINT, SIGUSR1};
  // When non-empty: the file's existence is a notice (checked at each should_stop()).
  // Default: none.
  std::string notice_file;
  // When non-empty: an http:// URL (a cloud's metadata endpoint) polled every
  // notice_poll_interval_s on the guard's thread, with `notice_url_headers`; a 200 response
  // whose body is neither empty nor "FALSE" is a notice, an unreachable URL is none.
  // Default: none; polled every 5 s.
  std::string notice_url;
  std::vector<std::pair<std::string, std::string>> notice_url_headers;
  double notice_poll_interval_s = 5.0;
  // The time a notice leaves; check_save_fits() compares saves with it. Default: 30 s (GCP's).
  double grace_period_s = 30.0;
};

class PreemptionGuard {
 public:
  PreemptionGuard(std::shared_ptr<Communicator> comm, PreemptionOptions options = {});
  ~PreemptionGuard();
  PreemptionGuard(const PreemptionGuard&) = delete;
  PreemptionGuard& operator=(const PreemptionGuard&) = delete;

  // True on every rank when any rank got a notice since construction; logs (once) which.
  // Collective, at a step boundary: an all-reduce of its own, unless join() made the vote part
  // of the step's.
  bool should_stop();
  // Makes the vote a slot of `agreement` (step_agreement.h): should_stop() then reads what the
  // step's agree() voted, and throws if agree() did not run since the last should_stop(). A
  // notice after agree() counts at the next step. May come at any step. Keeps `agreement`
  // alive. REQUIRES: `agreement` over the communicator's ranks.
  void join(std::shared_ptr<StepAgreement> agreement);
  // Whether this rank itself got a signal (no communication).
  bool signaled() const { return signal_.load() != 0; }
  // Once should_stop() returned true: the earliest moment any rank learned of the notice (Unix
  // seconds, the system clock), and what this rank saw: the signal's name ("SIGTERM"), "notice
  // file", "notice URL" or "another rank's notice". NaN and "" before.
  double notice_time() const { return notice_time_; }
  const std::string& cause() const { return cause_; }
  // Logs `save_seconds` against the grace period: a warning when it would not fit (call it at
  // start-up with the last checkpoint's TrainingProgress::save_seconds), else an info line.
  // Returns whether it fits.
  bool check_save_fits(double save_seconds) const;
  int exit_code() const { return kPreemptedExitCode; }
  const PreemptionOptions& options() const { return options_; }

 private:
  struct Impl;
  std::shared_ptr<Communicator> comm_;
  PreemptionOptions options_;
  std::atomic<int> signal_{0};
  std::atomic<bool> url_notice_{false};
  std::atomic<int64_t> seen_ns_{0};  // when this rank first saw a signal or the URL's notice (system clock)
  struct Vote {
    int64_t at = -1;  // the agreement (its count) that took it
    bool any = false;
    double earliest = INFINITY;  // the first notice any rank saw (Unix s)
  };
  std::shared_ptr<StepAgreement> agreement_;
  int64_t slot_ = -1;
  bool own_agreement_ = false;  // made by should_stop(): agreed there
  Vote vote_;
  struct Seen {  // what this rank saw when it last voted
    int signal = 0;
    bool url_notice = false, file_notice = false;
  };
  Seen seen_;
  int64_t read_at_ = -1;  // vote_.at when should_stop() last read it
  bool stopped_ = false;
  double notice_time_ = NAN;
  std::string cause_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
