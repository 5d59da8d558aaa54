// pipe_bench: the pipeline executor on synthetic stages of known cost, to
// measure its bubble and in-flight microbatches against the schedules' closed
// forms. Every rank is one stage (pp = world size, dp = 1) per chunk; a
// stage's forward sleeps --forward-ms / v and its backward twice that (a
// custom autograd node), so the passes cost what the formulas assume and the
// measurement needs no CPU (it runs at any number of ranks on a small
// machine). Payloads are small tensors sent between stages as in training.
//
// Measured per step: bubble = 1 − Σ_r (time rank r spent in F and B passes) /
// (p × slowest rank's step time), the step including the sends and the
// step-end all-reduce; and each rank's peak (stage, microbatch) pairs
// forwarded and not yet backwarded. Rank 0 prints a "ROW |...|" line beside
// the formulas:
//   bubble: GPipe and 1F1B (p−1)/(m+p−1); interleaved 1F1B (p−1)/(v·m+p−1)
//   peak on rank r: GPipe m; 1F1B min(p−r, m); interleaved min(2(p−r−1)+(v−1)p+1, v·m)
//
//   zeroshard-run --nproc-per-node 4 -- bench/pipe_bench --schedule 1f1b --microbatches 8
#include <zeroshard/comm.h>
#include <zeroshard/pipeline_executor.h>
#include <zeroshard/trace.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <thread>

namespace pipe_bench {

using namespace zeroshard::pipeline;

void sleep_ms(double ms) { std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms)); }

// Identity whose backward takes `ms`.
struct SlowBackward : torch::autograd::Function<SlowBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, double ms) {
    ctx->saved_data["ms"] = ms;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    sleep_ms(ctx->saved_data["ms"].toDouble());
    return {grads[0], torch::Tensor()};
  }
};

int formula_peak(ScheduleKind kind, int p, int r, int m, int v) {
  switch (kind) {
    case ScheduleKind::kGPipe: return m;
    case ScheduleKind::k1F1B: return std::min(p - r, m);
    case ScheduleKind::kInterleaved1F1B: return std::min(2 * (p - r - 1) + (v - 1) * p + 1, v * m);
    case ScheduleKind::kForward: return 0;  // evaluation keeps nothing
  }
  return 0;
}

}  // namespace pipe_bench

int pipe_bench_main(int argc, char** argv) {
  using namespace pipe_bench;
  std::string schedule = "1f1b";
  int microbatches = 8, chunks = 1, steps = 3;
  double forward_ms = 20;
  CLI::App app{"pipeline bubble and in-flight microbatches on stages of known cost, beside the formulas"};
  app.add_option("--schedule", schedule, "gpipe | 1f1b | interleaved-1f1b")->capture_default_str();
  app.add_option("--microbatches", microbatches, "m")->capture_default_str();
  app.add_option("--chunks", chunks, "v: stages per rank (interleaved)")->capture_default_str();
  app.add_option("--forward-ms", forward_ms, "a stage's forward on one rank (backward: twice)")->capture_default_str();
  app.add_option("--steps", steps, "timed steps (after one untimed)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto comm = zeroshard::init_communicator();
  const int p = comm->size(), rank = comm->rank();
  const ScheduleKind kind = parse_schedule_kind(schedule);
  GridOptions go;
  go.stages = p;
  const PipelineGrid grid(comm, go);
  const double pass_ms = forward_ms / chunks;  // every rank holds the same work
  const int rows = 4, width = 64;
  std::vector<torch::Tensor> weights;  // one per stage of this rank, so every stage has a backward
  for (int c = 0; c < chunks; ++c) weights.push_back(torch::ones({1}, torch::requires_grad()));
  StageFunctions f;
  f.forward = [&](int stage, int, const Payload& in) {
    sleep_ms(pass_ms);
    const auto x = stage == 0 ? torch::ones({rows, width}) : in.at(0).second;
    return Payload{{"h", SlowBackward::apply(x * weights[static_cast<size_t>(stage / p)], 2 * pass_ms)}};
  };
  f.input_spec = [&](int, int) { return PayloadSpec{{"h", {rows, width}, torch::kFloat}}; };
  f.loss = [](int, const Payload& out) { return out.at(0).second.mean(); };
  const Schedule schedule_of_run = make_schedule(kind, p, microbatches, chunks);
  PipelineExecutor ex(grid, schedule_of_run, f);

  ex.run_step();  // untimed: connections, allocations
  double bubble_sum = 0;
  std::vector<double> peaks(static_cast<size_t>(p), 0);
  for (int s = 0; s < steps; ++s) {
    const StepResult r = ex.run_step();
    auto mine = torch::tensor({r.compute_seconds, r.step_seconds, static_cast<double>(r.peak_in_flight)}, torch::kDouble);
    auto all = torch::empty({3 * p}, torch::kDouble);
    comm->all_gather(all, mine)->wait();
    const auto a = all.view({p, 3});
    const double compute = a.select(1, 0).sum().item<double>();
    const double slowest = a.select(1, 1).max().item<double>();
    bubble_sum += 1 - compute / (p * slowest);
    for (int q = 0; q < p; ++q) peaks[static_cast<size_t>(q)] = std::max(peaks[static_cast<size_t>(q)], a[q][2].item<double>());
  }
  if (rank == 0) {
    const double bubble = bubble_sum / steps;
    const double formula = formula_bubble(schedule_of_run);
    std::ostringstream measured, expected;
    bool peaks_equal = true;
    for (int q = 0; q < p; ++q) {
      const int want = formula_peak(kind, p, q, microbatches, chunks);
      measured << (q ? " " : "") << static_cast<int>(peaks[static_cast<size_t>(q)]);
      expected << (q ? " " : "") << want;
      peaks_equal = peaks_equal && static_cast<int>(peaks[static_cast<size_t>(q)]) == want;
    }
    std::printf("ROW | %s | %d | %d | %d | %.4f | %.4f | %+.1f%% | %s | %s | %s |\n", schedule.c_str(), p, microbatches,
                chunks, bubble, formula, 100 * (bubble - formula) / formula, measured.str().c_str(),
                expected.str().c_str(), peaks_equal ? "equal" : "DIFFERENT");
  }
  return 0;
}
