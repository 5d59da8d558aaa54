#include "comm/collectives.h"

#include "comm/reduce_kernels.h"
#include "comm/ring.h"
#include "comm/wire.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>

namespace zeroshard::comm {
namespace {

// Receives of at most this many bytes are posted before the header check, so
// the transport's ready notices overlap it (64 KiB all_gather: 0.45 -> 0.25 ms).
// Larger ones are posted after it: pre-posted 512 KiB receives made a 1 MiB
// all_gather twice as slow on loopback.
constexpr int64_t kPrepostBytes = int64_t(256) << 10;

// reduce_scatter pipelines in segments of this many bytes (at most 65535 per slice).
constexpr int64_t kSegmentBytes = int64_t(1) << 20;
// Segments of one reduce_scatter in flight at once (staging: kInflight x n x segment).
// Measured on loopback: 1 MiB x 2 is as good as or better than 256 KiB x 8,
// 512 KiB x 4, 1 MiB x 8, 2 MiB x 2 and 4 MiB x 2.
constexpr int kInflight = 2;

int64_t segment_elems(int64_t count, int64_t elem_size) {
  const int64_t by_bytes = std::max<int64_t>(1, kSegmentBytes / elem_size);
  const int64_t by_slots = (count + 65534) / 65535;
  return std::max(by_bytes, by_slots);
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

// What arrived from each peer in the header exchange.
struct HeaderMessages {
  std::vector<std::vector<char>> from;  // per rank: header, then inline payload
  const char* payload(int p) const { return from[p].data() + sizeof(WireHeader); }
};

// For peer p: the bytes this rank inlines in its header message to p (none by default).
using InlinePayload = std::function<std::pair<const void*, int64_t>(int)>;

// Exchanges headers with every peer and throws, naming the first rank that disagrees.
HeaderMessages exchange_headers(Exchange& ex, const WireHeader& mine, const InlinePayload& payload_for = {}) {
  HeaderMessages got;
  if (ex.size == 1) return got;
  const uint64_t slot = make_slot(kCollHeader, ex.work.seq(), 0);
  const size_t capacity = sizeof(WireHeader) + kInlineBytes;
  got.from.resize(ex.size);
  std::vector<std::vector<char>> outgoing(ex.size);
  std::vector<UBuf> bufs;
  std::vector<Pending> recvs, sends;
  for (int k = 1; k < ex.size; ++k) {
    const int p = (ex.rank + k) % ex.size;
    got.from[p].resize(capacity);
    bufs.push_back(make_buffer(ex.mesh, got.from[p].data(), capacity));
    bufs.back()->recv(p, slot, 0, capacity);
    recvs.push_back({p, bufs.back().get(), 1, true});

    WireHeader h = mine;
    h.host = ex.host;
    std::pair<const void*, int64_t> payload{nullptr, 0};
    if (payload_for) payload = payload_for(p);
    TORCH_INTERNAL_ASSERT(payload.second <= kInlineBytes);
    h.inline_bytes = payload.second;
    auto& msg = outgoing[p];
    msg.resize(sizeof(WireHeader) + payload.second);
    std::memcpy(msg.data(), &h, sizeof(WireHeader));
    if (payload.second > 0) std::memcpy(msg.data() + sizeof(WireHeader), payload.first, payload.second);
    bufs.push_back(make_buffer(ex.mesh, msg.data(), msg.size()));
    bufs.back()->send(p, slot, 0, msg.size());
    sends.push_back({p, bufs.back().get(), 1, false});
    ex.stats.control_bytes += 2 * static_cast<int64_t>(sizeof(WireHeader));
  }
  wait_all(ex, recvs, "header");
  wait_all(ex, sends, "receipt of this rank's header");

  for (int p = 0; p < ex.size; ++p) {
    if (p == ex.rank) continue;
    WireHeader h;
    std::memcpy(&h, got.from[p].data(), sizeof(WireHeader));
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
  return got;
}

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
                      c10::ScalarType dtype, ReduceOp op, const std::function<void()>& before_sends) {
  const int n = ex.size, r = ex.rank;
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  const char* in_bytes = static_cast<const char*>(in);
  const int64_t my_count = slices.counts[r];
  if (n == 1) {
    before_sends();
    if (out != in) std::memcpy(out, in, my_count * es);
    reduce_buffers(out, {out}, my_count, dtype, op);  // kAvg over one rank is the identity
    return;
  }

  // Receive the peers' contributions to my slice into two staging halves, so
  // one segment is reduced while the next arrives. One buffer per (half, peer).
  // Receives are posted before the sends, so peers' data can flow at once.
  const int64_t seg = my_count > 0 ? segment_elems(my_count, es) : 1;
  const int64_t segments = (my_count + seg - 1) / seg;
  // [half][rank][segment]; the own rank's row is unused. Reused across ops, never zeroed.
  const int64_t stride = std::min(seg, my_count) * es;
  char* staging = my_count > 0 ? ex.scratch.get(kInflight * n * stride) : nullptr;
  auto stage = [&](int64_t half, int p) { return staging + (half * n + p) * stride; };
  std::vector<UBuf> recv_bufs(kInflight * n);
  const bool check_first = stride > kPrepostBytes;
  if (check_first) before_sends();
  if (my_count > 0) {
    for (int h = 0; h < kInflight; ++h)
      for (int p = 0; p < n; ++p)
        if (p != r) recv_bufs[h * n + p] = make_buffer(ex.mesh, stage(h, p), stride);
  }
  auto post = [&](int64_t s) {
    const int64_t len = std::min(seg, my_count - s * seg);
    for (int k = 1; k < n; ++k) {
      const int p = (r + n - k) % n;
      recv_bufs[(s % kInflight) * n + p]->recv(p, make_slot(kReduceScatterData, ex.work.seq(), s), 0, len * es);
    }
  };
  for (int64_t s = 0; s < std::min<int64_t>(segments, kInflight); ++s) post(s);
  if (!check_first) before_sends();

  // Post every send: slice p goes to rank p, segment by segment, in p's segmentation.
  std::vector<UBuf> send_bufs;
  std::vector<Pending> sends;
  for (int k = 1; k < n; ++k) {
    const int p = (r + k) % n;
    const int64_t c = slices.counts[p];
    if (c == 0) continue;
    const int64_t pseg = segment_elems(c, es);
    send_bufs.push_back(make_buffer(ex.mesh, in_bytes + slices.offsets[p] * es, c * es));
    int posted = 0;
    for (int64_t s = 0; s * pseg < c; ++s, ++posted) {
      const int64_t len = std::min(pseg, c - s * pseg);
      send_bufs.back()->send(p, make_slot(kReduceScatterData, ex.work.seq(), s), s * pseg * es, len * es);
      ex.stats.bytes_sent += len * es;
    }
    sends.push_back({p, send_bufs.back().get(), posted, false});
  }

  std::vector<const void*> srcs(n);
  std::vector<Pending> recvs;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t len = std::min(seg, my_count - s * seg);
    recvs.clear();
    for (int k = 1; k < n; ++k) {
      const int p = (r + n - k) % n;
      recvs.push_back({p, recv_bufs[(s % kInflight) * n + p].get(), 1, true});
    }
    wait_all(ex, recvs, "reduce_scatter data");
    for (int q = 0; q < n; ++q) {
      srcs[q] = q == r ? in_bytes + (slices.offsets[r] + s * seg) * es : stage(s % kInflight, q);
    }
    reduce_buffers(static_cast<char*>(out) + s * seg * es, srcs, len, dtype, op);
    ex.stats.bytes_received += (n - 1) * len * es;
    if (s + kInflight < segments) post(s + kInflight);
  }
  wait_all(ex, sends, "receipt of reduce_scatter data");
}

// Fills every slice p of `out` from rank p. This rank's slice comes from `own`,
// or is already in place when `own` is that slice; it is sent straight from
// `own`, and copied into `out` while the network moves the other slices.
void all_gather_v(Exchange& ex, void* out, const Slices& slices, c10::ScalarType dtype, const void* own,
                  const std::function<void()>& before_sends) {
  const int n = ex.size, r = ex.rank;
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  char* mine = static_cast<char*>(out) + slices.offsets[r] * es;
  const bool copy_own = own != mine && slices.counts[r] > 0;
  if (n == 1 || slices.offsets[n - 1] + slices.counts[n - 1] == 0) {
    before_sends();
    if (copy_own) std::memcpy(mine, own, slices.counts[r] * es);
    return;
  }
  const uint64_t slot = make_slot(kAllGatherData, ex.work.seq(), 0);
  char* base = static_cast<char*>(out);
  std::vector<UBuf> bufs;
  std::vector<Pending> recvs, sends;
  const bool check_first = *std::max_element(slices.counts.begin(), slices.counts.end()) * es > kPrepostBytes;
  if (check_first) before_sends();
  for (int k = 1; k < n; ++k) {
    const int p = (r + n - k) % n;
    if (slices.counts[p] == 0) continue;
    bufs.push_back(make_buffer(ex.mesh, base + slices.offsets[p] * es, slices.counts[p] * es));
    bufs.back()->recv(p, slot, 0, slices.counts[p] * es);
    recvs.push_back({p, bufs.back().get(), 1, true});
    ex.stats.bytes_received += slices.counts[p] * es;
  }
  if (!check_first) before_sends();
  if (slices.counts[r] > 0) {
    for (int k = 1; k < n; ++k) {
      const int p = (r + k) % n;
      bufs.push_back(make_buffer(ex.mesh, own, slices.counts[r] * es));
      bufs.back()->send(p, slot, 0, slices.counts[r] * es);
      sends.push_back({p, bufs.back().get(), 1, false});
      ex.stats.bytes_sent += slices.counts[r] * es;
    }
  }
  if (copy_own) std::memcpy(mine, own, slices.counts[r] * es);
  wait_all(ex, recvs, "all_gather data");
  wait_all(ex, sends, "receipt of all_gather data");
}

void broadcast(Exchange& ex, at::Tensor& t, int root, const std::function<void()>& before_sends) {
  const int n = ex.size, r = ex.rank;
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (n == 1 || bytes == 0) return before_sends();
  const uint64_t slot = make_slot(kBroadcastData, ex.work.seq(), 0);
  std::vector<UBuf> bufs;
  std::vector<Pending> pending;
  if (r == root) {
    before_sends();
    for (int k = 1; k < n; ++k) {
      const int p = (r + k) % n;
      bufs.push_back(make_buffer(ex.mesh, t.data_ptr(), bytes));
      bufs.back()->send(p, slot, 0, bytes);
      pending.push_back({p, bufs.back().get(), 1, false});
    }
    ex.stats.bytes_sent += (n - 1) * bytes;
    wait_all(ex, pending, "receipt of broadcast data");
  } else {
    const bool check_first = bytes > kPrepostBytes;
    if (check_first) before_sends();
    bufs.push_back(make_buffer(ex.mesh, t.data_ptr(), bytes));
    bufs.back()->recv(root, slot, 0, bytes);
    if (!check_first) before_sends();
    wait_all(ex, {{root, bufs.back().get(), 1, true}}, "broadcast data");
    ex.stats.bytes_received += bytes;
  }
}

// How a large operation runs. A candidate for the ring (ring_candidate) checks the headers
// first and learns from them whether the ranks span hosts: every rank sees every header, so
// every rank makes the same choice. `checked`: the header exchange is done.
struct Plan {
  bool ring = false;
  bool checked = false;
};

Plan plan(Exchange& ex, const WireHeader& header, int64_t slice_bytes) {
  Plan p;
  if (!ring_candidate(ex.size, slice_bytes, ex.algorithm)) return p;
  const auto got = exchange_headers(ex, header);
  p.checked = true;
  bool spans_hosts = false;
  for (int q = 0; q < ex.size && !spans_hosts; ++q) {
    if (q == ex.rank) continue;
    WireHeader h;
    std::memcpy(&h, got.from[q].data(), sizeof(WireHeader));
    spans_hosts = h.host != ex.host;
  }
  p.ring = ring_chosen(slice_bytes, ex.algorithm, spans_hosts);
  return p;
}

// Reduces this rank's slice (`own`) with the contributions that arrived inline, in rank order.
void reduce_inline(Exchange& ex, void* out, const char* own, const HeaderMessages& got, int64_t count,
                   c10::ScalarType dtype) {
  std::vector<const void*> srcs(ex.size);
  for (int q = 0; q < ex.size; ++q) srcs[q] = q == ex.rank ? own : got.payload(q);
  reduce_buffers(out, srcs, count, dtype, ex.work.reduce_op);
}

// Each collective: small ones ride inline on the header exchange; larger ones
// run pairwise or as a ring, as plan() chose (the header check then goes first).
void run_all_gather(Exchange& ex) {
  OpWork& w = ex.work;
  const int n = ex.size, r = ex.rank;
  at::Tensor out = w.tensors()[0], in = w.tensors()[1];
  const int64_t bytes = in.numel() * static_cast<int64_t>(in.element_size());
  const auto slices = equal_slices(in.numel(), n);
  if (n > 1 && bytes > 0 && bytes <= kInlineBytes) {
    auto got = exchange_headers(ex, header_for(w, in.numel(), in.scalar_type(), 0),
                                [&](int) { return std::make_pair(in.data_ptr(), bytes); });
    char* base = static_cast<char*>(out.data_ptr());
    for (int p = 0; p < n; ++p) std::memcpy(base + p * bytes, p == r ? in.data_ptr() : got.payload(p), bytes);
    ex.stats.bytes_sent += (n - 1) * bytes;
    ex.stats.bytes_received += (n - 1) * bytes;
    return;
  }
  const auto header = header_for(w, in.numel(), in.scalar_type(), 0);
  const Plan how = plan(ex, header, bytes);
  auto check = [&] { if (!how.checked) exchange_headers(ex, header); };
  if (how.ring) {
    ring_all_gather(ex, out.data_ptr(), slices, in.scalar_type(), in.data_ptr(), check);
  } else {
    all_gather_v(ex, out.data_ptr(), slices, in.scalar_type(), in.data_ptr(), check);
  }
}

void run_reduce_scatter(Exchange& ex) {
  OpWork& w = ex.work;
  const int n = ex.size, r = ex.rank;
  at::Tensor out = w.tensors()[0], in = w.tensors()[1];
  const auto header = header_for(w, out.numel(), out.scalar_type(), static_cast<int32_t>(w.reduce_op));
  const int64_t bytes = out.numel() * static_cast<int64_t>(out.element_size());
  const char* base = static_cast<const char*>(in.data_ptr());
  if (n > 1 && bytes > 0 && bytes <= kInlineBytes) {
    auto got = exchange_headers(ex, header, [&](int p) { return std::make_pair(base + p * bytes, bytes); });
    reduce_inline(ex, out.data_ptr(), base + r * bytes, got, out.numel(), out.scalar_type());
    ex.stats.bytes_sent += (n - 1) * bytes;
    ex.stats.bytes_received += (n - 1) * bytes;
    return;
  }
  const Plan how = plan(ex, header, bytes);
  auto check = [&] { if (!how.checked) exchange_headers(ex, header); };
  if (how.ring && ring_keeps_arithmetic(out.scalar_type(), w.reduce_op)) {
    ring_reduce_scatter(ex, out.data_ptr(), in.data_ptr(), equal_slices(out.numel(), n), out.scalar_type(),
                        w.reduce_op, check);
  } else {
    reduce_scatter_v(ex, out.data_ptr(), in.data_ptr(), equal_slices(out.numel(), n), out.scalar_type(),
                     w.reduce_op, check);
  }
}

// A reduce-scatter of even slices, then an all-gather of the reduced slices.
void run_all_reduce(Exchange& ex) {
  OpWork& w = ex.work;
  const int n = ex.size, r = ex.rank;
  at::Tensor t = w.tensors()[0];
  const auto header = header_for(w, t.numel(), t.scalar_type(), static_cast<int32_t>(w.reduce_op));
  const auto slices = even_slices(t.numel(), n);
  const int64_t es = static_cast<int64_t>(t.element_size());
  char* base = static_cast<char*>(t.data_ptr());
  char* mine = base + slices.offsets[r] * es;
  // slices.counts[0] is the largest slice.
  if (n > 1 && t.numel() > 0 && slices.counts[0] * es <= kInlineBytes) {
    auto got = exchange_headers(ex, header, [&](int p) {
      return std::make_pair(static_cast<const void*>(base + slices.offsets[p] * es), slices.counts[p] * es);
    });
    reduce_inline(ex, mine, mine, got, slices.counts[r], t.scalar_type());
    ex.stats.bytes_sent += (t.numel() - slices.counts[r]) * es;
    ex.stats.bytes_received += (n - 1) * slices.counts[r] * es;
    all_gather_v(ex, base, slices, t.scalar_type(), mine, [] {});
    return;
  }
  const Plan how = plan(ex, header, slices.counts[0] * es);
  auto check = [&] { if (!how.checked) exchange_headers(ex, header); };
  if (how.ring && ring_keeps_arithmetic(t.scalar_type(), w.reduce_op)) {
    ring_reduce_scatter(ex, mine, base, slices, t.scalar_type(), w.reduce_op, check);
  } else {
    reduce_scatter_v(ex, mine, base, slices, t.scalar_type(), w.reduce_op, check);
  }
  if (how.ring) {
    ring_all_gather(ex, base, slices, t.scalar_type(), mine, [] {});
  } else {
    all_gather_v(ex, base, slices, t.scalar_type(), mine, [] {});
  }
}

void run_broadcast(Exchange& ex) {
  OpWork& w = ex.work;
  const int n = ex.size, r = ex.rank;
  at::Tensor t = w.tensors()[0];
  const int root = w.peer;
  const auto header = header_for(w, t.numel(), t.scalar_type(), root);
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (n > 1 && bytes > 0 && bytes <= kInlineBytes) {
    auto got = exchange_headers(ex, header, [&](int) {
      return r == root ? std::make_pair(static_cast<const void*>(t.data_ptr()), bytes)
                       : std::make_pair(static_cast<const void*>(nullptr), int64_t(0));
    });
    if (r != root) std::memcpy(t.data_ptr(), got.payload(root), bytes);
    ex.stats.bytes_sent += r == root ? (n - 1) * bytes : 0;
    ex.stats.bytes_received += r == root ? 0 : bytes;
    return;
  }
  const Plan how = plan(ex, header, bytes);
  auto check = [&] { if (!how.checked) exchange_headers(ex, header); };
  if (how.ring) {
    chain_broadcast(ex, t.data_ptr(), bytes, root, check);
  } else {
    broadcast(ex, t, root, check);
  }
}

}  // namespace

void run_collective(Exchange& ex) {
  switch (ex.work.kind()) {
    case OpKind::kAllGather:
      return run_all_gather(ex);
    case OpKind::kReduceScatter:
      return run_reduce_scatter(ex);
    case OpKind::kAllReduce:
      return run_all_reduce(ex);
    case OpKind::kBroadcast:
      return run_broadcast(ex);
    case OpKind::kBarrier:
      exchange_headers(ex, header_for(ex.work, 0, c10::kByte, 0));
      return;
    case OpKind::kSend:
    case OpKind::kRecv:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "run_collective called for ", to_string(ex.work.kind()));
}

}  // namespace zeroshard::comm
