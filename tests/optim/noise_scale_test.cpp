// The gradient noise scale: the estimator against closed forms (NoiseScale.*,
// one process), and the sample every ZeRO stage measures inside step()
// against the same norms computed here from the data, then the whole estimate
// on a model whose per-example gradient covariance is known
// (ShardedOptimizerNoise.*, 1-4 ranks under zeroshard-run).
#include "test_util.h"
#include "zeroshard/fully_shard.h"
#include "zeroshard/noise_scale.h"
#include "zeroshard/sharded_adamw.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace zeroshard {
namespace noise_scale_test {

using testing::world;
using testing::world_ptr;

// E|G_B|² = |G|² + tr Σ / B, exactly.
double expected_sumsq(double g2, double s, double batch) { return g2 + s / batch; }

TEST(NoiseScale, ExactExpectationsGiveTheClosedForm) {
  GradientNoiseScale gns(0.9);
  const double g2 = 3.5, s = 420.0;
  for (int step = 0; step < 5; ++step) {
    const double small = 4 + step, big = 32 + 8 * step;  // the batch sizes may change between steps
    ASSERT_TRUE(gns.update(expected_sumsq(g2, s, small), small, expected_sumsq(g2, s, big), big));
  }
  EXPECT_NEAR(gns.gradient_sq(), g2, 1e-9 * g2);
  EXPECT_NEAR(gns.trace_cov(), s, 1e-9 * s);
  EXPECT_NEAR(gns.noise_scale(), s / g2, 1e-9 * s / g2);
  const double phi = s / g2;
  EXPECT_NEAR(gns.efficiency(256, 8), (phi + 8) / (phi + 256), 1e-12);
  EXPECT_NEAR(gns.efficiency(8, 8), 1.0, 1e-12);
  EXPECT_EQ(gns.steps(), 5);
}

TEST(NoiseScale, AveragesAreBiasCorrected) {
  const double beta = 0.8;
  GradientNoiseScale gns(beta);
  // Step estimates: |G|² = (64·b − 16·a)/48 and tr Σ = (a − b)/(1/16 − 1/64).
  const double a[] = {10, 14, 9}, b[] = {6, 5, 7};
  double num_g = 0, num_s = 0, den = 0;
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(gns.update(a[k], 16, b[k], 64));
    num_g = beta * num_g + (1 - beta) * (64 * b[k] - 16 * a[k]) / 48;
    num_s = beta * num_s + (1 - beta) * (a[k] - b[k]) / (1.0 / 16 - 1.0 / 64);
    den = beta * den + (1 - beta);
    EXPECT_NEAR(gns.gradient_sq(), num_g / den, 1e-12 * std::abs(num_g / den)) << "step " << k;
    EXPECT_NEAR(gns.trace_cov(), num_s / den, 1e-12 * std::abs(num_s / den)) << "step " << k;
  }
}

TEST(NoiseScale, UnusableStepsAndEdges) {
  GradientNoiseScale gns;
  EXPECT_TRUE(std::isnan(gns.noise_scale()));
  EXPECT_TRUE(std::isnan(gns.efficiency(10, 1)));
  EXPECT_FALSE(gns.update(1, 8, 1, 8));    // one batch size: nothing to compare
  EXPECT_FALSE(gns.update(1, 16, 1, 8));   // small larger than big
  EXPECT_FALSE(gns.update(std::numeric_limits<double>::infinity(), 8, 1, 16));  // an overflowed step
  EXPECT_FALSE(gns.update(1, 0, 1, 16));
  EXPECT_EQ(gns.steps(), 0);
  ASSERT_TRUE(gns.update(2, 1, 2, 4));     // no variance: tr Σ = 0
  EXPECT_EQ(gns.noise_scale(), 0);
  EXPECT_NEAR(gns.efficiency(4, 1), 0.25, 1e-12);  // M0 / M
  GradientNoiseScale noisy;
  ASSERT_TRUE(noisy.update(10, 1, 1, 2));  // |G|² estimate 2·1 − 10 < 0: noise swamps the signal
  EXPECT_TRUE(std::isinf(noisy.noise_scale()));
  EXPECT_EQ(noisy.efficiency(1000, 1), 1.0);
  EXPECT_NE(testing::error_of([&] { (void)noisy.efficiency(0, 1); }).find("must both be positive"), std::string::npos);
  EXPECT_NE(testing::error_of([] { GradientNoiseScale bad(1.0); }).find("smoothing is 1"), std::string::npos);
}

TEST(NoiseScale, JsonRoundTrip) {
  GradientNoiseScale a(0.7);
  a.update(5, 2, 3, 8);
  a.update(6, 2, 2.5, 8);
  GradientNoiseScale b;
  b.from_json(a.to_json());
  EXPECT_EQ(b.steps(), 2);
  EXPECT_DOUBLE_EQ(b.noise_scale(), a.noise_scale());
  b.update(7, 2, 3, 8);
  a.update(7, 2, 3, 8);
  EXPECT_DOUBLE_EQ(b.gradient_sq(), a.gradient_sq());
  EXPECT_NE(testing::error_of([&] { b.from_json("{\"steps\": 1}"); }).find("no number \"smoothing\""), std::string::npos);
}

// Loss ½|w − x|² per example, x ~ N(μ, σ²I): per-example gradient w − x, so
// |G|² = |w − μ|² and tr Σ = σ²·d. w stays 0 (lr 0), |μ|² = 256, d = 1024,
// σ = 1: the noise scale is 4 examples.
constexpr int64_t kHeadDim = 256, kBodyDim = 768, kDim = kHeadDim + kBodyDim;
constexpr int64_t kPerMicro = 4;  // examples per rank per backward
constexpr double kMuSq = 256.0, kSigma = 1.0;

struct PartImpl : torch::nn::Module {
  PartImpl() { w = register_parameter("w", torch::zeros({kBodyDim})); }
  torch::Tensor forward(const torch::Tensor& x) { return w - x; }  // ZeRO-3 gathers w around this
  torch::Tensor w;
};
TORCH_MODULE(Part);

struct MeanModelImpl : torch::nn::Module {
  MeanModelImpl() {
    head = register_parameter("head", torch::zeros({kHeadDim}));
    body = register_module("body", Sharded<Part>());
  }
  torch::Tensor head;
  Sharded<Part> body;
  // Per example, w − x: [examples, kDim].
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::cat({head - x.slice(1, 0, kHeadDim), body->forward(x.slice(1, kHeadDim, kDim))}, 1);
  }
};
TORCH_MODULE(MeanModel);

// The examples of (step, rank, micro): [kPerMicro, kDim], the same on every rank that asks.
torch::Tensor examples(int step, int rank, int micro) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000003 * step + 1009 * rank + micro));
  const double mu = std::sqrt(kMuSq / kDim);
  return mu + kSigma * at::randn({kPerMicro, kDim}, gen, at::TensorOptions(at::kFloat));
}

struct NoiseRun {
  MeanModel model;
  std::shared_ptr<FullyShardedModel> sharded;
  std::unique_ptr<ShardedOptimizer> opt;
  int micros;
  NoiseRun(int stage, int micro_batches) : micros(micro_batches) {
    const auto adamw = torch::optim::AdamWOptions(0.0).weight_decay(0);  // w stays put
    if (stage == 3) {
      sharded = fully_shard(model, world_ptr());
      opt = std::make_unique<FullyShardedAdamW>(sharded, adamw);
    } else {
      ShardedAdamWOptions o;
      o.zero_stage = stage;
      o.bucket_bytes = 1024;  // several buckets, one split across ranks
      opt = std::make_unique<ShardedAdamW>(model->named_parameters(), world_ptr(), adamw, o);
    }
  }
  // One step: each backward's loss is scaled so the reduced gradient is the global mean.
  GradientNoiseSample step(int s) {
    const int n = world().size();
    const double global = static_cast<double>(kPerMicro) * micros * n;
    opt->zero_grad();
    for (int m = 0; m < micros; ++m) {
      const auto x = examples(s, world().rank(), m);
      (model->forward(x).square().sum() * (0.5 * n / global)).backward();
    }
    opt->step();
    return opt->last_gradient_noise();
  }
};

// The sample's two norms from the data, as the definitions say: the step's
// mean gradient, and the mean over (rank, part) of each part's own mean
// gradient, where a part is one rank's backward (ZeRO-0/2/3 reduce each) or its
// whole batch (ZeRO-1).
std::pair<double, double> oracle_norms(int s, int n, int micros, bool per_backward) {
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < n; ++r) {
    std::vector<torch::Tensor> xs;
    for (int m = 0; m < micros; ++m) xs.push_back(examples(s, r, m).to(at::kDouble));
    if (per_backward) {
      for (auto& x : xs) parts.push_back(-x.mean(0));
    } else {
      parts.push_back(-torch::cat(xs).mean(0));
    }
  }
  const auto all = torch::stack(parts);
  double small = 0;
  for (const auto& p : parts) small += p.square().sum().item<double>();
  return {all.mean(0).square().sum().item<double>(), small / static_cast<double>(parts.size())};
}

class ShardedOptimizerNoise : public ::testing::TestWithParam<int> {};

TEST_P(ShardedOptimizerNoise, SampleEqualsTheNormsOfTheData) {
  const int stage = GetParam(), n = world().size(), micros = 2;
  NoiseRun run(stage, micros);
  for (int s = 0; s < 3; ++s) {
    const auto got = run.step(s);
    const bool per_backward = stage != 1;  // ZeRO-0, 2 and 3 reduce every backward
    const auto [big, small] = oracle_norms(s, n, micros, per_backward);
    EXPECT_EQ(got.ranks, n);
    EXPECT_EQ(got.rounds, per_backward ? micros : 1);
    EXPECT_NEAR(got.big_sumsq, big, 1e-5 * big) << "ZeRO-" << stage << ", step " << s;
    EXPECT_NEAR(got.small_sumsq, small, 1e-5 * small) << "ZeRO-" << stage << ", step " << s;
  }
}

TEST_P(ShardedOptimizerNoise, EstimateMatchesTheKnownCovariance) {
  const int stage = GetParam(), n = world().size(), micros = 2;
  NoiseRun run(stage, micros);
  GradientNoiseScale gns(0.98);
  const double batch = static_cast<double>(kPerMicro) * micros * n;
  for (int s = 0; s < 300; ++s) {
    const auto got = run.step(s);
    if (got.parts() > 1) {
      ASSERT_TRUE(gns.update(got.small_sumsq, batch / got.parts(), got.big_sumsq, batch));
    }
  }
  if (stage == 1 && n == 1) {  // one rank, one reduction per step: one batch size only
    EXPECT_EQ(gns.steps(), 0);
    return;
  }
  const double trace = kSigma * kSigma * kDim, phi = trace / kMuSq;
  EXPECT_NEAR(gns.trace_cov(), trace, 0.1 * trace) << "ZeRO-" << stage;
  EXPECT_NEAR(gns.gradient_sq(), kMuSq, 0.1 * kMuSq) << "ZeRO-" << stage;
  EXPECT_NEAR(gns.noise_scale(), phi, 0.1 * phi) << "ZeRO-" << stage;
  EXPECT_NEAR(gns.efficiency(batch, 1), (phi + 1) / (phi + batch), 0.1 * (phi + 1) / (phi + batch));
  if (world().rank() == 0) {
    std::printf("ZeRO-%d, %d ranks: noise scale %.3f (closed form %.3f), tr S %.1f (%.1f), |G|^2 %.2f (%.2f)\n", stage,
                n, gns.noise_scale(), phi, gns.trace_cov(), trace, gns.gradient_sq(), kMuSq);
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, ShardedOptimizerNoise, ::testing::Values(0, 1, 2, 3),
                         [](const auto& info) { return "ZeRO" + std::to_string(info.param); });

}  // namespace noise_scale_test
}  // namespace zeroshard
