// minimal: a small MLP trained with ShardedAdamW, the drop-in ZeRO optimizer.
//
// A single-process LibTorch loop becomes a sharded data-parallel one by one
// line: the optimizer. Every rank computes gradients on its share of each
// global batch; ShardedAdamW averages them (reduce-scatter), updates only this
// rank's 1/N of the AdamW state, and all-gathers the new parameters. The global
// batch is the same for any number of ranks, so 1 rank and N ranks train the
// same model.
//
//   zeroshard-run --nproc-per-node 4 -- ./zs_minimal --steps 200 --stage 2
#include <zeroshard/comm.h>
#include <zeroshard/log.h>
#include <zeroshard/sharded_adamw.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

namespace {

struct MLPImpl : torch::nn::Module {
  MLPImpl(int in, int hidden)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        head(register_module("head", torch::nn::Linear(hidden, 1))) {}
  torch::Tensor forward(torch::Tensor x) {
    return head(torch::tanh(fc2(torch::tanh(fc1(x)))));
  }
  torch::nn::Linear fc1, fc2, head;
};
TORCH_MODULE(MLP);

constexpr int kFeatures = 16;

// The global batch of `step`: identical on every rank, whatever the world size.
std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t seed, int step, int batch) {
  torch::manual_seed(seed * 1000003 + step);
  auto x = torch::randn({batch, kFeatures});
  auto y = torch::sin(x.select(1, 0)) + 0.5 * x.select(1, 1) * x.select(1, 2) - 0.25 * x.select(1, 3);
  return {x, y.unsqueeze(1)};
}

torch::Tensor flatten(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> flat;
  for (const auto& t : ts) flat.push_back(t.reshape(-1));
  return torch::cat(flat);
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 200, global_batch_size = 256, hidden = 64;
  double lr = 1e-2;
  int64_t seed = 1;
  int stage = 2;
  std::string save_params;
  CLI::App app{"zeroshard minimal example: data-parallel MLP on synthetic data"};
  app.add_option("--steps", steps, "optimizer steps")->capture_default_str();
  app.add_option("--global-batch", global_batch_size, "samples per step, over all ranks")->capture_default_str();
  app.add_option("--hidden", hidden, "hidden width")->capture_default_str();
  app.add_option("--lr", lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--seed", seed, "data and init seed")->capture_default_str();
  app.add_option("--stage", stage, "ZeRO stage: 1 shards optimizer states, 2 also gradients")->capture_default_str();
  app.add_option("--save-params", save_params, "rank 0 writes the final flat parameters here (torch::save)");
  CLI11_PARSE(app, argc, argv);

  auto comm = zeroshard::init_communicator();
  const int rank = comm->rank(), world = comm->size();
  if (global_batch_size % world != 0) {
    zeroshard::log_error("--global-batch " + std::to_string(global_batch_size) +
                         " must be divisible by the number of ranks " + std::to_string(world));
    return 2;
  }
  const int local = global_batch_size / world;

  torch::manual_seed(seed);
  MLP model(kFeatures, hidden);
  zeroshard::ShardedAdamWOptions sharding;
  sharding.zero_stage = stage;
  // The one line that differs from single-process training, which would say
  //   torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(lr).weight_decay(0.01));
  zeroshard::ShardedAdamW opt(model->named_parameters(), comm, torch::optim::AdamWOptions(lr).weight_decay(0.01), sharding);

  float first_loss = 0, loss_value = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(seed, step, global_batch_size);
    x = x.slice(0, rank * local, (rank + 1) * local);
    y = y.slice(0, rank * local, (rank + 1) * local);
    opt.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    opt.step();

    auto loss_sum = loss.detach().reshape({1}).clone();  // for the log: the mean over ranks
    comm->all_reduce(loss_sum, zeroshard::ReduceOp::kAvg)->wait();
    loss_value = loss_sum.item<float>();
    if (step == 0) first_loss = loss_value;
    if (step % 50 == 0 || step == steps - 1) {
      zeroshard::log_info("step " + std::to_string(step) + " loss " + std::to_string(loss_value));
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto stats = comm->stats().total();

  if (rank == 0) {
    std::printf("minimal: %d ranks, ZeRO stage %d, %d steps, global batch %d (%d per rank)\n", world, stage,
                steps, global_batch_size, local);
    std::printf("minimal: loss %.4f -> %.4f\n", first_loss, loss_value);
    std::printf("minimal: %.2f s, %.0f samples/s, %.2f MB sent per rank in %lld collectives\n", seconds,
                steps * global_batch_size / seconds, stats.bytes_sent / 1e6,
                static_cast<long long>(stats.calls));
    std::printf("final loss %.6f\n", loss_value);
    if (!save_params.empty()) {
      torch::NoGradGuard no_grad;
      torch::save(flatten(model->parameters()), save_params);
    }
  }
  comm->barrier();
  return 0;
}
