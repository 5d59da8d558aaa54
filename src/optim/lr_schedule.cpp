// lr_schedule.cpp — warmup + constant / inverse-sqrt / cosine.
#include "zeroshard/lr_schedule.h"

#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>

namespace zeroshard {

LrSchedule::LrSchedule(Options options) : options_(options) {
  TORCH_CHECK_VALUE(options_.warmup_steps >= 0, "LrSchedule: warmup_steps is ", options_.warmup_steps,
                    "; it must be >= 0");
  TORCH_CHECK_VALUE(options_.kind != kCosine || options_.total_steps > options_.warmup_steps,
                    "LrSchedule: cosine decay needs total_steps (", options_.total_steps,
                    ") greater than warmup_steps (", options_.warmup_steps, ")");
  TORCH_CHECK_VALUE(options_.min_ratio >= 0 && options_.min_ratio <= 1, "LrSchedule: min_ratio is ",
                    options_.min_ratio, "; it must be in [0, 1]");
}

LrSchedule::Kind LrSchedule::parse_kind(const std::string& name) {
  if (name == "constant") return kConstant;
  if (name == "inverse-sqrt") return kInverseSqrt;
  if (name == "cosine") return kCosine;
  TORCH_CHECK_VALUE(false, "unknown learning-rate schedule '", name, "': use constant, inverse-sqrt or cosine");
}

std::string LrSchedule::kind_name(Kind kind) {
  switch (kind) {
    case kConstant: return "constant";
    case kInverseSqrt: return "inverse-sqrt";
    case kCosine: return "cosine";
  }
  return "?";
}

double LrSchedule::factor(int64_t step) const {
  const double s = static_cast<double>(std::max<int64_t>(step, 1));
  const double w = static_cast<double>(options_.warmup_steps);
  if (options_.warmup_steps > 0 && step <= options_.warmup_steps) return s / w;
  switch (options_.kind) {
    case kConstant:
      return 1.0;
    case kInverseSqrt:  // continuous at the end of warmup: sqrt(w / s)
      return options_.warmup_steps > 0 ? std::sqrt(w / s) : 1.0 / std::sqrt(s);
    case kCosine: {
      const double t = std::min(1.0, (s - w) / static_cast<double>(options_.total_steps - options_.warmup_steps));
      return options_.min_ratio + (1.0 - options_.min_ratio) * 0.5 * (1.0 + std::cos(M_PI * t));
    }
  }
  return 1.0;
}

namespace {
double& group_lr(torch::optim::OptimizerParamGroup& g) {
  auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&g.options());
  TORCH_CHECK_VALUE(adamw != nullptr, "LrSchedule: param group options are not AdamWOptions");
  return adamw->lr();
}
}  // namespace

void LrSchedule::attach(torch::optim::Optimizer& opt) {
  peaks_.clear();
  for (auto& g : opt.param_groups()) peaks_.push_back(group_lr(g));
}

double LrSchedule::apply(torch::optim::Optimizer& opt, int64_t step) const {
  auto& groups = opt.param_groups();
  TORCH_CHECK(groups.size() == peaks_.size(), "LrSchedule::apply: the optimizer has ", groups.size(),
              " param groups and attach() saw ", peaks_.size(), "; call attach(opt) first");
  const double f = factor(step);
  for (size_t i = 0; i < groups.size(); ++i) group_lr(groups[i]) = peaks_[i] * f;
  return groups.empty() ? 0.0 : peaks_[0] * f;
}

}  // namespace zeroshard
