// ring.h — ring algorithms for large operations on 3 or more ranks (collectives.cpp
// chooses them; at 2 ranks a ring is the pairwise exchange).
//
// Each rank talks to two peers only: it sends to rank+1 and receives from rank-1,
// n-1 steps of one slice each. Ranks are numbered host by host, so a host's link
// carries (n-1)/n of the buffer whatever the number of ranks on the host
// (pairwise exchange sends every slice straight to its owner: with 2 ranks per
// host on 4 hosts, 1.5x the buffer leaves each host). Slices travel in 1 MiB segments: a segment is reduced and sent on
// while the next ones arrive.
//   reduce-scatter: at step k, rank r sends its partial of slice r-1-k and
//     receives slice r-2-k, adds its own contribution; the last step leaves
//     slice r complete. Each slice is summed in ring order (from rank r+1 round
//     to r), which is deterministic but not rank order.
//   all-gather: at step k, rank r forwards slice r-k and receives slice r-k-1.
//   broadcast: a chain from the root; each rank forwards a segment once it arrived.
// Bytes on the wire are the pairwise exchange's: (n-1)/n of the buffer per rank
// (all-gather with uneven slices: the slices of every rank but rank+1).
#pragma once

#include "comm/collectives.h"

#include <functional>
#include <vector>

namespace zeroshard::comm {

// The slices of a buffer, one per rank (counts in elements, offsets from the start).
struct Slices {
  std::vector<int64_t> counts;
  std::vector<int64_t> offsets;
};

// Whether a ring reduction keeps the communicator's arithmetic contract for this
// dtype and op. A ring adds partials hop by hop in the element type: exact for max
// and min, and for integer sums (they wrap modulo 2^bits whatever the order), not
// for 16-bit sums and averages (float32 accumulation, rounded once: they stay
// pairwise) nor integer averages (the exact sum, divided once).
bool ring_keeps_arithmetic(c10::ScalarType dtype, ReduceOp op);

// Whether an operation whose largest slice is `slice_bytes` may run as a ring on `n` ranks
// (3 or more, slices of 64 KiB and up, and `algorithm` not kPairwise).
bool ring_candidate(int n, int64_t slice_bytes, CommOptions::Algorithm algorithm);

// Whether a candidate runs as a ring: always with kRing; with kAuto when the ranks span
// hosts (collectives.cpp learns it from the headers), or on one host from slices of 2 MiB.
bool ring_chosen(int64_t slice_bytes, CommOptions::Algorithm algorithm, bool spans_hosts);

// Reduces slice `rank` of `in` over all ranks into `out`, as a ring. `before_sends`
// (the header check) runs before any data moves.
void ring_reduce_scatter(Exchange& ex, void* out, const void* in, const Slices& slices, c10::ScalarType dtype,
                         ReduceOp op, const std::function<void()>& before_sends);

// Fills every slice p of `out` from rank p, as a ring. This rank's slice comes from `own`
// (which may be that slice of `out`).
void ring_all_gather(Exchange& ex, void* out, const Slices& slices, c10::ScalarType dtype, const void* own,
                     const std::function<void()>& before_sends);

// `bytes` of `data` from `root` to every rank along the chain root, root+1, ..., root-1.
void chain_broadcast(Exchange& ex, void* data, int64_t bytes, int root, const std::function<void()>& before_sends);

}  // namespace zeroshard::comm
