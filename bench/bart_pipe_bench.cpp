// bart_pipe_bench: BART training steps as pipeline stages (pp × dp) or as the
// whole model under ZeRO-3 over every rank, at the same world size, global
// batch and microbatch size:
//
//   zeroshard-run --nproc-per-node 4 -- bart_pipe_bench --pp 2 --schedule 1f1b --config small.json
//   zeroshard-run --nproc-per-node 4 -- bart_pipe_bench --pp 1            # fully_shard over the 4 ranks
//
// Per step and rank it measures the time (ranks start together), the time in
// F and B passes, the span to the last pass (the bubble as it ran: 1 − Σ
// compute / (pp · the largest span) over the pipeline group), the most
// microbatches in flight and what they held: the rise of malloc's bytes in
// use (heap_bytes_in_use()) after a forward, gradients excluded. The whole
// model runs its microbatches one after another (gradient accumulation), one
// in flight. Batches are random token ids. Rank 0 prints "ROW | ... |" for
// bench/bart_pipe_bench.sh.
#include "train/pipeline_training.h"
#include "bench_util.h"

#include <zeroshard/fully_shard.h>
#include <zeroshard/metrics.h>
#include <zeroshard/sharded_optimizer.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

namespace bart_pipe_bench {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Bytes of the gradients `params` hold now.
int64_t grad_bytes(const std::vector<torch::Tensor>& params) {
  int64_t b = 0;
  for (const auto& p : params) {
    if (p.grad().defined()) b += static_cast<int64_t>(p.grad().nbytes());
  }
  return b;
}

struct StepSample {
  double step = 0, compute = 0, passes = 0;
  int in_flight = 0;
  int64_t memory = 0, bytes = 0;
};

}  // namespace bart_pipe_bench

int bart_pipe_bench_main(int argc, char** argv) {
  using namespace bart_pipe_bench;
  std::string config = "tiny", schedule = "1f1b", partition = "timed", gather = "step";
  int pp = 2, chunks = 1, zero = 1;
  int64_t global_batch = 16, micro_rows = 2, src_len = 64, tgt_len = 64, steps = 4, warmup = 1;
  CLI::App app{"bart_pipe_bench: BART as pipeline stages (pp x dp) or ZeRO-3 over every rank"};
  app.add_option("--pp", pp, "pipeline stages; 1: the whole model, fully_shard over every rank")->capture_default_str();
  app.add_option("--schedule", schedule, "gpipe, 1f1b or interleaved-1f1b")->capture_default_str();
  app.add_option("--chunks", chunks, "interleaved-1f1b: stages per rank")->capture_default_str();
  app.add_option("--partition", partition, "uniform, balanced, timed or a layout")->capture_default_str();
  app.add_option("--zero", zero, "ZeRO stage inside each pipeline stage")->capture_default_str();
  app.add_option("--gather", gather, "ZeRO-3 stages: gather once per step (step) or per pass (pass)")
      ->check(CLI::IsMember({"step", "pass"}))
      ->capture_default_str();
  app.add_option("--config", config, "tiny, base, large or a config.json")->capture_default_str();
  app.add_option("--global-batch", global_batch, "sequences per step, all ranks")->capture_default_str();
  app.add_option("--micro-rows", micro_rows, "sequences per microbatch")->capture_default_str();
  app.add_option("--src-len", src_len, "encoder tokens per sequence")->capture_default_str();
  app.add_option("--tgt-len", tgt_len, "decoder tokens per sequence")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  at::set_num_threads(1);  // one core per rank: the ranks share the machine
  auto comm = zeroshard::init_communicator();
  const int rank = comm->rank(), world = comm->size();
  TORCH_CHECK_VALUE(world % pp == 0, "--pp ", pp, " must divide the ", world, " ranks");
  const int dp = world / pp;
  TORCH_CHECK_VALUE(global_batch % (dp * micro_rows) == 0, "--global-batch ", global_batch, " must divide into ",
                    dp, " data-parallel ranks x microbatches of --micro-rows ", micro_rows);
  const int m = static_cast<int>(global_batch / (dp * micro_rows));
  auto cfg = bart::BartConfig::named(config);
  cfg.dropout = cfg.attention_dropout = cfg.activation_dropout = 0.0;
  const auto adamw = torch::optim::AdamWOptions(1e-4).weight_decay(0.01);
  std::vector<torch::Tensor> params;  // this rank's, for the gradients' bytes
  const auto probe = [&params] { return zeroshard::heap_bytes_in_use() - grad_bytes(params); };

  std::unique_ptr<bart::PipelinedBart> pipe;
  bart::BartForConditionalGeneration whole{nullptr};
  std::shared_ptr<zeroshard::ShardedOptimizer> opt;
  int64_t numel = 0;
  if (pp > 1) {
    bart::PipelineOptions o;
    o.pp = pp;
    o.schedule = schedule;
    o.chunks = chunks;
    o.micro_batches = m;
    o.partition = partition;
    o.zero_stage = zero;
    o.unshard_per_step = gather == "step";
    o.adamw = adamw;
    o.memory_probe = probe;
    o.timing_rows = micro_rows;
    o.timing_length = std::max(src_len, tgt_len);
    pipe = std::make_unique<bart::PipelinedBart>(zeroshard::ProcessGroup(comm), cfg, o);
    for (const auto& st : pipe->stages()) {
      for (const auto& p : st.module->parameters()) params.push_back(p);
    }
    for (const auto& b : bart::bart_blocks(cfg)) numel += b.params;
    numel -= cfg.vocab_size * cfg.d_model;  // the head's copy
  } else {
    torch::manual_seed(0);
    whole = bart::BartForConditionalGeneration(cfg);
    for (const auto& p : whole->parameters()) numel += p.numel();
    params = whole->parameters();
    opt = std::make_shared<zeroshard::FullyShardedAdamW>(zeroshard::fully_shard(whole, comm), adamw);
  }
  const int d = pipe ? pipe->grid().dp_rank() : rank;
  // Everything this rank sent: the optimizers' communicators, and between stages.
  const auto bytes_sent = [&] {
    int64_t b = pipe ? pipe->bytes_sent() : opt->stats().traffic.total().bytes_sent;
    if (pipe) {
      for (const auto& st : pipe->stages()) b += st.optimizer->stats().traffic.total().bytes_sent;
    }
    return b;
  };
  const double tokens = static_cast<double>(global_batch * tgt_len);

  std::vector<StepSample> samples;
  for (int64_t s = 0; s < warmup + steps; ++s) {
    std::vector<bart::Microbatch> micro;
    for (int k = 0; k < m; ++k) {
      torch::manual_seed(1000 * s + 10 * k + d);
      bart::Microbatch mb;
      mb.batch.input_ids = torch::randint(4, cfg.vocab_size, {micro_rows, src_len}, torch::kLong);
      mb.labels = torch::randint(4, cfg.vocab_size, {micro_rows, tgt_len}, torch::kLong);
      mb.batch.decoder_input_ids = bart::shift_tokens_right(mb.labels, cfg.pad_token_id, cfg.decoder_start_token_id);
      micro.push_back(std::move(mb));
    }
    comm->barrier();  // every rank starts the step together
    const auto t0 = Clock::now();
    const int64_t bytes0 = bytes_sent();
    StepSample x;
    if (pipe) {
      const auto r = pipe->train_step(std::move(micro), tokens);
      x = {r.step_seconds, r.compute_seconds, r.passes_seconds, r.peak_in_flight, r.peak_memory_bytes};
    } else {
      opt->zero_grad();
      const int64_t base = probe();
      for (const auto& mb : micro) {
        const auto c0 = Clock::now();
        const auto logits = whole->forward(mb.batch.input_ids, mb.batch.decoder_input_ids);
        const auto loss = torch::nn::functional::cross_entropy(
            logits.reshape({-1, cfg.vocab_size}), mb.labels.reshape(-1),
            torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) * (dp / tokens);
        x.memory = std::max(x.memory, probe() - base);
        loss.backward();
        x.compute += since(c0);
      }
      opt->step();
      x.step = since(t0);
      x.passes = x.compute;
      x.in_flight = 1;
    }
    x.bytes = bytes_sent() - bytes0;
    if (s >= warmup) samples.push_back(x);
  }
  // Per rank: the median step's numbers (by step time); then every rank's.
  std::sort(samples.begin(), samples.end(), [](const StepSample& a, const StepSample& b) { return a.step < b.step; });
  const StepSample& med = samples[samples.size() / 2];
  auto mine = torch::tensor({med.step, med.compute, med.passes, static_cast<double>(med.in_flight),
                             static_cast<double>(med.memory), static_cast<double>(med.bytes)}, torch::kDouble);
  auto all = torch::empty({6 * world}, torch::kDouble);
  comm->all_gather(all, mine)->wait();
  if (rank == 0) {
    const auto a = all.view({world, 6});
    const double mb_sent = a.select(1, 5).max().item<double>() / 1e6;
    const double step_s = a.select(1, 0).max().item<double>();
    // The bubble over data-parallel index 0's pipeline (ranks 0, dp, 2·dp, ...).
    double busy = 0, span = 0;
    std::ostringstream in_flight, memory, busy_of;
    for (int s = 0; s < pp; ++s) {
      const auto row = a[s * dp];
      busy += row[1].item<double>();
      span = std::max(span, row[2].item<double>());
      in_flight << (s ? " " : "") << static_cast<int>(row[3].item<double>());
      char b[32];
      std::snprintf(b, sizeof(b), "%s%.2f", s ? " " : "", row[1].item<double>());
      busy_of << b;
      memory << (s ? " " : "") << static_cast<int64_t>(row[4].item<double>() / (1 << 20));
    }
    const double bubble = pp > 1 ? 1 - busy / (pp * span) : 0;
    const double formula = pp > 1 ? zeroshard::pipeline::formula_bubble(pipe->schedule()) : 0;
    // The formula with the stages' measured costs: the slowest rank sets the
    // pace, (v·m + p − 1) of its passes long; the others idle the difference.
    double slowest = 0;
    for (int s = 0; s < pp; ++s) slowest = std::max(slowest, a[s * dp][1].item<double>());
    const double vm = static_cast<double>(chunks * m);
    const double uneven = pp > 1 ? 1 - (busy / pp) / (slowest * (vm + pp - 1) / vm) : 0;
    std::printf("ROW | %s | %d x %d | %s | %d | %.1fM | %.2f | %.0f | %.1f | %s | %.3f | %.3f | %.3f | %s | %s |\n",
                pp > 1 ? "pipeline" : "ZeRO-3", pp, dp,
                pp > 1 ? (schedule + (chunks > 1 ? " v=" + std::to_string(chunks) : "") + ", ZeRO-" +
                          std::to_string(zero) + (zero == 3 ? " gathered per " + gather : std::string()) + ", " +
                          partition + " '" +
                          zeroshard::pipeline::to_layout(bart::bart_blocks(cfg), pipe->partition()) + "'").c_str()
                       : "accumulation",
                m, numel / 1e6, step_s, tokens / step_s, mb_sent, busy_of.str().c_str(), bubble, formula, uneven,
                in_flight.str().c_str(),
                memory.str().c_str());
  }
  comm->barrier();
  return 0;
}
