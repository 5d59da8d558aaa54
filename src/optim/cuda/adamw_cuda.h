// adamw_cuda.h — the fused AdamW kernel on a CUDA device (adamw.cu).
//
// One pass over pieces of flat arrays (adamw_segment.h): read the fp32 master,
// the gradient and both moments, write them back and, when asked, a bf16/fp16
// copy of the updated parameter. Bytes per element: 28 with an fp32 gradient
// (16 read, 12 written), 26 with a 16-bit one, plus 2 for a 16-bit copy.
// The arithmetic is adamw_math.h's, compiled without FMA contraction: the
// device writes the bits the CPU kernel writes.
//
// Device-side scalars make a step free of host synchronisation (and capturable
// in a CUDA graph): the gradient multiplier and the skip flag of a loss-scaled
// step, and for adamw_device_step() the step number itself.
//
// Thread-safety: the functions only enqueue work on `stream`; the caller keeps
// every array alive until that work has run.
#pragma once

#include "optim/cuda/adamw_segment.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace zeroshard::optim::cuda {

using kernel::Arrays;
using kernel::Coeffs;
using kernel::Hyper;
using kernel::Segment;

// Segments and coefficient sets one launch takes (adamw() launches as often as needed).
constexpr int kMaxSegments = 64;
constexpr int kMaxCoeffSets = 8;

// Scalars the kernel reads on the device; each optional (nullptr: unused).
struct DeviceScalars {
  const float* grad_scale = nullptr;  // multiplies every gradient, after Coeffs::grad_scale
  const float* found_inf = nullptr;   // > 0: the launch writes nothing (a skipped step)
};

// Updates `segments` (each naming one of `coeffs`), coefficients computed on the host.
// REQUIRES: n_segments <= kMaxSegments, n_coeffs <= kMaxCoeffSets, segments disjoint,
//           every segment's coeffs < n_coeffs; arrays on the stream's device.
cudaError_t adamw(const Arrays& arrays, const Segment* segments, int n_segments, const Coeffs* coeffs,
                  int n_coeffs, const DeviceScalars& scalars, cudaStream_t stream);

// Updates elements [0, n) with the coefficients of step *step (a float on the
// device, as torch keeps it; the caller increments it) from `hyper`.
cudaError_t adamw_device_step(const Arrays& arrays, int64_t n, const Hyper& hyper, const float* step,
                              const DeviceScalars& scalars, cudaStream_t stream);

}  // namespace zeroshard::optim::cuda
