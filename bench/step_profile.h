// step_profile.h — one step under LibTorch's profiler (Kineto), for the
// benchmarks: the Chrome trace written to a file, and a summary printed.
//
//   zeroshard::bench::profile_step("step.json", device, [&] { run_step(); });
//
// Prints, for bench scripts to pick up:
//   PROFILE top <total_us> <calls> <name>   the kernels (CUDA) or host ops
//                                           (CPU: inclusive, nested ops count in their parents)
//                                           with the most time, ten of them
//   PROFILE busy <busy_us> <span_us>        CUDA: the time some kernel or copy ran, against the
//                                           step's wall time; the rest is the device waiting for
//                                           the host (launch gaps, synchronizations)
// LibTorch 2.x only (1.13's public profiler API differs): elsewhere it throws.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/autograd/profiler_kineto.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard::bench {

inline void profile_step(const std::string& path, torch::Device device, const std::function<void()>& step) {
#if TORCH_VERSION_MAJOR >= 2
  namespace pi = torch::profiler::impl;
  namespace ap = torch::autograd::profiler;
  const pi::ProfilerConfig config(pi::ProfilerState::KINETO, /*report_input_shapes=*/true, /*profile_memory=*/false,
                                  /*with_stack=*/false, /*with_flops=*/true);
  std::set<pi::ActivityType> activities{pi::ActivityType::CPU};
  if (device.is_cuda()) activities.insert(pi::ActivityType::CUDA);
  ap::prepareProfiler(config, activities);
  ap::enableProfiler(config, activities);
  const auto t0 = std::chrono::steady_clock::now();
  step();
  const double span_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  const auto result = ap::disableProfiler();
  result->save(path);

  const auto wanted = device.is_cuda() ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  std::map<std::string, std::pair<double, int64_t>> by_name;  // total us, calls
  std::vector<std::pair<uint64_t, uint64_t>> intervals;      // device activity, ns
  for (const auto& e : result->events()) {
    if (e.deviceType() != wanted) continue;
    auto& [total, calls] = by_name[e.name()];
    total += static_cast<double>(e.durationNs()) / 1e3;
    ++calls;
    if (device.is_cuda()) intervals.emplace_back(e.startNs(), e.startNs() + e.durationNs());
  }
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> top(by_name.begin(), by_name.end());
  std::sort(top.begin(), top.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  if (top.size() > 10) top.resize(10);
  for (const auto& [name, t] : top) std::printf("PROFILE top %.0f %lld %s\n", t.first, static_cast<long long>(t.second), name.c_str());
  if (device.is_cuda()) {
    std::sort(intervals.begin(), intervals.end());
    double busy_ns = 0;
    uint64_t end = 0;
    for (const auto& [s, e] : intervals) {  // the union of the intervals
      if (e <= end) continue;
      busy_ns += static_cast<double>(e - std::max(s, end));
      end = e;
    }
    std::printf("PROFILE busy %.0f %.0f\n", busy_ns / 1e3, span_us);
  }
  std::fflush(stdout);
#else
  (void)path, (void)device, (void)step;
  TORCH_CHECK_VALUE(false, "--profile needs LibTorch 2.x (this build's is ", TORCH_VERSION, ")");
#endif
}

}  // namespace zeroshard::bench
