// The executor: a model split into pipeline stages, each sharded with
// ShardedAdamW over its data-parallel group, trained for a few steps under
// every schedule, against the same model trained unpipelined with the same
// microbatches by torch::optim::AdamW in every process. Runs at the world
// size of the run with every pipeline depth that divides it (and >= 2).
#include "test_util.h"
#include "zeroshard/pipeline_executor.h"
#include "zeroshard/pipeline_partition.h"
#include "zeroshard/sharded_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace zeroshard::pipeline {
namespace executor_test {

using testing::world;
using testing::world_ptr;

constexpr int kIn = 8, kWidth = 16, kOut = 4, kBlocks = 8, kBatch = 24, kSteps = 4;

// Blocks: an input layer, kBlocks - 2 hidden layers, a head.
std::vector<torch::nn::Linear> make_blocks() {
  torch::manual_seed(5);
  std::vector<torch::nn::Linear> b;
  b.emplace_back(kIn, kWidth);
  for (int i = 0; i < kBlocks - 2; ++i) b.emplace_back(kWidth, kWidth);
  b.emplace_back(kWidth, kOut);
  return b;
}
torch::Tensor apply(torch::nn::Linear& block, size_t index, const torch::Tensor& x) {
  auto y = block->forward(x);
  return index + 1 < kBlocks ? torch::tanh(y) : y;
}
std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(100 + step);
  return {torch::randn({kBatch, kIn}), torch::randn({kBatch, kOut})};
}
const auto kAdamW = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);

// The oracle: the whole model, the same microbatches, one process.
std::pair<std::vector<torch::Tensor>, std::vector<double>> unpipelined(int microbatches) {
  auto blocks = make_blocks();
  std::vector<torch::Tensor> params;
  for (auto& b : blocks) {
    for (auto& p : b->parameters()) params.push_back(p);
  }
  torch::optim::AdamW opt(params, kAdamW);
  std::vector<double> losses;
  const int rows = kBatch / microbatches;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    opt.zero_grad();
    double sum = 0;
    for (int mb = 0; mb < microbatches; ++mb) {
      auto h = x.slice(0, mb * rows, (mb + 1) * rows);
      for (size_t i = 0; i < blocks.size(); ++i) h = apply(blocks[i], i, h);
      auto loss = torch::mse_loss(h, y.slice(0, mb * rows, (mb + 1) * rows)) / microbatches;
      loss.backward();
      sum += loss.item<double>();
    }
    opt.step();
    losses.push_back(sum);
  }
  std::vector<torch::Tensor> out;
  for (auto& p : params) out.push_back(p.detach().clone());
  return {out, losses};
}

void expect_matches_unpipelined(int pp, ScheduleKind kind, int microbatches, int chunks) {
  SCOPED_TRACE(to_string(kind) + " pp=" + std::to_string(pp) + " m=" + std::to_string(microbatches) +
               " v=" + std::to_string(chunks));
  GridOptions go;
  go.stages = pp;
  const PipelineGrid grid(world_ptr(), go);
  const int dp = grid.dp(), stages = pp * chunks, last = stages - 1;
  const int rows = kBatch / microbatches / dp;  // this rank's rows of each microbatch
  auto blocks = make_blocks();
  std::vector<Block> described;
  for (int i = 0; i < kBlocks; ++i) described.push_back({"block" + std::to_string(i), "l", 0});
  const Partition part = partition_uniform(described, stages);
  // This rank's stages' parameters, sharded over its data-parallel group.
  std::vector<torch::Tensor> mine;
  for (int s = grid.stage(); s < stages; s += pp) {
    for (size_t b : part.stages[static_cast<size_t>(s)]) {
      for (auto& p : blocks[b]->parameters()) mine.push_back(p);
    }
  }
  ShardedAdamW opt(mine, grid.dp_group(), kAdamW);
  int step = 0;
  torch::Tensor x, y;
  StageFunctions f;
  f.forward = [&](int stage, int mb, const Payload& in) {
    const int64_t from = mb * (kBatch / microbatches) + grid.dp_rank() * rows;
    torch::Tensor h = stage == 0 ? x.slice(0, from, from + rows) : in.at(0).second;
    for (size_t b : part.stages[static_cast<size_t>(stage)]) h = apply(blocks[b], b, h);
    return Payload{{"h", h}};
  };
  f.input_spec = [&](int, int) { return PayloadSpec{{"h", {rows, kWidth}, torch::kFloat}}; };
  f.loss = [&](int mb, const Payload& out) {
    const int64_t from = mb * (kBatch / microbatches) + grid.dp_rank() * rows;
    return torch::mse_loss(out.at(0).second, y.slice(0, from, from + rows)) / microbatches;
  };
  PipelineExecutor ex(grid, make_schedule(kind, pp, microbatches, chunks), f);
  const auto [want, want_losses] = unpipelined(microbatches);
  for (step = 0; step < kSteps; ++step) {
    std::tie(x, y) = batch(step);
    opt.zero_grad();
    double loss = 0;
    {
      auto local = opt.no_sync();  // microbatches accumulate locally; step() reduces over dp
      loss = ex.run_step();
    }
    opt.step();
    // The last stage's loss, averaged over its data-parallel ranks: the oracle's.
    auto t = torch::tensor({loss}, torch::kDouble);
    grid.dp_group().control->all_reduce(t, ReduceOp::kAvg)->wait();
    if (grid.stage() == last % pp) {
      const double want_loss = want_losses[static_cast<size_t>(step)];
      EXPECT_NEAR(t.item<double>(), want_loss, 1e-6 * want_loss) << "step " << step;
    }
  }
  // Every parameter this rank trained against the oracle's.
  size_t k = 0;
  for (int b = 0; b < kBlocks; ++b) {
    const bool held = static_cast<int>(part.stage_of(static_cast<size_t>(b))) % pp == grid.stage();
    for (auto& p : blocks[static_cast<size_t>(b)]->parameters()) {
      if (held) {
        const double err = ((p.detach() - want[k]).abs() / (want[k].abs() + 1e-2)).max().item<double>();
        EXPECT_LT(err, 3e-5) << "block " << b;
      }
      ++k;
    }
  }
}

TEST(PipelineExecutor, EverySchedulesMatchesUnpipelinedTraining) {
  const int n = world().size();
  for (int pp = 2; pp <= n; ++pp) {
    if (n % pp != 0) continue;
    expect_matches_unpipelined(pp, ScheduleKind::kGPipe, 4, 1);
    expect_matches_unpipelined(pp, ScheduleKind::k1F1B, 4, 1);
    if (kBlocks >= 2 * pp) expect_matches_unpipelined(pp, ScheduleKind::kInterleaved1F1B, pp * 2, 2);
  }
  if (n < 2) GTEST_SKIP() << "needs 2 ranks for a pipeline";
}

// A stage whose output has another shape than the next stage's input is named
// at its first forward, before anything is sent.
TEST(PipelineExecutor, AStageReturningTheWrongShapeIsNamed) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  GridOptions go;
  go.stages = 2;
  const PipelineGrid grid(world_ptr(), go);
  StageFunctions f;
  f.forward = [](int stage, int, const Payload& in) {
    return stage == 0 ? Payload{{"h", torch::zeros({3, 5})}} : in;
  };
  f.input_spec = [](int, int) { return PayloadSpec{{"h", {3, 4}, torch::kFloat}}; };
  f.loss = [](int, const Payload& out) { return out.at(0).second.sum(); };
  PipelineExecutor ex(grid, make_schedule(ScheduleKind::kGPipe, 2, 1), f);
  if (grid.stage() == 0) {
    const std::string err = testing::error_of([&] { ex.run_step(); });
    EXPECT_NE(err.find("stage 0 (microbatch 0)'s output has h [3, 5] Float where h [3, 4] Float was expected"),
              std::string::npos) << err;
  }
  // stage 1 would wait for an activation that never comes: it does not run
}

}  // namespace executor_test
}  // namespace zeroshard::pipeline
