#include "compat/autograd_hooks.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <utility>

namespace zeroshard::compat {
namespace {

class PostAccumulateHook : public torch::autograd::FunctionPostHook {
 public:
  explicit PostAccumulateHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    at::NoGradGuard no_grad;  // what the hook does is never part of a graph (create_graph=true)
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

class PreAccumulateHook : public torch::autograd::FunctionPreHook {
 public:
  explicit PreAccumulateHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    at::NoGradGuard no_grad;
    fn_();
    return grads;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

GradReadyHook::GradReadyHook(const at::Tensor& param, std::function<void()> fn, const std::string& what)
    : GradReadyHook(param, std::move(fn), nullptr, what) {}

GradReadyHook::GradReadyHook(const at::Tensor& param, std::function<void()> fn, std::function<void()> before,
                             const std::string& what)
    : node_(torch::autograd::impl::grad_accumulator(param)) {
  TORCH_CHECK(node_, what, " has no gradient accumulator; is it a leaf tensor that requires grad?");
  key_ = node_->add_post_hook(std::make_unique<PostAccumulateHook>(std::move(fn)));
  if (before) {
    auto hook = std::make_unique<PreAccumulateHook>(std::move(before));
    pre_hook_ = hook.get();
    node_->add_pre_hook(std::move(hook));
  }
}

GradReadyHook::GradReadyHook(GradReadyHook&& other) noexcept
    : node_(std::move(other.node_)), key_(std::exchange(other.key_, 0)),
      pre_hook_(std::exchange(other.pre_hook_, nullptr)) {}

GradReadyHook& GradReadyHook::operator=(GradReadyHook&& other) noexcept {
  if (this != &other) {
    remove();
    node_ = std::move(other.node_);
    key_ = std::exchange(other.key_, 0);
    pre_hook_ = std::exchange(other.pre_hook_, nullptr);
  }
  return *this;
}

void GradReadyHook::remove() {
  if (node_) {
    node_->del_post_hook(key_);
    if (pre_hook_ != nullptr) {
      auto& hooks = node_->pre_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.get() == pre_hook_; }),
                  hooks.end());
    }
  }
  node_ = NodeRef();
  key_ = 0;
  pre_hook_ = nullptr;
}

void on_end_of_backward(std::function<void()> on_end, std::function<void()> on_abandoned) {
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

}  // namespace zeroshard::compat
