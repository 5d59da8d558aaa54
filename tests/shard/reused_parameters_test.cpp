// A parameter whose gradient arrives more than once in one backward, at
// ZeRO-0..3 and 1-4 ranks, against single-process torch::optim::AdamW on the
// same model and global batch.
//
// Under activation_checkpoint each checkpointed segment recomputes in a nested
// backward of its own, and a parameter's accumulator fires in each one that
// uses it, and once more for the outer graph's uses: a layer in two segments,
// a layer inside a segment and outside it (in either order), tied input and
// output embeddings with every layer checkpointed. Every arrival must reach
// the reduced gradient; none may be left in p.grad().
#include "shard/core/resharded_param.h"
#include "test_util.h"
#include "zeroshard/activation_checkpoint.h"
#include "zeroshard/fully_shard.h"
#include "zeroshard/sharded_adamw.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace zeroshard {
namespace reused_parameters_test {

using testing::world;
using testing::world_ptr;

constexpr int kVocab = 13, kWidth = 16, kSeq = 5, kBatch = 12;  // 12 sequences: 1-4 ranks split them evenly

struct LayerImpl : torch::nn::Module {
  LayerImpl() {
    fc = register_module("fc", torch::nn::Linear(kWidth, kWidth));
    side = register_module("side", torch::nn::Linear(kWidth, kWidth));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto through_fc = [this](const torch::Tensor& in) { return in + torch::tanh(fc(in)); };
    auto y = !twice ? through_fc(x) : checkpointed ? activation_checkpoint(through_fc, activation_checkpoint(through_fc, x))
                                                   : through_fc(through_fc(x));
    return use_side ? y + 0.5 * torch::tanh(side(x)) : y;
  }
  torch::nn::Linear fc{nullptr}, side{nullptr};  // `side` takes part when use_side (in the unit: ZeRO-3's S2 case)
  bool use_side = false;
  bool twice = false;         // `fc` applied twice within the layer's own forward (Reuse::kWithinUnit)
  bool checkpointed = false;  // each of those in a checkpointed segment
};
TORCH_MODULE(Layer);

enum class Reuse {
  kTwoSegments,        // one layer applied twice, each application checkpointed
  kInsideThenOutside,  // the layer in a checkpointed segment, then outside one
  kOutsideThenInside,  // the layer outside, then in a checkpointed segment
  kTiedEmbeddings,     // the embedding is the output projection; every layer (the projection too) checkpointed
  kWithinUnit,         // the layer runs once, and checkpoints its own `fc` twice inside (ZeRO-3: within one unit)
};

std::string to_string(Reuse r) {
  switch (r) {
    case Reuse::kTwoSegments: return "TwoSegments";
    case Reuse::kInsideThenOutside: return "InsideThenOutside";
    case Reuse::kOutsideThenInside: return "OutsideThenInside";
    case Reuse::kTiedEmbeddings: return "TiedEmbeddings";
    case Reuse::kWithinUnit: return "WithinUnit";
  }
  return "?";
}

// A token model: tied embedding, `block` (its own ZeRO-3 unit), `last`, and
// the output projection through the embedding's weight.
struct LmImpl : torch::nn::Module {
  explicit LmImpl(Reuse how) : how(how) {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kWidth));
    extra = register_module("extra", torch::nn::Linear(kWidth, kWidth));
    block = register_module("block", Sharded<Layer>());
    last = register_module("last", Sharded<Layer>());
  }
  torch::Tensor segment(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& h) {
    return checkpointed ? activation_checkpoint(fn, h) : fn(h);
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto b = block.ptr();
    auto run_block = [b](const torch::Tensor& in) { return b->forward(in); };
    auto h = embed(ids);
    if (use_extra) h = h + 0.5 * torch::tanh(extra(h));
    switch (how) {
      case Reuse::kTwoSegments:
        h = segment(run_block, segment(run_block, h));
        break;
      case Reuse::kInsideThenOutside:
        h = b->forward(segment(run_block, h));
        break;
      case Reuse::kOutsideThenInside:
        h = segment(run_block, b->forward(h));
        break;
      case Reuse::kTiedEmbeddings:
        h = segment(run_block, h);
        break;
      case Reuse::kWithinUnit:
        b->twice = true;
        b->checkpointed = checkpointed;
        h = b->forward(h);
        break;
    }
    h = segment([l = last.ptr()](const torch::Tensor& in) { return l->forward(in); }, h);
    auto project = [w = embed->weight](const torch::Tensor& in) { return torch::nn::functional::linear(in, w); };
    return how == Reuse::kTiedEmbeddings ? segment(project, h) : project(h);
  }
  Reuse how;
  bool checkpointed = false;
  bool use_extra = false;  // `extra` (between the embedding and the block; in ZeRO-3's root unit) takes part
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear extra{nullptr};
  Sharded<Layer> block{nullptr}, last{nullptr};
};
TORCH_MODULE(Lm);

// Step s's global batch: token ids and their next-token targets.
std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(300 + step);
  auto ids = torch::randint(kVocab, {kBatch, kSeq + 1}, torch::kLong);
  return {ids.slice(1, 0, kSeq), ids.slice(1, 1, kSeq + 1)};
}

torch::Tensor loss_of(Lm& m, const torch::Tensor& ids, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(m->forward(ids).reshape({-1, kVocab}), targets.reshape(-1));
}

torch::Tensor flat(Lm& m) {
  std::vector<torch::Tensor> ps;
  for (auto& p : m->parameters()) ps.push_back(p.detach().reshape(-1).clone());
  return torch::cat(ps);
}

const auto kAdamW = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.05);
constexpr int kSteps = 10;

// `skip_extra_on`: the rank whose part of the batch does not use `extra` (-1: none; no rank uses it
// unless `extra`): the loss is then the mean of the ranks' losses, each over its part of the batch.
torch::Tensor run_oracle(Reuse how, bool extra = false, int skip_extra_on = -1) {
  torch::manual_seed(7);
  Lm m(how);
  torch::optim::AdamW opt(m->parameters(), kAdamW);
  const int n = world().size(), local = kBatch / n;
  for (int s = 0; s < kSteps; ++s) {
    auto [ids, targets] = batch(s);
    opt.zero_grad();
    if (!extra) {
      loss_of(m, ids, targets).backward();
    } else {
      torch::Tensor loss;
      for (int r = 0; r < n; ++r) {
        m->use_extra = r != skip_extra_on;
        m->block->use_side = r != skip_extra_on;
        auto part = loss_of(m, ids.slice(0, r * local, (r + 1) * local), targets.slice(0, r * local, (r + 1) * local));
        loss = loss.defined() ? loss + part / n : part / n;
      }
      loss.backward();
    }
    opt.step();
  }
  return flat(m);
}

struct Run {
  torch::Tensor params;
  std::vector<int64_t> step_bytes;  // this rank's bytes sent per step
  std::vector<int> rounds;          // reduction rounds of each step's noise sample
  std::vector<GradientNoiseSample> noise;
  std::vector<std::string> left_in_grad;  // "step s: name" for a gradient left in p.grad() after a backward
};

// `checkpointed_steps`: checkpointed at these steps only (else at every step, or none, by `checkpointed`).
// `same_data`: every rank trains on the whole global batch (its gradient is then the mean one).
Run run_sharded(Reuse how, int stage, bool checkpointed, bool extra = false, int skip_extra_on = -1,
                const std::set<int>* checkpointed_steps = nullptr, bool same_data = false) {
  const int n = world().size(), r = world().rank(), local = kBatch / n;
  torch::manual_seed(7);
  Lm m(how);
  m->checkpointed = checkpointed;
  m->use_extra = extra && r != skip_extra_on;
  m->block->use_side = extra && r != skip_extra_on;
  std::shared_ptr<FullyShardedModel> sharded;
  std::unique_ptr<ShardedOptimizer> opt;
  if (stage == 3) {
    sharded = fully_shard(m, world_ptr());
    opt = std::make_unique<FullyShardedAdamW>(sharded, kAdamW);
  } else {
    ShardedAdamWOptions o;
    o.zero_stage = stage;
    o.bucket_bytes = 1024;  // a bucket or two per layer
    opt = std::make_unique<ShardedAdamW>(m->named_parameters(), testing::test_group(), kAdamW, o);
  }
  Run run;
  for (int s = 0; s < kSteps; ++s) {
    const int64_t before = opt->stats().traffic.total().bytes_sent;
    auto [ids, targets] = batch(s);
    if (checkpointed_steps != nullptr) m->checkpointed = checkpointed_steps->count(s) > 0;
    opt->zero_grad();
    if (same_data) {
      loss_of(m, ids, targets).backward();
    } else {
      loss_of(m, ids.slice(0, r * local, (r + 1) * local), targets.slice(0, r * local, (r + 1) * local)).backward();
    }
    if (stage != 1) {  // stage 1 keeps gradients in its flat buffers (p.grad() is a view of them) until step()
      for (const auto& item : m->named_parameters()) {
        if (shard::has_gradient(item.value())) run.left_in_grad.push_back("step " + std::to_string(s) + ": " + item.key());
      }
    }
    opt->step();
    run.step_bytes.push_back(opt->stats().traffic.total().bytes_sent - before);
    run.rounds.push_back(opt->last_gradient_noise().rounds);
    run.noise.push_back(opt->last_gradient_noise());
  }
  if (sharded) {
    auto full = sharded->summon_full_params();
    run.params = flat(m);
  } else {
    run.params = flat(m);
  }
  return run;
}

// Every rank holds the same parameters as this one.
void expect_same_on_every_rank(const torch::Tensor& params) {
  auto all = torch::empty({params.numel() * world().size()});
  world().all_gather(all, params)->wait();
  for (int q = 0; q < world().size(); ++q) {
    EXPECT_TRUE(torch::equal(all.slice(0, q * params.numel(), (q + 1) * params.numel()), params))
        << "rank " << q << " differs";
  }
}

// The parameters of the tests over every ZeRO stage and every shape of reuse, and their names.
const auto kEveryStageAndReuse =
    ::testing::Combine(::testing::Values(0, 1, 2, 3),
                       ::testing::Values(Reuse::kTwoSegments, Reuse::kInsideThenOutside, Reuse::kOutsideThenInside,
                                         Reuse::kTiedEmbeddings, Reuse::kWithinUnit));
std::string stage_and_reuse_name(const ::testing::TestParamInfo<std::tuple<int, Reuse>>& info) {
  return "stage" + std::to_string(std::get<0>(info.param)) + "_" + to_string(std::get<1>(info.param));
}

class ShardedAdamWReuse : public ::testing::TestWithParam<std::tuple<int, Reuse>> {};

// 10 steps: the same parameters as torch::optim::AdamW (the relative
// difference of every element, as the other oracle tests measure it), nothing
// left in p.grad() after any backward, one reduction round per backward in
// the noise sample, and every rank the same parameters. The bytes each step
// sends: exactly those of the run without checkpointing at ZeRO-0/2 (the first
// backward holds every bucket to its end and shows how often each gradient
// arrives; the ranks agree on that count at the step), and at ZeRO-3 a unit
// run twice is held to the end of each backward and reduced once (printed:
// the recomputations' gathers make the rest of the difference).
TEST_P(ShardedAdamWReuse, EveryArrivalOfAGradientIsReduced) {
  const auto [stage, how] = GetParam();
  const auto want = run_oracle(how);
  const auto got = run_sharded(how, stage, /*checkpointed=*/true);
  ASSERT_EQ(got.params.numel(), want.numel());
  const double err = ((got.params - want).abs() / (want.abs() + 1e-2)).max().item<double>();
  EXPECT_LT(err, 3e-5) << "stage " << stage << ", " << to_string(how) << ", " << world().size() << " ranks";
  EXPECT_TRUE(got.left_in_grad.empty()) << got.left_in_grad.front() << " (and " << got.left_in_grad.size() - 1
                                        << " more): a contribution left out of the reduced gradient";
  for (int s = 0; s < kSteps; ++s) EXPECT_EQ(got.rounds[s], 1) << "step " << s;

  const auto plain = run_sharded(how, stage, /*checkpointed=*/false);
  EXPECT_LT(((plain.params - want).abs() / (want.abs() + 1e-2)).max().item<double>(), 3e-5);
  std::string bytes;
  for (int s = 0; s < 3; ++s) {
    bytes += " " + std::to_string(got.step_bytes[s]) + " (" + std::to_string(plain.step_bytes[s]) + ")";
  }
  if (world().rank() == 0) {
    std::printf("stage %d %s at %d ranks: max relative difference from torch::optim::AdamW %.3g; bytes sent by "
                "rank 0 in steps 0-2, checkpointed (not):%s\n",
                stage, to_string(how).c_str(), world().size(), err, bytes.c_str());
  }
  // ZeRO-3's gather of the next step's first unit may land in either step: its bytes are compared in all.
  int64_t got_all = 0, plain_all = 0;
  for (int s = 0; s < kSteps; ++s) {
    got_all += got.step_bytes[s];
    plain_all += plain.step_bytes[s];
    if (stage != 3) {
      EXPECT_GE(got.step_bytes[s], plain.step_bytes[s]) << "step " << s;
    }
    if (stage != 3) {
      EXPECT_EQ(got.step_bytes[s], plain.step_bytes[s]) << "step " << s;
    }
  }
  EXPECT_GE(got_all, plain_all);
  expect_same_on_every_rank(got.params);
}

INSTANTIATE_TEST_SUITE_P(StagesAndModels, ShardedAdamWReuse,
                         kEveryStageAndReuse, stage_and_reuse_name);

// The count of arrivals follows the graph: a reuse at step 0 only (checkpointed then, not after;
// the first backward holds every bucket to its end, so it has no late round) is forgotten at
// step 1 (its buckets launch as soon as their one arrival is in), and reuse again at step 5 is
// late, costing one more reduction of those buckets there. Before, the count only grew: step 5
// sent no late round, and every bucket from the reused one on waited for the end of every
// backward from step 1 on.
TEST(ShardedAdamWReuseFollowsTheGraph, AReuseThatStopsAndReturnsIsReducedEachTimeItGrows) {
  const std::set<int> reused{0, 5};
  for (int stage : {0, 2}) {
    const auto want = run_oracle(Reuse::kInsideThenOutside);
    const auto got = run_sharded(Reuse::kInsideThenOutside, stage, false, false, -1, &reused);
    const auto plain = run_sharded(Reuse::kInsideThenOutside, stage, /*checkpointed=*/false);
    EXPECT_LT(((got.params - want).abs() / (want.abs() + 1e-2)).max().item<double>(), 3e-5) << "stage " << stage;
    for (int s = 0; s < kSteps && world().size() > 1; ++s) {  // one rank sends nothing to count
      if (s == 5) {
        EXPECT_GT(got.step_bytes[s], plain.step_bytes[s]) << "stage " << stage << ", step " << s << ": no late round";
      } else {
        EXPECT_EQ(got.step_bytes[s], plain.step_bytes[s]) << "stage " << stage << ", step " << s;
      }
    }
  }
}

// The gradient noise sample under reuse: with the same data on every rank, one rank's gradient is
// the mean gradient, so the small norm equals the big one; a step with a late round has no sample
// (NaN), never a biased one (before: 0.80-0.85 of the big norm at ZeRO-3 in every step, and at
// ZeRO-0/2 in the first).
TEST(ShardedAdamWReuseFollowsTheGraph, TheNoiseSampleSeesEveryArrival) {
  const std::set<int> reused{0, 1, 2, 5, 6, 7, 8, 9};  // reuse stops at 3, returns at 5 (a late round)
  for (int stage : {0, 1, 2, 3}) {
    for (auto how : {Reuse::kInsideThenOutside, Reuse::kTiedEmbeddings}) {
      const auto got = run_sharded(how, stage, false, false, -1, &reused, /*same_data=*/true);
      for (int s = 0; s < kSteps; ++s) {
        const auto& n = got.noise[static_cast<size_t>(s)];
        const bool late = (stage == 0 || stage == 2) && s == 5;
        if (late) {
          EXPECT_TRUE(std::isnan(n.small_sumsq)) << "stage " << stage << ", step " << s << ": " << n.small_sumsq;
        } else {
          EXPECT_NEAR(n.small_sumsq / n.big_sumsq, 1.0, 1e-6)
              << "stage " << stage << ", " << to_string(how) << ", step " << s << ": small " << n.small_sumsq
              << ", big " << n.big_sumsq;
        }
      }
    }
  }
}

// Ranks that reuse a parameter a different number of times cannot pair their late rounds: when
// their counts differ (here the block's gradient arrives twice on rank 0 and once on rank 1 at
// step 1, after both agreed on two at step 0), every rank's step() names the parameter and the fix.
TEST(ShardedAdamWReuseFollowsTheGraph, RanksThatReuseAParameterDifferentlyAreNamed) {
  if (world().size() == 1) return;  // one rank agrees with itself
  const std::set<int> every{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, first{0};
  for (int stage : {0, 2}) {
    const std::string m = testing::error_of([&] {
      run_sharded(Reuse::kInsideThenOutside, stage, false, false, -1, world().rank() == 1 ? &first : &every);
    });
    EXPECT_NE(m.find("'block.fc.weight' arrived a different number of times in one backward on different ranks"),
              std::string::npos) << m;
    EXPECT_NE(m.find("use ZeRO-1"), std::string::npos) << m;
  }
}

// A reused parameter beside one that rank 1 does not use (an expert without tokens, LayerDrop,
// a per-task head; `extra` beside the reused layer, and `side` in it, so at ZeRO-3 in the reused
// unit itself): whether an arrival is reduced late must not depend on the rank's own graph,
// or the ranks' reductions stop pairing (a collective mismatch on TCP; wrong pairs on NCCL).
// Against torch::optim::AdamW on the mean of the ranks' losses, each rank with or without
// `extra` as in the run; at ZeRO-0/2 the bytes of the same run without checkpointing in every
// step (the first backward holds every bucket to its end; then the ranks agree on how often each
// gradient arrives); at ZeRO-3 the reused unit is held to the end of each backward.
class ShardedAdamWReuseUnevenRanks : public ::testing::TestWithParam<std::tuple<int, Reuse>> {};

TEST_P(ShardedAdamWReuseUnevenRanks, AParameterUnusedOnOneRankBesideAReusedOne) {
  const auto [stage, how] = GetParam();
  const auto want = run_oracle(how, /*extra=*/true, /*skip_extra_on=*/1);
  const auto got = run_sharded(how, stage, /*checkpointed=*/true, /*extra=*/true, /*skip_extra_on=*/1);
  const double err = ((got.params - want).abs() / (want.abs() + 1e-2)).max().item<double>();
  EXPECT_LT(err, 3e-5) << "stage " << stage << ", " << to_string(how) << ", " << world().size() << " ranks";
  EXPECT_TRUE(got.left_in_grad.empty()) << got.left_in_grad.front();
  const auto plain = run_sharded(how, stage, /*checkpointed=*/false, /*extra=*/true, /*skip_extra_on=*/1);
  // (ZeRO-3 gathers units again to recompute their segments: its bytes are not the plain run's.)
  for (int s = 0; s < kSteps && stage != 3; ++s) EXPECT_EQ(got.step_bytes[s], plain.step_bytes[s]) << "step " << s;
  expect_same_on_every_rank(got.params);
}

INSTANTIATE_TEST_SUITE_P(StagesAndModels, ShardedAdamWReuseUnevenRanks,
                         kEveryStageAndReuse, stage_and_reuse_name);

// A reuse that begins after the ranks first agreed, of a parameter that rank 1 does not use at
// all (`side`, inside the layer applied in two checkpointed segments from step 3 on): at ZeRO-0/2
// rank 0's arrivals of `side` exceed the agreed count while rank 1 has none, so only rank 0 knows
// of a late gradient at the end of the backward. Every rank must still issue the same
// collectives: the late gradients wait for the step's agreement, which tells every rank that some
// rank holds one. Against torch::optim::AdamW; every rank the same parameters; at ZeRO-0/2 the
// bytes of the run without checkpointing except at step 3 (the late rounds), and more there.
TEST_P(ShardedAdamWReuseUnevenRanks, AReuseThatBeginsAfterTheFirstStepBesideAnUnusedParameter) {
  const auto [stage, how] = GetParam();
  if (how != Reuse::kTwoSegments && how != Reuse::kWithinUnit) return;  // the shapes that reuse `side`'s layer alone
  const std::set<int> from_step_3{3, 4, 5, 6, 7, 8, 9};
  const auto want = run_oracle(how, /*extra=*/true, /*skip_extra_on=*/1);
  const auto got = run_sharded(how, stage, false, /*extra=*/true, /*skip_extra_on=*/1, &from_step_3);
  const double err = ((got.params - want).abs() / (want.abs() + 1e-2)).max().item<double>();
  EXPECT_LT(err, 3e-5) << "stage " << stage << ", " << to_string(how) << ", " << world().size() << " ranks";
  EXPECT_TRUE(got.left_in_grad.empty()) << got.left_in_grad.front();
  const auto plain = run_sharded(how, stage, /*checkpointed=*/false, /*extra=*/true, /*skip_extra_on=*/1);
  for (int s = 0; s < kSteps && (stage == 0 || stage == 2) && world().size() > 1; ++s) {
    if (s == 3) {
      EXPECT_GT(got.step_bytes[s], plain.step_bytes[s]) << "step " << s << ": no late round";
    } else {
      EXPECT_EQ(got.step_bytes[s], plain.step_bytes[s]) << "step " << s;
    }
  }
  expect_same_on_every_rank(got.params);
}

}  // namespace reused_parameters_test
}  // namespace zeroshard
