// Collectives at the world size this process was launched with (ctest runs this
// suite through zeroshard-run at 1, 2, 3 and 4 ranks). Every expected value is
// a closed form of (rank, index); byte counters are compared to the theory.
#include "comm/ring.h"
#include "comm/tcp_communicator.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <c10/util/Exception.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

namespace zeroshard {
namespace collectives_test {

using testing::pattern;
using testing::world;

const std::vector<at::ScalarType> kFloatTypes = {at::kFloat, at::kBFloat16, at::kHalf};
// Element counts: empty, tiny, not multiples of anything, and large enough to be
// split into several 1 MiB pipeline segments.
const std::vector<int64_t> kCounts = {0, 1, 7, 1001, 600'007};

// Closed-form reduction of pattern(p, numel, salt) over all ranks, in float64,
// then rounded once to `dtype` (the float32-accumulation contract).
at::Tensor expected_reduction(int64_t offset, int64_t numel, int n, ReduceOp op, at::ScalarType dtype,
                              int salt) {
  at::Tensor acc;
  for (int p = 0; p < n; ++p) {
    auto v = pattern(p, offset + numel, at::kDouble, salt).slice(0, offset, offset + numel);
    if (!acc.defined()) {
      acc = v.clone();
    } else if (op == ReduceOp::kMax) {
      acc = at::maximum(acc, v);
    } else if (op == ReduceOp::kMin) {
      acc = at::minimum(acc, v);
    } else {
      acc = acc + v;
    }
  }
  if (op == ReduceOp::kAvg) {
    // Divided in the accumulation type: float32 for 16-bit and float32 data.
    auto acc_type = dtype == at::kDouble ? at::kDouble : at::kFloat;
    return (acc.to(acc_type) / static_cast<double>(n)).to(dtype);
  }
  return acc.to(dtype);
}

// A fresh communicator over every rank, for tests that leave theirs failed: of a
// family of its own, or its failure would fail `c` too.
std::shared_ptr<Communicator> whole_group(Communicator& c) {
  std::vector<int> all(c.size());
  std::iota(all.begin(), all.end(), 0);
  auto* tcp = dynamic_cast<comm::TcpCommunicator*>(&c);
  return tcp != nullptr ? tcp->split_new_family(all) : c.split(all);
}

// Whether an operation with slices of `slice_bytes` runs as a ring (ring.h's rule): with
// CommOptions::Algorithm::kAuto when the ranks span hosts (the cluster tests run this suite
// on several) or the slices are large, with kRing always (ZS_TEST_ALGORITHM=ring).
bool runs_as_ring(Communicator& c, int64_t slice_bytes) {
  static const bool spans_hosts = [&] {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    auto mine = at::full({1}, static_cast<int64_t>(std::hash<std::string>{}(name) >> 1), at::kLong);
    auto all = at::zeros({c.size()}, at::kLong);
    c.all_gather(all, mine)->wait();
    return (all != all[0]).any().item<bool>();
  }();
  const auto algorithm = testing::test_comm_options().algorithm;
  return comm::ring_candidate(c.size(), slice_bytes, algorithm) &&
         comm::ring_chosen(slice_bytes, algorithm, spans_hosts);
}

OpStats delta(const CommStats& before, const CommStats& after, OpKind kind) {
  OpStats a = after.by_kind.count(kind) ? after.by_kind.at(kind) : OpStats{};
  OpStats b = before.by_kind.count(kind) ? before.by_kind.at(kind) : OpStats{};
  a.calls -= b.calls;
  a.bytes_sent -= b.bytes_sent;
  a.bytes_received -= b.bytes_received;
  return a;
}

TEST(Collectives, AllGatherEveryDtypeAndCount) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  for (auto dt : kFloatTypes) {
    for (int64_t count : kCounts) {
      auto in = pattern(r, count, dt, 1);
      auto out = at::full({n * count}, 99, at::TensorOptions(dt));
      const auto before = c.stats();
      c.all_gather(out, in)->wait();
      const auto d = delta(before, c.stats(), OpKind::kAllGather);
      for (int p = 0; p < n; ++p) {
        ASSERT_TRUE(out.slice(0, p * count, (p + 1) * count).equal(pattern(p, count, dt, 1)))
            << "dtype " << dt << " count " << count << " slice of rank " << p;
      }
      const int64_t bytes = count * static_cast<int64_t>(c10::elementSize(dt));
      EXPECT_EQ(d.calls, 1);
      EXPECT_EQ(d.bytes_sent, (n - 1) * bytes) << "(n-1)/n of the " << n * bytes << "-byte output";
      EXPECT_EQ(d.bytes_received, (n - 1) * bytes);
    }
  }
}

// Bytes move (quantized gathers send int8 values and their scales as uint8); they do not sum.
TEST(Collectives, AllGatherMovesBytesAndReductionsRefuseThem) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  auto bytes_of = [](int rank, int64_t count, at::ScalarType dt) {
    auto x = (at::arange(count, at::kLong) * 31 + rank * 7) % 256;
    return (dt == at::kChar ? x - 128 : x).to(dt);
  };
  for (auto dt : {at::kByte, at::kChar}) {
    for (int64_t count : kCounts) {
      auto out = at::full({n * count}, 5, at::TensorOptions(dt));
      c.all_gather(out, bytes_of(r, count, dt))->wait();
      for (int p = 0; p < n; ++p) {
        ASSERT_TRUE(out.slice(0, p * count, (p + 1) * count).equal(bytes_of(p, count, dt)))
            << "dtype " << dt << " count " << count << " slice of rank " << p;
      }
    }
  }
  auto t = at::ones({8}, at::kByte);
  try {
    c.all_reduce(t, ReduceOp::kSum);
    FAIL() << "an all_reduce of uint8 was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce: `t` has dtype Byte; supported dtypes are float32"),
              std::string::npos) << e.what();
  }
}

TEST(Collectives, AllGatherInPlace) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  const int64_t count = 333;
  auto out = at::zeros({n * count});
  auto mine = out.slice(0, r * count, (r + 1) * count);
  mine.copy_(pattern(r, count, at::kFloat));
  c.all_gather(out, mine)->wait();
  for (int p = 0; p < n; ++p) EXPECT_TRUE(out.slice(0, p * count, (p + 1) * count).equal(pattern(p, count, at::kFloat)));
}

TEST(Collectives, ReduceScatterEveryOpDtypeAndCount) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    for (auto dt : kFloatTypes) {
      for (int64_t count : kCounts) {
        auto in = pattern(r, n * count, dt, 2);
        auto out = at::full({count}, 99, at::TensorOptions(dt));
        const auto before = c.stats();
        c.reduce_scatter(out, in, op)->wait();
        const auto d = delta(before, c.stats(), OpKind::kReduceScatter);
        auto want = expected_reduction(r * count, count, n, op, dt, 2);
        ASSERT_TRUE(out.equal(want)) << "op " << to_string(op) << " dtype " << dt << " count " << count;
        const int64_t bytes = count * static_cast<int64_t>(c10::elementSize(dt));
        EXPECT_EQ(d.bytes_sent, (n - 1) * bytes);
        EXPECT_EQ(d.bytes_received, (n - 1) * bytes);
      }
    }
  }
}

TEST(Collectives, AllReduceEveryOpDtypeAndUnevenCount) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    for (auto dt : kFloatTypes) {
      for (int64_t numel : {int64_t(0), int64_t(1), int64_t(5), int64_t(1003), int64_t(2'000'003)}) {
        auto t = pattern(r, numel, dt, 3);
        const auto before = c.stats();
        c.all_reduce(t, op)->wait();
        const auto d = delta(before, c.stats(), OpKind::kAllReduce);
        ASSERT_TRUE(t.equal(expected_reduction(0, numel, n, op, dt, 3)))
            << "op " << to_string(op) << " dtype " << dt << " numel " << numel;
        // Slices of numel/n (the first numel%n ranks one more): reduce-scatter sends the
        // other slices; all-gather sends this rank's slice to n-1 peers, or as a ring
        // forwards every slice but rank+1's.
        const int64_t es = static_cast<int64_t>(c10::elementSize(dt));
        auto slice = [&](int p) { return numel / n + (p < numel % n ? 1 : 0); };
        const int64_t mine = slice(r);
        const bool ring = runs_as_ring(c, slice(0) * es);
        EXPECT_EQ(d.bytes_sent, ((numel - mine) + (ring ? numel - slice((r + 1) % n) : (n - 1) * mine)) * es)
            << (ring ? "ring" : "pairwise");
        if (numel % n == 0) {
          EXPECT_EQ(d.bytes_sent * n, 2 * (n - 1) * numel * es) << "2(n-1)/n";
        }
      }
    }
  }
}

TEST(Collectives, AllReduceOtherDtypes) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  for (auto dt : {at::kDouble, at::kLong, at::kInt}) {
    for (int64_t numel : {int64_t(4097), int64_t(600'001)}) {  // pairwise, and (from 3 ranks) a ring for 64-bit
      auto t = pattern(r, numel, dt, 4);
      c.all_reduce(t, ReduceOp::kSum)->wait();
      EXPECT_TRUE(t.equal(expected_reduction(0, numel, n, ReduceOp::kSum, dt, 4))) << dt << " numel " << numel;
    }
  }
}

TEST(Collectives, IntegerSumsWrapAroundAndNeverOverflowMidSum) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  for (auto dt : {at::kInt, at::kLong}) {
    const int64_t mx = dt == at::kInt ? std::numeric_limits<int32_t>::max() : std::numeric_limits<int64_t>::max();
    // Element 0: the maximum on every rank (n·max wraps around; its average is max).
    // Element 1: max on ranks 0 and 1, -max on rank 2, 0 elsewhere: from 3 ranks on only the
    //            partial sum overflows and the total, max, fits.
    auto value = [&](int p, int i) -> int64_t { return i == 0 || p < 2 ? mx : p == 2 ? -mx : 0; };
    auto t = at::empty({2}, at::TensorOptions(dt));
    for (int i = 0; i < 2; ++i) t[i] = value(r, i);
    auto a = t.clone();
    c.all_reduce(t, ReduceOp::kSum)->wait();
    c.all_reduce(a, ReduceOp::kAvg)->wait();
    for (int i = 0; i < 2; ++i) {
      __int128 exact = 0;
      for (int p = 0; p < n; ++p) exact += value(p, i);
      // Two's complement wrap-around of the exact sum, through the unsigned type.
      const int64_t wrapped = dt == at::kInt ? static_cast<int32_t>(static_cast<uint32_t>(exact))
                                             : static_cast<int64_t>(static_cast<uint64_t>(exact));
      EXPECT_EQ(t[i].item<int64_t>(), wrapped) << dt << " element " << i << ": the exact sum, wrapped";
      EXPECT_EQ(a[i].item<int64_t>(), static_cast<int64_t>(exact / n))
          << dt << " element " << i << ": the exact average, truncated toward zero";
    }
  }
}

TEST(Collectives, MaxAndMinPropagateNaNFromAnyRank) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  // Element p holds NaN on rank p only (p < n), elements n.. hold none; every other value is
  // finite. torch.maximum/minimum make any NaN the result, whichever rank holds it.
  for (auto dt : kFloatTypes) {
    for (auto op : {ReduceOp::kMax, ReduceOp::kMin}) {
      auto t = at::full({n + 1}, static_cast<double>(r + 1), at::TensorOptions(dt));
      t[r] = std::numeric_limits<double>::quiet_NaN();
      c.all_reduce(t, op)->wait();
      for (int p = 0; p < n; ++p) {
        EXPECT_TRUE(std::isnan(t[p].item<double>())) << to_string(op) << " " << dt << ": NaN of rank " << p << " lost";
      }
      EXPECT_EQ(t[n].item<double>(), op == ReduceOp::kMax ? n : 1) << to_string(op) << " " << dt;
    }
  }
}

TEST(Collectives, SixteenBitReductionsAccumulateInFloat32) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  if (n < 3) GTEST_SKIP() << "below 3 ranks bf16 and fp32 accumulation give the same 256 (257 rounds to 256)";
  // 256 + 1 + 1 + ...: bf16 cannot hold 257, so summing in bf16 hop by hop stays at 256;
  // accumulating in fp32 and rounding once gives the bf16 nearest to 256 + (n-1).
  auto t = at::full({10}, r == 0 ? 256.0 : 1.0, at::TensorOptions(at::kBFloat16));
  c.all_reduce(t, ReduceOp::kSum)->wait();
  const float want = static_cast<float>(c10::BFloat16(256.0f + static_cast<float>(n - 1)));
  EXPECT_EQ(t[0].item<float>(), want);
}

TEST(Collectives, BroadcastFromEveryRoot) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  for (int root = 0; root < n; ++root) {
    for (auto dt : kFloatTypes) {
     // Inline in the header, pairwise, and (from 3 ranks) a chain of 1 MiB segments.
     for (int64_t numel : {int64_t(5), int64_t(70'001), int64_t(1'300'001)}) {
      auto t = r == root ? pattern(root, numel, dt, 5) : at::zeros({numel}, at::TensorOptions(dt));
      const auto before = c.stats();
      c.broadcast(t, root)->wait();
      const auto d = delta(before, c.stats(), OpKind::kBroadcast);
      ASSERT_TRUE(t.equal(pattern(root, numel, dt, 5))) << "root " << root << " dtype " << dt;
      const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dt));
      if (runs_as_ring(c, bytes)) {  // every rank but the chain's last forwards the buffer once
        EXPECT_EQ(d.bytes_sent, (r + 1) % n == root ? 0 : bytes) << "chain from root " << root;
      } else {
        EXPECT_EQ(d.bytes_sent, r == root ? (n - 1) * bytes : 0);
      }
      EXPECT_EQ(d.bytes_received, r == root ? 0 : bytes);
     }
    }
  }
}

// broadcast_text: every length (empty, not a multiple of the 8-byte words, large enough for a
// ring's chain), with bytes of every value, from every root.
TEST(Collectives, BroadcastTextFromEveryRoot) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  for (int root = 0; root < n; ++root) {
    for (size_t length : {size_t(0), size_t(13), size_t(300'001)}) {
      std::string text(length, '\0');
      for (size_t i = 0; i < length; ++i) text[i] = static_cast<char>((i * 131 + root) % 256);
      const std::string got = broadcast_text(c, r == root ? text : std::string("ignored"), root);
      EXPECT_EQ(got, text) << "root " << root << " length " << length;
    }
  }
}

// failed_ranks: every subset of failing ranks (as a bit mask over the ranks) comes back whole
// and in order on every rank; none failing is an empty answer.
TEST(Collectives, FailedRanksNamesEveryFailingRankOnEveryRank) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  for (int mask = 0; mask < (1 << n); ++mask) {
    std::vector<int> want;
    for (int q = 0; q < n; ++q) {
      if (mask >> q & 1) want.push_back(q);
    }
    EXPECT_EQ(failed_ranks(c, mask >> r & 1), want) << "mask " << mask;
  }
}

TEST(Collectives, SendRecvBetweenEveryPair) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  std::vector<std::shared_ptr<Work>> sends;
  std::vector<at::Tensor> keep;
  for (int src = 0; src < n; ++src) {
    for (int dst = 0; dst < n; ++dst) {
      if (src == dst) continue;
      // Differs per pair; every other pair is too large to ride inside the header.
      const int64_t numel = ((src + dst) % 2 ? 1000 : 300'000) + 17 * src + dst;
      if (r == src) {
        keep.push_back(pattern(src * n + dst, numel, at::kBFloat16, 6));
        sends.push_back(c.send(keep.back(), dst));
      }
      if (r == dst) {
        auto t = at::zeros({numel}, at::TensorOptions(at::kBFloat16));
        c.recv(t, src)->wait();
        ASSERT_TRUE(t.equal(pattern(src * n + dst, numel, at::kBFloat16, 6))) << src << " -> " << dst;
      }
    }
  }
  for (auto& w : sends) w->wait();
  for (auto& w : sends) EXPECT_TRUE(w->is_completed());
}

// Receives are posted, not run on the communication thread: pairs of ranks
// that each post a recv before their send complete, in both message sizes
// (inline and receiver-driven), and a collective issued after a recv whose
// sender comes later is not held up by it.
TEST(Collectives, PostedRecvsNeverHoldTheQueue) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  if (r >= 2) {  // ranks 0 and 1 exchange; the rest only join the all-reduce
    auto t = at::ones({8});
    c.all_reduce(t, ReduceOp::kSum)->wait();
    return;
  }
  const int peer = 1 - r;
  for (const int64_t numel : {100, 300'000}) {
    // The order: rank 0 recv then send, rank 1 send then recv.
    auto got = at::zeros({numel});
    auto mine = pattern(r, numel, at::kFloat, 7);
    std::shared_ptr<Work> a, b;
    if (r == 0) {
      a = c.recv(got, peer);
      b = c.send(mine, peer);
    } else {
      b = c.send(mine, peer);
      a = c.recv(got, peer);
    }
    a->wait(std::chrono::seconds(30));
    b->wait(std::chrono::seconds(30));
    EXPECT_TRUE(got.equal(pattern(peer, numel, at::kFloat, 7))) << numel;
    // Both recv first: the order that blocks when a recv runs on the thread.
    got.zero_();
    a = c.recv(got, peer);
    b = c.send(mine, peer);
    a->wait(std::chrono::seconds(30));
    b->wait(std::chrono::seconds(30));
    EXPECT_TRUE(got.equal(pattern(peer, numel, at::kFloat, 7))) << numel;
  }
  // Rank 0 posts a recv whose send rank 1 issues only after an all-reduce that
  // rank 0 issues after the recv: the all-reduce must not wait behind it.
  auto late = at::zeros({1000});
  std::shared_ptr<Work> pending;
  if (r == 0) pending = c.recv(late, 1);
  auto t = at::ones({8});
  c.all_reduce(t, ReduceOp::kSum)->wait(std::chrono::seconds(30));
  EXPECT_EQ(t[0].item<float>(), static_cast<float>(n));
  if (r == 1) c.send(pattern(9, 1000, at::kFloat, 1), 0)->wait(std::chrono::seconds(30));
  if (r == 0) {
    pending->wait(std::chrono::seconds(30));
    EXPECT_TRUE(late.equal(pattern(9, 1000, at::kFloat, 1)));
  }
}

TEST(Collectives, SplitGroupsRunConcurrently) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  std::vector<int> evens, odds;
  for (int p = 0; p < n; ++p) (p % 2 ? odds : evens).push_back(p);
  auto even = c.split(evens);
  auto odd = odds.empty() ? nullptr : c.split(odds);
  auto mine = r % 2 ? odd : even;
  ASSERT_NE(mine, nullptr);
  EXPECT_EQ(r % 2 ? even : odd, nullptr);
  const auto& members = r % 2 ? odds : evens;
  EXPECT_EQ(mine->size(), static_cast<int>(members.size()));
  EXPECT_EQ(mine->rank(), r / 2);

  // The group's all-reduce and the world's are both in flight before either is waited on.
  auto g = at::full({1 << 16}, static_cast<float>(r + 1));
  auto w = at::full({1 << 16}, static_cast<float>(r + 1));
  auto gw = mine->all_reduce(g, ReduceOp::kSum);
  auto ww = c.all_reduce(w, ReduceOp::kSum);
  gw->wait();
  ww->wait();
  float group_sum = 0;
  for (int p : members) group_sum += static_cast<float>(p + 1);
  EXPECT_EQ(g[0].item<float>(), group_sum);
  EXPECT_EQ(w[123].item<float>(), static_cast<float>(n * (n + 1) / 2));
  mine->barrier();
}

// A rank passing a different size is named on every rank; nothing hangs or overruns.
// Sizes cover the three paths: data inside the header, receives posted before
// the header check (up to 256 KiB), and receives posted after it.
TEST(Collectives, SizeMismatchBetweenRanksIsNamed) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  for (int64_t base : {int64_t(4), int64_t(20'000), int64_t(200'000)}) {
    auto sub = whole_group(c);
    const int64_t count = r == n - 1 ? base + 1 : base;
    auto in = at::ones({count});
    auto out = at::zeros({n * count});
    try {
      sub->all_gather(out, in)->wait();
      ADD_FAILURE() << "the size mismatch was not detected (count " << base << ")";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("all_gather #0"), std::string::npos) << msg;
      const std::string mine = std::to_string(count), other = std::to_string(r == n - 1 ? base : base + 1);
      EXPECT_NE(msg.find("has in.numel() == " + other + " but this rank has " + mine), std::string::npos) << msg;
      if (r == n - 1) {
        EXPECT_NE(msg.find("rank 0 has"), std::string::npos) << msg;
      }
    }
    EXPECT_TRUE(out.eq(0).all().item<bool>()) << "data moved despite the mismatch (count " << base << ")";
    // The group refuses further work with the original error.
    auto t = at::ones({3});
    try {
      sub->all_reduce(t, ReduceOp::kSum)->wait();
      ADD_FAILURE() << "a failed communicator accepted more work";
    } catch (const c10::Error& e) {
      // The cause first (the mismatch), then what was not run.
      const std::string msg = e.what_without_backtrace();
      EXPECT_EQ(msg.rfind("all_gather #0", 0), 0u) << msg;
      EXPECT_NE(msg.find("has in.numel() == "), std::string::npos) << msg;
      EXPECT_NE(msg.find("[all_reduce #1 on rank " + std::to_string(r) + " of " + std::to_string(n) +
                         " not run: the communicator had failed]"),
                std::string::npos)
          << msg;
    }
  }
  // Also for reduce_scatter, whose receives are staged, and broadcast.
  for (int64_t base : {int64_t(20'000), int64_t(200'000)}) {
    auto sub = whole_group(c);
    const int64_t count = r == n - 1 ? base + 1 : base;
    auto out = at::zeros({count});
    EXPECT_THROW(sub->reduce_scatter(out, at::ones({n * count}), ReduceOp::kSum)->wait(), c10::Error);
    auto sub2 = whole_group(c);
    auto t = at::zeros({count});
    EXPECT_THROW(sub2->broadcast(t, 0)->wait(), c10::Error);
  }
  c.barrier();
}

TEST(Collectives, DtypeOrOpMismatchBetweenRanksIsNamed) {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  auto sub = whole_group(c);
  auto t = at::ones({8}, at::TensorOptions(r == 1 ? at::kBFloat16 : at::kFloat));
  try {
    sub->all_reduce(t, ReduceOp::kSum)->wait();
    FAIL() << "the dtype mismatch was not detected";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("issued all_reduce #0"), std::string::npos) << msg;
    EXPECT_NE(msg.find(r == 1 ? "dtype Float" : "dtype BFloat16"), std::string::npos) << msg;
  }
  c.barrier();
}

}  // namespace collectives_test
}  // namespace zeroshard
