#include "zeroshard/trace.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <mutex>

namespace zeroshard::trace {
namespace {

// Events are kept in fixed-size records, in chunks mapped straight from the
// kernel. Keeping them as heap strings (one small allocation per event, alive
// until the trace is written) scattered long-lived blocks among the freed
// tensor buffers of every step, so glibc could not return those to the kernel:
// a traced run's resident memory grew by megabytes per step.
struct Record {
  char name[96];
  const char* category;  // a string literal
  int thread;
  double start_us, duration_us;
};
constexpr size_t kChunkRecords = 4096;  // about 500 KiB

std::mutex mu;                // guards the records and `next_thread`
std::vector<Record*> chunks;  // each kChunkRecords records
size_t count = 0;
int next_thread = 0;
std::vector<std::pair<int, std::string>> thread_names;  // guarded by `mu`
std::atomic<bool> on{false};

const std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();

int thread_id() {
  thread_local int id = -1;
  if (id < 0) {
    std::lock_guard<std::mutex> lock(mu);
    id = next_thread++;
  }
  return id;
}

double micros(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::micro>(t - origin).count();
}

// The next free record (caller holds `mu`); nullptr when memory cannot be mapped.
Record* next_record() {
  if (count == chunks.size() * kChunkRecords) {
    void* p = ::mmap(nullptr, kChunkRecords * sizeof(Record), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;  // the trace loses events; training goes on
    chunks.push_back(static_cast<Record*>(p));
  }
  Record* r = chunks[count / kChunkRecords] + count % kChunkRecords;
  ++count;
  return r;
}

}  // namespace

void enable(bool yes) { on = yes; }

bool enabled() { return on.load(std::memory_order_relaxed); }

void record(std::string name, const char* category, std::chrono::steady_clock::time_point start) {
  if (!enabled()) return;
  const auto end = std::chrono::steady_clock::now();
  const int thread = thread_id();
  std::lock_guard<std::mutex> lock(mu);
  Record* r = next_record();
  if (r == nullptr) return;
  const size_t n = std::min(name.size(), sizeof(r->name) - 1);  // longer names are cut
  std::memcpy(r->name, name.data(), n);
  r->name[n] = '\0';
  r->category = category;
  r->thread = thread;
  r->start_us = micros(start);
  r->duration_us = micros(end) - r->start_us;
}

Span::Span(const char* category, std::string name)
    : category_(category), name_(std::move(name)), start_(std::chrono::steady_clock::now()), on_(enabled()) {}

Span::~Span() {
  if (on_) record(std::move(name_), category_, start_);
}

void set_thread_name(const std::string& name) {
  const int id = thread_id();
  std::lock_guard<std::mutex> lock(mu);
  for (auto& tn : thread_names) {
    if (tn.first == id) {
      tn.second = name;
      return;
    }
  }
  thread_names.emplace_back(id, name);
}

std::vector<Event> events() {
  std::lock_guard<std::mutex> lock(mu);
  std::vector<Event> out;
  out.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const Record& r = chunks[i / kChunkRecords][i % kChunkRecords];
    out.push_back({r.name, r.category, r.thread, r.start_us, r.duration_us});
  }
  return out;
}

void clear() {
  std::lock_guard<std::mutex> lock(mu);
  for (Record* c : chunks) ::munmap(c, kChunkRecords * sizeof(Record));
  chunks.clear();
  count = 0;
}

size_t write_chrome_trace(const std::string& path, int rank) {
  const auto all = events();
  nlohmann::json out;
  auto& list = out["traceEvents"];
  list = nlohmann::json::array();
  list.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& tn : thread_names) {
      list.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", tn.first}, {"args", {{"name", tn.second}}}});
    }
  }
  for (const auto& e : all) {
    list.push_back({{"name", e.name}, {"cat", e.category}, {"ph", "X"}, {"pid", rank}, {"tid", e.thread},
                    {"ts", e.start_us}, {"dur", e.duration_us}});
  }
  std::ofstream f(path);
  TORCH_CHECK(f.good(), "write_chrome_trace: cannot open '", path, "' for writing");
  f << out.dump();
  TORCH_CHECK(f.good(), "write_chrome_trace: writing '", path, "' failed");
  return all.size();
}

}  // namespace zeroshard::trace
