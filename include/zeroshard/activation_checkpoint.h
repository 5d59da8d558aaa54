// zeroshard/activation_checkpoint.h — activation checkpointing for LibTorch C++.
//
//   h = zeroshard::activation_checkpoint(
//       [l = layer.ptr()](const torch::Tensor& x) { return l->forward(x); }, h);
//
// Runs `fn` without recording a graph (its intermediate activations are freed),
// and runs it again inside backward to compute the gradients (the inputs are
// kept, nothing else). The CPU random state is saved and restored around the
// recomputation, so dropout draws the same masks. A fully_shard unit inside
// `fn` is gathered again for the recomputation and reduces its gradients as
// usual. When no input requires grad, `fn` simply runs with the graph recorded
// (parameters inside would otherwise get no gradient).
//
// Thread-safety: as LibTorch's autograd. How it works: docs/fully-shard.md ("Activation
// checkpointing").
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace zeroshard {

using TensorList = std::vector<at::Tensor>;

// Several tensors in and out: `fn` gets `inputs` and returns its outputs.
TensorList activation_checkpoint(std::function<TensorList(const TensorList&)> fn, TensorList inputs);

// One tensor in, one out (the form the example above uses).
at::Tensor activation_checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input);

}  // namespace zeroshard
