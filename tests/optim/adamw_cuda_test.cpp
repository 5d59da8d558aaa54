// The CUDA AdamW kernel. On the host (every build): one CUDA thread's work
// (adamw_segment.h: its quads, 4-wide loads and tails, over emulated grids)
// against the CPU kernel, bit for bit. On a GPU: the kernel itself against the
// CPU kernel (bits) and torch::optim::AdamW (rounding); skipped without one.
#include "optim/cuda/adamw_segment.h"
#include "optim/fused_adamw.h"

#ifdef ZS_WITH_CUDA
#include "optim/cuda/fused_adamw_cuda.h"
#endif

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace zeroshard::optim {
namespace adamw_cuda_test {

using kernel::Half16;

Half16 kind_of(c10::ScalarType t) {
  return t == torch::kBFloat16 ? Half16::kBF16 : t == torch::kHalf ? Half16::kF16 : Half16::kNone;
}

struct State {
  torch::Tensor p, g, m, v, copy;
  State clone() const { return {p.clone(), g.clone(), m.clone(), v.clone(), copy.defined() ? copy.clone() : copy}; }
};

State random_state(int64_t n, c10::ScalarType gdt, c10::ScalarType cdt, torch::Device device = torch::kCPU) {
  State s;
  s.p = torch::randn({n});
  s.g = (torch::randn({n}) * 0.3).to(gdt);
  s.m = torch::randn({n}) * 0.01;
  s.v = torch::rand({n}) * 1e-3;
  if (cdt != c10::ScalarType::Undefined) s.copy = torch::zeros({n}, torch::TensorOptions().dtype(cdt));
  if (device != torch::kCPU) {
    for (auto* t : {&s.p, &s.g, &s.m, &s.v, &s.copy}) {
      if (t->defined()) *t = t->to(device);
    }
  }
  return s;
}

// The CPU kernel (scalar path) over [begin, begin + size).
void cpu_update(State& s, const AdamWCoeffs& c, int64_t begin, int64_t size) {
  const auto ge = s.g.element_size();
  fused_adamw(c, s.p.data_ptr<float>() + begin, static_cast<char*>(s.g.data_ptr()) + begin * ge,
              s.g.scalar_type(), s.m.data_ptr<float>() + begin, s.v.data_ptr<float>() + begin, size,
              s.copy.defined() ? static_cast<uint16_t*>(s.copy.data_ptr()) + begin : nullptr,
              s.copy.defined() ? s.copy.scalar_type() : c10::ScalarType::Undefined, SimdLevel::kScalar);
}

kernel::Arrays arrays_of(State& s) {
  kernel::Arrays a;
  a.param = s.p.data_ptr<float>();
  a.grad = s.g.data_ptr();
  a.grad_kind = kind_of(s.g.scalar_type());
  a.exp_avg = s.m.data_ptr<float>();
  a.exp_avg_sq = s.v.data_ptr<float>();
  if (s.copy.defined()) {
    a.copy = s.copy.data_ptr();
    a.copy_kind = kind_of(s.copy.scalar_type());
  }
  return a;
}

template <Half16 GK, Half16 CK>
void emulate_grid(const AdamWCoeffs& c, const kernel::Arrays& a, const kernel::Segment& seg, int64_t threads) {
  for (int64_t t = 0; t < threads; ++t) kernel::update_segment<GK, CK>(c, a, seg, t, threads);
}

void emulate(const AdamWCoeffs& c, const kernel::Arrays& a, const kernel::Segment& seg, int64_t threads) {
  auto with_copy = [&](auto gk) {
    constexpr Half16 G = decltype(gk)::value;
    switch (a.copy_kind) {
      case Half16::kBF16: return emulate_grid<G, Half16::kBF16>(c, a, seg, threads);
      case Half16::kF16: return emulate_grid<G, Half16::kF16>(c, a, seg, threads);
      default: return emulate_grid<G, Half16::kNone>(c, a, seg, threads);
    }
  };
  switch (a.grad_kind) {
    case Half16::kBF16: return with_copy(std::integral_constant<Half16, Half16::kBF16>());
    case Half16::kF16: return with_copy(std::integral_constant<Half16, Half16::kF16>());
    default: return with_copy(std::integral_constant<Half16, Half16::kNone>());
  }
}

void expect_same_bits(const State& got, const State& want, const std::string& what) {
  EXPECT_TRUE(torch::equal(got.p, want.p)) << what << ": parameters differ";
  EXPECT_TRUE(torch::equal(got.m, want.m)) << what << ": exp_avg differs";
  EXPECT_TRUE(torch::equal(got.v, want.v)) << what << ": exp_avg_sq differs";
  if (want.copy.defined()) {
    EXPECT_TRUE(torch::equal(got.copy, want.copy)) << what << ": 16-bit copies differ";
  }
}

const std::vector<c10::ScalarType> kCopyKinds = {c10::ScalarType::Undefined, torch::kBFloat16, torch::kHalf};

// Every gradient and copy kind, segments starting aligned and not (the scalar
// path), sizes with and without a tail, grids smaller and larger than the work.
TEST(AdamWDeviceMath, OneThreadsWorkMatchesTheCpuKernelBitForBit) {
  torch::manual_seed(21);
  const auto c = adamw_coeffs(1e-2, 0.9, 0.95, 1e-8, 0.1, 3, 0.5);
  for (auto gdt : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (auto cdt : kCopyKinds) {
      for (int64_t begin : {0, 4, 5}) {
        for (int64_t size : {1, 3, 4, 37, 1000}) {
          for (int64_t threads : {1, 3, 64}) {
            const State init = random_state(begin + size + 3, gdt, cdt);
            State want = init.clone(), got = init.clone();
            cpu_update(want, c, begin, size);
            emulate(c, arrays_of(got), kernel::Segment{begin, size, 0}, threads);
            expect_same_bits(got, want, std::string(c10::toString(gdt)) + "/" +
                                            (cdt == c10::ScalarType::Undefined ? "none" : c10::toString(cdt)) +
                                            " begin " + std::to_string(begin) + " size " + std::to_string(size) +
                                            " threads " + std::to_string(threads));
          }
        }
      }
    }
  }
}

TEST(AdamWDeviceMath, QuadsAreUsedOnlyWhenEveryArrayIsAligned) {
  State s = random_state(64, torch::kBFloat16, torch::kBFloat16);
  const auto a = arrays_of(s);
  EXPECT_TRUE(kernel::quads_aligned(a, 0));
  EXPECT_TRUE(kernel::quads_aligned(a, 8));
  EXPECT_FALSE(kernel::quads_aligned(a, 2));  // fp32 arrays at 8 bytes
  State f = random_state(64, torch::kFloat, c10::ScalarType::Undefined);
  EXPECT_FALSE(kernel::quads_aligned(arrays_of(f), 1));
}

// The coefficients the device computes from a step on the device are the
// host's: the same function, and every step of a long run agrees with the
// double-precision formula rounded once.
TEST(AdamWDeviceMath, CoefficientsOfAStepMatchTheClosedForm) {
  const kernel::Hyper h{3e-4, 0.9, 0.999, 1e-8, 0.01};
  for (int64_t step : {1, 2, 10, 1000, 100000}) {
    const auto c = kernel::coeffs_of_step(h, static_cast<double>(step), 1.0);
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.999, step);
    EXPECT_EQ(c.neg_step_size, static_cast<float>(-3e-4 / bc1)) << step;
    EXPECT_EQ(c.bias_correction2_sqrt, static_cast<float>(std::sqrt(bc2))) << step;
    EXPECT_EQ(c.decay, static_cast<float>(1 - 3e-4 * 0.01));
    const auto host = adamw_coeffs(3e-4, 0.9, 0.999, 1e-8, 0.01, step);
    EXPECT_EQ(std::memcmp(&c, &host, sizeof c), 0) << step;
  }
}

#ifdef ZS_WITH_CUDA

#define ZS_REQUIRE_GPU()                                                                  \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine"

// The kernel writes the CPU kernel's bits: many pieces (several launches), two
// coefficient sets, unaligned piece starts, every dtype pairing.
TEST(AdamWCuda, KernelMatchesTheCpuKernelBitForBit) {
  ZS_REQUIRE_GPU();
  torch::manual_seed(22);
  const auto c1 = adamw_coeffs(1e-2, 0.9, 0.95, 1e-8, 0.1, 4);
  const auto c2 = adamw_coeffs(3e-3, 0.9, 0.999, 1e-6, 0.0, 2);
  for (auto gdt : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (auto cdt : kCopyKinds) {
      const int64_t n = 200 * 37 + 11;
      State init = random_state(n, gdt, cdt);
      State want = init.clone();
      std::vector<AdamWPiece> pieces;
      for (int64_t b = 1, k = 0; b + 30 <= n; b += 37, ++k) {  // 199 pieces of 30 with gaps
        pieces.push_back({b, 30, k % 3 == 0 ? c2 : c1});
        cpu_update(want, pieces.back().coeffs, b, 30);
      }
      State got;
      got.p = init.p.cuda(); got.g = init.g.cuda(); got.m = init.m.cuda(); got.v = init.v.cuda();
      if (init.copy.defined()) got.copy = init.copy.cuda();
      fused_adamw_cuda(pieces, got.p, got.g, got.m, got.v, got.copy);
      State back{got.p.cpu(), got.g.cpu(), got.m.cpu(), got.v.cpu(), got.copy.defined() ? got.copy.cpu() : got.copy};
      expect_same_bits(back, want, std::string(c10::toString(gdt)));
    }
  }
}

// Device-side step and scalars: a step counted on the device gives the host's
// coefficients; found_inf > 0 leaves everything untouched; grad_scale scales.
TEST(AdamWCuda, DeviceStepAndScalars) {
  ZS_REQUIRE_GPU();
  torch::manual_seed(23);
  const kernel::Hyper h{1e-2, 0.9, 0.95, 1e-8, 0.1};
  const int64_t n = 4099;
  State init = random_state(n, torch::kBFloat16, torch::kBFloat16);
  State want = init.clone();
  State got{init.p.cuda(), init.g.cuda(), init.m.cuda(), init.v.cuda(), init.copy.cuda()};
  auto step = torch::zeros({1}, torch::TensorOptions().device(torch::kCUDA));
  auto scale = torch::full({1}, 0.25f, step.options());
  auto inf = torch::zeros({1}, step.options());
  cuda::DeviceScalars scalars{scale.data_ptr<float>(), inf.data_ptr<float>()};
  for (int s = 1; s <= 5; ++s) {
    step.add_(1);
    fused_adamw_cuda_step(h, step, got.p, got.g, got.m, got.v, got.copy, scalars);
    cpu_update(want, adamw_coeffs(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, s, 0.25), 0, n);
  }
  State back{got.p.cpu(), got.g.cpu(), got.m.cpu(), got.v.cpu(), got.copy.cpu()};
  expect_same_bits(back, want, "device step");
  inf.fill_(1);
  step.add_(1);
  fused_adamw_cuda_step(h, step, got.p, got.g, got.m, got.v, got.copy, scalars);
  EXPECT_TRUE(torch::equal(got.p.cpu(), back.p)) << "a step with found_inf > 0 wrote the parameters";
  EXPECT_TRUE(torch::equal(got.v.cpu(), back.v)) << "a step with found_inf > 0 wrote exp_avg_sq";
}

// Against the oracle: torch::optim::AdamW on the same CUDA tensors, to rounding.
TEST(AdamWCuda, MatchesTorchAdamWOnTheDevice) {
  ZS_REQUIRE_GPU();
  torch::manual_seed(24);
  const int64_t n = 100003;
  auto p0 = torch::randn({n}, torch::kCUDA);
  auto ref = p0.clone().set_requires_grad(true);
  torch::optim::AdamW opt({ref}, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  auto p = p0.clone(), m = torch::zeros_like(p0), v = torch::zeros_like(p0);
  for (int s = 1; s <= 6; ++s) {
    auto g = torch::randn({n}, torch::kCUDA) * s;
    ref.mutable_grad() = g.clone();
    opt.step();
    fused_adamw_cuda({{0, n, adamw_coeffs(1e-2, 0.9, 0.95, 1e-8, 0.1, s)}}, p, g, m, v);
  }
  const double err = ((p - ref.detach()).abs() / (ref.detach().abs() + 1e-2)).max().item<double>();
  EXPECT_LT(err, 2e-6);
}

TEST(AdamWCuda, BadArraysAreNamed) {
  ZS_REQUIRE_GPU();
  auto p = torch::zeros({8}, torch::kCUDA);
  auto short_grad = torch::zeros({7}, torch::kCUDA);
  try {
    fused_adamw_cuda({{0, 8, adamw_coeffs(1e-3, 0.9, 0.999, 1e-8, 0, 1)}}, p, short_grad, p.clone(), p.clone());
    FAIL() << "a gradient of the wrong length was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("the gradient has 7 elements"), std::string::npos) << e.what();
  }
  auto cpu_grad = torch::zeros({8});
  EXPECT_THROW(fused_adamw_cuda({}, p, cpu_grad, p.clone(), p.clone()), c10::ValueError);
}

#endif  // ZS_WITH_CUDA

}  // namespace adamw_cuda_test
}  // namespace zeroshard::optim
