// ShardedOptimizer: what ZeRO-1, 2 and 3 share, through the base class.
// Runs at 1-4 ranks under zeroshard-run (ctest sharded_adamw_np*).
#include "shard/fully_shard_models.h"
#include "test_util.h"
#include "zeroshard/fully_shard.h"
#include "zeroshard/sharded_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace zeroshard {
namespace sharded_optimizer_test {

using namespace fsdp_test;
using testing::world;
using testing::world_ptr;

// The same model trained through the base class, whatever the stage.
struct Trainer {
  Tiny model{nullptr};
  int64_t numel = 0;                           // parameters, counted before sharding
  std::shared_ptr<FullyShardedModel> sharded;  // stage 3
  std::unique_ptr<ShardedOptimizer> opt;
  explicit Trainer(int stage, LossScaleOptions scaling = {}) {
    torch::manual_seed(3);
    model = Tiny();
    for (const auto& p : model->parameters()) numel += p.numel();
    if (stage == 3) {
      sharded = fully_shard(model, world_ptr());
      FullyShardedAdamWOptions o;
      o.loss_scale = scaling;
      opt = std::make_unique<FullyShardedAdamW>(sharded, kAdamW, o);
    } else {
      ShardedAdamWOptions o;
      o.zero_stage = stage;
      o.bucket_bytes = 2048;  // several buckets
      o.loss_scale = scaling;
      opt = std::make_unique<ShardedAdamW>(model->named_parameters(), world_ptr(), kAdamW, o);
    }
  }
  void backward(int step) {
    const int n = world().size(), r = world().rank();
    auto [x, y] = batch(step, 0);
    x = x.slice(0, r * kBatch / n, (r + 1) * kBatch / n);
    y = y.slice(0, r * kBatch / n, (r + 1) * kBatch / n);
    opt->zero_grad();
    opt->scale_loss(torch::mse_loss(model->forward(x), y) * (static_cast<double>(x.size(0)) * n / kBatch)).backward();
  }
  torch::Tensor params() {
    if (!sharded) return flat(model);
    auto full = sharded->summon_full_params();
    return flat(model);
  }
};

class ShardedOptimizerStages : public ::testing::TestWithParam<int> {};

// local_sumsq() summed by the caller and handed to apply_clip() is
// clip_grad_norm(): the same norms, and the same parameters to the bit.
TEST_P(ShardedOptimizerStages, SplitClipEqualsClipGradNorm) {
  const int stage = GetParam();
  Trainer whole(stage), split(stage);
  for (int s = 0; s < 4; ++s) {
    whole.backward(s);
    const double norm = whole.opt->clip_grad_norm(0.05);
    whole.opt->step();

    split.backward(s);
    auto sumsq = torch::tensor({split.opt->local_sumsq()}, torch::kDouble);
    world().all_reduce(sumsq, ReduceOp::kSum)->wait();
    const double global = std::sqrt(sumsq.item<double>());
    split.opt->apply_clip(0.05, global);
    split.opt->step();

    EXPECT_EQ(global, norm) << "step " << s;
    EXPECT_GT(norm, 0.05) << "step " << s << ": the clip must bite for the test to mean something";
  }
  EXPECT_TRUE(torch::equal(whole.params(), split.params()));
  EXPECT_EQ(split.opt->zero_stage(), stage);
}

// A norm that overflowed (inf) skips the step on every rank when loss scaling
// is on, and halves the scale; the parameters stay as they were.
TEST_P(ShardedOptimizerStages, ApplyClipWithAnInfiniteNormSkipsTheStep) {
  LossScaleOptions scaling;
  scaling.enabled = 1;
  Trainer run(GetParam(), scaling);
  const auto before = run.params();
  const double scale = run.opt->loss_scale();
  run.backward(0);
  run.opt->local_sumsq();
  run.opt->apply_clip(1.0, std::numeric_limits<double>::infinity());
  run.opt->step();
  EXPECT_TRUE(run.opt->last_step_skipped());
  EXPECT_EQ(run.opt->loss_scale(), scale * 0.5);
  EXPECT_TRUE(torch::equal(before, run.params()));
  run.backward(1);  // and the next step trains again
  run.opt->step();
  EXPECT_FALSE(run.opt->last_step_skipped());
  EXPECT_FALSE(torch::equal(before, run.params()));
}

TEST_P(ShardedOptimizerStages, StatsCountTheMomentsAndTheTraffic) {
  Trainer run(GetParam());
  run.backward(0);
  run.opt->step();
  const auto st = run.opt->stats();
  // exp_avg and exp_avg_sq of every element this rank owns (the shards tile
  // the padded buffers: together at least every parameter).
  int64_t owned = 0;
  for (const auto& b : run.opt->sharded_state().buckets) owned += b.shard.size();
  EXPECT_EQ(st.memory.moments, 8 * owned);
  EXPECT_GE(owned * world().size(), run.numel);
  EXPECT_GE(st.memory.peak_model_states, st.memory.moments);
  if (world().size() > 1) {
    EXPECT_GT(st.traffic.total().bytes_sent, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(ZeroStages, ShardedOptimizerStages, ::testing::Values(0, 1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return "zero" + std::to_string(i.param); });

TEST(ShardedOptimizerBadInput, ForeignGroupOptionsAreAClearError) {
  torch::manual_seed(3);
  Tiny m;
  auto sharded = fully_shard(m, world_ptr());
  auto two = two_groups(*m);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(two[0]);
  groups.emplace_back(two[1].params(), std::make_unique<torch::optim::SGDOptions>(0.1));
  // LibTorch 1.13 keeps the SGD options (refused here, naming the group);
  // 2.x's Optimizer replaces options of another type by the defaults' type
  // before the optimizer sees them. Either way nothing reads them as AdamW's
  // unchecked (the old static_cast).
  std::unique_ptr<FullyShardedAdamW> opt;
  const auto what = testing::error_of([&] { opt = std::make_unique<FullyShardedAdamW>(sharded, groups, kAdamW); });
  if (opt == nullptr) {
    EXPECT_NE(what.find("FullyShardedAdamW: param group 1 has options of another optimizer"), std::string::npos)
        << what;
  } else {
    EXPECT_NE(dynamic_cast<const torch::optim::AdamWOptions*>(&opt->param_groups()[1].options()), nullptr);
  }
}

}  // namespace sharded_optimizer_test
}  // namespace zeroshard
