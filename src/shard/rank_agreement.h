// rank_agreement.h — make sure every rank set up the same thing before any data moves.
//
// Each rank describes what it built as a list of text entries (one per
// parameter, plus the options). check_same_on_all_ranks() exchanges one hash;
// when the hashes differ it finds the first entry where some rank differs from
// rank 0 and throws on every rank with both versions of that entry, instead of
// letting mismatched collectives hang or corrupt memory later.
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/sharded_optimizer.h"

#include <torch/optim/adamw.h>

#include <string>
#include <vector>

namespace zeroshard::shard {

// Collective. `what` names the thing compared in the error ("ShardedAdamW parameters").
void check_same_on_all_ranks(Communicator& comm, const std::vector<std::string>& entries,
                             const std::string& what);

// The entries both sharded optimizers compare (full precision, so any change shows).
std::string describe_param_group(int group, const torch::optim::AdamWOptions& options);
// " (init ..., growth ..., backoff ..., interval ..., min ...)" when scaling, else "".
std::string describe_loss_scaling(const LossScaleOptions& options, bool scaling);

}  // namespace zeroshard::shard
