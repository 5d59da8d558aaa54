// soak_train: the program the kill-and-resume soak (soak.py) runs under
// zeroshard-run, as `zs_tests --helper soak_train ARGS`. It trains a small model with dropout (so the RNG state
// matters) on a fixed dataset in DistributedSampler order, checkpoints every
// --save-every steps, resumes from `latest` by itself (or the durable tier's newest
// step: --durable), stops cleanly on a preemption signal (saving first, exit code 75), and at the end writes every
// rank's parameters and optimizer state to OUT.rankR.bin for a byte comparison.
#include <zeroshard/checkpoint.h>
#include <zeroshard/comm.h>
#include <zeroshard/fully_shard.h>
#include <zeroshard/log.h>
#include <zeroshard/preemption.h>
#include <zeroshard/sampler.h>
#include <zeroshard/sharded_adamw.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <fstream>
#include <thread>

namespace soak_train {

constexpr int kIn = 12, kOut = 5, kDataset = 240;
int kWidth = 32;  // --width

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kWidth, 2 * kWidth));
    fc2 = register_module("fc2", torch::nn::Linear(2 * kWidth, kWidth));
    drop = register_module("drop", torch::nn::Dropout(0.1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(drop(torch::gelu(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    in = register_module("in", torch::nn::Linear(kIn, kWidth));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), zeroshard::Sharded<Block>()));
    out = register_module("out", torch::nn::Linear(kWidth, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = in(x);
    for (auto& b : blocks) h = b->forward(h);
    return out(h);
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  std::vector<zeroshard::Sharded<Block>> blocks;
};
TORCH_MODULE(Net);

}  // namespace soak_train

int soak_train_main(int argc, char** argv) {
  using namespace soak_train;
  std::string dir, out, durable;
  int64_t steps = 200, save_every = 10, batch = 6;
  int stage = 3, slow_ms = 0;
  double liveness_s = 30;
  bool async = false;
  CLI::App app{"soak_train: checkpointed training that resumes by itself"};
  app.add_option("--dir", dir, "checkpoint run directory")->required();
  app.add_option("--out", out, "final state written to OUT.rank<r>.bin")->required();
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--save-every", save_every)->capture_default_str();
  app.add_option("--stage", stage, "2 (ShardedAdamW) or 3 (fully_shard)")->check(CLI::IsMember({2, 3}));
  app.add_option("--slow-ms", slow_ms, "sleep per step (gives kills time to land)")->capture_default_str();
  app.add_flag("--async", async, "asynchronous checkpoint saves");
  app.add_option("--durable", durable, "a durable tier (s3://bucket/prefix): a preemption's save is made durable");
  app.add_option("--liveness", liveness_s, "seconds of silence that fail a peer (CommOptions::liveness)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--width", kWidth, "hidden width (32: 13k parameters; 2048: 50M)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  zeroshard::CommOptions comm_options;
  comm_options.liveness = std::chrono::milliseconds(static_cast<int64_t>(liveness_s * 1000));
  auto comm = zeroshard::init_communicator(comm_options);
  const int rank = comm->rank(), world = comm->size();
  torch::manual_seed(1);
  Net net;
  std::shared_ptr<zeroshard::FullyShardedModel> sharded;
  std::unique_ptr<zeroshard::FullyShardedAdamW> z3;
  std::unique_ptr<zeroshard::ShardedAdamW> z2;
  const auto adamw = torch::optim::AdamWOptions(3e-3).weight_decay(0.01);
  if (stage == 3) {
    sharded = zeroshard::fully_shard(net, comm);
    z3 = std::make_unique<zeroshard::FullyShardedAdamW>(sharded, adamw);
  } else {
    z2 = std::make_unique<zeroshard::ShardedAdamW>(net->named_parameters(), comm, adamw);
  }
  torch::optim::Optimizer& opt = z3 ? static_cast<torch::optim::Optimizer&>(*z3) : *z2;

  torch::manual_seed(2);
  const auto X = torch::randn({kDataset, kIn}), Y = torch::randn({kDataset, kOut});
  zeroshard::CheckpointOptions co;
  co.async = async;
  co.durable_uri = durable;
  zeroshard::Checkpointer ckpt(dir, comm, co);
  zeroshard::PreemptionGuard guard(comm);
  zeroshard::DistributedSampler sampler(kDataset, rank, world, /*seed=*/7);
  torch::manual_seed(100 + rank);  // each rank's own dropout stream

  int64_t start = 0;
  const auto resumed = z3 ? ckpt.load(*z3, *net) : ckpt.load(*z2, *net);
  if (resumed) {
    start = resumed->step;
    sampler.load_state_json(nlohmann::json::parse(resumed->extra_json).at("sampler").dump());
    guard.check_save_fits(resumed->save_seconds);
  }
  auto save = [&](int64_t step) {
    zeroshard::TrainingProgress p;
    p.step = step;
    p.epoch = sampler.epoch();
    p.extra_json = nlohmann::json{{"sampler", nlohmann::json::parse(sampler.state_json())}}.dump();
    return z3 ? ckpt.save(*z3, *net, p) : ckpt.save(*z2, *net, p);
  };
  net->train();
  for (int64_t step = start; step < steps; ++step) {
    const auto idx = torch::tensor(sampler.next(batch), torch::kLong);
    opt.zero_grad();
    torch::mse_loss(net->forward(X.index_select(0, idx)), Y.index_select(0, idx)).backward();
    opt.step();
    if (step == start) {
      zeroshard::log_info("soak_train: first step of this run done (step " + std::to_string(step + 1) + ")");
    }
    const bool saved = (step + 1) % save_every == 0;
    if (saved) save(step + 1);
    if (guard.should_stop()) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!saved) save(step + 1);
      ckpt.wait();
      if (!durable.empty() && !ckpt.make_durable(std::chrono::minutes(5))) {
        zeroshard::log_warn("soak_train: step " + std::to_string(step + 1) + " is not durable: " +
                            ckpt.durable_status().last_error);
      }
      guard.check_save_fits(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      zeroshard::log_warn("soak_train: stopped after step " + std::to_string(step + 1) + " for a preemption");
      return zeroshard::kPreemptedExitCode;
    }
    if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
  }
  ckpt.wait();
  // Every rank's parameters (in full) and optimizer state (its shards), raw.
  auto state = z3 ? z3->sharded_state() : z2->sharded_state();
  std::ofstream f(out + ".rank" + std::to_string(rank) + ".bin", std::ios::binary);
  auto put = [&f](const torch::Tensor& t) {
    auto c = t.detach().contiguous();
    f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  };
  for (const auto& b : state.buckets) {
    put(b.master);
    put(b.exp_avg);
    put(b.exp_avg_sq);
  }
  for (auto s : state.param_steps) f.write(reinterpret_cast<const char*>(&s), sizeof(s));
  {
    std::optional<zeroshard::FullyShardedModel::FullParamsGuard> g;
    if (sharded) g.emplace(sharded->summon_full_params());
    for (const auto& p : net->parameters()) put(p);
  }
  put(torch::rand({4}));  // the RNG stream's position
  zeroshard::log_info("soak_train: finished " + std::to_string(steps) + " steps");
  return 0;
}
