// adamw_segment.h — what one CUDA thread does in the fused AdamW kernel
// (adamw.cu), written as host-and-device functions so the tests run the
// device's indexing, 4-wide loads and tails on the host against the CPU kernel.
//
// The kernel updates pieces (segments) of flat arrays: the fp32 master, its
// gradient (fp32, bf16 or fp16), the two fp32 moments and, optionally, a 16-bit
// copy of the updated parameter written in the same pass. Thread t of T updates
// the quads t, t+T, t+2T, ... of a segment (4 elements each, when every
// array's first element is aligned for it), then its tail elements likewise.
#pragma once

#include "optim/adamw_math.h"

#include <cstdint>

namespace zeroshard::optim::kernel {

// The arrays one launch updates (device pointers in the kernel).
struct Arrays {
  float* param = nullptr;          // fp32 master
  const void* grad = nullptr;      // grad_kind
  Half16 grad_kind = Half16::kNone;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* copy = nullptr;            // copy_kind; nullptr when copy_kind is kNone
  Half16 copy_kind = Half16::kNone;
};

// Elements [begin, begin + size) of every array, updated with coefficient set `coeffs`.
struct Segment {
  int64_t begin = 0;
  int64_t size = 0;
  int32_t coeffs = 0;
};

namespace {

struct alignas(16) Float4 {
  float v[4];
};
struct alignas(8) Half4 {
  uint16_t v[4];
};

ZS_HD bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Whether quads starting at element `begin` are aligned in every array.
ZS_HD bool quads_aligned(const Arrays& a, int64_t begin) {
  const uintptr_t gbytes = a.grad_kind == Half16::kNone ? 16 : 8;
  const size_t gsize = a.grad_kind == Half16::kNone ? 4 : 2;
  return aligned_to(a.param + begin, 16) && aligned_to(a.exp_avg + begin, 16) &&
         aligned_to(a.exp_avg_sq + begin, 16) &&
         aligned_to(static_cast<const char*>(a.grad) + begin * gsize, gbytes) &&
         (a.copy_kind == Half16::kNone || aligned_to(static_cast<uint16_t*>(a.copy) + begin, 8));
}

// Elements i .. i+3: one 16-byte load and store per fp32 array, 8 bytes per 16-bit one.
template <Half16 GK, Half16 CK>
ZS_HD void update_quad(const Coeffs& c, const Arrays& a, int64_t i) {
  Float4 p = *reinterpret_cast<const Float4*>(a.param + i);
  Float4 m = *reinterpret_cast<const Float4*>(a.exp_avg + i);
  Float4 v = *reinterpret_cast<const Float4*>(a.exp_avg_sq + i);
  float g[4];
  if constexpr (GK == Half16::kNone) {
    const Float4 g4 = *reinterpret_cast<const Float4*>(static_cast<const float*>(a.grad) + i);
    for (int k = 0; k < 4; ++k) g[k] = g4.v[k];
  } else {
    const Half4 g4 = *reinterpret_cast<const Half4*>(static_cast<const uint16_t*>(a.grad) + i);
    for (int k = 0; k < 4; ++k) g[k] = GK == Half16::kBF16 ? bf16_to_float(g4.v[k]) : f16_to_float(g4.v[k]);
  }
  for (int k = 0; k < 4; ++k) p.v[k] = adamw_update(c, p.v[k], g[k], m.v[k], v.v[k]);
  *reinterpret_cast<Float4*>(a.param + i) = p;
  *reinterpret_cast<Float4*>(a.exp_avg + i) = m;
  *reinterpret_cast<Float4*>(a.exp_avg_sq + i) = v;
  if constexpr (CK != Half16::kNone) {
    Half4 h;
    for (int k = 0; k < 4; ++k) h.v[k] = to_half16(p.v[k], CK);
    *reinterpret_cast<Half4*>(static_cast<uint16_t*>(a.copy) + i) = h;
  }
}

// Thread `thread` of `threads`' share of `seg`.
template <Half16 GK, Half16 CK>
ZS_HD void update_segment(const Coeffs& c, const Arrays& a, const Segment& seg, int64_t thread, int64_t threads) {
  const int64_t end = seg.begin + seg.size;
  int64_t tail = seg.begin;
  if (quads_aligned(a, seg.begin)) {
    tail = seg.begin + seg.size / 4 * 4;
    for (int64_t i = seg.begin + 4 * thread; i < tail; i += 4 * threads) update_quad<GK, CK>(c, a, i);
  }
  for (int64_t i = tail + thread; i < end; i += threads) {
    adamw_element(c, a.param, a.grad, GK, a.exp_avg, a.exp_avg_sq, i, a.copy, CK);
  }
}

}  // namespace
}  // namespace zeroshard::optim::kernel
