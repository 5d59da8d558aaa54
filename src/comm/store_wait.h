// store_wait.h — waiting for keys of the rendezvous store, naming the missing ones.
//
// Ranks publish their addresses (and split lists) under "<prefix><rank>"; a wait
// that times out names the ranks whose keys never appeared. Thread-safety: as
// the store.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace zeroshard::comm {

// Returns once every key prefix + keys[i] exists; throws naming the missing
// ones (they are rank numbers) after `timeout`; `what` is what they publish.
void wait_for_keys(c10d::Store& store, const std::string& prefix, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout, const std::string& what = "their address");

}  // namespace zeroshard::comm
