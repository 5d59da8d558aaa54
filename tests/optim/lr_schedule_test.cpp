// LR schedules against their closed forms, and their effect on every param group.
#include "test_util.h"

#include <zeroshard/lr_schedule.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace lr_schedule_test {

TEST(LrSchedule, ClosedForms) {
  using S = zeroshard::LrSchedule;
  S::Options o;
  o.kind = S::kInverseSqrt;
  o.warmup_steps = 100;
  S isqrt(o);
  EXPECT_DOUBLE_EQ(isqrt.factor(1), 0.01);
  EXPECT_DOUBLE_EQ(isqrt.factor(50), 0.5);
  EXPECT_DOUBLE_EQ(isqrt.factor(100), 1.0);
  EXPECT_DOUBLE_EQ(isqrt.factor(400), 0.5);  // sqrt(100 / 400)
  o.kind = S::kCosine;
  o.total_steps = 1100;
  o.min_ratio = 0.1;
  S cosine(o);
  EXPECT_DOUBLE_EQ(cosine.factor(100), 1.0);
  EXPECT_NEAR(cosine.factor(600), 0.1 + 0.9 * 0.5, 1e-12);  // half-way through the decay
  EXPECT_NEAR(cosine.factor(1100), 0.1, 1e-12);
  EXPECT_NEAR(cosine.factor(5000), 0.1, 1e-12);
  o.kind = S::kConstant;
  EXPECT_DOUBLE_EQ(S(o).factor(7), 0.07);
  EXPECT_DOUBLE_EQ(S(o).factor(700), 1.0);
  EXPECT_EQ(S::parse_kind("cosine"), S::kCosine);
  EXPECT_THROW(S::parse_kind("linear-ish"), c10::ValueError);
  o.kind = S::kCosine;
  o.total_steps = 50;
  EXPECT_THROW(S{o}, c10::ValueError) << "cosine decay must end after the warmup";
}

TEST(LrSchedule, SetsEveryGroupRelativeToItsOwnPeak) {
  auto a = torch::zeros({2}, torch::requires_grad()), b = torch::zeros({2}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a}, std::make_unique<torch::optim::AdamWOptions>(1e-3));
  groups.emplace_back(std::vector<torch::Tensor>{b}, std::make_unique<torch::optim::AdamWOptions>(4e-3));
  torch::optim::AdamW opt(std::move(groups));
  zeroshard::LrSchedule::Options o;
  o.warmup_steps = 4;
  zeroshard::LrSchedule s(o);
  s.attach(opt);
  EXPECT_DOUBLE_EQ(s.apply(opt, 2), 0.5e-3);
  auto lr = [&](int g) { return static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[g].options()).lr(); };
  EXPECT_DOUBLE_EQ(lr(0), 0.5e-3);
  EXPECT_DOUBLE_EQ(lr(1), 2e-3);
  s.apply(opt, 16);  // sqrt(4 / 16) = 0.5 of each peak, not of the value the last apply left
  EXPECT_DOUBLE_EQ(lr(0), 0.5e-3);
  EXPECT_DOUBLE_EQ(lr(1), 2e-3);
}

}  // namespace lr_schedule_test
