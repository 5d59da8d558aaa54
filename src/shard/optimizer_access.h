// optimizer_access.h — what the library's own callers (the pipeline executor)
// reach inside a ShardedOptimizer without the public interface growing: where
// a parameter's owned elements live, and making the parameters equal the
// masters after they were written.
#pragma once

#include "shard/shard_group.h"
#include "zeroshard/sharded_optimizer.h"

#include <optional>

namespace zeroshard::shard {

struct OptimizerAccess {
  // The elements of one parameter this rank owns in its optimizer's shards.
  struct Owned {
    ShardGroup* group = nullptr;
    Range piece;       // in the group's flat buffer (empty: none of it here)
    Range of_param;    // the same elements, counted in the parameter
    int replicas = 1;  // ranks holding the same elements (ZeRO stage 0: all of the communicator)
    at::Tensor slice(const at::Tensor& shard) const {
      return shard.slice(0, piece.begin - group->shard.begin, piece.end - group->shard.begin);
    }
  };
  // nullopt: `param` is not one this optimizer trains. No communication.
  static std::optional<Owned> owned(ShardedOptimizer& opt, const at::Tensor& param);
  // The masters were written (e.g. broadcast from another copy): bring the
  // parameters to their values. Collective over the optimizer's communicator.
  static void install_masters(ShardedOptimizer& opt);
};

}  // namespace zeroshard::shard
