// adamw_kernel.h — the AdamW element loop, written once over a vector-traits
// type and included by each ISA's translation unit (adamw_avx2.cpp, ...).
//
// Everything here has internal linkage: each ISA file compiles its own copy
// with its own -m flags, so no inline function compiled for AVX-512 can be
// picked by the linker for a caller on an AVX2-only CPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace zeroshard::optim::kernel {

// Kinds of the gradient input and of the optional 16-bit parameter copy.
enum class Half16 { kNone = 0, kBF16 = 1, kF16 = 2 };

struct Coeffs {  // mirror of AdamWCoeffs, kept free of other headers
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
      neg_step_size, grad_scale;
};

// Signature every ISA file exports.
using KernelFn = void (*)(const Coeffs& c, float* p, const void* g, Half16 grad_kind, float* m,
                          float* v, int64_t n, void* copy, Half16 copy_kind);

namespace {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t h) {
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

inline uint16_t float_to_f16(float f) {  // round to nearest even, as F16C does
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

inline float load_grad(const void* g, Half16 kind, int64_t i) {
  switch (kind) {
    case Half16::kBF16: return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
    case Half16::kF16: return f16_to_float(static_cast<const uint16_t*>(g)[i]);
    default: return static_cast<const float*>(g)[i];
  }
}

// One element, the reference for every vector path.
inline void adamw_element(const Coeffs& c, float* p, const void* g, Half16 gk, float* m, float* v,
                          int64_t i, void* copy, Half16 ck) {
  const float grad = load_grad(g, gk, i) * c.grad_scale;
  float param = p[i] * c.decay;
  const float mi = m[i] * c.beta1 + grad * c.one_minus_beta1;
  const float vi = v[i] * c.beta2 + c.one_minus_beta2 * grad * grad;
  const float denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
  param = param + c.neg_step_size * mi / denom;
  p[i] = param;
  m[i] = mi;
  v[i] = vi;
  if (ck == Half16::kBF16) static_cast<uint16_t*>(copy)[i] = float_to_bf16(param);
  if (ck == Half16::kF16) static_cast<uint16_t*>(copy)[i] = float_to_f16(param);
}

inline void adamw_scalar(const Coeffs& c, float* p, const void* g, Half16 gk, float* m, float* v,
                         int64_t begin, int64_t end, void* copy, Half16 ck) {
  for (int64_t i = begin; i < end; ++i) adamw_element(c, p, g, gk, m, v, i, copy, ck);
}

// V: vector traits (width, reg, load/store/set1/add/mul/div/sqrt, 16-bit loads/stores).
template <class V, Half16 GK, Half16 CK>
void adamw_vector(const Coeffs& c, float* p, const void* g, float* m, float* v, int64_t n, void* copy) {
  using R = typename V::reg;
  const R decay = V::set1(c.decay), b1 = V::set1(c.beta1), omb1 = V::set1(c.one_minus_beta1);
  const R b2 = V::set1(c.beta2), omb2 = V::set1(c.one_minus_beta2);
  const R bc2 = V::set1(c.bias_correction2_sqrt), eps = V::set1(c.eps);
  const R nss = V::set1(c.neg_step_size), gs = V::set1(c.grad_scale);
  int64_t i = 0;
  for (; i + V::width <= n; i += V::width) {
    R grad;
    if constexpr (GK == Half16::kBF16) {
      grad = V::load_bf16(static_cast<const uint16_t*>(g) + i);
    } else if constexpr (GK == Half16::kF16) {
      grad = V::load_f16(static_cast<const uint16_t*>(g) + i);
    } else {
      grad = V::load(static_cast<const float*>(g) + i);
    }
    grad = V::mul(grad, gs);
    R param = V::mul(V::load(p + i), decay);
    const R mi = V::add(V::mul(V::load(m + i), b1), V::mul(grad, omb1));
    const R vi = V::add(V::mul(V::load(v + i), b2), V::mul(V::mul(omb2, grad), grad));
    const R denom = V::add(V::div(V::sqrt(vi), bc2), eps);
    param = V::add(param, V::div(V::mul(nss, mi), denom));
    V::store(p + i, param);
    V::store(m + i, mi);
    V::store(v + i, vi);
    if constexpr (CK == Half16::kBF16) V::store_bf16(static_cast<uint16_t*>(copy) + i, param);
    if constexpr (CK == Half16::kF16) V::store_f16(static_cast<uint16_t*>(copy) + i, param);
  }
  adamw_scalar(c, p, g, GK, m, v, i, n, copy, CK);
}

template <class V, Half16 GK>
void adamw_copy_dispatch(const Coeffs& c, float* p, const void* g, float* m, float* v, int64_t n,
                         void* copy, Half16 ck) {
  switch (ck) {
    case Half16::kBF16: return adamw_vector<V, GK, Half16::kBF16>(c, p, g, m, v, n, copy);
    case Half16::kF16: return adamw_vector<V, GK, Half16::kF16>(c, p, g, m, v, n, copy);
    default: return adamw_vector<V, GK, Half16::kNone>(c, p, g, m, v, n, copy);
  }
}

template <class V>
void adamw_dispatch(const Coeffs& c, float* p, const void* g, Half16 gk, float* m, float* v, int64_t n,
                    void* copy, Half16 ck) {
  switch (gk) {
    case Half16::kBF16: return adamw_copy_dispatch<V, Half16::kBF16>(c, p, g, m, v, n, copy, ck);
    case Half16::kF16: return adamw_copy_dispatch<V, Half16::kF16>(c, p, g, m, v, n, copy, ck);
    default: return adamw_copy_dispatch<V, Half16::kNone>(c, p, g, m, v, n, copy, ck);
  }
}

}  // namespace

// Defined in adamw_avx2.cpp / adamw_avx512.cpp.
void adamw_avx2(const Coeffs& c, float* p, const void* g, Half16 gk, float* m, float* v, int64_t n,
                void* copy, Half16 ck);
void adamw_avx512(const Coeffs& c, float* p, const void* g, Half16 gk, float* m, float* v, int64_t n,
                  void* copy, Half16 ck);

}  // namespace zeroshard::optim::kernel
