// checkpoint_models.h — the model, data and trainer the checkpoint tests share
// (checkpoint_test.cpp: one data-parallel group; pipeline_checkpoint_test.cpp:
// the same model as two pipeline stages), and the directories they save into.
#pragma once

#include "test_util.h"

#include <zeroshard/checkpoint.h>
#include <zeroshard/fully_shard.h>
#include <zeroshard/sharded_adamw.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {
namespace checkpoint_test {

namespace fs = std::filesystem;
using testing::world;
using testing::world_ptr;

constexpr int kIn = 9, kWidth = 21, kOut = 4, kBatch = 24, kSaveAt = 6, kEnd = 12;
const auto kAdamW = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.05);

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kWidth, kWidth + 5));
    fc2 = register_module("fc2", torch::nn::Linear(kWidth + 5, kWidth));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// Units (stage 3) or plain layers (stage 2), a frozen layer and a bf16 buffer:
// what a checkpoint must hold besides the optimizer's shards.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    embed = register_module("embed", torch::nn::Linear(kIn, kWidth));
    frozen = register_module("frozen", torch::nn::Linear(kWidth, kWidth));
    frozen->weight.set_requires_grad(false);
    frozen->bias.set_requires_grad(false);
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), Sharded<Block>()));
    head = register_module("head", torch::nn::Linear(kWidth, kOut));
    offset = register_buffer("offset", (torch::randn({kOut}) * 0.1).to(torch::kBFloat16));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = frozen(embed(x));
    for (auto& b : blocks) h = b->forward(h);
    return head(h) + offset.to(torch::kFloat);
  }
  torch::nn::Linear embed{nullptr}, frozen{nullptr}, head{nullptr};
  std::vector<Sharded<Block>> blocks;
  torch::Tensor offset;
};
TORCH_MODULE(Net);

inline std::pair<torch::Tensor, torch::Tensor> batch(int64_t step) {
  torch::manual_seed(700 + step);
  return {torch::randn({kBatch, kIn}), torch::randn({kBatch, kOut})};
}

// A model and its optimizer at stage 0, 1 or 2 (ShardedAdamW) or 3 (fully_shard),
// on the CPU over the world, or on `group`'s device.
struct Trainer {
  Net net;
  std::shared_ptr<FullyShardedModel> sharded;
  std::unique_ptr<ShardedAdamW> zero2;
  std::unique_ptr<FullyShardedAdamW> zero3;
  c10::Device device = c10::kCPU;

  explicit Trainer(int stage, int seed = 1) : Trainer(stage, seed, world_ptr()) {}
  // shard_size: hybrid sharding (ShardedAdamWOptions / FullyShardOptions::shard_size).
  Trainer(int stage, int seed, const ProcessGroup& group, int shard_size = 0) : device(group.data->device()) {
    torch::manual_seed(seed);
    net = Net();
    net->to(device);
    if (stage == 3) {
      FullyShardOptions fo;
      fo.shard_size = shard_size;
      sharded = fully_shard(net, group, fo);
      zero3 = std::make_unique<FullyShardedAdamW>(sharded, kAdamW);
    } else {
      std::vector<torch::Tensor> trained;
      torch::OrderedDict<std::string, torch::Tensor> named;
      for (const auto& item : net->named_parameters()) {
        if (item.value().requires_grad()) named.insert(item.key(), item.value());
      }
      ShardedAdamWOptions so;
      so.zero_stage = stage;  // 0, 1 or 2
      so.shard_size = shard_size;
      zero2 = std::make_unique<ShardedAdamW>(named, group, kAdamW, so);
    }
  }
  torch::optim::Optimizer& opt() { return zero3 ? static_cast<torch::optim::Optimizer&>(*zero3) : *zero2; }
  void train(int64_t from, int64_t to) {
    const int n = world().size(), r = world().rank(), local = kBatch / n;
    for (int64_t s = from; s < to; ++s) {
      auto [x, y] = batch(s);
      x = x.to(device);
      y = y.to(device);
      opt().zero_grad();
      torch::mse_loss(net->forward(x.slice(0, r * local, (r + 1) * local)), y.slice(0, r * local, (r + 1) * local))
          .backward();
      opt().step();
    }
  }
  std::string save(Checkpointer& c, int64_t step) {
    TrainingProgress p;
    p.step = step;
    p.epoch = 1;
    p.extra_json = R"({"sampler": 42})";
    return zero3 ? c.save(*zero3, *net, p) : c.save(*zero2, *net, p);
  }
  std::optional<TrainingProgress> load(Checkpointer& c, std::optional<int64_t> step = std::nullopt) {
    return zero3 ? c.load(*zero3, *net, step) : c.load(*zero2, *net, step);
  }
  // Every parameter and buffer, in full, in module order (fp32).
  torch::Tensor flat() {
    std::optional<FullyShardedModel::FullParamsGuard> guard;
    if (sharded) guard.emplace(sharded->summon_full_params());
    std::vector<torch::Tensor> ps;
    for (auto& p : net->parameters()) ps.push_back(p.detach().to(torch::kFloat).reshape(-1).cpu().clone());
    for (auto& b : net->buffers()) ps.push_back(b.detach().to(torch::kFloat).reshape(-1).cpu().clone());
    return torch::cat(ps);
  }
};

// The fixture's name for a run at N ranks and ZeRO stage s with hybrid sharding over N / 2 ranks.
inline std::string hybrid_run(int n, int stage) {
  return "n" + std::to_string(n) + "_stage" + std::to_string(stage) + "_shard" + std::to_string(n / 2);
}

inline std::string shared_dir() {
  const char* d = std::getenv("ZS_CKPT_TEST_DIR");
  return d != nullptr ? d : (fs::temp_directory_path() / "zs_ckpt_test").string();
}

// Rank 0's temp dir, the same for every rank.
inline std::string common_temp_dir(const std::string& tag) {
  const std::string dir = world().rank() == 0 ? testing::make_temp_dir(tag) : std::string();
  return all_gather_text(world(), dir)[0];
}

inline void write_tensor(const std::string& path, const torch::Tensor& t) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
}
inline torch::Tensor read_tensor(const std::string& path, int64_t numel) {
  auto t = torch::empty({numel}, torch::kFloat);
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  EXPECT_TRUE(in) << "cannot read " << path << " (did checkpoint_save_np* run?)";
  return t;
}

inline std::string latest_of(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "latest");
  std::string name;
  in >> name;
  return name;
}

// The checkpoints CheckpointSave writes into shared_dir(): at N = 1..4 ranks,
// ZeRO stage 0, 2 and 3 ("n3_stage2"), as two pipeline stages at N = 2 and 4
// ("pp2_n4_stage3"), and at N = 2 and 4 at stages 2 and 3 with hybrid sharding
// over shard groups of N / 2 ranks ("n4_stage3_shard2").
inline std::vector<std::string> saved_runs() {
  std::vector<std::string> out;
  for (int n = 1; n <= 4; ++n) {
    for (int s : {0, 2, 3}) {
      out.push_back("n" + std::to_string(n) + "_stage" + std::to_string(s));
      if (n % 2 == 0) out.push_back("pp2_n" + std::to_string(n) + "_stage" + std::to_string(s));
      if (n % 2 == 0 && s > 0) out.push_back(hybrid_run(n, s));
    }
  }
  return out;
}

// Equal to float rounding: the tolerance of fully_shard vs AdamW (sums over
// ranks in another order).
inline void expect_close(const torch::Tensor& got, const torch::Tensor& want) {
  const auto rel = (got - want).abs() / (want.abs() + 1e-2);
  EXPECT_LT(rel.max().item<double>(), 2e-4);
  EXPECT_LT(rel.mean().item<double>(), 1e-6);
}

}  // namespace checkpoint_test
}  // namespace zeroshard
