// activation_checkpoint.cpp — a graph node that recomputes its forward in backward.
#include "zeroshard/activation_checkpoint.h"

#include "compat/autograd_node.h"
#include "compat/torch_compat.h"
#include "shard/backward/backward_round.h"
#include "shard/backward/recompute.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>

namespace zeroshard {
namespace {

thread_local int recompute_depth = 0;
thread_local int checkpointed_forward_depth = 0;
thread_local long long checkpointed_segments_begun = 0;

struct RecomputeScope {
  RecomputeScope() { ++recompute_depth; }
  ~RecomputeScope() { --recompute_depth; }
};

struct CheckpointBackward : torch::autograd::Node {
  std::function<TensorList(const TensorList&)> fn;
  TensorList inputs;  // detached: the values, no graph
  std::vector<bool> input_requires_grad;
  // The random generators the first run drew from (the CPU's and each CUDA
  // device's among the inputs), with their states then: the recomputation
  // draws the same dropout masks.
  std::vector<std::pair<at::Generator, at::Tensor>> rng;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TensorList xs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      xs.push_back(inputs[i].defined() ? inputs[i].detach().requires_grad_(input_requires_grad[i]) : inputs[i]);
    }
    TensorList ys;
    {
      RecomputeScope scope;
      at::AutoGradMode enable_grad(true);
      struct RestoreRng {  // the generators' states of now, also when fn throws
        std::vector<std::pair<at::Generator, at::Tensor>> saved;
        ~RestoreRng() {
          for (auto& [gen, state] : saved) gen.set_state(state);
        }
      } restore;
      for (auto& [gen, state] : rng) {
        restore.saved.emplace_back(gen, gen.get_state());
        gen.set_state(state);
      }
      ys = fn(xs);
    }
    TORCH_CHECK(ys.size() == grads.size(), "activation_checkpoint: the recomputed forward returned ", ys.size(),
                " tensors but the first run returned ", grads.size(), "; fn must be deterministic in its outputs");
    TensorList outs, out_grads;
    for (size_t i = 0; i < ys.size(); ++i) {
      if (ys[i].defined() && ys[i].requires_grad() && grads[i].defined()) {
        outs.push_back(ys[i]);
        out_grads.push_back(grads[i]);
      }
    }
    if (!outs.empty()) {
      // A round that begins in this backward (the segment holds the first
      // parameters whose gradients are ready) belongs to the outer backward.
      shard::BackwardRound::NestedBackward nested;
      torch::autograd::backward(outs, out_grads);
    }
    torch::autograd::variable_list result;
    for (auto& x : xs) result.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
    return result;
  }
  void release_variables() override {
    inputs.clear();
    fn = nullptr;
  }
};

}  // namespace

bool shard::in_recompute() { return recompute_depth > 0; }
bool shard::in_checkpointed_forward() { return checkpointed_forward_depth > 0; }
long long shard::checkpointed_segments() { return checkpointed_segments_begun; }

TensorList activation_checkpoint(std::function<TensorList(const TensorList&)> fn, TensorList inputs) {
  if (recompute_depth == 0 && (at::GradMode::is_enabled() || checkpointed_forward_depth > 0)) {
    ++checkpointed_segments_begun;
  }
  if (!at::GradMode::is_enabled() || !torch::autograd::any_variable_requires_grad(inputs)) return fn(inputs);
  auto node = compat::make_autograd_node<CheckpointBackward>();
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  for (const auto& x : inputs) {
    if (x.defined() && x.is_cuda() && std::find(devices.begin(), devices.end(), x.device()) == devices.end()) {
      devices.push_back(x.device());
    }
  }
  for (const auto& d : devices) {
    auto gen = compat::default_generator(d);
    node->rng.emplace_back(gen, gen.get_state());
  }
  TensorList outs;
  {
    at::NoGradGuard no_grad;
    struct Depth {
      Depth() { ++checkpointed_forward_depth; }
      ~Depth() { --checkpointed_forward_depth; }
    } depth;
    outs = fn(inputs);
  }
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (const auto& x : inputs) {
    node->inputs.push_back(x.defined() ? x.detach() : x);
    node->input_requires_grad.push_back(x.defined() && x.requires_grad());
  }
  node->fn = std::move(fn);
  for (auto& y : outs) {
    bool is_input = false;
    for (const auto& x : inputs) is_input = is_input || (x.defined() && y.defined() && y.is_same(x));
    if (is_input || (y.defined() && y.is_view())) y = y.clone();  // must not take this graph edge itself
    if (y.defined() && c10::isFloatingType(y.scalar_type())) {
      torch::autograd::set_history(y, node);
    } else {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
    }
  }
  return outs;
}

at::Tensor activation_checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input) {
  return activation_checkpoint([fn](const TensorList& in) { return TensorList{fn(in[0])}; }, TensorList{input})[0];
}

}  // namespace zeroshard
