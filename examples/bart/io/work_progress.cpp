// work_progress.cpp — progress lines for long work on bytes.
#include "io/work_progress.h"

#include <zeroshard/log.h>
#include <zeroshard/metrics.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace bart {

namespace {

std::string bytes_text(int64_t b) {
  char s[32];
  if (b >= 1000000000) {
    std::snprintf(s, sizeof(s), "%.2f GB", static_cast<double>(b) / 1e9);
  } else {
    std::snprintf(s, sizeof(s), "%.1f MB", static_cast<double>(b) / 1e6);
  }
  return s;
}

}  // namespace

WorkProgress::WorkProgress(std::string what, int64_t total_bytes, Options options)
    : what_(std::move(what)), total_(total_bytes), options_(options), start_(Clock::now()), last_(start_) {
  terminal_ = options.terminal >= 0 ? options.terminal == 1 : ::isatty(STDERR_FILENO) == 1;
}

WorkProgress::~WorkProgress() {
  if (drawn_) std::fputs("\n", stderr);
}

std::string WorkProgress::line(int64_t done_bytes, int64_t total_bytes, double seconds) {
  const double rate = seconds > 0 ? static_cast<double>(done_bytes) / seconds : 0;
  const double left = rate > 0 ? static_cast<double>(std::max<int64_t>(0, total_bytes - done_bytes)) / rate : -1;
  char s[160];
  std::snprintf(s, sizeof(s), "%s of %s (%d%%), %.1f MB/s, %s left", bytes_text(done_bytes).c_str(),
                bytes_text(total_bytes).c_str(),
                total_bytes > 0 ? static_cast<int>(100 * std::min(done_bytes, total_bytes) / total_bytes) : 100,
                rate / 1e6, zeroshard::ProgressLine::duration(left).c_str());
  return s;
}

void WorkProgress::update(int64_t done_bytes, const std::string& detail) {
  const auto now = Clock::now();
  const double since_start = std::chrono::duration<double>(now - start_).count();
  const double since_last = std::chrono::duration<double>(now - last_).count();
  if (since_start < 1 || since_last < (terminal_ ? options_.terminal_interval_s : options_.log_interval_s)) return;
  last_ = now;
  const std::string text = what_ + ": " + line(done_bytes, total_, since_start) + (detail.empty() ? "" : ", " + detail);
  if (terminal_) {
    std::fprintf(stderr, "\r%s\033[K", text.c_str());
    std::fflush(stderr);
    drawn_ = true;
  } else {
    zeroshard::log_info(text);
  }
}

}  // namespace bart
