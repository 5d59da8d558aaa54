// recompute.h — whether activation_checkpoint is recomputing a forward inside
// backward on this thread (a ZeRO-3 unit then gathers without recording the
// forward order or prefetching).
#pragma once

namespace zeroshard::shard {

bool in_recompute();
// Whether activation_checkpoint is running a segment's first forward on this thread (without
// gradients; the segment is recomputed in backward): a ZeRO-3 unit counts it as a use.
bool in_checkpointed_forward();
// How many checkpointed segments began on this thread outside recomputation (counting those in a
// segment's first forward, which become segments of their own when it is recomputed): a ZeRO-3
// unit whose forward saw this grow holds its gradients to the end of the backward, since the
// nested backwards of those segments can bring a parameter's gradient more than once.
long long checkpointed_segments();

}  // namespace zeroshard::shard
