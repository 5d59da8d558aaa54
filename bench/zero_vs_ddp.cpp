// zero_vs_ddp: one training step of a ~30M-parameter transformer language model
// on every rank, with
//   dp      torch::optim::AdamW on every rank + one all_reduce (average) of the
//           flattened gradients through the zeroshard communicator (plain data parallelism)
//   zero1   zeroshard::ShardedAdamW, stage 1
//   zero2   zeroshard::ShardedAdamW, stage 2
// bench/zero_vs_ddp.py runs the same model and batch on PyTorch's Python stack
// (DDP + ZeroRedundancyOptimizer); bench/zero_vs_ddp.sh runs all of them and
// prints one table. Rank 0 prints a "ROW |...|" line: median step time (slowest
// rank), tokens/s, peak RSS (largest rank) and model-state bytes per rank.
//
//   zeroshard-run --nproc-per-node 4 -- bench/zero_vs_ddp --mode zero2
#include <zeroshard/comm.h>
#include <zeroshard/sharded_adamw.h>

#include "bench_util.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace zero_vs_ddp {

struct LmImpl : torch::nn::Module {
  LmImpl(int vocab, int seq, int d, int heads, int ff, int layers) {
    tok = register_module("tok", torch::nn::Embedding(vocab, d));
    pos = register_module("pos", torch::nn::Embedding(seq, d));
    auto layer = torch::nn::TransformerEncoderLayer(
        torch::nn::TransformerEncoderLayerOptions(d, heads).dim_feedforward(ff).dropout(0.0));
    encoder = register_module("encoder", torch::nn::TransformerEncoder(layer, layers));
    head = register_module("head", torch::nn::Linear(d, vocab));
  }
  // ids: [batch, seq] -> logits [batch, seq, vocab]
  torch::Tensor forward(const torch::Tensor& ids) {
    auto positions = torch::arange(ids.size(1), torch::kLong);
    auto h = tok(ids) + pos(positions).unsqueeze(0);
    h = encoder(h.transpose(0, 1)).transpose(0, 1);  // LibTorch's encoder is sequence-first
    return head(h);
  }
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::TransformerEncoder encoder{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Lm);


}  // namespace zero_vs_ddp

int zero_vs_ddp_main(int argc, char** argv) {
  using namespace zero_vs_ddp;
  std::string mode = "zero2";
  int steps = 6, warmup = 2, batch = 2, seq = 64, vocab = 8192, d = 512, heads = 8, ff = 2048, layers = 7;
  CLI::App app{"~30M-parameter transformer LM: ShardedAdamW vs plain data parallelism"};
  app.add_option("--mode", mode, "dp | zero1 | zero2")->check(CLI::IsMember({"dp", "zero1", "zero2"}))->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed first steps")->capture_default_str();
  app.add_option("--batch", batch, "sequences per rank")->capture_default_str();
  app.add_option("--seq", seq, "tokens per sequence")->capture_default_str();
  app.add_option("--layers", layers, "transformer layers")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto comm = zeroshard::init_communicator();
  const int rank = comm->rank(), world = comm->size();
  torch::manual_seed(0);
  Lm model(vocab, seq, d, heads, ff, layers);
  int64_t psi = 0;
  for (const auto& p : model->parameters()) psi += p.numel();

  const auto adamw = torch::optim::AdamWOptions(1e-4).weight_decay(0.01);
  std::unique_ptr<torch::optim::Optimizer> opt;
  zeroshard::ShardedAdamW* sharded = nullptr;
  if (mode == "dp") {
    {  // equal start everywhere
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) comm->broadcast(p.data(), 0)->wait();
    }
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), adamw);
  } else {
    zeroshard::ShardedAdamWOptions o;
    o.zero_stage = mode == "zero1" ? 1 : 2;
    auto s = std::make_unique<zeroshard::ShardedAdamW>(model->named_parameters(), comm, adamw, o);
    sharded = s.get();
    opt = std::move(s);
  }
  auto params = model->parameters();

  std::vector<double> times;
  int64_t sent = 0;  // payload bytes this rank sent in the timed steps (the timing all-reduce left out)
  for (int step = 0; step < warmup + steps; ++step) {
    const int64_t sent_before = comm->stats().total().bytes_sent;
    torch::manual_seed(1000 * step + rank);
    auto ids = torch::randint(vocab, {batch, seq + 1}, torch::kLong);
    const auto start = std::chrono::steady_clock::now();
    opt->zero_grad();
    auto logits = model->forward(ids.slice(1, 0, seq));
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, vocab}), ids.slice(1, 1, seq + 1).reshape(-1));
    loss.backward();
    if (mode == "dp") zeroshard::bench::average_gradients(*comm, params);
    opt->step();
    auto t = torch::tensor({std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()},
                           torch::kDouble);
    if (step >= warmup) sent += comm->stats().total().bytes_sent - sent_before;
    comm->all_reduce(t, zeroshard::ReduceOp::kMax)->wait();  // the step ends when the slowest rank's does
    if (step >= warmup) times.push_back(t.item<double>());
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  auto sent_mib = torch::tensor({sent / 1048576.0 / steps}, torch::kDouble);  // mean over ranks, as the peer's
  comm->all_reduce(sent_mib, zeroshard::ReduceOp::kAvg)->wait();
  auto rss = torch::tensor({zeroshard::bench::peak_rss_mib()}, torch::kDouble);
  comm->all_reduce(rss, zeroshard::ReduceOp::kMax)->wait();
  double states_mib;
  if (sharded != nullptr) {
    states_mib = sharded->stats().memory.peak_model_states / 1048576.0;
  } else {  // params + grads + exp_avg + exp_avg_sq, all full size, + the flat all-reduce buffer
    states_mib = 20.0 * psi / 1048576.0;
  }
  if (rank == 0) {
    std::printf("ROW | zeroshard (C++) | %s | %d | %.1fM | %.0f | %.0f | %.0f | %.0f | %.1f |\n", mode.c_str(), world,
                psi / 1e6, median * 1e3, batch * seq * world / median, rss.item<double>(), states_mib,
                sent_mib.item<double>());
  }
  comm->barrier();
  return 0;
}
