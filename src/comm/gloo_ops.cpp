#include "comm/gloo_ops.h"

#include "comm/reduce_kernels.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

namespace zeroshard::comm {
namespace {

constexpr uint32_t kMagic = 0x5A534844;  // "ZSHD"

// Message tags: the top byte of a Gloo slot. The slot also carries the
// operation's sequence number (40 bits) and a sub-index (16 bits: segment).
enum Tag : uint64_t {
  kCollHeader = 1,
  kReduceScatterData = 2,
  kAllGatherData = 3,
  kBroadcastData = 4,
  kP2PHeader = 5,
  kP2PData = 6,
};

uint64_t make_slot(Tag tag, uint64_t seq, uint64_t sub) {
  return (static_cast<uint64_t>(tag) << 56) | ((seq & ((uint64_t(1) << 40) - 1)) << 16) |
         (sub & 0xFFFF);
}

// reduce_scatter pipelines in segments of this many bytes (at most 65535 per slice).
constexpr int64_t kSegmentBytes = int64_t(1) << 20;

int64_t segment_elems(int64_t count, int64_t elem_size) {
  const int64_t by_bytes = std::max<int64_t>(1, kSegmentBytes / elem_size);
  const int64_t by_slots = (count + 65534) / 65535;
  return std::max(by_bytes, by_slots);
}

using UBuf = std::unique_ptr<gloo::transport::UnboundBuffer>;

UBuf make_buffer(gloo::Context& ctx, const void* ptr, size_t bytes) {
  return ctx.createUnboundBuffer(const_cast<void*>(ptr), bytes);
}

std::string join_ranks(const std::vector<int>& ranks, const std::vector<int>& world_ranks) {
  std::ostringstream s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    s << (i ? ", " : "") << ranks[i];
    if (world_ranks[ranks[i]] != ranks[i]) s << " (world rank " << world_ranks[ranks[i]] << ")";
  }
  return s.str();
}

std::string what_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

// Waits until buffer `buf` has seen expected[p] recv (or send) completions for every rank p.
// On a timeout or a broken connection, throws naming the ranks still owed.
struct WaitScope {
  OpWork& work;
  const std::vector<int>& world_ranks;
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds timeout;
};

void wait_completions(const WaitScope& ex, gloo::transport::UnboundBuffer& buf,
                      std::vector<int> expected, bool is_recv, const char* what) {
  int remaining = std::accumulate(expected.begin(), expected.end(), 0);
  auto owed = [&] {
    std::vector<int> ranks;
    for (int p = 0; p < static_cast<int>(expected.size()); ++p)
      if (expected[p] > 0) ranks.push_back(p);
    return ranks;
  };
  if (remaining > 0) {
    ex.work.set_progress(std::string("waiting for ") + what + " of rank(s) [" +
                         join_ranks(owed(), ex.world_ranks) + "]");
  }
  while (remaining > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        ex.deadline - std::chrono::steady_clock::now());
    int from = -1;
    bool ok = false;
    try {
      ok = left.count() > 0 && (is_recv ? buf.waitRecv(&from, left) : buf.waitSend(&from, left));
    } catch (const std::exception& e) {
      const std::string cause = what_of(e);
      const bool timed_out = cause.find("Timed out") != std::string::npos;
      if (timed_out) {
        TORCH_CHECK(false, ex.work.name(), " timed out after ", ex.timeout.count(),
                    " ms: rank(s) [", join_ranks(owed(), ex.world_ranks),
                    "] never arrived (this rank was waiting for their ", what,
                    "). Every rank must issue the same operations in the same order; check that "
                    "those ranks are alive and not stuck");
      }
      TORCH_CHECK(false, ex.work.name(), " failed: the connection broke while waiting for the ",
                  what, " of rank(s) [", join_ranks(owed(), ex.world_ranks),
                  "] (", cause, "). A rank probably died; its own output says why");
    }
    if (!ok) {
      TORCH_CHECK(false, ex.work.name(), " timed out after ", ex.timeout.count(), " ms: rank(s) [",
                  join_ranks(owed(), ex.world_ranks), "] never arrived (this rank was waiting for their ",
                  what, "). Every rank must issue the same operations in the same order; check "
                  "that those ranks are alive and not stuck");
    }
    TORCH_INTERNAL_ASSERT(from >= 0 && from < static_cast<int>(expected.size()) && expected[from] > 0,
                          "unexpected completion from rank ", from);
    --expected[from];
    --remaining;
  }
}

void wait_completions(Exchange& ex, gloo::transport::UnboundBuffer& buf, std::vector<int> expected,
                      bool is_recv, const char* what) {
  wait_completions(WaitScope{ex.work, ex.world_ranks, ex.deadline, ex.timeout}, buf,
                   std::move(expected), is_recv, what);
}

std::vector<int> peers_once(int size, int rank, int count = 1) {
  std::vector<int> v(size, count);
  v[rank] = 0;
  return v;
}

std::string describe(const WireHeader& h) {
  std::ostringstream s;
  const auto kind = static_cast<OpKind>(h.kind);
  s << to_string(kind) << " #" << h.seq << " (numel " << h.numel << ", dtype "
    << c10::toString(static_cast<c10::ScalarType>(h.dtype));
  if (kind == OpKind::kReduceScatter || kind == OpKind::kAllReduce)
    s << ", op " << to_string(static_cast<ReduceOp>(h.extra));
  if (kind == OpKind::kBroadcast) s << ", root " << h.extra;
  s << ")";
  return s.str();
}

const char* numel_argument(OpKind kind) {
  switch (kind) {
    case OpKind::kAllGather: return "in.numel()";
    case OpKind::kReduceScatter: return "out.numel()";
    default: return "t.numel()";
  }
}

// Exchanges headers with every peer and throws, naming the first rank that disagrees.
void exchange_headers(Exchange& ex, const WireHeader& mine) {
  if (ex.size == 1) return;
  std::vector<WireHeader> theirs(ex.size);
  auto out = make_buffer(ex.ctx, &mine, sizeof(WireHeader));
  auto in = make_buffer(ex.ctx, theirs.data(), sizeof(WireHeader) * ex.size);
  const uint64_t slot = make_slot(kCollHeader, ex.work.seq(), 0);
  for (int p = 0; p < ex.size; ++p) {
    if (p == ex.rank) continue;
    in->recv(p, slot, p * sizeof(WireHeader), sizeof(WireHeader));
    out->send(p, slot, 0, sizeof(WireHeader));
  }
  wait_completions(ex, *in, peers_once(ex.size, ex.rank), true, "header");
  wait_completions(ex, *out, peers_once(ex.size, ex.rank), false, "header receipt");
  ex.stats.control_bytes += 2 * (ex.size - 1) * static_cast<int64_t>(sizeof(WireHeader));

  for (int p = 0; p < ex.size; ++p) {
    if (p == ex.rank) continue;
    const WireHeader& h = theirs[p];
    TORCH_CHECK(h.magic == kMagic, ex.work.name(), ": received a corrupt header from ",
                rank_label(p, ex.world_ranks), " (is another program using this port?)");
    if (h.kind == mine.kind && h.seq == mine.seq && h.dtype == mine.dtype && h.extra == mine.extra &&
        h.numel != mine.numel) {
      TORCH_CHECK_VALUE(false, ex.work.name(), ": ", rank_label(p, ex.world_ranks), " has ",
                        numel_argument(static_cast<OpKind>(mine.kind)), " == ", h.numel,
                        " but this rank has ", mine.numel,
                        "; every rank must pass tensors of the same size");
    }
    TORCH_CHECK_VALUE(h.kind == mine.kind && h.seq == mine.seq && h.dtype == mine.dtype &&
                          h.extra == mine.extra,
                      ex.work.name(), ": ", rank_label(p, ex.world_ranks), " issued ", describe(h),
                      " where this rank issued ", describe(mine),
                      ". Every rank must issue the same collectives in the same order with the "
                      "same dtypes, ops and roots");
  }
}

struct Slices {
  std::vector<int64_t> counts;
  std::vector<int64_t> offsets;
};

Slices even_slices(int64_t numel, int size) {
  Slices s;
  s.counts.resize(size);
  s.offsets.resize(size);
  const int64_t base = numel / size, rem = numel % size;
  int64_t off = 0;
  for (int p = 0; p < size; ++p) {
    s.counts[p] = base + (p < rem ? 1 : 0);
    s.offsets[p] = off;
    off += s.counts[p];
  }
  return s;
}

Slices equal_slices(int64_t count, int size) {
  Slices s;
  for (int p = 0; p < size; ++p) {
    s.counts.push_back(count);
    s.offsets.push_back(p * count);
  }
  return s;
}

// Reduces slice `rank` of `in` (laid out by `slices`) over all ranks into `out`.
// `out` may be the rank's own slice of `in` (in-place all_reduce).
void reduce_scatter_v(Exchange& ex, void* out, const void* in, const Slices& slices,
                      c10::ScalarType dtype, ReduceOp op) {
  const int n = ex.size, r = ex.rank;
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  const char* in_bytes = static_cast<const char*>(in);
  const int64_t my_count = slices.counts[r];
  if (n == 1) {
    if (out != in) std::memcpy(out, in, my_count * es);
    reduce_buffers(out, {out}, my_count, dtype, op);  // kAvg over one rank is the identity
    return;
  }
  const int64_t total = slices.offsets[n - 1] + slices.counts[n - 1];

  // Post every send: slice p goes to rank p, segment by segment, in p's segmentation.
  UBuf in_buf = total > 0 ? make_buffer(ex.ctx, in, total * es) : nullptr;
  std::vector<int> sends_owed(n, 0);
  int64_t max_segments = 0;
  for (int p = 0; p < n; ++p) {
    const int64_t c = slices.counts[p];
    if (c > 0) max_segments = std::max(max_segments, (c + segment_elems(c, es) - 1) / segment_elems(c, es));
  }
  for (int64_t s = 0; s < max_segments; ++s) {
    for (int k = 1; k < n; ++k) {
      const int p = (r + k) % n;
      const int64_t c = slices.counts[p];
      const int64_t seg = c > 0 ? segment_elems(c, es) : 1;
      if (s * seg >= c) continue;
      const int64_t len = std::min(seg, c - s * seg);
      in_buf->send(p, make_slot(kReduceScatterData, ex.work.seq(), s),
                   (slices.offsets[p] + s * seg) * es, len * es);
      ++sends_owed[p];
      ex.stats.bytes_sent += len * es;
    }
  }

  // Receive the peers' contributions to my slice into two staging halves, so
  // one segment is reduced while the next arrives.
  if (my_count > 0) {
    const int64_t seg = segment_elems(my_count, es);
    const int64_t segments = (my_count + seg - 1) / seg;
    const int64_t half_elems = (n - 1) * seg;
    std::vector<char> staging(2 * half_elems * es);
    UBuf halves[2] = {make_buffer(ex.ctx, staging.data(), half_elems * es),
                      make_buffer(ex.ctx, staging.data() + half_elems * es, half_elems * es)};
    auto peer_index = [&](int p) { return p < r ? p : p - 1; };
    auto post = [&](int64_t s) {
      const int64_t len = std::min(seg, my_count - s * seg);
      for (int p = 0; p < n; ++p) {
        if (p == r) continue;
        halves[s % 2]->recv(p, make_slot(kReduceScatterData, ex.work.seq(), s),
                            peer_index(p) * seg * es, len * es);
      }
    };
    post(0);
    if (segments > 1) post(1);
    std::vector<const void*> srcs(n);
    for (int64_t s = 0; s < segments; ++s) {
      const int64_t len = std::min(seg, my_count - s * seg);
      wait_completions(ex, *halves[s % 2], peers_once(n, r), true, "reduce_scatter data");
      const char* half = staging.data() + (s % 2) * half_elems * es;
      for (int q = 0; q < n; ++q) {
        srcs[q] = q == r ? in_bytes + (slices.offsets[r] + s * seg) * es
                         : half + peer_index(q) * seg * es;
      }
      reduce_buffers(static_cast<char*>(out) + s * seg * es, srcs, len, dtype, op);
      ex.stats.bytes_received += (n - 1) * len * es;
      if (s + 2 < segments) post(s + 2);
    }
  }
  if (in_buf) wait_completions(ex, *in_buf, sends_owed, false, "receipt of reduce_scatter data");
}

// Fills every slice p != rank of `out` from rank p; slice `rank` must already hold this rank's data.
void all_gather_v(Exchange& ex, void* out, const Slices& slices, c10::ScalarType dtype) {
  const int n = ex.size, r = ex.rank;
  if (n == 1) return;
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t total = slices.offsets[n - 1] + slices.counts[n - 1];
  if (total == 0) return;
  UBuf buf = make_buffer(ex.ctx, out, total * es);
  const uint64_t slot = make_slot(kAllGatherData, ex.work.seq(), 0);
  std::vector<int> recvs(n, 0), sends(n, 0);
  for (int k = 1; k < n; ++k) {
    const int p = (r + n - k) % n;
    if (slices.counts[p] == 0) continue;
    buf->recv(p, slot, slices.offsets[p] * es, slices.counts[p] * es);
    recvs[p] = 1;
    ex.stats.bytes_received += slices.counts[p] * es;
  }
  if (slices.counts[r] > 0) {
    for (int k = 1; k < n; ++k) {
      const int p = (r + k) % n;
      buf->send(p, slot, slices.offsets[r] * es, slices.counts[r] * es);
      sends[p] = 1;
      ex.stats.bytes_sent += slices.counts[r] * es;
    }
  }
  wait_completions(ex, *buf, recvs, true, "all_gather data");
  wait_completions(ex, *buf, sends, false, "receipt of all_gather data");
}

void broadcast(Exchange& ex, at::Tensor& t, int root) {
  const int n = ex.size, r = ex.rank;
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (n == 1 || bytes == 0) return;
  UBuf buf = make_buffer(ex.ctx, t.data_ptr(), bytes);
  const uint64_t slot = make_slot(kBroadcastData, ex.work.seq(), 0);
  if (r == root) {
    for (int k = 1; k < n; ++k) buf->send((r + k) % n, slot, 0, bytes);
    ex.stats.bytes_sent += (n - 1) * bytes;
    wait_completions(ex, *buf, peers_once(n, r), false, "receipt of broadcast data");
  } else {
    buf->recv(root, slot, 0, bytes);
    std::vector<int> from(n, 0);
    from[root] = 1;
    wait_completions(ex, *buf, from, true, "broadcast data");
    ex.stats.bytes_received += bytes;
  }
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

}  // namespace

std::string rank_label(int rank, const std::vector<int>& world_ranks) {
  std::string s = "rank " + std::to_string(rank);
  if (world_ranks[rank] != rank) s += " (world rank " + std::to_string(world_ranks[rank]) + ")";
  return s;
}

void run_collective(Exchange& ex) {
  OpWork& w = ex.work;
  const auto& ts = w.tensors();
  switch (w.kind()) {
    case OpKind::kAllGather: {
      at::Tensor out = ts[0], in = ts[1];
      exchange_headers(ex, header_for(w, in.numel(), in.scalar_type(), 0));
      const auto slices = equal_slices(in.numel(), ex.size);
      const int64_t es = static_cast<int64_t>(in.element_size());
      char* mine = static_cast<char*>(out.data_ptr()) + slices.offsets[ex.rank] * es;
      if (mine != in.data_ptr() && in.numel() > 0) std::memcpy(mine, in.data_ptr(), in.numel() * es);
      all_gather_v(ex, out.data_ptr(), slices, in.scalar_type());
      return;
    }
    case OpKind::kReduceScatter: {
      at::Tensor out = ts[0], in = ts[1];
      exchange_headers(ex, header_for(w, out.numel(), out.scalar_type(), static_cast<int32_t>(w.reduce_op)));
      reduce_scatter_v(ex, out.data_ptr(), in.data_ptr(), equal_slices(out.numel(), ex.size),
                       out.scalar_type(), w.reduce_op);
      return;
    }
    case OpKind::kAllReduce: {
      at::Tensor t = ts[0];
      exchange_headers(ex, header_for(w, t.numel(), t.scalar_type(), static_cast<int32_t>(w.reduce_op)));
      const auto slices = even_slices(t.numel(), ex.size);
      const int64_t es = static_cast<int64_t>(t.element_size());
      char* base = static_cast<char*>(t.data_ptr());
      reduce_scatter_v(ex, base + slices.offsets[ex.rank] * es, base, slices, t.scalar_type(), w.reduce_op);
      all_gather_v(ex, base, slices, t.scalar_type());
      return;
    }
    case OpKind::kBroadcast: {
      at::Tensor t = ts[0];
      exchange_headers(ex, header_for(w, t.numel(), t.scalar_type(), w.peer));
      broadcast(ex, t, w.peer);
      return;
    }
    case OpKind::kBarrier:
      exchange_headers(ex, header_for(w, 0, c10::kByte, 0));
      return;
    case OpKind::kSend:
    case OpKind::kRecv:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "run_collective called for ", to_string(w.kind()));
}

PostedSend post_send(Exchange& ex, std::shared_ptr<OpWork> work, uint64_t p2p_seq) {
  PostedSend ps;
  const at::Tensor& t = work->tensors()[0];
  const int dst = work->peer;
  ps.header = std::make_unique<WireHeader>(header_for(*work, t.numel(), t.scalar_type(), 0));
  ps.header->seq = p2p_seq;
  ps.header_buf = make_buffer(ex.ctx, ps.header.get(), sizeof(WireHeader));
  ps.header_buf->send(dst, make_slot(kP2PHeader, p2p_seq, 0), 0, sizeof(WireHeader));
  ex.stats.control_bytes += sizeof(WireHeader);
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (bytes > 0) {
    ps.data_buf = make_buffer(ex.ctx, t.data_ptr(), bytes);
    ps.data_buf->send(dst, make_slot(kP2PData, p2p_seq, 0), 0, bytes);
    ex.stats.bytes_sent += bytes;
  }
  ps.work = std::move(work);
  ps.deadline = ex.deadline;
  ps.timeout = ex.timeout;
  return ps;
}

void wait_send(PostedSend& send, int rank, int size, const std::vector<int>& world_ranks) {
  const WaitScope ex{*send.work, world_ranks, send.deadline, send.timeout};
  std::vector<int> from(size, 0);
  from[send.work->peer] = 1;
  wait_completions(ex, *send.header_buf, from, false, "receipt of the send (no matching recv yet)");
  if (send.data_buf) wait_completions(ex, *send.data_buf, from, false, "receipt of the send data");
}

void run_recv(Exchange& ex, uint64_t p2p_seq) {
  OpWork& w = ex.work;
  at::Tensor t = w.tensors()[0];
  const int src = w.peer;
  WireHeader theirs;
  auto hbuf = make_buffer(ex.ctx, &theirs, sizeof(WireHeader));
  hbuf->recv(src, make_slot(kP2PHeader, p2p_seq, 0), 0, sizeof(WireHeader));
  std::vector<int> from(ex.size, 0);
  from[src] = 1;
  wait_completions(ex, *hbuf, from, true, "send (its header)");
  ex.stats.control_bytes += sizeof(WireHeader);
  TORCH_CHECK(theirs.magic == kMagic, w.name(), ": received a corrupt header from ",
              rank_label(src, ex.world_ranks));
  const auto their_dtype = static_cast<c10::ScalarType>(theirs.dtype);
  TORCH_CHECK_VALUE(theirs.numel == t.numel() && their_dtype == t.scalar_type(), w.name(), ": ",
                    rank_label(src, ex.world_ranks), " sent ", theirs.numel, " elements of ",
                    c10::toString(their_dtype), " but this rank's tensor has ", t.numel(),
                    " elements of ", c10::toString(t.scalar_type()),
                    "; the receiving tensor must match the sent one");
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (bytes == 0) return;
  auto dbuf = make_buffer(ex.ctx, t.data_ptr(), bytes);
  dbuf->recv(src, make_slot(kP2PData, p2p_seq, 0), 0, bytes);
  wait_completions(ex, *dbuf, from, true, "send data");
  ex.stats.bytes_received += bytes;
}

}  // namespace zeroshard::comm
