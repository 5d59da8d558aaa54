// end_of_backward.h — run something when the current backward pass ends,
// and something else if it ends with an exception instead.
//
// Autograd's final callbacks run after the last node of a backward pass; when
// backward throws, the callback is dropped without running. The token carried
// by the callback notices that in its destructor. Both functions run with grad
// mode off. REQUIRES: called during backward (from an autograd hook).
#pragma once

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>

#include <functional>
#include <memory>
#include <utility>

namespace zeroshard::shard {

inline void on_end_of_backward(std::function<void()> on_end, std::function<void()> on_abandoned) {
  struct Token {
    std::function<void()> abandoned;
    bool ran = false;
    ~Token() {
      if (!ran && abandoned) abandoned();
    }
  };
  auto token = std::make_shared<Token>();
  token->abandoned = std::move(on_abandoned);
  torch::autograd::Engine::get_default_engine().queue_callback([token, end = std::move(on_end)] {
    token->ran = true;
    at::NoGradGuard no_grad;
    end();
  });
}

}  // namespace zeroshard::shard
