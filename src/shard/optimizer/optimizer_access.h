// optimizer_access.h — what the library's own callers (the pipeline executor)
// reach inside a ShardedOptimizer without the public interface growing: where
// a parameter's owned elements live, making the parameters equal the masters
// after they were written, and joining the gradient norms of other
// optimizers that clip as one model (over more ranks than the optimizer's).
#pragma once

#include "shard/optimizer/front_end.h"
#include "shard/optimizer/gradient_norms.h"
#include "shard/core/shard_group.h"
#include "zeroshard/sharded_optimizer.h"

#include <memory>
#include <optional>
#include <string>

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

  // Makes the optimizer's step agreement members of `norms` (the gradient
  // norms of optimizers that clip as one model: a pipeline's stages) and a
  // slot `flags_name` of its agreement (which parameters had a gradient),
  // instead of its own. Ranks that do not hold this optimizer hold a slot of
  // the same name and width that fills zeros. REQUIRES: `norms` over the
  // optimizer's data-parallel ranks. Null `norms`: back to an agreement of its own.
  static void join(ShardedOptimizer& opt, std::shared_ptr<GradientNorms> norms, std::string flags_name);
  // Its flags' slot's width: per parameter it trains, whether it had a gradient (and, for
  // ZeRO-0/2, how many times it arrived in one backward).
  static size_t flags_width(const ShardedOptimizer& opt);
  // Finishes the step's gradient reductions, as step() does first (a
  // pipeline's REDUCE_GRAD). Waits for them; no other collective.
  static void reduce_gradients(ShardedOptimizer& opt);

  // Replica groups (replica/): `across` is this shard position's communicator across the live
  // groups (null: this group trains alone); every reduction is then averaged over it, and a
  // failure of it abandons the step (ReplicaGroupLost). Between steps only: refused by name
  // with reductions in flight or a backward under way. Refused with hybrid sharding inside the
  // group (the groups are the shards' replicas). No communication.
  static void set_replica_groups(ShardedOptimizer& opt, std::shared_ptr<Communicator> across);
  // The agreement the optimizer's step runs (its own, or the one it joined).
  static std::shared_ptr<StepAgreement> agreement(ShardedOptimizer& opt);

  // A front-end's constructor, once its shard groups exist: the optimizer
  // takes them over and joins an agreement of its own.
  static void attach(ShardedOptimizer& opt, Shards shards);
  // A front-end's destructor, under the round's mutex: the round is about to go.
  static void detach(ShardedOptimizer& opt);
};

}  // namespace zeroshard::shard
