// grad_norm.h — sum of squares of a flat gradient, accumulated in double.
//
// inf and NaN propagate (an overflowed gradient gives a non-finite sum), so the
// same pass serves gradient clipping and the loss scaler's overflow check.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace zeroshard::optim {

// REQUIRES: dtype is Float, BFloat16 or Half; data holds n elements of it.
double sum_of_squares(const void* data, c10::ScalarType dtype, int64_t n);

}  // namespace zeroshard::optim
