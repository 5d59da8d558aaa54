// zero3_bench: the ~30M-parameter transformer LM of zero_vs_ddp, one training
// step per rank, with
//   dp         torch::optim::AdamW + one all_reduce of the flattened gradients
//   zero2      ShardedAdamW, stage 2
//   zero3      fully_shard (one unit per layer, embedding and head in the root) + FullyShardedAdamW
//   zero3-nopf the same without prefetch (every unit gathered when needed)
// --head-unit makes the LM head a unit of its own (Sharded<Linear>) instead of
// part of the root: its gradient is then reduced early in backward and it is
// gathered like a layer, rather than reduced and gathered with the root after
// backward.
// Rank 0 prints a "ROW |...|" line: median step time (slowest rank), exposed
// communication (time the training thread waited for gathers and reductions,
// zero3 only), peak RSS (largest rank), model-state bytes per rank, and MiB
// sent per rank per step (payload, mean over ranks and timed steps; for zero3
// the gathers' communicator plus the reduce-scatters' own).
//
//   zeroshard-run --nproc-per-node 4 -- bench/zero3_bench --mode zero3
#include <zeroshard/comm.h>
#include <zeroshard/fully_shard.h>
#include <zeroshard/sharded_adamw.h>
#include <zeroshard/trace.h>

#include "bench_util.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace zero3_bench {

struct LmImpl : torch::nn::Module {
  LmImpl(int vocab, int seq, int d, int heads, int ff, int layers, bool head_unit) : head_unit(head_unit) {
    tok = register_module("tok", torch::nn::Embedding(vocab, d));
    pos = register_module("pos", torch::nn::Embedding(seq, d));
    auto opts = torch::nn::TransformerEncoderLayerOptions(d, heads).dim_feedforward(ff).dropout(0.0);
    for (int i = 0; i < layers; ++i) {
      blocks.push_back(register_module("layer" + std::to_string(i), zeroshard::Sharded<torch::nn::TransformerEncoderLayer>(opts)));
    }
    if (head_unit) {
      sharded_head = register_module("head", zeroshard::Sharded<torch::nn::Linear>(d, vocab));
    } else {
      head = register_module("head", torch::nn::Linear(d, vocab));
    }
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto h = tok(ids) + pos(torch::arange(ids.size(1), torch::kLong)).unsqueeze(0);
    h = h.transpose(0, 1);  // LibTorch's transformer layers are sequence-first
    for (auto& b : blocks) h = b->forward(h);
    h = h.transpose(0, 1);
    return head_unit ? sharded_head->forward(h) : head(h);
  }
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  std::vector<zeroshard::Sharded<torch::nn::TransformerEncoderLayer>> blocks;
  torch::nn::Linear head{nullptr};
  zeroshard::Sharded<torch::nn::Linear> sharded_head{nullptr};
  bool head_unit;
};
TORCH_MODULE(Lm);


}  // namespace zero3_bench

int zero3_bench_main(int argc, char** argv) {
  using namespace zero3_bench;
  std::string mode = "zero3";
  int steps = 10, warmup = 2, batch = 2, seq = 64, vocab = 8192, d = 512, heads = 8, ff = 2048, layers = 7;
  CLI::App app{"~30M-parameter transformer LM: ZeRO-3 (fully_shard) vs ZeRO-2 vs data parallelism"};
  app.add_option("--mode", mode, "dp | zero2 | zero3 | zero3-nopf")
      ->check(CLI::IsMember({"dp", "zero2", "zero3", "zero3-nopf"}))
      ->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed first steps")->capture_default_str();
  app.add_option("--batch", batch, "sequences per rank")->capture_default_str();
  app.add_option("--layers", layers, "transformer layers")->capture_default_str();
  std::string trace_path;
  app.add_option("--trace", trace_path, "write a Chrome trace of the timed steps to PATH.rank<r>.json");
  zeroshard::FullyShardOptions fso;
  app.add_option("--max-inflight-gathers", fso.max_inflight_gathers, "FullyShardOptions::max_inflight_gathers")
      ->capture_default_str();
  app.add_option("--max-inflight-reductions", fso.max_inflight_reductions,
                 "FullyShardOptions::max_inflight_reductions")
      ->capture_default_str();
  bool head_unit = false;
  app.add_flag("--head-unit", head_unit, "the LM head is a unit of its own (default: in the root with the embeddings)");
  CLI11_PARSE(app, argc, argv);

  auto comm = zeroshard::init_communicator();
  const int rank = comm->rank(), world = comm->size();
  torch::manual_seed(0);
  Lm model(vocab, seq, d, heads, ff, layers, head_unit);
  int64_t psi = 0;
  for (const auto& p : model->parameters()) psi += p.numel();

  const auto adamw = torch::optim::AdamWOptions(1e-4).weight_decay(0.01);
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::shared_ptr<zeroshard::FullyShardedModel> sharded;
  zeroshard::ShardedOptimizer* sharding = nullptr;  // zero2, zero3; null: dp
  if (mode == "dp") {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) comm->broadcast(p.data(), 0)->wait();
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), adamw);
  } else if (mode == "zero2") {
    auto s = std::make_unique<zeroshard::ShardedAdamW>(model->named_parameters(), comm, adamw);
    sharding = s.get();
    opt = std::move(s);
  } else {
    zeroshard::FullyShardOptions o = fso;
    o.prefetch = mode == "zero3";
    sharded = zeroshard::fully_shard(model, comm, o);
    auto s = std::make_unique<zeroshard::FullyShardedAdamW>(sharded, adamw);
    sharding = s.get();
    opt = std::move(s);
  }
  auto params = model->parameters();

  // Payload bytes this rank has sent so far: the given communicator's, plus, for
  // zero3, the reduce-scatters' communicator of its own.
  auto bytes_sent = [&] {
    return (sharding != nullptr ? sharding->stats().traffic : comm->stats()).total().bytes_sent;
  };
  std::vector<double> times, exposed, exposed_gathers;
  int64_t sent = 0;  // in the timed steps (the timing all-reduce left out)
  for (int step = 0; step < warmup + steps; ++step) {
    const int64_t sent_before = bytes_sent();
    torch::manual_seed(1000 * step + rank);
    auto ids = torch::randint(vocab, {batch, seq + 1}, torch::kLong);
    const auto waits_before = sharding != nullptr ? sharding->stats().waits : zeroshard::CommWaits{};
    if (step == warmup && !trace_path.empty()) {
      zeroshard::trace::clear();
      zeroshard::trace::enable();
    }
    const auto start = std::chrono::steady_clock::now();
    opt->zero_grad();
    auto logits = model->forward(ids.slice(1, 0, seq));
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, vocab}), ids.slice(1, 1, seq + 1).reshape(-1));
    loss.backward();
    if (mode == "dp") zeroshard::bench::average_gradients(*comm, params);
    opt->step();
    const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    double waited = 0, waited_gathers = 0;
    if (sharding != nullptr) {
      const auto w = sharding->stats().waits;
      waited_gathers = w.gathers - waits_before.gathers;
      waited = waited_gathers + (w.reductions - waits_before.reductions);
    }
    if (step >= warmup) sent += bytes_sent() - sent_before;
    auto t = torch::tensor({mine, waited, waited_gathers}, torch::kDouble);
    comm->all_reduce(t, zeroshard::ReduceOp::kMax)->wait();
    if (step >= warmup) {
      times.push_back(t[0].item<double>());
      exposed.push_back(t[1].item<double>());
      exposed_gathers.push_back(t[2].item<double>());
    }
  }
  if (!trace_path.empty()) zeroshard::trace::write_chrome_trace(trace_path + ".rank" + std::to_string(rank) + ".json", rank);
  std::sort(times.begin(), times.end());
  std::sort(exposed.begin(), exposed.end());
  std::sort(exposed_gathers.begin(), exposed_gathers.end());
  const double median = times[times.size() / 2];
  auto rss = torch::tensor({zeroshard::bench::peak_rss_mib()}, torch::kDouble);
  comm->all_reduce(rss, zeroshard::ReduceOp::kMax)->wait();
  auto sent_mib = torch::tensor({sent / 1048576.0 / steps}, torch::kDouble);  // mean over ranks, as the peer's
  comm->all_reduce(sent_mib, zeroshard::ReduceOp::kAvg)->wait();
  const double states_mib =
      (sharding != nullptr ? static_cast<double>(sharding->stats().memory.peak_model_states) : 20.0 * psi) / 1048576.0;
  if (rank == 0) {
    const std::string exposed_col =
        sharding != nullptr ? std::to_string(static_cast<int>(exposed[exposed.size() / 2] * 1e3 + 0.5)) + " (" +
                      std::to_string(static_cast<int>(100 * exposed[exposed.size() / 2] / median + 0.5)) + "%; gathers " +
                      std::to_string(static_cast<int>(exposed_gathers[exposed_gathers.size() / 2] * 1e3 + 0.5)) + ")"
                : "-";
    const std::string label = mode + (head_unit ? " (head a unit)" : "");
    std::printf("ROW | zeroshard %s | %d | %.1fM | %.0f | %s | %.0f | %.0f | %.1f |\n", label.c_str(), world, psi / 1e6,
                median * 1e3, exposed_col.c_str(), rss.item<double>(), states_mib, sent_mib.item<double>());
  }
  comm->barrier();
  return 0;
}
