// fused_adamw_cuda.h — fused_adamw (optim/fused_adamw.h) for tensors on a CUDA
// device: the kernel of adamw_cuda.h behind tensor arguments.
//
// Work is enqueued on the current CUDA stream of the tensors' device (as an
// ATen op would be); nothing waits on the host. The caller keeps the tensors
// alive until that stream has run it (ATen's caching allocator does so for
// tensors used on their own stream).
#pragma once

#include "optim/cuda/adamw_cuda.h"
#include "optim/fused_adamw.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace zeroshard::optim {

// Elements [begin, begin + size) of the flat arrays and their coefficients.
struct AdamWPiece {
  int64_t begin = 0;
  int64_t size = 0;
  AdamWCoeffs coeffs;
};

// AdamW over `pieces` of `master` (fp32) with `grad` (fp32, bf16 or fp16) and
// the fp32 moments, in one launch per 64 pieces; when `copy` is defined (bf16 or
// fp16) the updated parameter is also written there, rounded to nearest even.
// `scalars` (device pointers, optional) scale the gradient and skip the step.
// REQUIRES: every tensor contiguous, 1-D, of master's numel, on one CUDA device;
//           pieces disjoint and inside it.
void fused_adamw_cuda(const std::vector<AdamWPiece>& pieces, const at::Tensor& master, const at::Tensor& grad,
                      const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const at::Tensor& copy = {},
                      const cuda::DeviceScalars& scalars = {});

// AdamW over all of `master` with the coefficients of step `step` (a one-element
// fp32 tensor on the device, incremented by the caller) computed on the device:
// no host value changes between steps, so a CUDA graph can capture it.
void fused_adamw_cuda_step(const kernel::Hyper& hyper, const at::Tensor& step, const at::Tensor& master,
                           const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                           const at::Tensor& copy = {}, const cuda::DeviceScalars& scalars = {});

}  // namespace zeroshard::optim
