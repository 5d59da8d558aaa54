// zeroshard/zeroshard.h — what a training loop uses, in one include:
// the communicator (comm.h), ZeRO-1/2 (sharded_adamw.h), ZeRO-3
// (fully_shard.h), checkpoints (checkpoint.h: link zeroshard::checkpoint),
// the data samplers (sampler.h, loader_sampler.h) and blends of datasets
// (blend.h), batches built ahead
// (prefetcher.h), token stores (token_store.h), the preemption guard and the
// step's agreement (preemption.h, step_agreement.h), activation
// checkpointing (activation_checkpoint.h) and the version (version.h).
// docs/drop-in.md shows a loop before and after; docs/getting-started.md
// uses each.
#pragma once

#include "zeroshard/activation_checkpoint.h"
#include "zeroshard/blend.h"
#include "zeroshard/checkpoint.h"
#include "zeroshard/comm.h"
#include "zeroshard/fully_shard.h"
#include "zeroshard/loader_sampler.h"
#include "zeroshard/preemption.h"
#include "zeroshard/prefetcher.h"
#include "zeroshard/sharded_adamw.h"
#include "zeroshard/step_agreement.h"
#include "zeroshard/token_store.h"
#include "zeroshard/version.h"
