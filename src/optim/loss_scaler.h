// loss_scaler.h — the dynamic loss scale state machine (fp16 training).
//
// After every step the caller reports whether any rank saw an inf/NaN
// gradient (a decision already agreed across ranks). An overflow multiplies
// the scale by backoff_factor (never below min_scale) and the step is skipped;
// growth_interval clean steps in a row multiply it by growth_factor. Same rule
// as PyTorch's GradScaler and DeepSpeed's DynamicLossScaler.
#pragma once

#include "zeroshard/optim_options.h"

namespace zeroshard::optim {

class LossScaler {
 public:
  // enabled: whether scaling is on (resolved from LossScaleOptions::enabled by the caller).
  LossScaler(const LossScaleOptions& options, bool enabled);

  bool enabled() const { return enabled_; }
  double scale() const { return enabled_ ? scale_ : 1.0; }
  int64_t clean_steps() const { return clean_steps_; }
  // Records one step's outcome; returns true when the step must be skipped.
  bool update(bool found_inf);
  // Resumes from a checkpoint.
  void restore(double scale, int64_t clean_steps) {
    scale_ = scale;
    clean_steps_ = clean_steps;
  }

 private:
  LossScaleOptions options_;
  bool enabled_;
  double scale_;
  int64_t clean_steps_ = 0;
};

}  // namespace zeroshard::optim
