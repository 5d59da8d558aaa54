// options_text.cpp — a sharded optimizer's options as its ranks compare them.
#include "shard/optimizer/options_text.h"

#include <iomanip>
#include <sstream>

namespace zeroshard::shard {

std::string describe_param_group(int group, const torch::optim::AdamWOptions& o) {
  std::ostringstream os;
  os << std::setprecision(17) << "param group " << group << ": lr=" << o.lr() << " betas=(" << std::get<0>(o.betas())
     << ", " << std::get<1>(o.betas()) << ") eps=" << o.eps() << " weight_decay=" << o.weight_decay();
  return os.str();
}

std::string describe_loss_scaling(const LossScaleOptions& l, bool scaling) {
  if (!scaling) return "";
  std::ostringstream os;
  os << std::setprecision(17) << " (init " << l.init_scale << ", growth " << l.growth_factor << ", backoff "
     << l.backoff_factor << ", interval " << l.growth_interval << ", min " << l.min_scale << ")";
  return os.str();
}

}  // namespace zeroshard::shard
