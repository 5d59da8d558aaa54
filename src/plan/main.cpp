// zeroshard-plan: which strategy to train a model with on a cluster, and the
// memory per rank each one needs: the cost model's predictions (cost_model.h).
//   zeroshard-plan --model bart-large --hosts 4 --ranks-per-host 8
//   zeroshard-plan --model 7b --hosts 128 --inter-GBps 400 --memory-GB 80
//   zeroshard-plan --decoder 2048,5632,16,22,32000 --hosts 2   (a model of your own shape)
#include "plan/cost_model.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>

namespace {

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", bytes / (1024.0 * 1024 * 1024));
  return buf;
}

// Every candidate strategy's prediction, fastest that fits first, as a
// Markdown table, and the recommendation; 1 when none fits.
int print_plan(const zeroshard::plan::Model& m, const zeroshard::plan::Cluster& c, const zeroshard::plan::Step& step,
               int64_t batch, int64_t seq, const std::string& precision, double memory_gb) {
  using namespace zeroshard::plan;
  struct Row {
    Strategy s;
    Prediction p;
  };
  std::vector<Row> rows;
  for (const auto& s : candidates(c, m, step, batch)) rows.push_back({s, predict(m, c, s, step)});
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    return a.p.fits != b.p.fits ? a.p.fits : a.p.step_s < b.p.step_s;
  });
  std::printf("%s: %.1fM parameters, %s; %d host(s) x %d ranks; global batch %lld x %lld tokens. Predictions of "
              "the cost model (src/plan/cost_model.h), not measurements.\n\n",
              m.name.c_str(), m.params() / 1e6, precision.c_str(), c.hosts, c.ranks_per_host,
              static_cast<long long>(batch), static_cast<long long>(seq));
  std::printf("| strategy | step, s | tokens/s | compute, s | exposed comm, s | bubble, s | GB between hosts per host "
              "link | memory per rank, GiB (states + gathered + activations) | fits %.0f GB |\n",
              memory_gb);
  std::printf("|---|---:|---:|---:|---:|---:|---:|---|---|\n");
  for (const auto& r : rows) {
    const auto& p = r.p;
    std::printf("| %s | %.3f | %.0f | %.3f | %.3f | %.3f | %.2f | %s (%s + %s + %s) | %s |\n", r.s.describe().c_str(),
                p.step_s, step.tokens / p.step_s, p.compute_s, p.exposed_comm_s, p.bubble_s, p.inter_host_bytes / 1e9,
                gib(p.memory()).c_str(), gib(p.model_states).c_str(), gib(p.working_set).c_str(),
                gib(p.activations).c_str(), p.fits ? "yes" : "no");
  }
  if (rows.empty() || !rows.front().p.fits) {
    std::printf("\nNo strategy fits %.0f GB per rank: add ranks, or shorten the batch per rank.\n", memory_gb);
    return 1;
  }
  std::printf("\nRecommended: %s (%.3f s per step, %s GiB per rank).\n", rows.front().s.describe().c_str(),
              rows.front().p.step_s, gib(rows.front().p.memory()).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace zeroshard::plan;
  std::string model_name = "bart-large", precision = "bf16";
  int64_t seq = 1024, batch = 512;
  Cluster c;
  c.hosts = 1;
  c.ranks_per_host = 8;
  double intra_gbps = 450, intra_alpha_us = 5, inter_gbps = 400, inter_alpha_us = 10, tflops = 989, mfu = 0.4,
         memory_gb = 80;
  CLI::App app{"zeroshard-plan: the predicted step time and memory per rank of every sharding strategy for a model "
               "on a cluster, and the fastest that fits. Defaults describe H100 hosts: 8 GPUs on NVLink "
               "(450 GB/s each way per GPU), 8 x 400 Gb/s InfiniBand per host, 989 dense bf16 TFLOP/s at 40% "
               "utilization, 80 GB"};
  app.add_option("--model", model_name, "bart-base, bart-large or 7b (LLaMA-7B's shape)")->capture_default_str();
  app.add_option("--seq", seq, "tokens per sequence")->check(CLI::Range(int64_t{1}, int64_t{1} << 20))->capture_default_str();
  app.add_option("--global-batch", batch, "sequences per step, over every rank")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--precision", precision, "bf16 (parameters and gradients; fp32 master and moments) or fp32")
      ->check(CLI::IsMember({"bf16", "fp32"}))
      ->capture_default_str();
  app.add_option("--hosts", c.hosts, "hosts")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--ranks-per-host", c.ranks_per_host, "ranks (GPUs) per host")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--intra-GBps", intra_gbps, "bandwidth between two ranks of a host, GB/s each way")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--intra-alpha-us", intra_alpha_us, "latency of a message inside a host, microseconds")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--inter-GBps", inter_gbps, "a host's bandwidth to the others, GB/s each way (all its NICs)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--inter-alpha-us", inter_alpha_us, "latency of a message between hosts, microseconds")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--tflops", tflops, "peak dense TFLOP/s of a rank in the training precision")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--mfu", mfu, "the fraction of the peak the model's compute reaches (measure it: tokens/s x 6 x "
                 "parameters / peak)")
      ->check(CLI::Range(0.001, 1.0))
      ->capture_default_str();
  app.add_option("--memory-GB", memory_gb, "memory per rank, GB (10^9 bytes)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--gather-overlap", c.gather_overlap, "the share of ZeRO-3's prefetched gathers that compute hides "
                 "(1: GPUs, where collectives have their own streams; bench/plan_validate.sh fits it for CPU hosts)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--reduce-overlap", c.reduce_overlap, "the share of gradient reductions that compute hides (as "
                 "--gather-overlap)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  std::vector<int64_t> bart_shape;
  app.add_option("--bart", bart_shape, "instead of --model: a BART of D_MODEL,FFN,HEADS,LAYERS,VOCAB,POSITIONS "
                 "(LAYERS encoder and LAYERS decoder layers)")
      ->delimiter(',')
      ->expected(6);
  std::vector<int64_t> decoder_shape;
  app.add_option("--decoder", decoder_shape, "instead of --model: a decoder-only transformer of LLaMA's layout "
                 "(SwiGLU, untied embeddings) of D_MODEL,FFN,HEADS,LAYERS,VOCAB")
      ->delimiter(',')
      ->expected(5)
      ->excludes("--bart");
  double seconds_per_token = 0;
  app.add_option("--seconds-per-token", seconds_per_token, "measured forward + backward seconds per token on one "
                 "rank (instead of --tflops and --mfu)")
      ->check(CLI::NonNegativeNumber);
  double tokens = 0;
  app.add_option("--tokens-per-step", tokens, "tokens per step when sequences are shorter than --seq (default: "
                 "--seq x --global-batch)")
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  Model m;
  try {
    m = !bart_shape.empty() ? bart(bart_shape[0], bart_shape[1], bart_shape[2], bart_shape[3], bart_shape[4],
                                   bart_shape[5], seq)
        : !decoder_shape.empty() ? llama(decoder_shape[0], decoder_shape[1], decoder_shape[2], decoder_shape[3],
                                         decoder_shape[4], seq)
                                 : named_model(model_name, seq);
  } catch (const std::exception& e) {
    std::cerr << "zeroshard-plan: --model: " << e.what() << "\n";
    return 2;
  }
  c.seconds_per_token = seconds_per_token;
  m.param_bytes = precision == "bf16" ? 2 : 4;
  c.intra = {intra_alpha_us * 1e-6, intra_gbps * 1e9};
  c.inter = {inter_alpha_us * 1e-6, inter_gbps * 1e9};
  c.flops_per_s = tflops * 1e12 * mfu;
  c.memory_bytes = memory_gb * 1e9;
  const Step step{tokens > 0 ? tokens : static_cast<double>(seq * batch)};

  return print_plan(m, c, step, batch, seq, precision, memory_gb);
}
