// bart_bench: BART training steps on N ranks, one sharding mode per run, and
// this machine's matmul peak (the denominator of model-FLOPs utilisation).
//
//   bart_bench --mode peak                       # one process, every core: fp32 GEMM GFLOP/s
//   zeroshard-run --nproc-per-node 4 -- bart_bench --mode zero3 --config base
//
// Modes: dp (replicated model and torch::optim::AdamW; gradients averaged by
// one all-reduce after backward), zero2 (ShardedAdamW stage 2), zero3
// (fully_shard + FullyShardedAdamW). Batches are random token ids (the cost of
// a step does not depend on the text). Rank 0 prints "ROW | ... |" for
// bench/bart_bench.sh, which runs every mode and prints the table.
#include "model/bart_model.h"
#include "bench_util.h"
#include "step_profile.h"

#include <zeroshard/fully_shard.h>
#include <zeroshard/log.h>
#include <zeroshard/metrics.h>
#include <zeroshard/sharded_adamw.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

namespace bart_bench {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// GEMM throughput of `dtype` on `device` (on the CPU with every core): the
// best of several timed rounds.
double matmul_peak_gflops(int64_t n, double seconds, torch::Device device, torch::Dtype dtype) {
  at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const auto opts = torch::TensorOptions().device(device).dtype(dtype);
  auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts), c = torch::empty({n, n}, opts);
  torch::mm_out(c, a, b);  // warm-up
  zeroshard::bench::sync_device(device);
  double best = 0;
  const auto start = Clock::now();
  while (since(start) < seconds) {
    const auto t0 = Clock::now();
    for (int i = 0; i < 4; ++i) torch::mm_out(c, a, b);
    zeroshard::bench::sync_device(device);
    best = std::max(best, 4 * 2.0 * n * n * n / since(t0) / 1e9);
  }
  return best;
}

}  // namespace bart_bench

int bart_bench_main(int argc, char** argv) {
  using namespace bart_bench;
  std::string mode = "zero3", config = "base", device_name = "cpu", precision = "fp32", profile, device_comm = "auto";
  int64_t batch = 2, src_len = 64, tgt_len = 64, steps = 3, warmup = 1, matmul_n = 2048;
  CLI::App app{"bart_bench: BART training steps under dp / zero2 / zero3, and the matmul peak"};
  app.add_option("--mode", mode, "peak, dp, zero2 or zero3")
      ->check(CLI::IsMember({"peak", "dp", "zero2", "zero3"}))
      ->capture_default_str();
  app.add_option("--config", config, "tiny, base, large or a config.json")->capture_default_str();
  app.add_option("--batch", batch, "sequences per rank and step")->capture_default_str();
  app.add_option("--src-len", src_len, "encoder tokens per sequence")->capture_default_str();
  app.add_option("--tgt-len", tgt_len, "decoder tokens per sequence")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_option("--matmul-n", matmul_n, "peak: square matrix size")->capture_default_str();
  app.add_option("--device-comm", device_comm, "cuda: nccl, staged (through host memory) or auto (NCCL, unless "
                 "ranks share a GPU)")
      ->check(CLI::IsMember({"auto", "nccl", "staged"}))
      ->capture_default_str();
  app.add_option("--profile", profile, "after the timed steps, one more traced on rank 0 (LibTorch's profiler): "
                 "its Chrome trace to this file, and the top kernels and device busy time printed (LibTorch 2.x)");
  app.add_option("--device", device_name, "cpu, or cuda (rank r on cuda:(LOCAL_RANK mod GPUs))")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--precision", precision, "fp32, or bf16 (bf16 weights, fp32 master and AdamW states; the peak "
                                           "is bf16 GEMM)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const auto dtype = precision == "bf16" ? torch::kBFloat16 : torch::kFloat;
  torch::Device device = torch::kCPU;
  if (device_name == "cuda") {
    const auto gpus = static_cast<int>(torch::cuda::device_count());
    TORCH_CHECK_VALUE(gpus > 0, "bart_bench --device cuda: no CUDA device is visible");
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(zeroshard::read_dist_env().local_rank % gpus));
    c10::impl::VirtualGuardImpl(device.type()).setDevice(device);
  }
  if (mode == "peak") {
    std::printf("ROW peak %.1f\n", matmul_peak_gflops(matmul_n, 3.0, device, dtype));
    return 0;
  }
  auto comm = zeroshard::init_communicator();
  const auto transport = device_comm == "nccl"     ? zeroshard::DeviceTransport::kNccl
                         : device_comm == "staged" ? zeroshard::DeviceTransport::kStaged
                                                   : zeroshard::DeviceTransport::kAuto;
  const zeroshard::ProcessGroup group = zeroshard::device_group(comm, device, {}, transport);
  const int rank = comm->rank(), world = comm->size();
  auto cfg = bart::BartConfig::named(config);
  cfg.dropout = cfg.attention_dropout = cfg.activation_dropout = 0.0;
  torch::manual_seed(0);
  bart::BartForConditionalGeneration model(cfg);
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  model->to(dtype);
  model->to(device);

  std::shared_ptr<zeroshard::FullyShardedModel> sharded;
  std::unique_ptr<torch::optim::Optimizer> opt;
  zeroshard::ShardedOptimizer* sharding = nullptr;  // ZeRO-2 or 3; null: plain data parallelism
  const auto adamw = torch::optim::AdamWOptions(1e-4).weight_decay(0.01);
  if (mode == "zero3") {
    sharded = zeroshard::fully_shard(model, group);
    auto o = std::make_unique<zeroshard::FullyShardedAdamW>(sharded, adamw);
    sharding = o.get();
    opt = std::move(o);
  } else if (mode == "zero2") {
    auto o = std::make_unique<zeroshard::ShardedAdamW>(model->named_parameters(), group, adamw);
    sharding = o.get();
    opt = std::move(o);
  } else {
    // Plain data parallelism starts from rank 0's parameters too.
    for (auto& p : model->parameters()) group.data->broadcast(p.data(), 0)->wait();
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), adamw);
  }
  auto waited = [&] { return sharding != nullptr ? sharding->stats().waits.total() : 0.0; };

  std::vector<double> times, exposed;
  torch::manual_seed(1000 + rank);
  double dp_wait = 0;
  const auto run_step = [&](const torch::Tensor& input, const torch::Tensor& labels) {
    opt->zero_grad();
    model->loss(input, labels, /*source_padded=*/false).backward();  // ids >= 4: no padding, as the peer's (no mask)
    dp_wait = 0;
    if (sharding == nullptr) {
      const auto a0 = Clock::now();
      zeroshard::bench::average_gradients(*group.data, model->parameters());
      dp_wait = since(a0);
    }
    opt->step();
    zeroshard::bench::sync_device(device);
  };
  // With --profile, one more step after the timed ones, traced on rank 0 (untimed: the profiler slows it).
  for (int64_t s = 0; s < warmup + steps + (profile.empty() ? 0 : 1); ++s) {
    const auto input = torch::randint(4, cfg.vocab_size, {batch, src_len}, torch::kLong).to(device);
    const auto labels = torch::randint(4, cfg.vocab_size, {batch, tgt_len}, torch::kLong).to(device);
    zeroshard::bench::sync_device(device);
    comm->barrier();  // every rank starts the step together: the slowest rank's time is the step's
    if (s == warmup + steps) {
      if (rank == 0) {
        zeroshard::bench::profile_step(profile, device, [&] { run_step(input, labels); });
      } else {
        run_step(input, labels);
      }
      continue;
    }
    const auto t0 = Clock::now();
    const double w0 = waited();
    run_step(input, labels);
    const double t = since(t0);
    if (s >= warmup) {
      times.push_back(t);
      exposed.push_back(waited() - w0 + dp_wait);
    }
  }
  std::sort(times.begin(), times.end());
  std::sort(exposed.begin(), exposed.end());
  // The slowest rank's median step and exposed communication, and every rank's peak memory.
  // Parameters, gradients and AdamW moments held (plain data parallelism: 16 bytes per parameter).
  const double model_states = sharding != nullptr ? static_cast<double>(sharding->stats().memory.peak_model_states)
                                                  : 16.0 * static_cast<double>(numel);
  auto mine = torch::tensor({times[times.size() / 2], exposed[exposed.size() / 2],
                             zeroshard::bench::peak_memory_mib(device) * (1 << 20), model_states}, torch::kDouble);
  comm->all_reduce(mine, zeroshard::ReduceOp::kMax)->wait();
  const double step_s = mine[0].item<double>();
  const double tokens_per_s = static_cast<double>(world * batch * tgt_len) / step_s;
  if (rank == 0) {
    // ROW mode ranks params step_s tokens/s model_tflops exposed_s peak_memory_mib model_states_mib
    std::printf("ROW %s %d %lld %.3f %.1f %.4f %.3f %.0f %.0f\n", mode.c_str(), world, static_cast<long long>(numel),
                step_s, tokens_per_s, 6.0 * static_cast<double>(numel) * tokens_per_s / 1e12, mine[1].item<double>(),
                mine[2].item<double>() / (1 << 20), mine[3].item<double>() / (1 << 20));
  }
  comm->barrier();
  return 0;
}
