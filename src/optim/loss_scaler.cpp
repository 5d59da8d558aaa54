#include "optim/loss_scaler.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard::optim {

LossScaler::LossScaler(const LossScaleOptions& options, bool enabled)
    : options_(options), enabled_(enabled), scale_(options.init_scale) {
  if (!enabled_) return;
  TORCH_CHECK_VALUE(options.init_scale > 0, "LossScaleOptions::init_scale is ", options.init_scale,
                    "; it must be positive (Default: 65536)");
  TORCH_CHECK_VALUE(options.growth_factor >= 1, "LossScaleOptions::growth_factor is ", options.growth_factor,
                    "; it must be >= 1 (Default: 2)");
  TORCH_CHECK_VALUE(options.backoff_factor > 0 && options.backoff_factor < 1,
                    "LossScaleOptions::backoff_factor is ", options.backoff_factor,
                    "; it must be in (0, 1) (Default: 0.5)");
  TORCH_CHECK_VALUE(options.growth_interval >= 1, "LossScaleOptions::growth_interval is ",
                    options.growth_interval, "; it must be >= 1 (Default: 2000)");
  TORCH_CHECK_VALUE(options.min_scale > 0, "LossScaleOptions::min_scale is ", options.min_scale,
                    "; it must be positive (Default: 1)");
}

bool LossScaler::update(bool found_inf) {
  if (!enabled_) return false;
  if (found_inf) {
    scale_ = std::max(options_.min_scale, scale_ * options_.backoff_factor);
    clean_steps_ = 0;
    return true;
  }
  if (++clean_steps_ >= options_.growth_interval) {
    scale_ *= options_.growth_factor;
    clean_steps_ = 0;
  }
  return false;
}

}  // namespace zeroshard::optim
