// grad_norm.h — sum of squares of a flat gradient, accumulated in double.
//
// inf and NaN propagate (an overflowed gradient gives a non-finite sum), so the
// same pass serves gradient clipping and the loss scaler's overflow check.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace zeroshard::optim {

// REQUIRES: dtype is Float, BFloat16 or Half; data holds n elements of it.
double sum_of_squares(const void* data, c10::ScalarType dtype, int64_t n);

// Over several contiguous tensors on any devices (undefined ones skipped): CPU
// ones by the function above; device ones as fp32 norms there (as
// torch.nn.utils.clip_grad_norm_), squared and summed in double on the device,
// read back once per device (the value goes to the control plane).
double sum_of_squares(const std::vector<at::Tensor>& tensors);

// A sum in two parts: what is known on the host, and double scalars still on
// their devices (added to it when read). Several of them are read together by
// read_sums(), in one copy per device: one stop of the host, not one per value.
struct PendingSum {
  double host = 0;
  std::vector<at::Tensor> device;  // double scalars
  // this += factor * other (device parts scaled on their devices)
  void add(const PendingSum& other, double factor = 1.0);
};

// sum_of_squares(tensors) without reading the device parts.
PendingSum pending_sum_of_squares(const std::vector<at::Tensor>& tensors);

// The value of each of `sums`: every device part read in one copy per device.
std::vector<double> read_sums(const std::vector<PendingSum>& sums);

}  // namespace zeroshard::optim
