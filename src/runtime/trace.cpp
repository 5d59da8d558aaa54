#include "zeroshard/trace.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <mutex>

namespace zeroshard::trace {
namespace {

std::mutex mu;                // guards `recorded` and `next_thread`
std::vector<Event> recorded;
int next_thread = 0;
std::atomic<int> state{-1};   // -1: not decided yet (read ZS_TRACE), 0 off, 1 on

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

}  // namespace

void enable(bool on) { state = on ? 1 : 0; }

bool enabled() {
  int s = state.load();
  if (s < 0) {
    const char* env = std::getenv("ZS_TRACE");
    s = (env != nullptr && *env != '\0' && std::string(env) != "0") ? 1 : 0;
    state = s;
  }
  return s == 1;
}

void record(std::string name, const char* category, std::chrono::steady_clock::time_point start) {
  if (!enabled()) return;
  const auto end = std::chrono::steady_clock::now();
  Event e{std::move(name), category, thread_id(), micros(start), micros(end) - micros(start)};
  std::lock_guard<std::mutex> lock(mu);
  recorded.push_back(std::move(e));
}

Span::Span(const char* category, std::string name)
    : category_(category), name_(std::move(name)), start_(std::chrono::steady_clock::now()), on_(enabled()) {}

Span::~Span() {
  if (on_) record(std::move(name_), category_, start_);
}

std::vector<Event> events() {
  std::lock_guard<std::mutex> lock(mu);
  return recorded;
}

void clear() {
  std::lock_guard<std::mutex> lock(mu);
  recorded.clear();
}

size_t write_chrome_trace(const std::string& path, int rank) {
  const auto all = events();
  nlohmann::json out;
  auto& list = out["traceEvents"];
  list = nlohmann::json::array();
  list.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
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
