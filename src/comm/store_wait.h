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
// With a `failed_key`, throws as soon as that key exists: a rank that failed its
// rendezvous set it to why (rendezvous_failed), so no one waits for it.
void wait_for_keys(c10d::Store& store, const std::string& prefix, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout, const std::string& what = "their address",
                   const std::string& failed_key = "");

// Throws if `failed_key` is set (a rank gave up on the rendezvous), with its message;
// before that it counts this rank as one that read it (linger_after_failure).
void check_rendezvous_alive(c10d::Store& store, const std::string& failed_key);

// Tells every rank waiting in this rendezvous that this one failed, and why (best effort:
// a store that cannot be reached is ignored; the first failure's message stays).
// `counted`: this rank counts as one that read it (every rank but the store's server).
void rendezvous_failed(c10d::Store& store, const std::string& failed_key, const std::string& why, bool counted);

// For the rank that serves the store, after its rendezvous failed: keeps serving it
// until `readers` ranks have read the failure (check_rendezvous_alive, rendezvous_failed),
// at most `linger`, so that a rank that comes late learns why instead of losing the store.
void linger_after_failure(c10d::Store& store, const std::string& failed_key, int readers,
                          std::chrono::milliseconds linger);

}  // namespace zeroshard::comm
