// optim_bench: one AdamW step over n fp32 elements, three ways, in one process:
//   fused   zeroshard's fused kernel (SIMD path chosen at run time, at::parallel_for threads)
//   torch   torch::optim::AdamW::step on one parameter of n elements
//   triad   STREAM triad a = b + s*c over n floats (the machine's bandwidth anchor)
// Bandwidth counts the bytes each algorithm must move, STREAM's convention:
// AdamW 28 B/element (read p, g, m, v; write p, m, v), triad 12 B/element.
// Triad's store to `a` also makes the CPU read `a` first (write-allocate), so
// its real traffic is 16 B/element; that column is printed too. AdamW writes
// only what it read, so its 28 B are its real traffic.
//
//   bench/optim_bench [--min-m 16] [--max-m 128] [--reps 7]
#include "optim/fused_adamw.h"

#include <CLI/CLI.hpp>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

namespace {

// STREAM's rule, for all three: the best of `reps` timed runs after one warm-up.
double best_seconds(int reps, const std::function<void()>& f) {
  f();  // warm-up: page faults, thread pool start
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return *std::min_element(t.begin(), t.end());
}

void triad(float* __restrict a, const float* __restrict b, const float* __restrict c, float s, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
  });
}

}  // namespace

int main(int argc, char** argv) {
  int min_m = 16, max_m = 128, reps = 7;
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  CLI::App app{"AdamW step: fused kernel vs torch::optim::AdamW vs STREAM triad"};
  app.add_option("--min-m", min_m, "smallest size, millions of elements (x 2^20)")->capture_default_str();
  app.add_option("--max-m", max_m, "largest size, millions of elements (x 2^20)")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (best reported, as STREAM does)")->capture_default_str();
  app.add_option("--threads", threads, "threads for all three (default: every core)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(std::max(1, threads));

  using zeroshard::optim::to_string;
  std::printf("optim_bench: %d threads, SIMD %s, best of %d\n\n", at::get_num_threads(),
              to_string(zeroshard::optim::default_simd()).c_str(), reps);
  std::printf("| elements | triad GB/s (12 B) | triad GB/s (16 B) | fused ms | fused GB/s | fused / triad (12 B) | fused / triad (16 B) | torch AdamW ms | torch GB/s | fused speedup |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  torch::NoGradGuard no_grad;
  for (int m = min_m; m <= max_m; m *= 2) {
    const int64_t n = static_cast<int64_t>(m) << 20;
    double triad_s, fused_s, torch_s;
    {
      auto a = torch::zeros({n}), b = torch::rand({n}), c = torch::rand({n});
      triad_s = best_seconds(reps, [&] { triad(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), 3.0f, n); });
    }
    {
      auto p = torch::randn({n}), g = torch::randn({n}), mo = torch::zeros({n}), v = torch::zeros({n});
      int64_t step = 0;
      fused_s = best_seconds(reps, [&] {
        const auto co = zeroshard::optim::adamw_coeffs(1e-3, 0.9, 0.999, 1e-8, 0.01, ++step);
        zeroshard::optim::fused_adamw(co, p.data_ptr<float>(), g.data_ptr(), torch::kFloat, mo.data_ptr<float>(),
                                      v.data_ptr<float>(), n);
      });
    }
    {
      auto p = torch::randn({n}).set_requires_grad(true);
      p.mutable_grad() = torch::randn({n});
      torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
      torch_s = best_seconds(reps, [&] { opt.step(); });
    }
    const double tri_gbs = 12.0 * n / triad_s / 1e9, fused_gbs = 28.0 * n / fused_s / 1e9,
                 torch_gbs = 28.0 * n / torch_s / 1e9;
    const double tri16 = tri_gbs * 16.0 / 12.0;
    std::printf("| %dM | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.1f | %.1f | %.1fx |\n", m, tri_gbs, tri16,
                fused_s * 1e3, fused_gbs, fused_gbs / tri_gbs, fused_gbs / tri16, torch_s * 1e3, torch_gbs,
                torch_s / fused_s);
    std::fflush(stdout);
  }
  return 0;
}
