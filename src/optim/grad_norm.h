// grad_norm.h — sum of squares of a flat gradient, accumulated in double.
//
// inf and NaN propagate (an overflowed gradient gives a non-finite sum), so the
// same pass serves gradient clipping and the loss scaler's overflow check.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace zeroshard::optim {

// REQUIRES: dtype is Float, BFloat16 or Half; data holds n elements of it.
double sum_of_squares(const void* data, c10::ScalarType dtype, int64_t n);

// Of a contiguous tensor on any device: on the CPU the function above; on a
// device its norm in fp32 there (as torch.nn.utils.clip_grad_norm_), squared in
// double. Waits for the device (the value goes to the control plane).
double sum_of_squares(const at::Tensor& t);

}  // namespace zeroshard::optim
