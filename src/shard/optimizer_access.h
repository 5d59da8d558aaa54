// optimizer_access.h — what the library's own callers (the pipeline executor)
// reach inside a ShardedOptimizer without the public interface growing: where
// a parameter's owned elements live, making the parameters equal the masters
// after they were written, and the step's agreement (clipping norm, which
// parameters had gradients, the gradient noise sample) split in halves for a
// caller that agrees it over more ranks than the optimizer's.
#pragma once

#include "shard/shard_group.h"
#include "zeroshard/sharded_optimizer.h"

#include <optional>
#include <vector>

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

  // clip_grad_norm() in two halves, for callers whose norm spans more than
  // this optimizer's ranks (pipeline stages): local_sumsq() finishes this
  // rank's reductions and returns the sum of squares of its shard of the mean
  // gradient, unscaled (no communication beyond the reductions; the sum over
  // the ranks of the communicator is the squared global norm). apply_clip()
  // then clips the next step() to `max_norm` given the global norm the caller
  // summed; an inf/NaN norm skips the step when loss scaling is on. The norm
  // must be the same on every rank.
  static double local_sumsq(ShardedOptimizer& opt);
  static void apply_clip(ShardedOptimizer& opt, double max_norm, double global_norm);
  // For a caller that agrees the step over more ranks than this optimizer's
  // (pipeline stages: one world all-reduce for every stage), the rest of the
  // agreement, so that step() issues no collective of its own. After
  // local_sumsq(), local_had_grad() is this rank's part (per parameter, in
  // sharded_state().params order: 1 if it had a gradient this step);
  // apply_agreement() then takes `had_grad` summed over this optimizer's
  // ranks, the global norm and max_norm as apply_clip() takes them, and the
  // gradient noise sample the caller composed (last_gradient_noise() returns it).
  static std::vector<char> local_had_grad(ShardedOptimizer& opt);
  static void apply_agreement(ShardedOptimizer& opt, const std::vector<double>& had_grad, double max_norm,
                              double global_norm, const GradientNoiseSample& noise);
  // The same split for the gradient noise sample: after local_sumsq(), this
  // rank's reductions x the squared norms of what it fed them this step
  // (unscaled), and its most reductions of one group (the sample's rounds).
  static double unreduced_sumsq(ShardedOptimizer& opt);
  static int reduction_rounds(const ShardedOptimizer& opt);
};

}  // namespace zeroshard::shard
