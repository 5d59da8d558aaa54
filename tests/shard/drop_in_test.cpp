// The drop-in contract (docs/drop-in.md): the idioms of a plain LibTorch loop,
// each on ShardedAdamW (ZeRO-0, 1, 2) and FullyShardedAdamW (ZeRO-3) at 1-4
// ranks (ctest sharded_adamw_np*), against the same loop on torch::optim's own
// optimizer in one process over the global batch.
#include "test_util.h"
#include "zeroshard/fully_shard.h"
#include "zeroshard/sharded_adamw.h"
#include "zeroshard/step_agreement.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>

namespace zeroshard {
namespace drop_in_test {

using testing::world;
using testing::world_ptr;

constexpr int kBatch = 24;  // divides among 1-4 ranks
constexpr int kOracle = -1;  // the stage of the unsharded run: torch::optim's optimizer

torch::nn::Sequential mlp(int in, int hidden, int out, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::Tanh(), torch::nn::Linear(hidden, out));
}

// One model and its optimizer: torch::optim's (kOracle) or zeroshard's at a stage.
struct Trained {
  torch::nn::Sequential model;
  std::shared_ptr<FullyShardedModel> sharded;  // stage 3
  std::unique_ptr<torch::optim::Optimizer> opt;
  ShardedOptimizer* zs = nullptr;  // opt, when it is zeroshard's
  int stage = kOracle;

  // As a loop calls it: zero_grad() is not virtual, so the type matters.
  void zero_grad(bool set_to_none = true) {
    if (zs != nullptr) {
      zs->zero_grad(set_to_none);
    } else {
#if TORCH_VERSION_MAJOR >= 2
      opt->zero_grad(set_to_none);
#else
      if (set_to_none) {
        for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
      } else {
        opt->zero_grad();
      }
#endif
    }
  }
  // This rank's rows of a global batch (all of them for the oracle).
  torch::Tensor local(const torch::Tensor& global) const {
    if (stage == kOracle) return global;
    const int64_t n = global.size(0) / world().size(), r = world().rank();
    return global.slice(0, r * n, (r + 1) * n);
  }
  torch::Tensor params() {
    std::unique_ptr<FullyShardedModel::FullParamsGuard> full;
    if (sharded) full = std::make_unique<FullyShardedModel::FullParamsGuard>(sharded->summon_full_params());
    std::vector<torch::Tensor> ps;
    for (auto& p : model->parameters()) ps.push_back(p.detach().reshape(-1).clone());
    return torch::cat(ps);
  }
};

// `model` trained by AdamW (`adam`: Adam) with `options` at `stage`.
Trained make(int stage, torch::nn::Sequential model, const torch::optim::OptimizerOptions& options, bool adam = false) {
  Trained t;
  t.model = model;
  t.stage = stage;
  if (stage == kOracle) {
    if (adam) {
      t.opt = std::make_unique<torch::optim::Adam>(model->parameters(),
                                                   dynamic_cast<const torch::optim::AdamOptions&>(options));
    } else {
      t.opt = std::make_unique<torch::optim::AdamW>(model->parameters(),
                                                    dynamic_cast<const torch::optim::AdamWOptions&>(options));
    }
    return t;
  }
  std::unique_ptr<ShardedOptimizer> opt;
  if (stage == 3) {
    t.sharded = fully_shard(model, world_ptr());
    opt = std::make_unique<FullyShardedAdamW>(t.sharded, options);
  } else {
    ShardedAdamWOptions o;
    o.zero_stage = stage;
    o.bucket_bytes = 512;  // several buckets
    opt = std::make_unique<ShardedAdamW>(model->named_parameters(), world_ptr(), options, o);
  }
  t.zs = opt.get();
  t.opt = std::move(opt);
  return t;
}

std::pair<torch::Tensor, torch::Tensor> regression_batch(int step) {
  torch::manual_seed(700 + step);
  auto x = torch::randn({kBatch, 6});
  return {x, torch::sin(x.sum(1, true)) + 0.1 * x.narrow(1, 0, 1)};
}

// The mean squared error of this rank's rows, as a loop computes it; with
// equal rows per rank the mean over ranks is the global batch's.
torch::Tensor regression_loss(Trained& t, int step) {
  auto [x, y] = regression_batch(step);
  return torch::mse_loss(t.model->forward(t.local(x)), t.local(y));
}

// |a - b| relative to |b| + 1e-2 (a learning-rate-sized step): the tolerance
// of the oracle tests (sharded_adamw_test.cpp's kTol: the reduction order
// differs from one process's; a lost or extra gradient is off by 1e-3 or more).
void expect_same_training(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const double err = ((got - want).abs() / (want.abs() + 1e-2)).max().item<double>();
  EXPECT_LT(err, 3e-5) << what << " at " << world().size() << " rank(s)";
  if (world().rank() == 0) std::printf("%s: max relative difference from torch::optim: %.3g\n", what.c_str(), err);
}

class ShardedOptimizerDropIn : public ::testing::TestWithParam<int> {};

const auto kAdamW = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.05);

// zero_grad() drops the step's gradients, set to none or not: a backward
// before it (an evaluation pass, say) contributes nothing to the step, even
// where ZeRO-2, 0 and 3 had already reduced it into the shards.
TEST_P(ShardedOptimizerDropIn, ZeroGradDropsEveryGradientSetToNoneOrNot) {
  for (bool set_to_none : {true, false}) {
    auto run = [&](int stage) {
      auto t = make(stage, mlp(6, 19, 1, 11), kAdamW);
      for (int s = 0; s < 6; ++s) {
        regression_loss(t, 100 + s).backward();  // to be dropped
        t.zero_grad(set_to_none);
        for (int k = 0; k < 2; ++k) (regression_loss(t, 2 * s + k) / 2).backward();
        t.opt->step();
      }
      return t.params();
    };
    expect_same_training(run(GetParam()), run(kOracle),
                         std::string("zero_grad(set_to_none=") + (set_to_none ? "true" : "false") + ")");
  }
}

// torch's LR schedulers drive the sharded optimizer through
// torch::optim::Optimizer&, as they drive torch's: StepLR, and (LibTorch 2.x)
// ReduceLROnPlateauScheduler.
TEST_P(ShardedOptimizerDropIn, TorchLrSchedulersSetTheLearningRate) {
  auto run = [](int stage, bool plateau) {
    auto t = make(stage, mlp(6, 19, 1, 12), kAdamW);
    torch::optim::StepLR step_lr(*t.opt, /*step_size=*/2, /*gamma=*/0.5);
#if TORCH_VERSION_MAJOR >= 2
    torch::optim::ReduceLROnPlateauScheduler on_plateau(*t.opt, torch::optim::ReduceLROnPlateauScheduler::min,
                                                        /*factor=*/0.3, /*patience=*/0);
    // The metric a loop passes (a validation loss, the same on every rank):
    // it stops improving at steps 3 and 5.
    const float metric[] = {1.0f, 0.9f, 0.8f, 0.85f, 0.7f, 0.75f, 0.6f, 0.5f};
#endif
    std::vector<double> lrs;
    for (int s = 0; s < 8; ++s) {
      t.zero_grad();
      regression_loss(t, s).backward();
      t.opt->step();
      if (plateau) {
#if TORCH_VERSION_MAJOR >= 2
        on_plateau.step(metric[s]);
#endif
      } else {
        step_lr.step();
      }
      lrs.push_back(t.opt->param_groups()[0].options().get_lr());
    }
    return std::make_pair(t.params(), lrs);
  };
  std::vector<bool> schedulers{false};
#if TORCH_VERSION_MAJOR >= 2
  schedulers.push_back(true);
#endif
  for (bool plateau : schedulers) {
    const std::string what = plateau ? "ReduceLROnPlateauScheduler" : "StepLR";
    auto [got, got_lrs] = run(GetParam(), plateau);
    auto [want, want_lrs] = run(kOracle, plateau);
    EXPECT_EQ(got_lrs, want_lrs) << what;
    EXPECT_NE(want_lrs.front(), want_lrs.back()) << what << " changed no learning rate: the test would not notice";
    expect_same_training(got, want, what);
  }
}

// A loop written for torch::optim::Adam keeps its AdamOptions: the same
// training as torch::optim::Adam (weight decay 0). Adam's weight decay (an L2
// term in the gradient) and other optimizers' options are refused, by name.
TEST_P(ShardedOptimizerDropIn, AdamOptionsTrainAsTorchAdam) {
  const auto adam = torch::optim::AdamOptions(1e-2).betas({0.8, 0.99}).eps(1e-7);
  auto run = [&](int stage) {
    auto t = make(stage, mlp(6, 19, 1, 13), adam, /*adam=*/true);
    for (int s = 0; s < 6; ++s) {
      t.zero_grad();
      regression_loss(t, s).backward();
      t.opt->step();
    }
    return t.params();
  };
  expect_same_training(run(GetParam()), run(kOracle), "AdamOptions");

  // (The fully sharded model outlives the refusals: one destroyed while an
  // exception unwinds aborts the communicator, as a failing rank must.)
  auto model = mlp(6, 19, 1, 13);
  std::shared_ptr<FullyShardedModel> sharded;
  if (GetParam() == 3) sharded = fully_shard(model, world_ptr());
  auto refusal = [&](const torch::optim::OptimizerOptions& options) {
    return testing::error_of([&] {
      if (sharded) {
        FullyShardedAdamW opt(sharded, options);
      } else {
        ShardedAdamWOptions o;
        o.zero_stage = GetParam();
        ShardedAdamW opt(model->named_parameters(), world_ptr(), options, o);
      }
    });
  };
  const auto decayed = refusal(torch::optim::AdamOptions(1e-2).weight_decay(0.1));
  EXPECT_NE(decayed.find("AdamOptions with weight_decay(0.1)"), std::string::npos) << decayed;
  EXPECT_NE(decayed.find("AdamWOptions(lr).weight_decay(0.1)"), std::string::npos) << decayed;
  const auto sgd = refusal(torch::optim::SGDOptions(0.1));
  EXPECT_NE(sgd.find("options of another optimizer than Adam or AdamW"), std::string::npos) << sgd;
}

// torch::save(optimizer, path) would save none of the sharded state: refused,
// naming the checkpoint that does; torch::load likewise.
TEST_P(ShardedOptimizerDropIn, TorchSaveAndLoadAreRefusedNamingTheCheckpointer) {
  auto t = make(GetParam(), mlp(6, 19, 1, 14), kAdamW);
  const auto path = testing::make_temp_dir("drop_in") + "/optimizer.pt";
  const auto saved = testing::error_of([&] { torch::save(*t.zs, path); });
  EXPECT_NE(saved.find("zeroshard::Checkpointer"), std::string::npos) << saved;
  auto unsharded = mlp(6, 19, 1, 14);
  torch::optim::AdamW written(unsharded->parameters(), kAdamW);  // a file torch::load reads, up to the optimizer
  torch::save(written, path);
  const auto loaded = testing::error_of([&] { torch::load(*t.zs, path); });
  EXPECT_NE(loaded.find("zeroshard::Checkpointer"), std::string::npos) << loaded;
}

// Two optimizers in one process, as a GAN trains: the discriminator's
// parameters get gradients in the generator's backward too, which its next
// zero_grad() must drop (with ZeRO-2, 0 and 3 they were already reduced into
// its shards when that backward ended). Then both joined to one step
// agreement: each step() runs it for its own optimizer (the discriminator's
// step comes before the generator's backward, which must not find the
// generator frozen), and the training is the same.
TEST_P(ShardedOptimizerDropIn, TwoOptimizersTrainAGan) {
  auto run = [](int stage, bool joined) {
    auto g = make(stage, mlp(4, 16, 2, 21), torch::optim::AdamOptions(2e-3).betas({0.5, 0.999}), true);
    auto d = make(stage, mlp(2, 16, 1, 22), torch::optim::AdamOptions(2e-3).betas({0.5, 0.999}), true);
    if (joined) {
      auto agreement = std::make_shared<StepAgreement>(world_ptr());
      g.zs->join(agreement);
      d.zs->join(agreement);
    }
    auto bce = [](const torch::Tensor& logits, double label) {
      return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, label));
    };
    for (int s = 0; s < 8; ++s) {
      torch::manual_seed(900 + s);
      auto real = torch::randn({kBatch, 2}) * 0.5 + torch::tensor({1.0, -2.0});
      auto noise = torch::randn({kBatch, 4});
      auto fake = g.model->forward(g.local(noise));
      d.zero_grad();
      (bce(d.model->forward(d.local(real)), 1) + bce(d.model->forward(fake.detach()), 0)).backward();
      d.opt->step();
      g.zero_grad();
      bce(d.model->forward(fake), 1).backward();  // the discriminator's parameters get gradients too
      g.opt->step();
    }
    return std::make_pair(g.params(), d.params());
  };
  auto [want_g, want_d] = run(kOracle, false);
  for (bool joined : {false, true}) {
    auto [got_g, got_d] = run(GetParam(), joined);
    const std::string how = joined ? " (joined to one agreement)" : "";
    expect_same_training(got_g, want_g, "GAN generator" + how);
    expect_same_training(got_d, want_d, "GAN discriminator" + how);
  }
}

INSTANTIATE_TEST_SUITE_P(ZeroStages, ShardedOptimizerDropIn, ::testing::Values(0, 1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return "zero" + std::to_string(i.param); });

// The stages that reduce gradients during backward (ZeRO-0, 2, 3).
class ShardedOptimizerDropInReducing : public ::testing::TestWithParam<int> {};

// torch::nn::utils::clip_grad_norm_ after a backward that reduced the
// gradients into the shards fails at once, naming the parameter and
// opt.clip_grad_norm, instead of finding no gradient and clipping nothing.
// What p.grad() holds then does not disturb the loop: zeroed in place
// (LibTorch 1.13's Module::zero_grad), set to none, or left for the next
// backward, the training is torch::optim's.
TEST_P(ShardedOptimizerDropInReducing, TorchClipGradNormFailsNamingTheFix) {
  auto t = make(GetParam(), mlp(6, 19, 1, 15), kAdamW);
  regression_loss(t, 0).backward();
  const auto what = testing::error_of([&] { torch::nn::utils::clip_grad_norm_(t.model->parameters(), 1.0); });
  EXPECT_NE(what.find("the gradient of '"), std::string::npos) << what;
  EXPECT_NE(what.find("call opt.clip_grad_norm(max_norm)"), std::string::npos) << what;
  EXPECT_NE(what.find("ZeRO-" + std::to_string(GetParam())), std::string::npos) << what;

  auto run = [](int stage) {
    auto r = make(stage, mlp(6, 19, 1, 16), kAdamW);
    for (int s = 0; s < 6; ++s) {
      if (s % 3 == 0) {
        for (auto& p : r.model->parameters()) {  // as LibTorch 1.13's Module::zero_grad() clears
          if (p.grad().defined()) {
            p.mutable_grad() = p.grad().detach();
            p.mutable_grad().zero_();
          }
        }
      } else if (s % 3 == 1) {
        r.model->zero_grad();
      }  // else: nothing cleared (the previous step's gradients are in no shard any more)
      for (int k = 0; k < 2; ++k) (regression_loss(r, 2 * s + k) / 2).backward();
      if (r.zs != nullptr) {
        r.zs->clip_grad_norm(0.05);
      } else {
        torch::nn::utils::clip_grad_norm_(r.model->parameters(), 0.05);
      }
      r.opt->step();
      if (r.zs == nullptr) r.zero_grad();  // torch::optim's gradients would still be in p.grad()
    }
    return r.params();
  };
  expect_same_training(run(GetParam()), run(kOracle), "clip_grad_norm after clearing in place, to none, or not");
}

INSTANTIATE_TEST_SUITE_P(ZeroStages, ShardedOptimizerDropInReducing, ::testing::Values(0, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return "zero" + std::to_string(i.param); });

}  // namespace drop_in_test
}  // namespace zeroshard
