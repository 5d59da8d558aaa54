// zeroshard/activation_checkpoint.h — activation checkpointing for LibTorch C++.
//
//   auto y = zeroshard::activation_checkpoint([&](const auto& in) { return std::vector{layer->forward(in[0])}; }, {x})[0];
//
// Runs `fn` without recording a graph (its intermediate activations are freed),
// and runs it again inside backward to compute the gradients (the inputs are
// kept, nothing else). The CPU random state is saved and restored around the
// recomputation, so dropout draws the same masks. A fully_shard unit inside
// `fn` is gathered again for the recomputation and reduces its gradients as
// usual. When no input requires grad, `fn` simply runs with the graph recorded
// (parameters inside would otherwise get no gradient).
//
// Thread-safety: as LibTorch's autograd.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace zeroshard {

using TensorList = std::vector<at::Tensor>;

TensorList activation_checkpoint(std::function<TensorList(const TensorList&)> fn, TensorList inputs);

// One tensor in, one out.
at::Tensor activation_checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input);

}  // namespace zeroshard
