// heal.h — a group that joins (or returns) takes its state from a live group:
// over the communicator across groups (group_comm.h), each shard position
// from the same position of the source group, the whole optimizer state of
// that shard (masters, AdamW moments, step counts, the loss scale), verified
// by checksums on every group, then the parameters brought to the masters, as
// a checkpoint load does, with no file read.
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/sharded_optimizer.h"

#include <cstdint>

namespace zeroshard::replica {

struct HealReport {
  int64_t bytes = 0;      // of state moved to this rank (0 on the source)
  double seconds = 0;     // the transfer and its verification
  uint64_t checksum = 0;  // xxh3 of this rank's shard state after it, equal on every group
};

// Collective over `across` (one shard position of every live group; every rank of every
// group calls it with its own position's communicator): the group at index `source` sends,
// the others receive into `opt`'s live state and restore it (collective over each receiving
// group's ranks too). Throws, naming the groups, when a group's layout of the state (its
// parameters, its shards) differs from the source's, or when a group's state differs from
// the source's after the transfer (its checksum).
HealReport heal(Communicator& across, int source, ShardedOptimizer& opt);

}  // namespace zeroshard::replica
