// zeroshard/pipeline_payload.h — what a pipeline stage takes and returns for one microbatch.
//
// A payload is named tensors in a fixed order: the activations a stage hands
// the next (and, backward, their gradients). Both sides of a stage boundary
// compute its spec (names, shapes, dtypes) from the microbatch, so a stage
// that returns something else is named at once.
//
// Thread-safety: values and pure functions.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

namespace zeroshard::pipeline {

using Payload = std::vector<std::pair<std::string, at::Tensor>>;

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::string describe() const;  // "hidden [4, 16, 64] Float"
  bool operator==(const TensorSpec& o) const { return name == o.name && shape == o.shape && dtype == o.dtype; }
};
using PayloadSpec = std::vector<TensorSpec>;
PayloadSpec spec_of(const Payload& payload);
std::string describe(const PayloadSpec& spec);  // "{hidden [4, 16, 64] Float, mask [4, 16] Long}"

// Throws unless `payload` has the spec `expected`, naming `what` ("stage 1's
// output of microbatch 3") and the first tensor that differs.
void check_payload(const Payload& payload, const PayloadSpec& expected, const std::string& what);

}  // namespace zeroshard::pipeline
