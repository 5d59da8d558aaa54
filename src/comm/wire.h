// wire.h — what every operation shares: message slots, the header, transport
// buffers, and waiting on them with errors that name ranks.
// Internal to src/comm. Functions run on a communicator's threads; none keeps state.
#pragma once

#include "comm/collectives.h"

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard::comm {

constexpr uint32_t kMagic = 0x5A534844;  // "ZSHD"

// Message tags: the top byte of a transport slot. The slot also carries the
// operation's sequence number (40 bits) and a sub-index (16 bits: segment).
enum Tag : uint64_t {
  kCollHeader = 1,
  kReduceScatterData = 2,
  kAllGatherData = 3,
  kBroadcastData = 4,
  kP2PHeader = 5,
  kP2PData = 6,
};

inline uint64_t make_slot(Tag tag, uint64_t seq, uint64_t sub) {
  return (static_cast<uint64_t>(tag) << 56) | ((seq & ((uint64_t(1) << 40) - 1)) << 16) |
         (sub & 0xFFFF);
}

using UBuf = std::unique_ptr<Buffer>;

// A transport buffer over caller-owned memory (the transport never writes a send buffer).
UBuf make_buffer(TcpMesh& mesh, const void* ptr, size_t bytes);

struct WaitScope {
  OpWork& work;
  const std::vector<int>& world_ranks;
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds timeout;
};

// Operations posted on one buffer, all with the same peer, so that a failing
// buffer identifies the rank to blame.
struct Pending {
  int peer;
  Buffer* buf;
  int count;  // posted operations still to complete
  bool is_recv;
};

// Waits until every pending operation completed, or throws naming the ranks to blame:
// after a timeout those still owing something, after a broken connection those
// whose connection broke.
void wait_all(const WaitScope& scope, std::vector<Pending> pending, const char* what);
void wait_all(Exchange& ex, std::vector<Pending> pending, const char* what);

// A header for `work` (kind, sequence number) describing its tensor.
WireHeader header_for(const OpWork& work, int64_t numel, c10::ScalarType dtype, int32_t extra);

}  // namespace zeroshard::comm
