// optim_bench: one AdamW step over n fp32 elements, in one process:
//   ceiling  AdamW's memory traffic without its arithmetic: read p, g, m, v and
//            write p, m, v (one XOR each, so nothing is elided), vectorized for
//            the widest ISA the CPU has: the physical limit of the access pattern
//   fused    zeroshard's fused kernel (SIMD path chosen at run time)
//   PyTorch  at::_fused_adamw_, the kernel of torch.optim.AdamW(fused=True) (LibTorch 2.x)
//   torch    torch::optim::AdamW::step on one parameter of n elements (C++)
//   triad    STREAM triad a = b + s*c (12 B/element counted, STREAM's convention)
// Ours use at::parallel_for with the fused kernel's grain. The kernels take turns
// (best of --reps each), so they see the same memory bandwidth. Bandwidth counts
// 28 B/element for AdamW and the ceiling (their real traffic: they write only
// what they read). Prints "ROW | threads | elements | stack | ms | GB/s |" lines,
// which bench/optim_bench.sh puts beside PyTorch's (bench/optim_peer.py).
//
//   bench/optim_bench [--min-m 16] [--max-m 128] [--reps 11] [--threads N]
//
// With --device cuda (a CUDA build, on a GPU), the same step on the device:
//   copy     a device-to-device copy of n fp32 (8 B/element: read + write), the
//            bandwidth the goal is measured against
//   fused    zeroshard's CUDA kernel: fp32 gradient (28 B), and fp32 master +
//            bf16 gradient + bf16 parameter copy written in the same pass (28 B)
//   PyTorch  at::_fused_adamw_ (fp32, 28 B), what torch.optim.AdamW(fused=True) runs
// Each row also gives its GB/s divided by the copy's ("of copy").
#include "optim/fused_adamw.h"
#ifdef ZS_WITH_CUDA
#include "optim/cuda/fused_adamw_cuda.h"
#endif

#include <CLI/CLI.hpp>
#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

namespace optim_bench {

// STREAM's rule: the best of `reps` timed runs of each, after one warm-up each
// (page faults, thread pool start). The kernels take turns, so a change in the
// machine's memory bandwidth during the run reaches every kernel alike.
std::vector<double> best_seconds(int reps, const std::vector<std::function<void()>>& kernels) {
  for (const auto& f : kernels) f();
  std::vector<double> best(kernels.size(), 1e30);
  for (int i = 0; i < reps; ++i) {
    for (size_t k = 0; k < kernels.size(); ++k) {
      const auto start = std::chrono::steady_clock::now();
      kernels[k]();
      best[k] = std::min(best[k], std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  return best;
}

// The ceiling (see the top): AdamW's reads and writes, one XOR per write.
__attribute__((target_clones("avx512f", "avx2", "default"))) void read4_write3(
    uint32_t* __restrict p, const uint32_t* __restrict g, uint32_t* __restrict m, uint32_t* __restrict v,
    int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t x = g[i];
    p[i] ^= x;
    m[i] ^= x;
    v[i] ^= x;
  }
}

void ceiling(float* p, const float* g, float* m, float* v, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    read4_write3(reinterpret_cast<uint32_t*>(p) + begin, reinterpret_cast<const uint32_t*>(g) + begin,
                 reinterpret_cast<uint32_t*>(m) + begin, reinterpret_cast<uint32_t*>(v) + begin, end - begin);
  });
}

void triad(float* __restrict a, const float* __restrict b, const float* __restrict c, float s, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
  });
}

#ifdef ZS_WITH_CUDA
// The device rows (see the top); every kernel synchronises before its clock stops.
int run_cuda(int min_m, int max_m, int reps) {
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "optim_bench --device cuda: no CUDA device on this machine\n");
    return 1;
  }
  std::printf("optim_bench: CUDA device 0, best of %d\n", reps);
  torch::NoGradGuard no_grad;
  const auto dev = torch::TensorOptions().device(torch::kCUDA);
  for (int m = min_m; m <= max_m; m *= 2) {
    const int64_t n = static_cast<int64_t>(m) << 20;
    auto src = torch::randn({n}, dev), dst = torch::empty({n}, dev);
    auto state = [&](c10::ScalarType gdt) {
      return std::vector<torch::Tensor>{torch::randn({n}, dev), torch::randn({n}, dev).to(gdt),
                                        torch::zeros({n}, dev), torch::zeros({n}, dev)};
    };
    auto z = state(torch::kFloat), zb = state(torch::kBFloat16), pt = state(torch::kFloat);
    auto copy16 = torch::empty({n}, dev.dtype(torch::kBFloat16));
    auto pt_step = torch::zeros({}, dev);
    int64_t step = 0, step_b = 0;
    auto sync = [](const std::function<void()>& f) { return [f] { f(); torch::cuda::synchronize(); }; };
    const std::vector<std::pair<std::string, double>> rows{
        {"device-to-device copy (8 B: read + write)", 8},
        {"zeroshard CUDA AdamW, fp32 gradient", 28},
        {"zeroshard CUDA AdamW, fp32 master + bf16 gradient + bf16 copy", 28},
        {"PyTorch at::_fused_adamw_ (fp32)", 28}};
    const std::vector<std::function<void()>> kernels{
        sync([&] { dst.copy_(src); }),
        sync([&] {
          zeroshard::optim::fused_adamw_cuda({{0, n, zeroshard::optim::adamw_coeffs(1e-3, 0.9, 0.999, 1e-8, 0.01, ++step)}},
                                             z[0], z[1], z[2], z[3]);
        }),
        sync([&] {
          zeroshard::optim::fused_adamw_cuda(
              {{0, n, zeroshard::optim::adamw_coeffs(1e-3, 0.9, 0.999, 1e-8, 0.01, ++step_b)}}, zb[0], zb[1], zb[2],
              zb[3], copy16);
        }),
        sync([&] {
          pt_step += 1;
          at::_fused_adamw_({pt[0]}, {pt[1]}, {pt[2]}, {pt[3]}, {}, {pt_step}, 1e-3, 0.9, 0.999, 0.01, 1e-8,
                            /*amsgrad=*/false, /*maximize=*/false);
        })};
    torch::cuda::synchronize();
    const auto best = best_seconds(reps, kernels);
    const double copy_gbs = rows[0].second * static_cast<double>(n) / best[0] / 1e9;
    for (size_t k = 0; k < rows.size(); ++k) {
      const double gbs = rows[k].second * static_cast<double>(n) / best[k] / 1e9;
      std::printf("ROW | cuda | %dM | %s | %.3f | %.1f | %.2f of copy |\n", m, rows[k].first.c_str(), best[k] * 1e3,
                  gbs, gbs / copy_gbs);
    }
    std::fflush(stdout);
  }
  return 0;
}
#endif

}  // namespace optim_bench

int optim_bench_main(int argc, char** argv) {
  using namespace optim_bench;
  int min_m = 16, max_m = 128, reps = 11;
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  CLI::App app{"AdamW step: fused kernel vs its memory-traffic ceiling, torch::optim::AdamW and STREAM triad"};
  app.add_option("--min-m", min_m, "smallest size, millions of elements (x 2^20)")->capture_default_str();
  app.add_option("--max-m", max_m, "largest size, millions of elements (x 2^20)")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (best reported, as STREAM does)")->capture_default_str();
  app.add_option("--threads", threads, "threads for all four (default: every core)")->capture_default_str();
  std::string device = "cpu";
  app.add_option("--device", device, "cpu, or cuda (the CUDA kernel against a device copy and PyTorch's)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (device == "cuda") {
#ifdef ZS_WITH_CUDA
    return run_cuda(min_m, max_m, reps);
#else
    std::fprintf(stderr, "optim_bench --device cuda: this zeroshard was built without CUDA\n");
    return 1;
#endif
  }
  at::set_num_threads(std::max(1, threads));
  threads = at::get_num_threads();

  std::printf("optim_bench: %d threads, SIMD %s, best of %d\n", threads,
              zeroshard::optim::to_string(zeroshard::optim::default_simd()).c_str(), reps);
  auto row = [&](int m, const char* stack, double seconds, double bytes_per_element) {
    const double gbs = bytes_per_element * (static_cast<double>(m) * (1 << 20)) / seconds / 1e9;
    std::printf("ROW | %d | %dM | %s | %.1f | %.1f |\n", threads, m, stack, seconds * 1e3, gbs);
    std::fflush(stdout);
  };
  torch::NoGradGuard no_grad;
  for (int m = min_m; m <= max_m; m *= 2) {
    const int64_t n = static_cast<int64_t>(m) << 20;
    // Each kernel its own arrays (the ceiling's XORs would turn AdamW's inputs into
    // arbitrary bit patterns).
    auto state = [n] { return std::vector<torch::Tensor>{torch::randn({n}), torch::randn({n}), torch::zeros({n}), torch::zeros({n})}; };
    auto c = state(), z = state(), pt = state();
    auto t = state();
    t[0].set_requires_grad(true);
    t[0].mutable_grad() = t[1];
    torch::optim::AdamW opt({t[0]}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    auto a = torch::zeros({n}), b = torch::rand({n}), tc = torch::rand({n});
    int64_t step = 0;
    std::vector<std::pair<std::string, double>> rows{{"ceiling: read p, g, m, v, write p, m, v (no arithmetic)", 28},
                                                     {"zeroshard fused AdamW", 28}};
    std::vector<std::function<void()>> kernels{
        [&] { ceiling(c[0].data_ptr<float>(), c[1].data_ptr<float>(), c[2].data_ptr<float>(), c[3].data_ptr<float>(), n); },
        [&] {
          const auto co = zeroshard::optim::adamw_coeffs(1e-3, 0.9, 0.999, 1e-8, 0.01, ++step);
          zeroshard::optim::fused_adamw(co, z[0].data_ptr<float>(), z[1].data_ptr(), torch::kFloat,
                                        z[2].data_ptr<float>(), z[3].data_ptr<float>(), n);
        }};
#if TORCH_VERSION_MAJOR >= 2
    // PyTorch's fused CPU kernel, as torch.optim.AdamW(fused=True) calls it (LibTorch 2.x).
    auto pt_step = torch::zeros({}, torch::kFloat);
    rows.emplace_back("PyTorch's fused kernel (at::_fused_adamw_, what AdamW(fused=True) runs)", 28);
    kernels.emplace_back([&] {
      pt_step += 1;
      at::_fused_adamw_({pt[0]}, {pt[1]}, {pt[2]}, {pt[3]}, {}, {pt_step}, 1e-3, 0.9, 0.999, 0.01, 1e-8,
                        /*amsgrad=*/false, /*maximize=*/false);
    });
#endif
    rows.emplace_back("torch::optim::AdamW (C++)", 28);
    kernels.emplace_back([&] { opt.step(); });
    rows.emplace_back("STREAM triad (12 B counted)", 12);
    kernels.emplace_back([&] { triad(a.data_ptr<float>(), b.data_ptr<float>(), tc.data_ptr<float>(), 3.0f, n); });
    const auto best = best_seconds(reps, kernels);
    for (size_t k = 0; k < rows.size(); ++k) row(m, rows[k].first.c_str(), best[k], rows[k].second);
  }
  return 0;
}
