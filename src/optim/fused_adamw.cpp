#include "optim/fused_adamw.h"

#include "optim/adamw_kernel.h"
#include "zeroshard/optim_options.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <cstdlib>

namespace zeroshard::optim {
namespace {

std::atomic<int> chosen{-1};  // a SimdLevel set by set_adamw_simd(); -1: the CPU's best

kernel::Half16 half_kind(c10::ScalarType t, const char* what) {
  switch (t) {
    case c10::ScalarType::Float: return kernel::Half16::kNone;
    case c10::ScalarType::BFloat16: return kernel::Half16::kBF16;
    case c10::ScalarType::Half: return kernel::Half16::kF16;
    default:
      TORCH_CHECK_VALUE(false, "fused_adamw: ", what, " dtype ", c10::toString(t),
                        " is not supported; use Float, BFloat16 or Half");
  }
}

bool cpu_has(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar: return true;
    case SimdLevel::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case SimdLevel::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("f16c");
  }
  return false;
}

// Elements per parallel chunk: ~450 KB of traffic, a multiple of every vector width.
constexpr int64_t kGrain = 1 << 14;

}  // namespace

std::string to_string(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar: return "scalar";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kAvx512: return "avx512";
  }
  return "?";
}

SimdLevel detected_simd() {
  if (cpu_has(SimdLevel::kAvx512)) return SimdLevel::kAvx512;
  if (cpu_has(SimdLevel::kAvx2)) return SimdLevel::kAvx2;
  return SimdLevel::kScalar;
}

SimdLevel default_simd() {
  const int c = chosen.load(std::memory_order_relaxed);
  return c < 0 ? detected_simd() : static_cast<SimdLevel>(c);
}

AdamWCoeffs adamw_coeffs(double lr, double beta1, double beta2, double eps, double weight_decay,
                         int64_t step, double grad_scale) {
  TORCH_CHECK_VALUE(step >= 1, "adamw_coeffs: step is ", step, "; the first step is 1");
  return kernel::coeffs_of_step({lr, beta1, beta2, eps, weight_decay}, static_cast<double>(step), grad_scale);
}

void fused_adamw(const AdamWCoeffs& c, float* param, const void* grad, c10::ScalarType grad_dtype,
                 float* exp_avg, float* exp_avg_sq, int64_t n, void* param_copy,
                 c10::ScalarType copy_dtype, SimdLevel level) {
  const kernel::Half16 gk = half_kind(grad_dtype, "gradient");
  kernel::Half16 ck = kernel::Half16::kNone;
  if (param_copy != nullptr) {
    ck = half_kind(copy_dtype, "parameter copy");
    TORCH_CHECK_VALUE(ck != kernel::Half16::kNone, "fused_adamw: the parameter copy must be BFloat16 or Half");
  }
  TORCH_CHECK_VALUE(cpu_has(level), "fused_adamw: SIMD level ", to_string(level), " is not available on this CPU");
  const size_t gsize = gk == kernel::Half16::kNone ? 4 : 2;
  auto run = [&](int64_t begin, int64_t end) {
    const int64_t len = end - begin;
    const void* g = static_cast<const char*>(grad) + begin * gsize;
    void* copy = param_copy ? static_cast<char*>(param_copy) + begin * 2 : nullptr;
    switch (level) {
      case SimdLevel::kAvx512:
        kernel::adamw_avx512(c, param + begin, g, gk, exp_avg + begin, exp_avg_sq + begin, len, copy, ck);
        break;
      case SimdLevel::kAvx2:
        kernel::adamw_avx2(c, param + begin, g, gk, exp_avg + begin, exp_avg_sq + begin, len, copy, ck);
        break;
      case SimdLevel::kScalar:
        kernel::adamw_scalar(c, param + begin, g, gk, exp_avg + begin, exp_avg_sq + begin, 0, len, copy, ck);
        break;
    }
  };
  if (n <= kGrain) {
    run(0, n);
  } else {
    at::parallel_for(0, n, kGrain, run);
  }
}

}  // namespace zeroshard::optim

namespace zeroshard {

void set_adamw_simd(const std::string& isa) {
  using optim::SimdLevel;
  if (isa.empty()) {
    optim::chosen = -1;
    return;
  }
  SimdLevel want;
  if (isa == "scalar") {
    want = SimdLevel::kScalar;
  } else if (isa == "avx2") {
    want = SimdLevel::kAvx2;
  } else if (isa == "avx512") {
    want = SimdLevel::kAvx512;
  } else {
    TORCH_CHECK_VALUE(false, "set_adamw_simd: '", isa, "' is not one of scalar, avx2, avx512 (or \"\" for the "
                      "best this CPU has)");
  }
  TORCH_CHECK_VALUE(optim::cpu_has(want), "set_adamw_simd: '", isa, "' but this CPU lacks it (best available: ",
                    optim::to_string(optim::detected_simd()), ")");
  optim::chosen = static_cast<int>(want);
}

}  // namespace zeroshard
