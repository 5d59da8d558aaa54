// fully_shard_models.h — the small models and data the fully_shard tests share.
#pragma once

#include "zeroshard/activation_checkpoint.h"
#include "zeroshard/fully_shard.h"

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace zeroshard::fsdp_test {

constexpr int kIn = 11, kWidth = 27, kOut = 5, kBatch = 24;

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kWidth, kWidth + 6));
    fc2 = register_module("fc2", torch::nn::Linear(kWidth + 6, kWidth));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// Root parameters: the input projection and the head; three sharded blocks.
struct TinyImpl : torch::nn::Module {
  TinyImpl() {
    embed = register_module("embed", torch::nn::Linear(kIn, kWidth));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), Sharded<Block>()));
    head = register_module("head", torch::nn::Linear(kWidth, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = embed(x);
    for (auto& b : blocks) {
      if (checkpoint) {
        h = activation_checkpoint([p = b.ptr()](const torch::Tensor& in) { return p->forward(in); }, h);
      } else {
        h = b->forward(h);
      }
    }
    return head(h);
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  std::vector<Sharded<Block>> blocks;
  bool checkpoint = false;  // recompute each block in backward
};
TORCH_MODULE(Tiny);

inline std::pair<torch::Tensor, torch::Tensor> batch(int step, int micro) {
  torch::manual_seed(500 + 10 * step + micro);
  return {torch::randn({kBatch, kIn}), torch::randn({kBatch, kOut})};
}

inline torch::Tensor flat(Tiny& m) {
  std::vector<torch::Tensor> ps;
  for (auto& p : m->parameters()) ps.push_back(p.detach().reshape(-1).clone());
  return torch::cat(ps);
}

constexpr int kSteps = 20;
inline const auto kAdamW = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.05);

// Two param groups: biases (twice the lr, no weight decay) and weights (kAdamW),
// (fully_shard_test.cpp also halves the weights' lr from step kSteps / 2 on, as a scheduler would).
inline std::vector<torch::optim::OptimizerParamGroup> two_groups(torch::nn::Module& m) {
  std::vector<torch::Tensor> biases, weights;
  for (const auto& item : m.named_parameters()) {
    (item.key().find("bias") != std::string::npos ? biases : weights).push_back(item.value());
  }
  auto bias_options = std::make_unique<torch::optim::AdamWOptions>(kAdamW);
  bias_options->lr(2 * kAdamW.lr()).weight_decay(0);
  return {torch::optim::OptimizerParamGroup(biases, std::move(bias_options)),
          torch::optim::OptimizerParamGroup(weights)};
}

// Six wide units (the memory and mixed-precision tests).
struct WideBlockImpl : torch::nn::Module {
  WideBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(256, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 256));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(WideBlock);

struct WideImpl : torch::nn::Module {
  WideImpl() {
    embed = register_module("embed", torch::nn::Linear(16, 256));
    for (int i = 0; i < 6; ++i) blocks.push_back(register_module("block" + std::to_string(i), Sharded<WideBlock>()));
    head = register_module("head", torch::nn::Linear(256, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = embed(x);
    for (auto& b : blocks) x = b->forward(x);
    return head(x);
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  std::vector<Sharded<WideBlock>> blocks;
};
TORCH_MODULE(Wide);

}  // namespace zeroshard::fsdp_test
