// zeroshard/trace.h — a Chrome-trace timeline of what each rank did.
//
// When tracing is on (trace::enable(); bart_pretrain --trace), the
// communicator records every operation it executes (on its own thread), and
// fully_shard units record their forward and backward compute and the time the
// training thread waited for a gather. write_chrome_trace() writes the events
// as Chrome trace JSON (open it in Perfetto or chrome://tracing): one process
// per rank, one track per thread, so overlap of communication and compute is
// visible at a glance.
//
// Thread-safety: all functions may be called from any thread. Recording costs one
// mutex-protected copy (names are cut at 95 bytes), and nothing when tracing is off.
// What a trace shows: docs/observability.md ("Timelines").
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard::trace {

struct Event {
  std::string name;      // "all_gather #12", "forward layer3"
  std::string category;  // "comm", "compute", "wait"
  int thread = 0;        // small id per thread, in order of first event
  double start_us = 0;   // since the process's first trace clock reading
  double duration_us = 0;
};

void enable(bool on = true);
bool enabled();  // since enable() (off at the start)

// A complete event from `start` to now, on the calling thread.
void record(std::string name, const char* category, std::chrono::steady_clock::time_point start);

// Records a span from construction to destruction (when tracing is on).
class Span {
 public:
  Span(const char* category, std::string name);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* category_;
  std::string name_;
  std::chrono::steady_clock::time_point start_;
  bool on_;
};

// Names the calling thread's track in the trace ("training", "checkpoint
// writer"); the communicators name their own threads. Cheap; works whether or
// not tracing is on.
void set_thread_name(const std::string& name);

std::vector<Event> events();  // everything recorded so far
void clear();
// Writes {"traceEvents": [...]} with pid = rank. Returns the number of events.
size_t write_chrome_trace(const std::string& path, int rank);

}  // namespace zeroshard::trace
