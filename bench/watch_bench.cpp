// watch_bench: what watching a run costs per step, each beside the same without it, in one run
// (bench/watch_bench.sh relates it to the demo's step time):
//   - the step's agreement with every rank's figures in it (RankTimes: 10 values per rank) against
//     the same agreement without them: the trainer's slots (the optimizer's norms and flags, the
//     loss, the preemption vote), timed over blocks of agreements that alternate;
//   - a metrics line written with its TensorBoard record against the line alone (rank 0).
//
//   zeroshard-run --nproc-per-node 2 -- build/bench/watch_bench [--steps 2000] [--blocks 10]
#include <zeroshard/comm.h>
#include <zeroshard/metrics.h>
#include <zeroshard/rank_times.h>
#include <zeroshard/step_agreement.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The slots bart_pretrain's agreement carries without the ranks' figures: the optimizer's (norms,
// rounds, late arrivals, replicas lost: 5), the summed loss (1), the preemption vote (2 per rank).
std::shared_ptr<zeroshard::StepAgreement> trainer_agreement(const std::shared_ptr<zeroshard::Communicator>& comm) {
  auto a = std::make_shared<zeroshard::StepAgreement>(comm);
  a->add("optimizer", 5, [](double* v) { v[0] = 1; }, nullptr);
  a->add("summed token loss", 1, [](double* v) { v[0] = 2; }, nullptr);
  a->add_per_rank("preemption vote", 2, [](double* v) { v[0] = 0; }, nullptr);
  return a;
}

}  // namespace

int watch_bench_main(int argc, char** argv) {
  CLI::App app{"watch_bench: the per-step cost of every rank's figures in the agreement, and of TensorBoard's record"};
  int64_t steps = 2000;
  int blocks = 10;
  app.add_option("--steps", steps, "agreements (and lines) per block");
  app.add_option("--blocks", blocks, "blocks of each kind, alternating");
  CLI11_PARSE(app, argc, argv);
  auto comm = zeroshard::init_communicator();
  const int rank = comm->rank();
  auto plain = trainer_agreement(comm);
  auto watched = trainer_agreement(comm);
  zeroshard::RankTimes times(watched);
  std::vector<double> agree_plain, agree_watched;  // seconds per agreement, per block
  int64_t step = 0;
  std::string spread;  // the last step's, for the line below
  for (int b = 0; b < 2 * blocks; ++b) {
    const bool with = b % 2 == 1;
    auto& a = with ? *watched : *plain;
    comm->barrier();
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < steps; ++i) {
      if (with) {
        times.step_began();
        times.set(0.1, 0.001, 0.01);
      }
      a.agree();
      if (with) spread = times.spread(++step).json;
    }
    (with ? agree_watched : agree_plain).push_back(seconds_since(t0) / static_cast<double>(steps));
  }
  // The metrics line, alone and with its TensorBoard record (rank 0 writes both in a run).
  std::vector<double> write_plain, write_tb;
  if (rank == 0) {
    const auto dir = std::filesystem::temp_directory_path() / ("zs-watch-bench-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    zeroshard::MetricsOptions with_tb;
    with_tb.tensorboard_dir = (dir / "tensorboard").string();
    zeroshard::MetricsLog lines((dir / "plain.jsonl").string(), 0);
    zeroshard::MetricsLog both((dir / "tb.jsonl").string(), 0, with_tb);
    zeroshard::StepMetrics m;
    m.loss = 4.2;
    m.lr = 1e-3;
    m.grad_norm = 0.9;
    m.tokens = 1642;
    m.seconds = 0.2;
    m.extra_json = "{\"data_wait_s\": 0.001, \"world_all_reduces\": 1, \"noise_scale\": 1900.0, \"efficiency\": 0.73, "
                   "\"goodput\": 2200.0, \"ranks\": " + spread + "}";
    for (int b = 0; b < 2 * blocks; ++b) {
      const bool with = b % 2 == 1;
      auto& log = with ? both : lines;
      const auto t0 = Clock::now();
      for (int64_t i = 0; i < steps; ++i) {
        m.step = b * steps + i + 1;
        log.write(m);
      }
      (with ? write_tb : write_plain).push_back(seconds_since(t0) / static_cast<double>(steps));
    }
    std::filesystem::remove_all(dir);
  }
  if (rank == 0) {
    const double ap = median(agree_plain), aw = median(agree_watched);
    const double wp = median(write_plain), wt = median(write_tb);
    std::printf("watch_bench: %d ranks, %lld agreements and lines per block, medians of %d blocks each\n",
                comm->size(), static_cast<long long>(steps), blocks);
    std::printf("ROW | the step's agreement (the trainer's slots) | %.1f us |\n", ap * 1e6);
    std::printf("ROW | the same with every rank's figures (+%d values per rank) and the spread | %.1f us |\n",
                zeroshard::RankTimes::kSlot, aw * 1e6);
    std::printf("ROW | a metrics line (rank 0) | %.1f us |\n", wp * 1e6);
    std::printf("ROW | the same with its TensorBoard record | %.1f us |\n", wt * 1e6);
    std::printf("ADDED_S %.9f\n", std::max(0.0, aw - ap) + std::max(0.0, wt - wp));
  }
  return 0;
}
