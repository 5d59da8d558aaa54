// The fused AdamW kernel against torch::optim::AdamW (the oracle), on odd sizes,
// on every SIMD path this CPU has, with 16-bit gradients and parameter copies.
#include "optim/adamw_kernel.h"
#include "optim/fused_adamw.h"
#include "optim/grad_norm.h"
#include "test_util.h"
#include "zeroshard/sharded_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <random>

namespace zeroshard::optim {
namespace fused_adamw_test {

std::vector<SimdLevel> available_levels() {
  std::vector<SimdLevel> out = {SimdLevel::kScalar};
  if (detected_simd() == SimdLevel::kAvx2 || detected_simd() == SimdLevel::kAvx512) out.push_back(SimdLevel::kAvx2);
  if (detected_simd() == SimdLevel::kAvx512) out.push_back(SimdLevel::kAvx512);
  return out;
}

struct Hyper {
  double lr = 1e-2, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1;
};

// Runs `steps` of torch::optim::AdamW on p0 with the given gradients.
torch::Tensor torch_adamw(const torch::Tensor& p0, const std::vector<torch::Tensor>& grads, const Hyper& h) {
  auto p = p0.clone().set_requires_grad(true);
  torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(h.lr).betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.wd));
  for (const auto& g : grads) {
    p.mutable_grad() = g.to(torch::kFloat).clone();
    opt.step();
  }
  return p.detach();
}

struct Result {
  torch::Tensor p, m, v, copy;
};

Result fused(const torch::Tensor& p0, const std::vector<torch::Tensor>& grads, const Hyper& h, SimdLevel level,
             c10::ScalarType copy_dtype = c10::ScalarType::Undefined, double grad_scale = 1.0) {
  Result r{p0.clone(), torch::zeros_like(p0), torch::zeros_like(p0), torch::Tensor()};
  if (copy_dtype != c10::ScalarType::Undefined) r.copy = torch::empty(p0.sizes(), p0.options().dtype(copy_dtype));
  int64_t step = 0;
  for (const auto& g : grads) {
    auto c = adamw_coeffs(h.lr, h.beta1, h.beta2, h.eps, h.wd, ++step, grad_scale);
    auto gc = g.contiguous();
    fused_adamw(c, r.p.data_ptr<float>(), gc.data_ptr(), gc.scalar_type(), r.m.data_ptr<float>(),
                r.v.data_ptr<float>(), p0.numel(), r.copy.defined() ? r.copy.data_ptr() : nullptr, copy_dtype, level);
  }
  return r;
}

std::vector<torch::Tensor> random_grads(int64_t n, int steps, c10::ScalarType dtype = torch::kFloat) {
  std::vector<torch::Tensor> out;
  for (int s = 0; s < steps; ++s) out.push_back((torch::randn({n}) * (s + 1) * 0.3).to(dtype));
  return out;
}

// Closeness to the oracle: torch's CPU ops may fuse a multiply-add where we do
// not, so the two differ by float rounding only: relative to |p| plus the size
// of one update (lr), so parameters crossing zero are judged fairly.
void expect_close(const torch::Tensor& got, const torch::Tensor& want, double rtol, const std::string& what) {
  const double err = ((got - want).abs() / (want.abs() + 1e-2)).max().item<double>();
  EXPECT_LT(err, rtol) << what << ": max relative error " << err;
}

TEST(FusedAdamW, MatchesTorchAdamWOnOddSizesOnEveryPath) {
  torch::manual_seed(7);
  Hyper h;
  for (int64_t n : {1, 7, 15, 17, 33, 1001, 65537}) {
    auto p0 = torch::randn({n});
    auto grads = random_grads(n, 6);
    auto want = torch_adamw(p0, grads, h);
    for (auto level : available_levels()) {
      auto got = fused(p0, grads, h, level);
      expect_close(got.p, want, 2e-6, "n=" + std::to_string(n) + " " + to_string(level));
    }
  }
}

TEST(FusedAdamW, EverySimdPathGivesIdenticalBits) {
  if (available_levels().size() < 2) GTEST_SKIP() << "this CPU has no AVX2: the scalar path is the only one";
  torch::manual_seed(8);
  Hyper h;
  const int64_t n = 3 * 16 + 13;  // full vectors and a tail on each path
  auto p0 = torch::randn({n});
  for (auto gdt : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (auto cdt : {c10::ScalarType::Undefined, torch::kBFloat16, torch::kHalf}) {
      auto grads = random_grads(n, 4, gdt);
      auto ref = fused(p0, grads, h, SimdLevel::kScalar, cdt);
      for (auto level : available_levels()) {
        auto got = fused(p0, grads, h, level, cdt);
        EXPECT_TRUE(torch::equal(got.p, ref.p)) << to_string(level);
        EXPECT_TRUE(torch::equal(got.m, ref.m)) << to_string(level);
        EXPECT_TRUE(torch::equal(got.v, ref.v)) << to_string(level);
        if (ref.copy.defined()) {
          EXPECT_TRUE(torch::equal(got.copy, ref.copy)) << to_string(level);
        }
      }
    }
  }
}

TEST(FusedAdamW, SixteenBitGradientsAndCopies) {
  torch::manual_seed(9);
  Hyper h;
  const int64_t n = 1000;
  auto p0 = torch::randn({n});
  for (auto dt : {torch::kBFloat16, torch::kHalf}) {
    auto grads = random_grads(n, 5, dt);
    auto want = torch_adamw(p0, grads, h);  // the oracle sees the same 16-bit values, widened
    for (auto level : available_levels()) {
      auto got = fused(p0, grads, h, level, dt);
      expect_close(got.p, want, 2e-6, to_string(level));
      // the copy is the updated fp32 parameter rounded exactly as LibTorch rounds it
      EXPECT_TRUE(torch::equal(got.copy, got.p.to(dt))) << to_string(level);
    }
  }
}

TEST(FusedAdamW, GradScaleEqualsPrescaledGradient) {
  torch::manual_seed(10);
  Hyper h;
  auto p0 = torch::randn({513});
  auto grads = random_grads(513, 3);
  std::vector<torch::Tensor> scaled;
  for (auto& g : grads) scaled.push_back(g * 0.25);  // exact in binary
  auto want = torch_adamw(p0, scaled, h);
  auto got = fused(p0, grads, h, default_simd(), c10::ScalarType::Undefined, 0.25);
  expect_close(got.p, want, 2e-6, "grad_scale");
}

TEST(FusedAdamW, ThreadsDoNotChangeResults) {
  torch::manual_seed(11);
  Hyper h;
  const int64_t n = (1 << 18) + 5;
  auto p0 = torch::randn({n});
  auto grads = random_grads(n, 2);
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  auto one = fused(p0, grads, h, default_simd());
  at::set_num_threads(2);
  auto two = fused(p0, grads, h, default_simd());
  at::set_num_threads(before);
  EXPECT_TRUE(torch::equal(one.p, two.p));
  EXPECT_TRUE(torch::equal(one.v, two.v));
}

// The library and its users are compiled with OpenMP: LibTorch's inline
// at::parallel_for (the fused kernel's and the gradient norm's threads) runs
// serially without it.
TEST(FusedAdamW, ParallelForRunsOnSeveralThreads) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  std::atomic<int> most{0};
  at::parallel_for(0, 1 << 20, 1 << 10, [&](int64_t, int64_t) {
    int seen = most.load();
    const int id = at::get_thread_num();
    while (id > seen && !most.compare_exchange_weak(seen, id)) {
    }
  });
  at::set_num_threads(before);
  EXPECT_EQ(most.load(), 1) << "at::parallel_for ran on one thread: the build lost -fopenmp (CMakeLists.txt: OpenMP)";
}

TEST(GradNorm, SumOfSquaresMatchesTorchAndIgnoresThreadCount) {
  torch::manual_seed(5);
  const int64_t n = (int64_t{1} << 20) + 3;  // 33 chunks, the last one short
  auto g = torch::randn({n});
  const double want = g.to(torch::kDouble).pow(2).sum().item<double>();
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  const double one = sum_of_squares(g.data_ptr(), g.scalar_type(), n);
  at::set_num_threads(2);
  const double two = sum_of_squares(g.data_ptr(), g.scalar_type(), n);
  auto h = g.to(torch::kBFloat16);
  const double half = sum_of_squares(h.data_ptr(), h.scalar_type(), n);
  at::set_num_threads(before);
  EXPECT_NEAR(one, want, 1e-12 * want);
  EXPECT_EQ(one, two) << "the sum must not depend on the thread count";
  EXPECT_NEAR(half, h.to(torch::kDouble).pow(2).sum().item<double>(), 1e-12 * want);
  auto bad = torch::zeros({4}, torch::kInt);
  EXPECT_THROW(sum_of_squares(bad.data_ptr(), bad.scalar_type(), 4), c10::ValueError);
}

// Sums whose parts wait on a device are read together: each sum is its host
// part plus its own parts, whatever the order they were added in, scaled by
// add()'s factor. (CPU scalars stand in for device ones: the reader groups by
// device and reads each group in one copy.)
TEST(GradNorm, PendingSumsAreReadTogether) {
  const auto scalar = [](double v) { return torch::tensor(v, torch::kDouble); };
  PendingSum a, b, c;
  a.host = 1.5;
  a.device = {scalar(2.0), scalar(0.25)};
  b.device = {scalar(8.0)};
  c.add(a, 2.0);
  c.add(b);
  c.host += 0.5;
  const auto got = read_sums({a, b, c, PendingSum{}});
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[0], 3.75);
  EXPECT_EQ(got[1], 8.0);
  EXPECT_EQ(got[2], 2 * 3.75 + 8.0 + 0.5);
  EXPECT_EQ(got[3], 0.0);
  // sum_of_squares is its pending form, read
  torch::manual_seed(6);
  const std::vector<at::Tensor> ts{torch::randn({100}), at::Tensor(), torch::randn({7}).to(torch::kBFloat16)};
  EXPECT_EQ(read_sums({pending_sum_of_squares(ts)})[0], sum_of_squares(ts));
  EXPECT_NEAR(sum_of_squares(ts), ts[0].to(torch::kDouble).pow(2).sum().item<double>() +
                                      ts[2].to(torch::kDouble).pow(2).sum().item<double>(), 1e-9);
}

TEST(FusedAdamW, ConversionsMatchLibTorch) {
  using namespace kernel;
  // every fp16 and bf16 bit pattern widens as LibTorch widens it
  for (uint32_t h = 0; h < 65536; ++h) {
    c10::Half half(static_cast<uint16_t>(h), c10::Half::from_bits());
    const float want = static_cast<float>(half);
    const float got = f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(std::memcmp(&want, &got, 4), 0) << "f16 " << h;
    }
    c10::BFloat16 bf(static_cast<uint16_t>(h), c10::BFloat16::from_bits());
    const float bw = static_cast<float>(bf), bg = bf16_to_float(static_cast<uint16_t>(h));
    ASSERT_EQ(std::memcmp(&bw, &bg, 4), 0) << "bf16 " << h;
  }
  // narrowing: random bit patterns over the whole float range, plus the edges
  std::mt19937 rng(3);
  std::vector<float> xs = {0.f, -0.f, 65504.f, 65519.f, 65520.f, 1e-8f, 2.9802322e-08f, 5.9604645e-08f,
                           6.1035156e-05f, 6.1e-05f, std::numeric_limits<float>::infinity(), 1e30f, -3.3e-6f};
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    xs.push_back(f);
  }
  for (float f : xs) {
    if (std::isnan(f)) continue;
    const uint16_t want = c10::Half(f).x;
    ASSERT_EQ(float_to_f16(f), want) << f;
    ASSERT_EQ(float_to_bf16(f), c10::BFloat16(f).x) << f;
  }
}

// set_adamw_simd() forces a path (how a user compares paths or works around a
// CPU problem); a path the CPU lacks, or a misspelling, is a clear error.
TEST(FusedAdamW, SimdLevelChosenByName) {
  EXPECT_EQ(default_simd(), detected_simd());
  zeroshard::set_adamw_simd("scalar");
  EXPECT_EQ(default_simd(), SimdLevel::kScalar);
  const auto bogus = zeroshard::testing::error_of([] { zeroshard::set_adamw_simd("sse9"); });
  EXPECT_NE(bogus.find("'sse9' is not one of scalar, avx2, avx512"), std::string::npos) << bogus;
  EXPECT_EQ(default_simd(), SimdLevel::kScalar) << "a refused name changes nothing";
  if (detected_simd() != SimdLevel::kAvx512) {
    const auto missing = zeroshard::testing::error_of([] { zeroshard::set_adamw_simd("avx512"); });
    EXPECT_NE(missing.find("this CPU lacks it"), std::string::npos) << missing;
  } else {
    zeroshard::set_adamw_simd("avx2");
    EXPECT_EQ(default_simd(), SimdLevel::kAvx2);
  }
  zeroshard::set_adamw_simd("");
  EXPECT_EQ(default_simd(), detected_simd());
}

TEST(FusedAdamW, BadInputIsRefused) {
  float x = 0;
  auto c = adamw_coeffs(1e-3, 0.9, 0.999, 1e-8, 0, 1);
  EXPECT_THROW(fused_adamw(c, &x, &x, c10::ScalarType::Double, &x, &x, 1), c10::Error);
  EXPECT_THROW(adamw_coeffs(1e-3, 0.9, 0.999, 1e-8, 0, 0), c10::Error);
}

}  // namespace fused_adamw_test
}  // namespace zeroshard::optim
