// link_stats.h — what this process received from each other rank, and how fast: the TCP
// transport's bulk data frames (kLinkMinBytes or more; comm/tcp_mesh_io.cpp), each timed from
// its header to its last byte, so that a sender's lateness does not count, only the link (and the
// sender's host) moving the bytes. Process-wide: every mesh of every communicator adds to one
// table, keyed by the sender's world rank. Read by RankTimes (rank_times.h), which names a rank
// whose links are slow. Thread-safe.
#pragma once

#include <cstdint>
#include <map>

namespace zeroshard {

struct LinkTotals {
  uint64_t bytes = 0;
  double seconds = 0;  // the frames' transfer time, header to last byte
};

// Frames shorter than this are latency, not bandwidth: not counted.
constexpr uint64_t kLinkMinBytes = uint64_t(64) << 10;

// This process's world rank, as its meshes know it (-1 before the first mesh).
void set_link_self(int world_rank);
int link_self();
// A bulk frame of `bytes` from world rank `from`, moved in `seconds`.
void note_link(int from, uint64_t bytes, double seconds);
// The totals per sender since the last take (and starts anew).
std::map<int, LinkTotals> take_links();

}  // namespace zeroshard
