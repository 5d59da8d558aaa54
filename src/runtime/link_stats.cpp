// link_stats.cpp — the process-wide table of received bulk frames (link_stats.h).
#include "runtime/link_stats.h"

#include <atomic>
#include <mutex>
#include <utility>

namespace zeroshard {

namespace {
std::atomic<int> g_self{-1};
// Never destroyed: a mesh's thread may still receive a frame while the process exits (a
// communicator held in a static closes after this file's statics would have been destroyed).
std::mutex& mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::map<int, LinkTotals>& table() {
  static auto* t = new std::map<int, LinkTotals>;  // guarded by mu()
  return *t;
}
}  // namespace

void set_link_self(int world_rank) { g_self.store(world_rank); }
int link_self() { return g_self.load(); }

void note_link(int from, uint64_t bytes, double seconds) {
  if (bytes < kLinkMinBytes) return;
  std::lock_guard<std::mutex> lock(mu());
  auto& t = table()[from];
  t.bytes += bytes;
  t.seconds += seconds;
}

std::map<int, LinkTotals> take_links() {
  std::lock_guard<std::mutex> lock(mu());
  std::map<int, LinkTotals> out;
  std::swap(out, table());
  return out;
}

}  // namespace zeroshard
