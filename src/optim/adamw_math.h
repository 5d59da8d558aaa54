// adamw_math.h — AdamW's arithmetic on one element, and the per-step
// coefficients, written once for every kernel: the CPU's scalar and SIMD loops
// (adamw_kernel.h) and the CUDA kernel (cuda/adamw.cu) compile these same
// functions, so a CUDA build without FMA contraction produces the CPU's bits,
// and the tests can run the device's arithmetic on the host.
//
// Everything here has internal linkage (see adamw_kernel.h: each ISA file
// compiles its own copy with its own -m flags).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ZS_HD __host__ __device__ __forceinline__
#else
#define ZS_HD inline
#endif

namespace zeroshard::optim::kernel {

// Kinds of the gradient input and of the optional 16-bit parameter copy.
enum class Half16 { kNone = 0, kBF16 = 1, kF16 = 2 };

// Per-step scalars (coeffs_of_step). The element update reads them in this form.
struct Coeffs {
  float decay = 1;  // 1 - lr * weight_decay
  float beta1 = 0.9f, one_minus_beta1 = 0.1f;
  float beta2 = 0.999f, one_minus_beta2 = 0.001f;
  float bias_correction2_sqrt = 1;  // sqrt(1 - beta2^step)
  float eps = 1e-8f;
  float neg_step_size = 0;  // -lr / (1 - beta1^step)
  float grad_scale = 1;     // 1/loss-scale x clip coefficient
};

// AdamW's hyperparameters: the coefficients of a step follow from these and the step number.
struct Hyper {
  double lr, beta1, beta2, eps, weight_decay;
};

namespace {

ZS_HD float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

ZS_HD uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  if (f != f) return 0x7FC0;  // NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>(u >> 16);
}

ZS_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      u = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3FFu) << 13);
    }
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

ZS_HD uint16_t float_to_f16(float f) {  // round to nearest even, as F16C does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) {  // inf or NaN
    return sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u | ((abs >> 13) & 0x3FFu) : 0u);
  }
  if (abs >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000u) {  // result is subnormal or zero
    const int shift = 113 - static_cast<int>(abs >> 23);  // value = man24 >> (shift + 13) subnormal units
    if (shift > 11) return sign;  // below 2^-25: rounds to zero (2^-25 itself ties to even 0)
    const uint32_t man = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t q = man >> (shift + 13);
    const uint32_t rem = man & ((1u << (shift + 13)) - 1);
    const uint32_t half = 1u << (shift + 12);
    uint32_t r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xFFFu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

ZS_HD float load_grad(const void* g, Half16 kind, int64_t i) {
  switch (kind) {
    case Half16::kBF16: return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
    case Half16::kF16: return f16_to_float(static_cast<const uint16_t*>(g)[i]);
    default: return static_cast<const float*>(g)[i];
  }
}

// One element's update in registers, torch::optim::AdamW's operations in its
// order: returns the new parameter and updates the moments `m` and `v`.
ZS_HD float adamw_update(const Coeffs& c, float param, float grad, float& m, float& v) {
  grad = grad * c.grad_scale;
  param = param * c.decay;
  m = m * c.beta1 + grad * c.one_minus_beta1;
  v = v * c.beta2 + c.one_minus_beta2 * grad * grad;
  const float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
  return param + c.neg_step_size * m / denom;
}

ZS_HD uint16_t to_half16(float x, Half16 kind) {
  return kind == Half16::kBF16 ? float_to_bf16(x) : float_to_f16(x);
}

// Element i of the arrays, the reference for every vector path.
ZS_HD void adamw_element(const Coeffs& c, float* p, const void* g, Half16 gk, float* m, float* v,
                         int64_t i, void* copy, Half16 ck) {
  p[i] = adamw_update(c, p[i], load_grad(g, gk, i), m[i], v[i]);
  if (ck != Half16::kNone) static_cast<uint16_t*>(copy)[i] = to_half16(p[i], ck);
}

// The coefficients of step `step` (>= 1), computed in double precision as
// torch::optim::AdamW does and rounded once to float. The CUDA kernel calls it
// with a step read on the device (so a step needs no host value).
ZS_HD Coeffs coeffs_of_step(const Hyper& h, double step, double grad_scale) {
  Coeffs c;
  c.decay = static_cast<float>(1 - h.lr * h.weight_decay);
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  const double bc1 = 1 - pow(h.beta1, step);
  const double bc2 = 1 - pow(h.beta2, step);
  c.bias_correction2_sqrt = static_cast<float>(sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-(h.lr / bc1));
  c.grad_scale = static_cast<float>(grad_scale);
  return c;
}

}  // namespace
}  // namespace zeroshard::optim::kernel
