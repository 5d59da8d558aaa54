// recompute.h — whether activation_checkpoint is recomputing a forward inside
// backward on this thread (a ZeRO-3 unit then gathers without recording the
// forward order or prefetching).
#pragma once

namespace zeroshard::shard {

bool in_recompute();

}  // namespace zeroshard::shard
