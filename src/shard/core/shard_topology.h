// shard_topology.h — which ranks share a shard group (hybrid sharding).
//
// Flat ZeRO shards every model state across all N data-parallel ranks. Hybrid
// sharding shards it across groups of S ranks (by default one host's) and
// replicates it across the R = N / S groups: rank r is member r % S of shard
// group r / S, and the ranks with the same r % S form its replica group.
// Parameters are gathered and gradients reduce-scattered inside the shard
// group; the reduced shards are then averaged across the replica group, so
// only 1/S of the gradient bytes cross between groups.
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/sharded_optimizer.h"

#include <memory>
#include <string>

namespace zeroshard::shard {

struct ShardTopology {
  std::shared_ptr<Communicator> shard;     // the S ranks of this rank's shard group (the data communicator when R == 1)
  std::shared_ptr<Communicator> replicas;  // the R ranks holding the same shard; null when R == 1
  int shard_size = 1, shard_rank = 0;      // S, and this rank's index in its shard group
  int num_replicas = 1, replica_rank = 0;  // R, and this rank's index in its replica group
  bool hybrid() const { return replicas != nullptr; }
  // For the construction log: " (hybrid: shard groups of S ranks, R replicas)", or "" when flat.
  std::string describe() const;
  // Hybrid: adds to `stats` the traffic of the communicators besides the shard group's
  // (`data`: the broadcast at construction, control values on a CPU group; the
  // replicas', also as stats.replica_traffic). Nothing when flat.
  void add_traffic(ShardedStats& stats, const Communicator& data) const;
};

// The shard group's size S for `requested` (below) without making the
// communicators; collective over group.control for kShardPerHost.
int resolve_shard_size(const ProcessGroup& group, int requested, const std::string& who);

// Resolves `requested` (0: every rank; kShardPerHost: the ranks of one host,
// found by host name; N > 0: N ranks) against `group` and makes the
// communicators (splits of group.data: collective over it). Throws, naming
// `who` and the fix, when N does not divide the ranks or hosts hold unequal
// or interleaved ranks. Every rank must pass the same `requested`.
ShardTopology make_shard_topology(const ProcessGroup& group, int requested, const std::string& who);

}  // namespace zeroshard::shard
