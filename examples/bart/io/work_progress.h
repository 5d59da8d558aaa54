// work_progress.h — where long work on bytes stands (prepare, merge,
// train-tokenizer on a corpus of gigabytes): bytes done of the total, MB/s and
// the time left. On a terminal (stderr) one line rewritten in place about
// twice a second; otherwise (a log file, a pipe) a log line a minute. Work of
// a second or less prints nothing. One thread updates it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace bart {

class WorkProgress {
 public:
  struct Options {
    double terminal_interval_s = 0.5;  // between lines on a terminal
    double log_interval_s = 60;        // between log lines elsewhere
    int terminal = -1;                 // 1: as on a terminal, 0: as not, -1: whether stderr is one
  };
  // `what` starts each line ("prepare"); `total_bytes` is what done counts up to.
  WorkProgress(std::string what, int64_t total_bytes, Options options);
  WorkProgress(std::string what, int64_t total_bytes) : WorkProgress(std::move(what), total_bytes, Options()) {}
  ~WorkProgress();  // ends a terminal line that was drawn
  WorkProgress(const WorkProgress&) = delete;
  WorkProgress& operator=(const WorkProgress&) = delete;

  // `done_bytes` of the total are done; `detail` is added to the line.
  void update(int64_t done_bytes, const std::string& detail = "");

  // "1.2 GB of 10.0 GB (12%), 35.2 MB/s, 4m10s left" for the state at `seconds`.
  static std::string line(int64_t done_bytes, int64_t total_bytes, double seconds);

 private:
  using Clock = std::chrono::steady_clock;
  std::string what_;
  int64_t total_;
  Options options_;
  bool terminal_ = false, drawn_ = false;
  Clock::time_point start_, last_;
};

}  // namespace bart
