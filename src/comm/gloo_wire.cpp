#include "comm/gloo_wire.h"

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
  return p.is_recv ? p.buf->waitRecv(nullptr, timeout) : p.buf->waitSend(nullptr, timeout);
}

bool is_timeout(const std::string& cause) {
  return cause.empty() || cause.find("Timed out") != std::string::npos ||
         cause.find("Application timeout") != std::string::npos;
}

[[noreturn]] void fail_pending(const WaitScope& ex, std::vector<Pending>& pending, size_t failed,
                               const std::string& cause, const char* what) {
  // Which peers are to blame? The failing entry's. Probe the others (Gloo
  // answers at once: completed, or an error). After a timeout every peer still
  // owing something is named; after a broken connection only peers whose
  // connection broke too (a peer merely slower than the probe is alive).
  const bool timed_out = is_timeout(cause);
  std::vector<int> owed = {pending[failed].peer};
  for (size_t j = failed + 1; j < pending.size(); ++j) {
    bool blame = false;
    try {
      while (pending[j].count > 0 && wait_one(pending[j], std::chrono::milliseconds(1))) --pending[j].count;
      blame = pending[j].count > 0 && timed_out;
    } catch (const std::exception& e) {
      blame = timed_out || !is_timeout(what_of(e));
    }
    if (blame && std::find(owed.begin(), owed.end(), pending[j].peer) == owed.end())
      owed.push_back(pending[j].peer);
  }
  std::sort(owed.begin(), owed.end());
  const std::string ranks = join_ranks(owed, ex.world_ranks);
  if (timed_out) {
    TORCH_CHECK(false, ex.work.name(), " timed out after ", ex.timeout.count(), " ms: rank(s) [", ranks,
                "] never arrived (this rank was waiting for their ", what,
                "). Every rank must issue the same operations in the same order; check that "
                "those ranks are alive and not stuck");
  }
  TORCH_CHECK(false, ex.work.name(), " failed: the connection to rank(s) [", ranks,
              "] broke while waiting for their ", what, " (", cause,
              "). A rank probably died; its own output says why");
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
        fail_pending(ex, pending, i, what_of(e), what);
      }
      if (!ok) fail_pending(ex, pending, i, "", what);
      --pending[i].count;
    }
  }
}

void wait_all(Exchange& ex, std::vector<Pending> pending, const char* what) {
  wait_all(WaitScope{ex.work, ex.world_ranks, ex.deadline, ex.timeout}, std::move(pending), what);
}

UBuf make_buffer(gloo::Context& ctx, const void* ptr, size_t bytes) {
  return ctx.createUnboundBuffer(const_cast<void*>(ptr), bytes);
}

std::string what_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
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
