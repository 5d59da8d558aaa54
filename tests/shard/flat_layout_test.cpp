// Flat layout and bucket planning: pure functions, checked against hand-computed
// offsets and against a brute-force element-ownership map.
#include "zeroshard/flat_layout.h"

#include <gtest/gtest.h>

#include <map>
#include <set>

namespace zeroshard {
namespace flat_layout_test {

ParamInfo P(std::string name, std::vector<int64_t> shape, c10::ScalarType dt = c10::ScalarType::Float) {
  return {std::move(name), std::move(shape), dt};
}

TEST(FlatLayout, OffsetsAlignedAndPaddedClosedForm) {
  // 3x5 = 15, 7, 64, scalar 1, 130
  auto l = make_flat_layout({P("a", {3, 5}), P("b", {7}), P("c", {8, 8}), P("d", {}), P("e", {130})}, 3, 64);
  EXPECT_EQ(l.offsets, (std::vector<int64_t>{0, 64, 128, 192, 256}));
  EXPECT_EQ(l.numel, 256 + 130);
  // rounded to a multiple of 3 * 64 = 192: 386 -> 576
  EXPECT_EQ(l.padded_numel, 576);
  EXPECT_EQ(l.shard_numel(), 192);
  EXPECT_EQ(l.shard(2), (Range{384, 576}));
  EXPECT_EQ(l.param_range(4), (Range{256, 386}));
  EXPECT_EQ(l.params[3].numel(), 1);
}

TEST(FlatLayout, OffsetsDoNotDependOnWorldSize) {
  std::vector<ParamInfo> ps = {P("w", {33, 17}), P("b", {17}), P("x", {1000})};
  auto ref = make_flat_layout(ps, 1, 64);
  for (int n = 2; n <= 7; ++n) {
    auto l = make_flat_layout(ps, n, 64);
    EXPECT_EQ(l.offsets, ref.offsets) << n;
    EXPECT_EQ(l.numel, ref.numel);
    EXPECT_EQ(l.padded_numel % (n * 64), 0);
    EXPECT_GE(l.padded_numel, l.numel);
    EXPECT_LT(l.padded_numel - l.numel, n * 64);
  }
}

// Every element of every parameter is owned by exactly one rank, and the
// segments of shard_segments() reproduce exactly that ownership.
TEST(FlatLayout, SegmentsPartitionEveryParameterExactly) {
  std::vector<ParamInfo> ps = {P("a", {5, 3}), P("b", {1}), P("c", {200}), P("d", {63}), P("e", {2, 2, 2})};
  for (int n = 1; n <= 5; ++n) {
    for (int64_t align : {1, 4, 64}) {
      auto l = make_flat_layout(ps, n, align);
      std::map<std::pair<size_t, int64_t>, int> owner;  // (param, element) -> rank
      for (int r = 0; r < n; ++r) {
        const Range shard = l.shard(r);
        int64_t prev_end = -1;
        for (const auto& s : shard_segments(l, r)) {
          EXPECT_GE(s.flat.begin, shard.begin);
          EXPECT_LE(s.flat.end, shard.end);
          EXPECT_GE(s.flat.begin, prev_end) << "segments in buffer order";
          prev_end = s.flat.end;
          const Range local = s.local(l, r);
          EXPECT_EQ(local.begin, s.flat.begin - r * l.shard_numel());
          for (int64_t e = 0; e < s.flat.size(); ++e) {
            auto key = std::make_pair(s.param, s.param_offset + e);
            EXPECT_EQ(owner.count(key), 0u) << "element owned twice";
            owner[key] = r;
            // the flat position of element k of param i is offsets[i] + k
            EXPECT_EQ(l.offsets[s.param] + s.param_offset + e, s.flat.begin + e);
          }
        }
      }
      int64_t total = 0;
      for (const auto& p : ps) total += p.numel();
      EXPECT_EQ(static_cast<int64_t>(owner.size()), total) << "n=" << n << " align=" << align;
    }
  }
}

TEST(FlatLayout, BadInputIsNamed) {
  EXPECT_THROW(make_flat_layout({}, 2), c10::Error);
  try {
    make_flat_layout({P("w", {4}), P("h", {4}, c10::ScalarType::BFloat16)}, 2);
    FAIL() << "mixed dtypes accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'h' [4] BFloat16"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_flat_layout({P("w", {4})}, 0), c10::Error);
  auto l = make_flat_layout({P("w", {4})}, 2);
  EXPECT_THROW(l.shard(2), c10::Error);
}

TEST(FlatLayout, BucketsInBackwardOrderBySize) {
  // fp32 params of 100, 100, 300, 50, 50 elements; 1000-byte buckets (250 elements).
  std::vector<ParamInfo> ps = {P("p0", {100}), P("p1", {100}), P("p2", {300}), P("p3", {50}), P("p4", {50})};
  auto b = plan_buckets(ps, std::vector<int>(5, 0), 1000);
  // backward: p4 p3 (400 B) then p2 (1200 B: alone), then p1 p0.
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (std::vector<size_t>{3, 4}));
  EXPECT_EQ(b[1], (std::vector<size_t>{2}));
  EXPECT_EQ(b[2], (std::vector<size_t>{0, 1}));
}

TEST(FlatLayout, BucketsSplitOnDtypeAndGroup) {
  std::vector<ParamInfo> ps = {P("a", {10}), P("b", {10}), P("c", {10}, c10::ScalarType::BFloat16),
                               P("d", {10}, c10::ScalarType::BFloat16), P("e", {10})};
  auto b = plan_buckets(ps, {0, 1, 1, 1, 1}, 1 << 20);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0], (std::vector<size_t>{4}));
  EXPECT_EQ(b[1], (std::vector<size_t>{2, 3}));
  EXPECT_EQ(b[2], (std::vector<size_t>{1}));
  EXPECT_EQ(b[3], (std::vector<size_t>{0}));
  // every parameter in exactly one bucket
  std::set<size_t> seen;
  for (auto& bucket : b)
    for (size_t i : bucket) EXPECT_TRUE(seen.insert(i).second);
  EXPECT_EQ(seen.size(), ps.size());
}

}  // namespace flat_layout_test
}  // namespace zeroshard
