// adamw_kernel.h — the AdamW element loop, written once over a vector-traits
// type and included by each ISA's translation unit (adamw_avx2.cpp, ...).
//
// Everything here has internal linkage: each ISA file compiles its own copy
// with its own -m flags, so no inline function compiled for AVX-512 can be
// picked by the linker for a caller on an AVX2-only CPU.
#pragma once

#include "optim/adamw_math.h"

#include <cstdint>

namespace zeroshard::optim::kernel {

// Signature every ISA file exports.
using KernelFn = void (*)(const Coeffs& c, float* p, const void* g, Half16 grad_kind, float* m,
                          float* v, int64_t n, void* copy, Half16 copy_kind);

namespace {

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
