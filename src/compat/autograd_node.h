// autograd_node.h — creating a custom autograd Node the way each LibTorch
// version's engine expects. Part of src/compat.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/version.h>

#include <memory>
#include <type_traits>

namespace zeroshard::compat {

// How the graph holds a node: std::shared_ptr in 1.13 and older 2.x,
// c10::intrusive_ptr in newer 2.x.
using NodeRef = decltype(torch::autograd::Edge::function);

// A new T (an autograd Node), held the way the graph holds nodes. LibTorch
// 1.13 wants its deleteNode deleter (which frees long chains of nodes without
// deep recursion); 2.x frees nodes iteratively itself.
template <class T>
auto make_autograd_node() {
#if TORCH_VERSION_MAJOR < 2
  return std::shared_ptr<T>(new T(), torch::autograd::deleteNode);
#else
  if constexpr (std::is_same_v<NodeRef, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
#endif
}

}  // namespace zeroshard::compat
