#include "comm/store_wait.h"

#include <c10/util/Exception.h>

#include <sstream>
#include <thread>

namespace zeroshard::comm {

namespace {

std::string readers_key(const std::string& failed_key) { return failed_key + "/read"; }

}  // namespace

void check_rendezvous_alive(c10d::Store& store, const std::string& failed_key) {
  if (failed_key.empty() || !store.check({failed_key})) return;
  const auto why = store.get(failed_key);
  try {
    store.add(readers_key(failed_key), 1);
  } catch (const std::exception&) {
    // The store's server left meanwhile: the message was read all the same.
  }
  TORCH_CHECK(false, "rendezvous abandoned: ", std::string(why.begin(), why.end()),
              ". This rank stops instead of waiting for it; its own output says more");
}

void rendezvous_failed(c10d::Store& store, const std::string& failed_key, const std::string& why, bool counted) {
  if (failed_key.empty()) return;
  try {
    store.compareSet(failed_key, {}, std::vector<uint8_t>(why.begin(), why.end()));
    if (counted) store.add(readers_key(failed_key), 1);
  } catch (const std::exception&) {
    // The store is gone or unreachable: the others' rendezvous times out, naming this rank.
  }
}

void linger_after_failure(c10d::Store& store, const std::string& failed_key, int readers,
                          std::chrono::milliseconds linger) {
  const auto deadline = std::chrono::steady_clock::now() + linger;
  try {
    while (store.add(readers_key(failed_key), 0) < readers && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {
    // The store failed: nothing left to serve.
  }
}

void wait_for_keys(c10d::Store& store, const std::string& prefix, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout, const std::string& what, const std::string& failed_key) {
  // Poll with check() rather than Store::wait(), so that a timeout can say
  // exactly which keys (ranks) are missing.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::string> missing;
  auto sleep = std::chrono::milliseconds(1);
  while (true) {
    missing.clear();
    for (const auto& k : keys) {
      if (!store.check({prefix + k})) missing.push_back(k);
    }
    if (missing.empty()) return;
    check_rendezvous_alive(store, failed_key);
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::milliseconds(50));
  }
  std::ostringstream names;
  for (size_t i = 0; i < missing.size(); ++i) names << (i ? ", " : "") << missing[i];
  TORCH_CHECK(false, "rendezvous timed out after ", timeout.count(), " ms (store prefix '", prefix,
              "'): rank(s) [", names.str(),
              "] never published ", what, ". Check that those ranks started, that every rank "
              "uses the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE, and that they create the "
              "same communicators in the same order");
}

}  // namespace zeroshard::comm
