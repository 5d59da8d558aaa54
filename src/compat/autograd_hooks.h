// autograd_hooks.h — the two moments of a backward pass the sharding code acts
// on: "this parameter's gradient is complete" and "the backward pass ended".
// Part of src/compat: how LibTorch exposes them differs between versions.
//
// Gradient ready: a post hook on the parameter's gradient accumulator, which
// LibTorch 1.13 and 2.x both offer (2.1's register_post_accumulate_grad_hook is
// a single slot per tensor that replaces an earlier hook, so it is not used).
// End of backward: an autograd final callback; when backward throws the
// callback is dropped without running, which the token it carries notices.
// Thread-safety: hooks and callbacks run on autograd's threads.
#pragma once

#include "compat/autograd_node.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>

namespace zeroshard::compat {

// Removes its hook when destroyed (or on remove()). Move-only.
class GradReadyHook {
 public:
  GradReadyHook() = default;
  // Runs `fn` (with grad mode off) each time a backward pass has accumulated
  // `param`'s gradient. `what` names the parameter in the error thrown when
  // it has no gradient accumulator (it is not a leaf that requires grad).
  // The accumulator is created now, with the parameter's current shape.
  GradReadyHook(const at::Tensor& param, std::function<void()> fn, const std::string& what);
  // Also runs `before` each time, before the accumulator adds the pass's
  // gradient into p.grad() (a pre hook on the same accumulator).
  GradReadyHook(const at::Tensor& param, std::function<void()> fn, std::function<void()> before,
                const std::string& what);
  ~GradReadyHook() { remove(); }
  GradReadyHook(GradReadyHook&& other) noexcept;
  GradReadyHook& operator=(GradReadyHook&& other) noexcept;
  GradReadyHook(const GradReadyHook&) = delete;
  GradReadyHook& operator=(const GradReadyHook&) = delete;

  void remove();

 private:
  NodeRef node_;
  uintptr_t key_ = 0;
  const void* pre_hook_ = nullptr;  // identifies the pre hook among the node's
};

// Runs `on_end` when the current backward pass ends, or `on_abandoned` if it
// ends with an exception instead. Both run with grad mode off.
// REQUIRES: called during backward (from an autograd hook).
void on_end_of_backward(std::function<void()> on_end, std::function<void()> on_abandoned);

}  // namespace zeroshard::compat
