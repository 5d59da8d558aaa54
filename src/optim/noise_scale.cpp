// noise_scale.cpp — McCandlish's two-batch estimators, smoothed; Pollux's efficiency.
#include "zeroshard/noise_scale.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

namespace zeroshard {

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
}

GradientNoiseScale::GradientNoiseScale(double smoothing) : smoothing_(smoothing) {
  TORCH_CHECK_VALUE(smoothing >= 0 && smoothing < 1, "GradientNoiseScale: smoothing is ", smoothing,
                    "; it must be in [0, 1) (the moving average's weight of the past)");
}

bool GradientNoiseScale::update(double small_sumsq, double small_batch, double big_sumsq, double big_batch) {
  if (!std::isfinite(small_sumsq) || !std::isfinite(big_sumsq) || !(small_batch > 0) || !(big_batch > small_batch) ||
      !std::isfinite(big_batch)) {
    return false;
  }
  const double g2 = (big_batch * big_sumsq - small_batch * small_sumsq) / (big_batch - small_batch);
  const double s = (small_sumsq - big_sumsq) / (1.0 / small_batch - 1.0 / big_batch);
  g2_ = smoothing_ * g2_ + (1 - smoothing_) * g2;
  s_ = smoothing_ * s_ + (1 - smoothing_) * s;
  ++steps_;
  return true;
}

// Adam's bias correction: the averages start at 0, so divide by 1 − smoothing^steps.
double GradientNoiseScale::correction() const {
  return 1.0 - std::pow(smoothing_, static_cast<double>(steps_));
}

double GradientNoiseScale::gradient_sq() const { return steps_ == 0 ? kNaN : g2_ / correction(); }
double GradientNoiseScale::trace_cov() const { return steps_ == 0 ? kNaN : s_ / correction(); }

double GradientNoiseScale::noise_scale() const {
  if (steps_ == 0) return kNaN;
  if (g2_ <= 0) return std::numeric_limits<double>::infinity();
  return s_ <= 0 ? 0.0 : s_ / g2_;  // the corrections cancel
}

double GradientNoiseScale::efficiency(double batch, double reference) const {
  TORCH_CHECK_VALUE(batch > 0 && reference > 0, "GradientNoiseScale::efficiency: batch ", batch, " and reference ",
                    reference, " must both be positive (in the unit update() was given)");
  const double phi = noise_scale();
  if (std::isnan(phi)) return kNaN;
  if (std::isinf(phi)) return 1.0;
  return (phi + reference) / (phi + batch);
}

std::string GradientNoiseScale::to_json() const {
  return nlohmann::json{{"smoothing", smoothing_}, {"steps", steps_}, {"g2", g2_}, {"s", s_}}.dump();
}

void GradientNoiseScale::from_json(const std::string& text) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  for (const char* key : {"smoothing", "steps", "g2", "s"}) {
    TORCH_CHECK_VALUE(j.is_object() && j.contains(key) && j[key].is_number(), "GradientNoiseScale::from_json: '",
                      text, "' has no number \"", key, "\"; give what to_json() wrote");
  }
  smoothing_ = j["smoothing"].get<double>();
  steps_ = j["steps"].get<int64_t>();
  g2_ = j["g2"].get<double>();
  s_ = j["s"].get<double>();
}

}  // namespace zeroshard
