// options_text.h — the text of a sharded optimizer's options that its ranks
// compare before any data moves (runtime/rank_agreement.h), at full
// precision so that any difference shows.
#pragma once

#include "zeroshard/optim_options.h"

#include <torch/optim/adamw.h>

#include <string>

namespace zeroshard::shard {

// "param group <g>: lr=... betas=(...) eps=... weight_decay=..."
std::string describe_param_group(int group, const torch::optim::AdamWOptions& options);
// " (init ..., growth ..., backoff ..., interval ..., min ...)" when scaling, else "".
std::string describe_loss_scaling(const LossScaleOptions& options, bool scaling);

}  // namespace zeroshard::shard
