// zeroshard/flat_layout.h — where each parameter lives in a sharded flat buffer, as pure
// functions of (names, shapes, dtypes, world size, alignment, bucket size): no communication,
// no tensors, so any reader (a checkpoint tool, a loader at another world size) recomputes it.
//
//   FlatLayout l = make_flat_layout(params, world_size);   // rank r owns l.shard(r)
//
// A buffer holds parameters of one dtype back to back, each starting on a multiple of
// `alignment` elements, padded to split into `world_size` equal contiguous shards. Parameter
// offsets do not depend on the world size (only the tail padding does), so (parameter,
// offset) pairs hold at any world size. Thread-safety: plain values.
// How it works: docs/drop-in.md ("What happens").
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

// One parameter as the layout sees it.
struct ParamInfo {
  std::string name;            // e.g. "encoder.layers.3.fc1.weight" (or "param 7" when unnamed)
  std::vector<int64_t> shape;  // sizes; {} for a scalar
  c10::ScalarType dtype = c10::ScalarType::Float;

  int64_t numel() const;
  // "name [d0, d1] Float": the text hashed and compared across ranks.
  std::string describe() const;
};

// Half-open element range [begin, end).
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  bool operator==(const Range& o) const { return begin == o.begin && end == o.end; }
};
Range intersect(Range a, Range b);

// Default element alignment of each parameter's start (64 elements = 256 bytes in fp32).
constexpr int64_t kDefaultAlignment = 64;

struct FlatLayout {
  std::vector<ParamInfo> params;  // in buffer order
  std::vector<int64_t> offsets;   // offsets[i]: first element of params[i]; a multiple of alignment
  int64_t numel = 0;              // end of the last parameter
  int64_t padded_numel = 0;       // numel rounded up to a multiple of world_size * alignment
  int world_size = 1;
  int64_t alignment = kDefaultAlignment;
  c10::ScalarType dtype = c10::ScalarType::Float;

  // Elements each rank owns: padded_numel / world_size (a multiple of alignment).
  int64_t shard_numel() const { return padded_numel / world_size; }
  // The elements rank `rank` owns: [rank * shard_numel(), (rank + 1) * shard_numel()).
  Range shard(int rank) const;
  // The elements params[i] occupies.
  Range param_range(size_t i) const { return {offsets[i], offsets[i] + params[i].numel()}; }
  // The shard rank `rank` of the communicator holds: its own, or shard 0 (the whole buffer) when
  // the layout is for one rank, which every rank then holds (ZeRO stage 0).
  int shard_of_rank(int rank) const { return world_size == 1 ? 0 : rank; }
};

// Lays out `params` in the given order.
// REQUIRES: params non-empty, all of one dtype; world_size >= 1; alignment >= 1.
FlatLayout make_flat_layout(std::vector<ParamInfo> params, int world_size,
                            int64_t alignment = kDefaultAlignment);

// The part of one parameter that falls inside a rank's shard.
struct ShardSegment {
  size_t param = 0;          // index into FlatLayout::params
  Range flat;                // elements of the flat buffer (global offsets)
  int64_t param_offset = 0;  // first element of the parameter (flattened) that flat.begin holds
  // The same elements relative to the shard's start.
  Range local(const FlatLayout& layout, int rank) const;
};
// Every parameter piece inside shard `rank`, in buffer order (padding is not listed).
std::vector<ShardSegment> shard_segments(const FlatLayout& layout, int rank);

// Which parameters share a flat buffer. `params` in model order (module->parameters()), and
// `group` each one's param-group index. Buckets come in backward order (the model's last
// parameters first); a bucket holds consecutive parameters of one dtype and one group, in model
// order, closing when the next would take it past `bucket_bytes`; a larger parameter gets a
// bucket of its own.
// REQUIRES: group.size() == params.size(); bucket_bytes > 0.
std::vector<std::vector<size_t>> plan_buckets(const std::vector<ParamInfo>& params,
                                              const std::vector<int>& group, int64_t bucket_bytes);

}  // namespace zeroshard
