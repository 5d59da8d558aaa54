// module_access.h — the library's side of a Sharded<> module (ShardedModule,
// fully_shard.h): its unit once fully_shard() made it one, and this rank's
// shard of its parameters while it was built under DeferredInit and not yet
// sharded. fully_shard(), FullyShardedModel, DeferredInit and
// initialize_parameters() reach them here; nothing else does.
#pragma once

#include "shard/zero3/deferred_init.h"
#include "zeroshard/fully_shard.h"

#include <memory>

namespace zeroshard {

namespace shard {
class Unit;  // unit.h
}

struct ShardedModule::State {
  std::shared_ptr<shard::Unit> unit;              // null until fully_shard()
  std::shared_ptr<shard::DeferredUnit> deferred;  // built under DeferredInit, until fully_shard() takes it
};

namespace shard {

struct ModuleAccess {
  static std::shared_ptr<Unit>& unit(ShardedModule& m) { return state(m).unit; }
  static std::shared_ptr<DeferredUnit>& deferred(ShardedModule& m) { return state(m).deferred; }

 private:
  static ShardedModule::State& state(ShardedModule& m) {
    if (!m.state_) m.state_ = std::make_shared<ShardedModule::State>();
    return *m.state_;
  }
};

}  // namespace shard
}  // namespace zeroshard
