// ShardedOptimizer: what ZeRO-1, 2 and 3 share, through the base class.
// Runs at 1-4 ranks under zeroshard-run (ctest sharded_adamw_np*).
#include "shard/fully_shard_models.h"
#include "shard/optimizer/optimizer_access.h"
#include "test_util.h"
#include "zeroshard/fully_shard.h"
#include "zeroshard/preemption.h"
#include "zeroshard/sharded_adamw.h"
#include "zeroshard/step_agreement.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
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
  explicit Trainer(int stage, LossScaleOptions scaling = {}) : Trainer(stage, ProcessGroup(world_ptr()), scaling) {}
  Trainer(int stage, const ProcessGroup& group, LossScaleOptions scaling = {}) {
    torch::manual_seed(3);
    model = Tiny();
    for (const auto& p : model->parameters()) numel += p.numel();
    if (stage == 3) {
      sharded = fully_shard(model, group);
      FullyShardedAdamWOptions o;
      o.loss_scale = scaling;
      opt = std::make_unique<FullyShardedAdamW>(sharded, kAdamW, o);
    } else {
      ShardedAdamWOptions o;
      o.zero_stage = stage;
      o.bucket_bytes = 2048;  // several buckets
      o.loss_scale = scaling;
      opt = std::make_unique<ShardedAdamW>(model->named_parameters(), group, kAdamW, o);
    }
  }
  // Returns this rank's part of the step's loss (summed over the ranks: the batch's).
  // `zero_grad`: clear the last step's gradients first (a loop may leave it out:
  // at ZeRO-0/2/3 they are in no shard after step()).
  double backward(int step, bool zero_grad = true) {
    const int n = world().size(), r = world().rank();
    auto [x, y] = batch(step, 0);
    x = x.slice(0, r * kBatch / n, (r + 1) * kBatch / n);
    y = y.slice(0, r * kBatch / n, (r + 1) * kBatch / n);
    if (zero_grad) opt->zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y) * (static_cast<double>(x.size(0)) * n / kBatch);
    opt->scale_loss(loss).backward();
    return loss.item<double>() / n;
  }
  torch::Tensor params() {
    if (!sharded) return flat(model);
    auto full = sharded->summon_full_params();
    return flat(model);
  }
};

class ShardedOptimizerStages : public ::testing::TestWithParam<int> {};

int64_t all_reduces(const Communicator& comm);

// Two optimizers that clip as one model (a pipeline's stages do, over more
// ranks) share their gradient norms in one agreement. Trained on the same
// data from the same values, the pair's squared norms are exactly twice one
// optimizer's alone, both clip by that norm (here without biting, so that all
// three train alike), and the pair's step is one all-reduce.
TEST_P(ShardedOptimizerStages, OptimizersSharingGradientNormsClipByTheWholeNorm) {
  const int stage = GetParam();
  const ProcessGroup group(world_ptr(), world().dup());
  Trainer alone(stage), a(stage, group), b(stage, group);
  auto agreement = std::make_shared<StepAgreement>(group.control);
  auto norms = std::make_shared<shard::GradientNorms>(agreement, "both (gradient norms)", world().size());
  shard::OptimizerAccess::join(*a.opt, norms, "a (parameters with a gradient)");
  shard::OptimizerAccess::join(*b.opt, norms, "b (parameters with a gradient)");
  for (int s = 0; s < 4; ++s) {
    alone.backward(s);
    const double alone_norm = alone.opt->clip_grad_norm(1e3);  // does not bite
    alone.opt->step();

    a.backward(s);
    b.backward(s);
    const int64_t before = all_reduces(*group.control);
    agreement->agree();
    const double norm = a.opt->clip_grad_norm(1e3);
    EXPECT_EQ(b.opt->clip_grad_norm(1e3), norm) << "step " << s;
    a.opt->step();
    b.opt->step();
    EXPECT_EQ(all_reduces(*group.control) - before, 1) << "step " << s;

    const auto one = alone.opt->last_gradient_noise(), pair = a.opt->last_gradient_noise();
    EXPECT_EQ(pair.big_sumsq, 2 * one.big_sumsq) << "step " << s;
    EXPECT_EQ(pair.small_sumsq, 2 * one.small_sumsq) << "step " << s;
    EXPECT_EQ(pair.rounds, one.rounds) << "step " << s;
    EXPECT_EQ(pair.ranks, one.ranks) << "step " << s;
    EXPECT_EQ(norms->last().sumsq, pair.big_sumsq) << "step " << s;
    EXPECT_NEAR(norm * norm, 2 * alone_norm * alone_norm, 1e-12 * norm * norm) << "step " << s;
  }
  EXPECT_TRUE(torch::equal(a.params(), b.params()));
  EXPECT_TRUE(torch::equal(a.params(), alone.params()));
}

// What a member adds to shared norms counts for every member: an overflow
// one of them reports (a pipeline's non-finite loss) skips every member's step
// when loss scaling is on and halves the scale; the parameters stay as they
// were, and the next step trains again.
TEST_P(ShardedOptimizerStages, AnOverflowInSharedNormsSkipsEveryMembersStep) {
  LossScaleOptions scaling;
  scaling.enabled = 1;
  Trainer run(GetParam(), scaling);
  auto agreement = std::make_shared<StepAgreement>(world().dup());
  auto norms = std::make_shared<shard::GradientNorms>(agreement, "norms", world().size());
  shard::OptimizerAccess::join(*run.opt, norms, "flags");
  bool overflow = true;
  norms->join(
      [&](shard::GradientNorms::Part& p) {
        if (overflow && world().rank() == world().size() - 1) {
          p.sumsq.push_back({{std::numeric_limits<double>::infinity(), {}}, 1});
        }
        return true;
      },
      nullptr);
  const auto before = run.params();
  const double scale = run.opt->loss_scale();
  run.backward(0);
  run.opt->step();
  EXPECT_TRUE(run.opt->last_step_skipped());
  EXPECT_EQ(run.opt->loss_scale(), scale * 0.5);
  EXPECT_TRUE(torch::equal(before, run.params()));
  overflow = false;
  run.backward(1);
  run.opt->step();
  EXPECT_FALSE(run.opt->last_step_skipped());
  EXPECT_FALSE(torch::equal(before, run.params()));
}

TEST_P(ShardedOptimizerStages, StatsCountTheMomentsAndTheTraffic) {
  Trainer run(GetParam());
  const auto at_start = run.opt->stats().traffic;  // construction's own traffic (rank 0's parameters broadcast)
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
  // ZeRO-1/2: one reduce-scatter of each bucket and one all-gather of the
  // updated shards, each sending (n - 1) shards. (ZeRO-0's all-reduces and
  // ZeRO-3's gathers are counted exactly in collectives_test and fully_shard_runtime_test.)
  if (GetParam() == 1 || GetParam() == 2) {
    const int64_t n = world().size();
    int64_t shard_numel = 0;  // with the padding each bucket's layout adds
    for (const auto& b : run.opt->sharded_state().buckets) shard_numel += b.layout.shard_numel();
    auto sent = [&](const CommStats& c, OpKind k) { return c.by_kind.count(k) ? c.by_kind.at(k).bytes_sent : 0; };
    for (OpKind k : {OpKind::kReduceScatter, OpKind::kAllGather}) {
      EXPECT_EQ(sent(st.traffic, k) - sent(at_start, k), (n - 1) * 4 * shard_numel) << to_string(k);
    }
  }
}

// Identity forward; its backward throws (reached after every parameter's
// gradient: the input's gradient comes last).
struct FailInBackward : torch::autograd::Function<FailInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("injected failure in backward");
  }
};

// One step of two micro-batches, clipped; `fail` makes micro-batch 1's first
// attempt throw part-way, after which the step starts over (zero_grad, both
// micro-batches again); with `try_step` a step() in between must refuse.
struct StepRecord {
  double norm = 0;
  GradientNoiseSample noise;
};

enum class Failure { kNone, kMidModel, kAfterEveryGradient };

StepRecord recovery_step(Trainer& t, int s, Failure fail, bool try_step = false) {
  const int n = world().size(), r = world().rank();
  auto backward = [&](int micro, Failure how) {
    auto [x, y] = batch(s, micro);
    x = x.slice(0, r * kBatch / n, (r + 1) * kBatch / n);
    y = y.slice(0, r * kBatch / n, (r + 1) * kBatch / n);
    if (how == Failure::kAfterEveryGradient) x = FailInBackward::apply(x.clone().requires_grad_(true));
    at::Tensor hooked;
    unsigned hook = 0;
    if (how == Failure::kMidModel) {  // the middle block's first layer: the units (buckets) after it are reduced
      hooked = t.model->blocks[1]->fc1->weight;
      hook = hooked.register_hook([](const at::Tensor&) -> at::Tensor {
        throw std::runtime_error("injected failure in backward");
      });
    }
    auto loss = t.opt->scale_loss(torch::mse_loss(t.model->forward(x), y) * (static_cast<double>(x.size(0)) * n / kBatch) / 2);
    if (how == Failure::kNone) {
      loss.backward();
      return;
    }
    EXPECT_THROW(loss.backward(), std::exception);
    if (hooked.defined()) hooked.remove_hook(hook);
  };
  t.opt->zero_grad();
  backward(0, Failure::kNone);
  if (fail != Failure::kNone) {
    backward(1, fail);
    if (try_step) {  // step() right after the failure refuses, naming it
      const auto msg = testing::error_of([&] { t.opt->step(); });
      EXPECT_NE(msg.find("ended with an exception part-way"), std::string::npos) << msg;
    }
    t.opt->zero_grad();
    backward(0, Failure::kNone);
  }
  backward(1, Failure::kNone);
  StepRecord rec;
  rec.norm = t.opt->clip_grad_norm(0.05);
  t.opt->step();
  rec.noise = t.opt->last_gradient_noise();
  return rec;
}

// A backward that throws part-way (in the middle of the model, or after every
// gradient was reduced), then the step run again, leaves no trace: the norms,
// the gradient noise sample and the parameters equal a run that never failed,
// to the bit (the same reductions of the same inputs).
TEST_P(ShardedOptimizerStages, AFailedBackwardLeavesNoTrace) {
  const int stage = GetParam();
  Trainer clean(stage), failing(stage);
  // The first step's backward also records ZeRO-3's unit orders.
  const Failure plan[] = {Failure::kMidModel, Failure::kNone, Failure::kAfterEveryGradient, Failure::kMidModel,
                          Failure::kAfterEveryGradient};
  for (int s = 0; s < 5; ++s) {
    const auto want = recovery_step(clean, s, Failure::kNone);
    const auto got = recovery_step(failing, s, plan[s], /*try_step=*/s >= 3);
    EXPECT_EQ(got.norm, want.norm) << "ZeRO-" << stage << ", step " << s;
    EXPECT_EQ(got.noise.big_sumsq, want.noise.big_sumsq) << "ZeRO-" << stage << ", step " << s;
    EXPECT_EQ(got.noise.small_sumsq, want.noise.small_sumsq) << "ZeRO-" << stage << ", step " << s;
    EXPECT_EQ(got.noise.rounds, want.noise.rounds) << "ZeRO-" << stage << ", step " << s;
    EXPECT_EQ(got.noise.rounds, stage == 1 ? 1 : 2);
  }
  EXPECT_TRUE(torch::equal(clean.params(), failing.params())) << "ZeRO-" << stage;
  EXPECT_FALSE(failing.opt->last_step_skipped());
}

int64_t all_reduces(const Communicator& comm) {
  const auto st = comm.stats();
  return st.by_kind.count(OpKind::kAllReduce) ? st.by_kind.at(OpKind::kAllReduce).calls : 0;
}

// The step's agreement (the optimizer's norms and flags), the loss and the
// preemption vote in one StepAgreement: one blocking all-reduce per step on
// the control plane, where each on its own takes three; the same norms,
// noise samples, losses, stop decision and parameters to the bit.
TEST_P(ShardedOptimizerStages, OneStepAgreementCarriesTheNormsTheLossAndTheVote) {
  const int stage = GetParam(), n = world().size(), r = world().rank();
  // Control planes of their own, so their all-reduces are the step's agreements alone.
  const ProcessGroup joined_group(world_ptr(), world().dup()), plain_group(world_ptr(), world().dup());
  Trainer joined(stage, joined_group), plain(stage, plain_group);
  const std::string dir = testing::make_temp_dir("step_agreement");  // the last rank's notice file
  PreemptionOptions po = testing::no_signals();
  po.notice_file = dir + "/notice-" + std::to_string(r);
  PreemptionGuard joined_guard(joined_group.control, po), plain_guard(plain_group.control, po);
  auto agreement = std::make_shared<StepAgreement>(joined_group.control);
  joined.opt->join(agreement);
  double local_loss = 0, agreed_loss = 0;
  agreement->add("loss", 1, [&](double* v) { v[0] = local_loss; }, [&](const double* sum) { agreed_loss = sum[0]; });
  joined_guard.join(agreement);
  constexpr int kNoticeAt = 3;
  const auto unix_seconds = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  };
  double noticed_after = 0;
  for (int s = 0; s < 5; ++s) {
    if (s == kNoticeAt) {
      noticed_after = unix_seconds();
      if (r == n - 1) std::ofstream(po.notice_file) << "going away";
    }
    const int64_t joined_before = all_reduces(*joined_group.control), plain_before = all_reduces(*plain_group.control);
    local_loss = joined.backward(s);
    const double joined_norm = joined.opt->clip_grad_norm(0.05);
    joined.opt->step();
    const bool joined_stop = joined_guard.should_stop();

    const double plain_local = plain.backward(s);
    const double plain_norm = plain.opt->clip_grad_norm(0.05);
    plain.opt->step();
    auto loss = torch::tensor({plain_local}, torch::kDouble);
    plain_group.control->all_reduce(loss, ReduceOp::kSum)->wait();
    const bool plain_stop = plain_guard.should_stop();

    EXPECT_EQ(all_reduces(*joined_group.control) - joined_before, 1) << "step " << s;
    // (a guard that stopped votes no more)
    EXPECT_EQ(all_reduces(*plain_group.control) - plain_before, s > kNoticeAt ? 2 : 3) << "step " << s;
    EXPECT_EQ(joined_norm, plain_norm) << "step " << s;
    EXPECT_GT(joined_norm, 0.05) << "step " << s << ": the clip must bite for the test to mean something";
    EXPECT_EQ(agreed_loss, loss.item<double>()) << "step " << s;
    const auto jn = joined.opt->last_gradient_noise(), pn = plain.opt->last_gradient_noise();
    EXPECT_EQ(jn.big_sumsq, pn.big_sumsq) << "step " << s;
    EXPECT_EQ(jn.small_sumsq, pn.small_sumsq) << "step " << s;
    EXPECT_EQ(jn.rounds, pn.rounds) << "step " << s;
    EXPECT_EQ(joined_stop, s >= kNoticeAt) << "step " << s;
    EXPECT_EQ(plain_stop, s >= kNoticeAt) << "step " << s;
  }
  const double noticed_before = unix_seconds();
  EXPECT_EQ(joined_guard.cause(), r == n - 1 ? "notice file" : "another rank's notice");
  // The notice's time: when the last rank first saw its file, the same on every rank.
  auto times = torch::tensor({joined_guard.notice_time(), -joined_guard.notice_time()}, torch::kDouble);
  world().all_reduce(times, ReduceOp::kMax)->wait();
  EXPECT_EQ(times[0].item<double>(), -times[1].item<double>());
  EXPECT_GE(joined_guard.notice_time(), noticed_after);
  EXPECT_LE(joined_guard.notice_time(), noticed_before);
  EXPECT_TRUE(torch::equal(joined.params(), plain.params()));
  // A vote read twice without an agreement in between is refused, by name.
  PreemptionGuard late(joined_group.control, testing::no_signals());
  late.join(agreement);
  joined.backward(5);
  joined.opt->step();
  EXPECT_FALSE(late.should_stop());
  const auto msg = testing::error_of([&] { late.should_stop(); });
  EXPECT_NE(msg.find("the step's agreement has not run since the last call"), std::string::npos) << msg;
  std::filesystem::remove_all(dir);
}

// The order docs/getting-started.md teaches: the guard votes in an agreement
// of its own for a few steps, then joins the step's agreement. From then on
// each step is one all-reduce (the joined agreement, which the optimizer's
// step() runs), should_stop() reads it without running it again, and the
// optimizer is not frozen after its step: the next backward runs, with or
// without zero_grad() before it. The training is that of the same optimizer
// without a guard.
TEST_P(ShardedOptimizerStages, AGuardJoinedAfterVotingAloneVotesInTheStepsAgreement) {
  const int stage = GetParam();
  const ProcessGroup group(world_ptr(), world().dup()), plain_group(world_ptr(), world().dup());
  Trainer t(stage, group), plain(stage, plain_group);
  PreemptionGuard guard(group.control, testing::no_signals());
  for (int s = 0; s < 3; ++s) {
    t.backward(s);
    plain.backward(s);
    t.opt->step();
    plain.opt->step();
    const int64_t before = all_reduces(*group.control);
    EXPECT_FALSE(guard.should_stop()) << "step " << s;
    EXPECT_EQ(all_reduces(*group.control) - before, 1) << "step " << s << ": the guard's own agreement";
  }
  auto agreement = std::make_shared<StepAgreement>(group.control);
  t.opt->join(agreement);
  guard.join(agreement);
  for (int s = 3; s < 9; ++s) {
    const bool zero_grad = s % 2 == 0;
    const int64_t before = all_reduces(*group.control);
    EXPECT_NO_THROW(t.backward(s, zero_grad)) << "step " << s;
    plain.backward(s, zero_grad);
    t.opt->step();
    plain.opt->step();
    bool stop = true;
    EXPECT_NO_THROW(stop = guard.should_stop()) << "step " << s;
    EXPECT_FALSE(stop) << "step " << s;
    EXPECT_EQ(all_reduces(*group.control) - before, 1) << "step " << s << ": the step's one agreement";
  }
  EXPECT_TRUE(torch::equal(t.params(), plain.params()));
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
  // Refused before torch::optim::Optimizer sees them (LibTorch 2.x's would
  // replace options of another type by the defaults' type, silently).
  const auto what = testing::error_of([&] { FullyShardedAdamW opt(sharded, groups, kAdamW); });
  EXPECT_NE(what.find("FullyShardedAdamW: param group 1's options are options of another optimizer than Adam or AdamW"),
            std::string::npos)
      << what;
}

}  // namespace sharded_optimizer_test
}  // namespace zeroshard
