#include "comm/wire.h"
#include "zeroshard/log.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace zeroshard::comm {
namespace {

std::string join_ranks(const std::vector<int>& ranks, const std::vector<int>& world_ranks) {
  std::ostringstream s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    s << (i ? ", " : "") << ranks[i];
    if (world_ranks[ranks[i]] != ranks[i]) s << " (world rank " << world_ranks[ranks[i]] << ")";
  }
  return s.str();
}

bool wait_one(Pending& p, std::chrono::milliseconds timeout) {
  return p.is_recv ? p.buf->wait_recv(timeout) : p.buf->wait_send(timeout);
}

[[noreturn]] void fail_pending(const WaitScope& ex, std::vector<Pending>& pending, size_t failed,
                               const std::string& cause, const char* what) {
  // Which peers are to blame? After a timeout, the failing entry's and every
  // other peer still owing something (probed: the transport answers at once).
  // After a broken connection, the peer whose connection broke first: when a
  // rank dies, the others give up and close theirs too.
  const bool timed_out = cause.empty();  // a wait that ran out has no cause
  if (!timed_out) {
    std::vector<int> peers;
    for (const auto& p : pending) peers.push_back(p.peer);
    const auto [first, why] = pending[failed].buf->mesh().first_broken(peers);
    const std::string ranks = join_ranks({first >= 0 ? first : pending[failed].peer}, ex.world_ranks);
    TORCH_CHECK(false, ex.work.name(), " failed: the connection to rank(s) [", ranks,
                "] broke while waiting for their ", what, " (", first >= 0 ? why : cause,
                "). A rank probably died; its own output says why");
  }
  std::vector<int> owed = {pending[failed].peer};
  for (size_t j = failed + 1; j < pending.size(); ++j) {
    bool late = false;
    try {
      while (pending[j].count > 0 && wait_one(pending[j], std::chrono::milliseconds(1))) --pending[j].count;
      late = pending[j].count > 0;
    } catch (const std::exception&) {
      late = true;
    }
    if (late && std::find(owed.begin(), owed.end(), pending[j].peer) == owed.end()) owed.push_back(pending[j].peer);
  }
  std::sort(owed.begin(), owed.end());
  TORCH_CHECK(false, ex.work.name(), " timed out after ", ex.timeout.count(), " ms: rank(s) [",
              join_ranks(owed, ex.world_ranks), "] never arrived (this rank was waiting for their ", what,
              "). Every rank must issue the same operations in the same order; check that "
              "those ranks are alive and not stuck");
}

}  // namespace

void wait_all(const WaitScope& ex, std::vector<Pending> pending, const char* what) {
  std::vector<int> peers;
  for (const auto& p : pending)
    if (p.count > 0) peers.push_back(p.peer);
  if (peers.empty()) return;
  ex.work.set_progress(std::string("waiting for ") + what + " of rank(s) [" +
                       join_ranks(peers, ex.world_ranks) + "]");
  for (size_t i = 0; i < pending.size(); ++i) {
    while (pending[i].count > 0) {
      const auto left = std::max(std::chrono::milliseconds(1),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(
                                     ex.deadline - std::chrono::steady_clock::now()));
      bool ok = false;
      try {
        ok = wait_one(pending[i], left);
      } catch (const std::exception& e) {
        fail_pending(ex, pending, i, error_message(e), what);
      }
      if (!ok) fail_pending(ex, pending, i, "", what);
      --pending[i].count;
    }
  }
}

void wait_all(Exchange& ex, std::vector<Pending> pending, const char* what) {
  wait_all(WaitScope{ex.work, ex.world_ranks, ex.deadline, ex.timeout}, std::move(pending), what);
}

UBuf make_buffer(TcpMesh& mesh, const void* ptr, size_t bytes) {
  return std::make_unique<Buffer>(mesh, const_cast<void*>(ptr), bytes);
}


WireHeader header_for(const OpWork& work, int64_t numel, c10::ScalarType dtype, int32_t extra) {
  WireHeader h;
  h.magic = kMagic;
  h.kind = static_cast<uint32_t>(work.kind());
  h.seq = work.seq();
  h.numel = numel;
  h.dtype = static_cast<int32_t>(dtype);
  h.extra = extra;
  return h;
}

std::string rank_label(int rank, const std::vector<int>& world_ranks) {
  std::string s = "rank " + std::to_string(rank);
  if (world_ranks[rank] != rank) s += " (world rank " + std::to_string(world_ranks[rank]) + ")";
  return s;
}

}  // namespace zeroshard::comm
