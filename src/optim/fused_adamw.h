// fused_adamw.h — one memory-bound pass of AdamW over a flat fp32 shard.
//
// Per element: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg,
// exp_avg_sq (28 bytes in fp32), and optionally a 16-bit copy of the updated
// parameter (mixed precision). The math is torch::optim::AdamW's, operation
// for operation:
//   g  = grad * grad_scale                       (grad_scale: 1/loss-scale × clip coefficient)
//   p  = p * (1 - lr * weight_decay)             (decoupled weight decay)
//   m  = m * beta1 + g * (1 - beta1)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p  = p + (-lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// Multiplications and additions are never fused (no FMA), so the scalar, AVX2
// and AVX-512 paths produce identical bits.
//
// SIMD: AVX-512 or AVX2 chosen at run time from the CPU (set_adamw_simd() in
// zeroshard/optim_options.h forces a path; a path the CPU lacks is an
// error). Threads: at::parallel_for over chunks (at::get_num_threads(), i.e.
// OMP_NUM_THREADS).
#pragma once

#include "optim/adamw_math.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace zeroshard::optim {

enum class SimdLevel { kScalar, kAvx2, kAvx512 };
std::string to_string(SimdLevel level);

// The best level this CPU supports.
SimdLevel detected_simd();
// The level set_adamw_simd() chose, else detected_simd().
SimdLevel default_simd();

// Per-step scalars, computed once in double precision as torch::optim::AdamW does.
using AdamWCoeffs = kernel::Coeffs;
// REQUIRES: step >= 1.
AdamWCoeffs adamw_coeffs(double lr, double beta1, double beta2, double eps, double weight_decay,
                         int64_t step, double grad_scale = 1.0);

// Updates n elements in place. `grad` has dtype grad_dtype (Float, BFloat16 or
// Half). When `param_copy` is non-null, the updated parameter is also written
// there as copy_dtype (BFloat16 or Half, round to nearest even).
// REQUIRES: no two of the arrays overlap.
void fused_adamw(const AdamWCoeffs& c, float* param, const void* grad, c10::ScalarType grad_dtype,
                 float* exp_avg, float* exp_avg_sq, int64_t n, void* param_copy = nullptr,
                 c10::ScalarType copy_dtype = c10::ScalarType::Undefined, SimdLevel level = default_simd());

}  // namespace zeroshard::optim
