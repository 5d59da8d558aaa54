#include "zeroshard/flat_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace zeroshard {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

int64_t ParamInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ParamInfo::describe() const {
  std::ostringstream os;
  os << "'" << name << "' [";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "] " << c10::toString(dtype);
  return os.str();
}

Range intersect(Range a, Range b) {
  Range r{std::max(a.begin, b.begin), std::min(a.end, b.end)};
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

Range FlatLayout::shard(int rank) const {
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "FlatLayout::shard: rank ", rank,
                    " is outside [0, ", world_size, ")");
  const int64_t n = shard_numel();
  return {rank * n, (rank + 1) * n};
}

FlatLayout make_flat_layout(std::vector<ParamInfo> params, int world_size, int64_t alignment) {
  TORCH_CHECK_VALUE(!params.empty(), "make_flat_layout: no parameters given");
  TORCH_CHECK_VALUE(world_size >= 1, "make_flat_layout: world_size is ", world_size, "; it must be >= 1");
  TORCH_CHECK_VALUE(alignment >= 1, "make_flat_layout: alignment is ", alignment, "; it must be >= 1");
  FlatLayout layout;
  layout.world_size = world_size;
  layout.alignment = alignment;
  layout.dtype = params.front().dtype;
  int64_t cursor = 0;
  for (const auto& p : params) {
    TORCH_CHECK_VALUE(p.dtype == layout.dtype, "make_flat_layout: parameter ", p.describe(),
                      " does not have the buffer's dtype ", c10::toString(layout.dtype),
                      "; a flat buffer holds one dtype");
    for (int64_t d : p.shape) {
      TORCH_CHECK_VALUE(d >= 0, "make_flat_layout: parameter ", p.describe(), " has a negative size");
    }
    cursor = round_up(cursor, alignment);
    layout.offsets.push_back(cursor);
    cursor += p.numel();
  }
  layout.numel = cursor;
  layout.padded_numel = round_up(std::max<int64_t>(cursor, 1), world_size * alignment);
  layout.params = std::move(params);
  return layout;
}

Range ShardSegment::local(const FlatLayout& layout, int rank) const {
  const int64_t base = layout.shard(rank).begin;
  return {flat.begin - base, flat.end - base};
}

std::vector<ShardSegment> shard_segments(const FlatLayout& layout, int rank) {
  const Range mine = layout.shard(rank);
  std::vector<ShardSegment> out;
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const Range p = layout.param_range(i);
    const Range piece = intersect(p, mine);
    if (piece.empty()) continue;
    out.push_back({i, piece, piece.begin - p.begin});
  }
  return out;
}

std::vector<std::vector<size_t>> plan_buckets(const std::vector<ParamInfo>& params,
                                              const std::vector<int>& group, int64_t bucket_bytes) {
  TORCH_CHECK_VALUE(group.size() == params.size(), "plan_buckets: ", params.size(),
                    " parameters but ", group.size(), " group indices");
  TORCH_CHECK_VALUE(bucket_bytes > 0, "plan_buckets: bucket_bytes is ", bucket_bytes,
                    "; it must be positive");
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> current;  // in backward order while filling
  int64_t current_bytes = 0;
  auto close = [&] {
    if (current.empty()) return;
    std::reverse(current.begin(), current.end());  // model order inside the bucket
    buckets.push_back(std::move(current));
    current.clear();
    current_bytes = 0;
  };
  for (size_t k = params.size(); k-- > 0;) {
    const int64_t bytes = params[k].numel() * static_cast<int64_t>(c10::elementSize(params[k].dtype));
    if (!current.empty()) {
      const size_t last = current.back();
      const bool compatible = params[last].dtype == params[k].dtype && group[last] == group[k];
      if (!compatible || current_bytes + bytes > bucket_bytes) close();
    }
    current.push_back(k);
    current_bytes += bytes;
  }
  close();
  return buckets;
}

}  // namespace zeroshard
