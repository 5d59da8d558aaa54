// recompute.h — whether activation_checkpoint is recomputing a forward inside
// backward on this thread (a ZeRO-3 unit then gathers without recording the
// forward order or prefetching).
#pragma once

namespace zeroshard::shard {

bool in_recompute();
// Whether activation_checkpoint is running a segment's first forward on this thread (without
// gradients; the segment is recomputed in backward): a ZeRO-3 unit counts it as a use.
bool in_checkpointed_forward();

}  // namespace zeroshard::shard
