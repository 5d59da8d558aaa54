#include "comm/ring.h"

#include "comm/reduce_kernels.h"
#include "comm/wire.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <deque>

namespace zeroshard::comm {
namespace {

// Segments of 1 MiB (the pairwise reduce-scatter's), two receives in flight per ring link.
constexpr int64_t kRingSegmentBytes = int64_t(1) << 20;
constexpr int kRingInflight = 2;
// Rings from this slice size up. Across 4 hosts at 1 Gbit/s (8 ranks) the ring moved 1 MiB
// operations (128 KiB slices) at 0.95-0.99 of the anchor where pairwise reached 0.25-0.31;
// with 32 KiB slices neither was ahead (docs/performance.md).
constexpr int64_t kRingSliceBytes = int64_t(64) << 10;
// On one host kAuto rings from this slice size up. With a core per rank (16 cores), 8 ranks'
// 16 MiB all_reduce took 14.3 ms as a ring and 17.9 ms pairwise (medians), and their reduce_scatter
// 7.5 ms against 10.7; with smaller slices the ring took up to 35% longer (4 ranks, 256 KiB),
// and on 2 shared cores 40% longer at 4 MiB (docs/performance.md).
constexpr int64_t kRingOneHostSliceBytes = int64_t(2) << 20;

// One segmentation for every slice and step, so that sender and receiver agree:
// `seg` elements per segment, `per_slice` segments per slice, and at most 65536
// (step, segment) units per operation (the slot's 16-bit sub-index).
struct Segments {
  int64_t seg = 1;
  int64_t per_slice = 0;
  int64_t len(int64_t count, int64_t s) const { return std::clamp<int64_t>(count - s * seg, 0, seg); }
};

Segments segment(int64_t max_count, int64_t elem_size, int64_t steps) {
  Segments g;
  const int64_t by_bytes = std::max<int64_t>(1, kRingSegmentBytes / elem_size);
  const int64_t max_per_slice = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, steps));
  g.seg = std::max(by_bytes, (max_count + max_per_slice - 1) / max_per_slice);
  g.per_slice = (max_count + g.seg - 1) / g.seg;
  return g;
}

int mod(int a, int n) { return ((a % n) + n) % n; }

// One (step, segment) to receive.
struct Unit {
  int k;
  int64_t s;
};

// What a rank receives, in order: at step k the segments of slice received_slice(k) that hold
// anything (slices may differ in length by one element).
template <typename SliceOf>
std::vector<Unit> receives(const Segments& g, int steps, const Slices& slices, SliceOf received_slice) {
  std::vector<Unit> units;
  for (int k = 0; k < steps; ++k)
    for (int64_t s = 0; s < g.per_slice; ++s)
      if (g.len(slices.counts[received_slice(k)], s) > 0) units.push_back({k, s});
  return units;
}

// Sends still in flight, oldest first, each on a buffer of its own. The rings post their
// sends in slot order, so "every send up to slot X left" is a prefix of the queue.
struct SendQueue {
  Exchange& ex;
  int peer;
  const char* what;
  std::deque<std::pair<uint64_t, UBuf>> posted;  // (slot, buffer)

  void post(const void* data, int64_t bytes, uint64_t slot) {
    posted.emplace_back(slot, make_buffer(ex.mesh, data, bytes));
    posted.back().second->send(peer, slot, 0, bytes);
    ex.stats.bytes_sent += bytes;
  }
  // Waits until every send posted for a slot up to `slot` left (its memory may be written again).
  void wait_through(uint64_t slot) {
    while (!posted.empty() && posted.front().first <= slot) {
      wait_all(ex, {{peer, posted.front().second.get(), 1, false}}, what);
      posted.pop_front();
    }
  }
  void finish() {
    std::vector<Pending> pending;
    for (auto& [slot, buf] : posted) pending.push_back({peer, buf.get(), 1, false});
    wait_all(ex, std::move(pending), what);
    posted.clear();
  }
};

}  // namespace

bool ring_keeps_arithmetic(c10::ScalarType dtype, ReduceOp op) {
  if (op == ReduceOp::kMax || op == ReduceOp::kMin) return true;
  switch (dtype) {
    case c10::kFloat:
    case c10::kDouble:
      return true;
    case c10::kInt:
    case c10::kLong:
      return op == ReduceOp::kSum;
    default:
      return false;
  }
}

bool ring_candidate(int n, int64_t slice_bytes, CommOptions::Algorithm algorithm) {
  return n >= 3 && slice_bytes >= kRingSliceBytes && algorithm != CommOptions::Algorithm::kPairwise;
}

bool ring_chosen(int64_t slice_bytes, CommOptions::Algorithm algorithm, bool spans_hosts) {
  return algorithm == CommOptions::Algorithm::kRing || spans_hosts || slice_bytes >= kRingOneHostSliceBytes;
}

void ring_reduce_scatter(Exchange& ex, void* out, const void* in, const Slices& slices, c10::ScalarType dtype,
                         ReduceOp op, const std::function<void()>& before_sends) {
  const int n = ex.size, r = ex.rank, next = (r + 1) % n, prev = mod(r - 1, n);
  TORCH_INTERNAL_ASSERT(n >= 3);
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  const char* in_bytes = static_cast<const char*>(in);
  const int64_t max_count = *std::max_element(slices.counts.begin(), slices.counts.end());
  const int steps = n - 1;
  const Segments g = segment(max_count, es, steps);
  // Step k sends slice r-1-k (the own input at step 0, then the partial reduced at step k-1) and
  // receives slice r-2-k; the last step's is slice r itself.
  auto sent_slice = [&](int k) { return mod(r - 1 - k, n); };
  auto received_slice = [&](int k) { return mod(r - 2 - k, n); };
  auto slot = [&](int k, int64_t s) { return make_slot(kReduceScatterData, ex.work.seq(), k * g.per_slice + s); };
  // Scratch: kRingInflight staging segments, then two partial slices (steps alternate between them).
  const int64_t seg_bytes = g.seg * es, partial_bytes = max_count * es;
  char* scratch = ex.scratch.get(kRingInflight * seg_bytes + 2 * partial_bytes);
  auto stage = [&](int64_t unit) { return scratch + (unit % kRingInflight) * seg_bytes; };
  auto partial = [&](int k) { return scratch + kRingInflight * seg_bytes + (k % 2) * partial_bytes; };

  before_sends();
  // The receives, in (step, segment) order: a window of kRingInflight over the staging segments.
  const std::vector<Unit> units = receives(g, steps, slices, received_slice);
  std::vector<UBuf> recv_bufs(kRingInflight);  // one per staging segment, made anew for each receive
  auto post_recv = [&](size_t i) {
    const auto [k, s] = units[i];
    const int64_t bytes = g.len(slices.counts[received_slice(k)], s) * es;
    recv_bufs[i % kRingInflight] = make_buffer(ex.mesh, stage(i), bytes);
    recv_bufs[i % kRingInflight]->recv(prev, slot(k, s), 0, bytes);
  };
  for (size_t i = 0; i < std::min<size_t>(units.size(), kRingInflight); ++i) post_recv(i);

  SendQueue sends{ex, next, "receipt of reduce_scatter data", {}};
  {
    const int c = sent_slice(0);
    for (int64_t s = 0; s < g.per_slice; ++s) {
      const int64_t len = g.len(slices.counts[c], s);
      if (len > 0) sends.post(in_bytes + (slices.offsets[c] + s * g.seg) * es, len * es, slot(0, s));
    }
  }

  const ReduceOp hop_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  for (size_t i = 0; i < units.size(); ++i) {
    const auto [k, s] = units[i];
    const int c = received_slice(k);
    const int64_t len = g.len(slices.counts[c], s);
    wait_all(ex, {{prev, recv_bufs[i % kRingInflight].get(), 1, true}}, "reduce_scatter data");
    ex.stats.bytes_received += len * es;
    const bool last = k == steps - 1;
    char* dst = last ? static_cast<char*>(out) + s * g.seg * es : partial(k) + s * g.seg * es;
    if (!last && k >= 2) sends.wait_through(slot(k - 1, s));  // partial(k) == partial(k-2), sent on at step k-1
    const char* own = in_bytes + (slices.offsets[c] + s * g.seg) * es;
    reduce_buffers(dst, {stage(i), own}, len, dtype, last ? op : hop_op, last ? n : 0);
    if (i + kRingInflight < units.size()) post_recv(i + kRingInflight);
    if (!last) sends.post(dst, len * es, slot(k + 1, s));
  }
  sends.finish();
}

void ring_all_gather(Exchange& ex, void* out, const Slices& slices, c10::ScalarType dtype, const void* own,
                     const std::function<void()>& before_sends) {
  const int n = ex.size, r = ex.rank, next = (r + 1) % n, prev = mod(r - 1, n);
  TORCH_INTERNAL_ASSERT(n >= 3);
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  char* base = static_cast<char*>(out);
  const int64_t max_count = *std::max_element(slices.counts.begin(), slices.counts.end());
  const int steps = n - 1;
  const Segments g = segment(max_count, es, steps);
  // Step k forwards slice r-k (the own at step 0) and receives slice r-1-k, straight into `out`.
  auto received_slice = [&](int k) { return mod(r - 1 - k, n); };
  auto at = [&](int c, int64_t s) { return base + (slices.offsets[c] + s * g.seg) * es; };
  auto slot = [&](int k, int64_t s) { return make_slot(kAllGatherData, ex.work.seq(), k * g.per_slice + s); };

  before_sends();
  const std::vector<Unit> units = receives(g, steps, slices, received_slice);
  // Receives go straight into `out`: a window of 2 x kRingInflight segments ahead.
  constexpr size_t kWindow = 2 * kRingInflight;
  std::vector<UBuf> recv_bufs(units.size());
  auto post_recv = [&](size_t i) {
    const auto [k, s] = units[i];
    const int c = received_slice(k);
    const int64_t bytes = g.len(slices.counts[c], s) * es;
    recv_bufs[i] = make_buffer(ex.mesh, at(c, s), bytes);
    recv_bufs[i]->recv(prev, slot(k, s), 0, bytes);
  };
  for (size_t i = 0; i < std::min(units.size(), kWindow); ++i) post_recv(i);

  SendQueue sends{ex, next, "receipt of all_gather data", {}};
  const char* own_bytes = static_cast<const char*>(own);
  for (int64_t s = 0; s < g.per_slice; ++s) {
    const int64_t len = g.len(slices.counts[r], s);
    if (len > 0) sends.post(own_bytes + s * g.seg * es, len * es, slot(0, s));
  }
  char* mine = base + slices.offsets[r] * es;
  if (own != mine && slices.counts[r] > 0) std::memcpy(mine, own, slices.counts[r] * es);

  for (size_t i = 0; i < units.size(); ++i) {
    const auto [k, s] = units[i];
    const int c = received_slice(k);
    const int64_t len = g.len(slices.counts[c], s);
    wait_all(ex, {{prev, recv_bufs[i].get(), 1, true}}, "all_gather data");
    ex.stats.bytes_received += len * es;
    if (i + kWindow < units.size()) post_recv(i + kWindow);
    if (k + 1 < steps) sends.post(at(c, s), len * es, slot(k + 1, s));
  }
  sends.finish();
}

void chain_broadcast(Exchange& ex, void* data, int64_t bytes, int root, const std::function<void()>& before_sends) {
  const int n = ex.size, r = ex.rank;
  const int position = mod(r - root, n);
  const int next = position + 1 < n ? (r + 1) % n : -1, prev = (r + n - 1) % n;
  const Segments g = segment(bytes, 1, 1);
  char* base = static_cast<char*>(data);
  auto slot = [&](int64_t s) { return make_slot(kBroadcastData, ex.work.seq(), s); };
  before_sends();
  SendQueue sends{ex, next, "receipt of broadcast data", {}};
  if (position == 0) {
    for (int64_t s = 0; s < g.per_slice; ++s) sends.post(base + s * g.seg, g.len(bytes, s), slot(s));
    sends.finish();
    return;
  }
  constexpr int64_t kWindow = 2 * kRingInflight;
  std::vector<UBuf> recv_bufs(g.per_slice);
  auto post_recv = [&](int64_t s) {
    recv_bufs[s] = make_buffer(ex.mesh, base + s * g.seg, g.len(bytes, s));
    recv_bufs[s]->recv(prev, slot(s), 0, g.len(bytes, s));
  };
  for (int64_t s = 0; s < std::min(g.per_slice, kWindow); ++s) post_recv(s);
  for (int64_t s = 0; s < g.per_slice; ++s) {
    wait_all(ex, {{prev, recv_bufs[s].get(), 1, true}}, "broadcast data");
    ex.stats.bytes_received += g.len(bytes, s);
    if (s + kWindow < g.per_slice) post_recv(s + kWindow);
    if (next >= 0) sends.post(base + s * g.seg, g.len(bytes, s), slot(s));
  }
  sends.finish();
}

}  // namespace zeroshard::comm
