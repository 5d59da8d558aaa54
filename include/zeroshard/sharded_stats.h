// zeroshard/sharded_stats.h — what a sharded optimizer reports: memory per rank,
// communication waited for and sent (ShardedOptimizer::stats()), and the
// gradient noise sample every step measures (last_gradient_noise()). Plain values.
// What the figures mean: docs/drop-in.md ("Memory per rank"), docs/observability.md.
#pragma once

#include "zeroshard/comm.h"

#include <cstdint>
#include <limits>

namespace zeroshard {

// Communication the training thread waited for: exposed, not hidden behind
// compute. Seconds, cumulative since construction.
struct CommWaits {
  double gathers = 0;     // all-gathers of parameters (ZeRO-3: unsharding a unit; ZeRO-1/2: after the update)
  double reductions = 0;  // gradient reduce-scatters (in backward and in step())
  double total() const { return gathers + reductions; }
};

// Bytes held by this rank, measured from the tensors' storages. One type for
// ZeRO-1, 2 and 3.
struct ShardedMemory {
  int64_t params = 0;        // full-size parameters held now: ZeRO-1/2 the whole (replicated)
                             // model; ZeRO-3 the root unit and the units gathered right now
  int64_t param_shards = 0;  // ZeRO-3: the units' shards in the parameters' dtype (ZeRO-1/2's
                             // shards are slices of `params`)
  int64_t grads = 0;         // full-size gradients (stage 1; stages 2 and 3 under no_sync)
  int64_t grad_shards = 0;   // reduced gradient shards (stages 2 and 3, between backward and step)
  int64_t master = 0;        // fp32 master shard of 16-bit parameters (fp32 ones are their own)
  int64_t moments = 0;       // exp_avg + exp_avg_sq shards
  // Most bytes of communication buffers alive at once since construction:
  // ZeRO-1/2 gradient buckets being filled or reduced; ZeRO-3 units gathered
  // (the root excluded).
  int64_t peak_transient = 0;
  // Largest total() seen since construction; sampled inside step() once every
  // gradient is reduced, which is when all of the above exist together.
  int64_t peak_model_states = 0;
  int64_t total() const { return params + param_shards + grads + grad_shards + master + moments; }
};

// What a sharded optimizer holds, waited for and sent.
struct ShardedStats {
  ShardedMemory memory;
  CommWaits waits;
  // Traffic of every communicator the sharding uses (ZeRO-3: the model's
  // gathers and its reductions' own communicator), since construction.
  CommStats traffic;
  // Of `traffic`, what went between shard groups (hybrid sharding: the
  // all-reduces of reduced gradient shards, which cross hosts when a shard
  // group is a host). Zero when the state is sharded across every rank.
  CommStats replica_traffic;
};

// The two squared gradient norms a step's gradient noise scale is estimated from
// (noise_scale.h), measured by every step() without a collective of its own. Unscaled (loss
// scaling divided out).
struct GradientNoiseSample {
  // |G_big|²: the step's mean gradient (all ranks, every backward), this optimizer's parameters.
  double big_sumsq = std::numeric_limits<double>::quiet_NaN();
  // |G_small|²: the mean, over the ranks and their reductions, of the squared
  // norm of what one rank reduced once, rescaled to a mean over its own
  // examples (× `rounds`): a batch of step batch / parts(). NaN in a step where
  // a gradient was reduced in a late round (activation checkpointing reusing a
  // parameter more than the last step did): the rank's gradient then went out
  // in two pieces, and the norm of their sum is not measured.
  double small_sumsq = std::numeric_limits<double>::quiet_NaN();
  int ranks = 0;   // of the communicator
  // How often each rank reduced its gradients in the step: ZeRO-1 once;
  // ZeRO-2/3 once per backward (once in all under no_sync or
  // reduce_every_backward = false). Assumes equal parts of the rank's batch.
  int rounds = 0;
  // The step's batch over the small one; the estimate needs parts() > 1 (at
  // one rank: several backwards that each reduce).
  int parts() const { return ranks * rounds; }
};

}  // namespace zeroshard
