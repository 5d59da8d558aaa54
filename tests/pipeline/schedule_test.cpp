// Pipeline schedules, no communication: every generator over a (p, m, v)
// grid is valid on the transport's semantics, and its simulated bubble and
// peak in-flight microbatches equal the closed forms; bad schedules are
// refused naming rank, step and action.
#include "test_util.h"
#include "zeroshard/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace zeroshard::pipeline {
namespace schedule_test {

// The closed forms (equal stage costs): bubble fraction of the step, and the
// peak number of (stage, microbatch) a rank holds forwarded but not yet backwarded.
double bubble_formula(ScheduleKind kind, int p, int m, int v) {
  return kind == ScheduleKind::kInterleaved1F1B ? (p - 1.0) / (v * m + p - 1.0) : (p - 1.0) / (m + p - 1.0);
}
int peak_formula(ScheduleKind kind, int p, int m, int v, int r) {
  switch (kind) {
    case ScheduleKind::kGPipe: return m;
    case ScheduleKind::k1F1B: return std::min(p - r, m);
    case ScheduleKind::kInterleaved1F1B: return std::min(2 * (p - r - 1) + (v - 1) * p + 1, v * m);
    case ScheduleKind::kForward: return 0;
  }
  return -1;
}

void expect_formulas(ScheduleKind kind, int p, int m, int v, const PassCosts& costs) {
  SCOPED_TRACE(to_string(kind) + " p=" + std::to_string(p) + " m=" + std::to_string(m) + " v=" + std::to_string(v));
  for (bool unshard : {false, true}) {
    LoweringOptions o;
    o.unshard = unshard;
    const Schedule s = make_schedule(kind, p, m, v, o);
    ASSERT_EQ(s.stages, p * v);
    Simulation sim;
    ASSERT_NO_THROW(sim = validate(s, costs));
    EXPECT_NEAR(sim.bubble, bubble_formula(kind, p, m, v), 1e-12);
    for (int r = 0; r < p; ++r) EXPECT_EQ(sim.peak_in_flight[static_cast<size_t>(r)], peak_formula(kind, p, m, v, r)) << "rank " << r;
    // every rank does the same work: m forwards and backwards of one stage's worth
    for (double b : sim.busy) EXPECT_NEAR(b, m * (costs.forward + costs.backward), 1e-9);
  }
}

TEST(PipelineSchedule, GPipeAnd1F1BMeetTheirFormulas) {
  for (int p : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 5, 8, 16, 32}) {
      for (const PassCosts& c : {PassCosts{1, 2}, PassCosts{1, 1}, PassCosts{2, 3}}) {
        expect_formulas(ScheduleKind::kGPipe, p, m, 1, c);
        if (m >= p) expect_formulas(ScheduleKind::k1F1B, p, m, 1, c);
      }
    }
  }
}

TEST(PipelineSchedule, InterleavedMeetsItsFormulas) {
  for (int p : {1, 2, 3, 4, 8}) {
    for (int v : {2, 3, 4}) {
      for (int groups : {1, 2, 3, 4}) {
        for (const PassCosts& c : {PassCosts{1, 1}, PassCosts{1, 2}}) expect_formulas(ScheduleKind::kInterleaved1F1B, p, groups * p, v, c);
      }
    }
  }
}

// The lowered lists carry each receive before its pass and each send after,
// and nothing else changes the order of the passes.
TEST(PipelineSchedule, LoweringKeepsThePassOrder) {
  const Schedule compute = compute_schedule(ScheduleKind::kInterleaved1F1B, 4, 8, 2);
  const Schedule lowered = lower(compute);
  for (int r = 0; r < 4; ++r) {
    std::vector<Action> passes;
    for (const auto& a : lowered.actions[static_cast<size_t>(r)]) {
      if (a.op == Op::kForward || a.op == Op::kBackward) passes.push_back(a);
    }
    EXPECT_EQ(passes, compute.actions[static_cast<size_t>(r)]) << "rank " << r;
  }
}

TEST(PipelineSchedule, TextRoundTripAndHash) {
  const Schedule s = make_schedule(ScheduleKind::k1F1B, 3, 4, 1, {true, true});
  const std::string text = to_text(s);
  EXPECT_EQ(text.substr(0, text.find('\n')), "pipeline-schedule ranks=3 stages=3 microbatches=4");
  // rank 0 of 3: two forwards of warm-up, then one forward and one backward in turn
  EXPECT_NE(text.find("rank 0: 0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0F3"), std::string::npos)
      << text;
  EXPECT_EQ(from_text(text), s);
  EXPECT_EQ(schedule_hash(from_text(text)), schedule_hash(s));
  Schedule other = s;
  std::swap(other.actions[1][1], other.actions[1][2]);
  EXPECT_NE(schedule_hash(other), schedule_hash(s));
  for (const char* a : {"2F0", "10SEND_F31", "0REDUCE_GRAD", "3RECV_B2", "1UNSHARD"}) EXPECT_EQ(to_string(parse_action(a)), a);
  for (const char* bad : {"F0", "2X0", "2F", "2F0x", "0REDUCE_GRAD1", ""}) {
    EXPECT_NE(testing::error_of([&] { parse_action(bad); }).find("is not an action"), std::string::npos) << bad;
  }
  EXPECT_NE(testing::error_of([&] { from_text("schedule 2\n"); }).find("expected 'pipeline-schedule ranks=P"),
            std::string::npos);
  EXPECT_EQ(parse_schedule_kind("interleaved-1f1b"), ScheduleKind::kInterleaved1F1B);
  EXPECT_NE(testing::error_of([&] { parse_schedule_kind("zb"); }).find("use gpipe, 1f1b or interleaved-1f1b"),
            std::string::npos);
}

size_t find_step(const Schedule& s, int rank, const std::string& action) {
  const auto& list = s.actions[static_cast<size_t>(rank)];
  const auto it = std::find(list.begin(), list.end(), parse_action(action));
  EXPECT_NE(it, list.end()) << action << " not on rank " << rank;
  return static_cast<size_t>(it - list.begin());
}

// Receives posted early, but microbatch 2's before microbatch 1's: the queue
// from rank 0 would hand microbatch 1's activation to microbatch 2.
TEST(PipelineSchedule, SwappedReceiveOrderIsNamed) {
  Schedule s = make_schedule(ScheduleKind::k1F1B, 2, 4);
  auto& list = s.actions[1];
  list.erase(list.begin() + static_cast<std::ptrdiff_t>(find_step(s, 1, "1RECV_F2")));
  list.insert(list.begin() + static_cast<std::ptrdiff_t>(find_step(s, 1, "1RECV_F1")), parse_action("1RECV_F2"));
  const std::string err = testing::error_of([&] { validate(s); });
  EXPECT_NE(err.find("channel rank 0 -> rank 1: message 1 is rank 0 step"), std::string::npos) << err;
  EXPECT_NE(err.find("but the receive posted for it is rank 1 step"), std::string::npos) << err;
  EXPECT_NE(err.find("(1RECV_F2)"), std::string::npos) << err;
}

TEST(PipelineSchedule, MissingReceiveIsNamed) {
  Schedule s = make_schedule(ScheduleKind::kGPipe, 3, 2);
  auto& list = s.actions[2];
  const size_t step = find_step(s, 2, "2RECV_F1");
  list.erase(list.begin() + static_cast<std::ptrdiff_t>(step));
  const std::string err = testing::error_of([&] { validate(s); });
  EXPECT_NE(err.find("rank 2 step " + std::to_string(find_step(s, 2, "2F1")) + " (2F1) has no RECV_F2/1 before it"),
            std::string::npos) << err;
}

TEST(PipelineSchedule, OneFOneBNeedsAsManyMicrobatchesAsRanks) {
  const std::string err = testing::error_of([&] { compute_schedule(ScheduleKind::k1F1B, 4, 3); });
  EXPECT_NE(err.find("1f1b with 3 microbatches on 4 ranks; 1F1B needs at least as many microbatches as ranks"),
            std::string::npos) << err;
  EXPECT_NE(testing::error_of([&] { compute_schedule(ScheduleKind::kInterleaved1F1B, 4, 6, 2); })
                .find("must be a multiple of the ranks (4); use 8"), std::string::npos);
  EXPECT_NE(testing::error_of([&] { compute_schedule(ScheduleKind::kGPipe, 2, 4, 2); }).find("use interleaved-1f1b"),
            std::string::npos);
}

// Rank 0 waits for the gradient before sending its activation; rank 1 waits
// for that activation: a deadlock no timing avoids, shown as the grid.
TEST(PipelineSchedule, DeadlockPrintsTheGridWithTheStuckActions) {
  Schedule s = from_text(
      "pipeline-schedule ranks=2 stages=2 microbatches=1\n"
      "rank 0: 0F0 0RECV_B0 0B0 0SEND_F0\n"
      "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n");
  const std::string err = testing::error_of([&] { validate(s); });
  EXPECT_NE(err.find("deadlock"), std::string::npos) << err;
  EXPECT_NE(err.find("rank 0: 0F0 0RECV_B0 [0B0] 0SEND_F0   <- waits for rank 1's 1SEND_B0"), std::string::npos) << err;
  EXPECT_NE(err.find("rank 1: 1RECV_F0 [1F0] 1B0 1SEND_B0   <- waits for rank 0's 0SEND_F0"), std::string::npos) << err;
}

TEST(PipelineSchedule, MisplacedOrMissingPassesAreNamed) {
  Schedule s = make_schedule(ScheduleKind::kGPipe, 2, 2);
  s.actions[0].push_back(parse_action("1F0"));
  EXPECT_NE(testing::error_of([&] { validate(s); }).find("(1F0): stage 1 lives on rank 1, not rank 0"),
            std::string::npos);
  s = make_schedule(ScheduleKind::kGPipe, 2, 2);
  auto& list = s.actions[0];
  list.erase(list.begin() + static_cast<std::ptrdiff_t>(find_step(s, 0, "0B1")));
  EXPECT_NE(testing::error_of([&] { validate(s); }).find("rank 0 never runs 0B1"), std::string::npos);
  s = make_schedule(ScheduleKind::k1F1B, 2, 2);
  std::swap(s.actions[0][find_step(s, 0, "0F1")], s.actions[0][find_step(s, 0, "0B1")]);
  EXPECT_NE(testing::error_of([&] { validate(s); }).find("(0B1) comes before its forward 0F1"), std::string::npos);
  s = make_schedule(ScheduleKind::kGPipe, 2, 2);
  auto& l0 = s.actions[0];
  l0.erase(l0.begin() + static_cast<std::ptrdiff_t>(find_step(s, 0, "0SEND_F0")));
  EXPECT_NE(testing::error_of([&] { validate(s); }).find("rank 0 never sends the output of 0F0"), std::string::npos);
}

// Forward schedules (evaluation): valid for every (p, m, v), no backward,
// nothing in flight; with one stage per rank they fill and drain like GPipe,
// so the bubble is (p−1)/(m+p−1).
TEST(PipelineSchedule, ForwardSchedulesAreValidAndKeepNothing) {
  for (int p : {1, 2, 3, 4}) {
    for (int m = 1; m <= 8; ++m) {
      for (int v = 1; v <= 3; ++v) {
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) + " v=" + std::to_string(v));
        LoweringOptions lo;
        lo.unshard = v == 2;
        const Schedule s = make_schedule(ScheduleKind::kForward, p, m, v, lo);
        EXPECT_TRUE(forward_only(s));
        const Simulation sim = validate(s, PassCosts{1, 2});
        for (int r = 0; r < p; ++r) EXPECT_EQ(sim.peak_in_flight[static_cast<size_t>(r)], 0);
        if (v == 1) {
          EXPECT_NEAR(sim.bubble, static_cast<double>(p - 1) / (m + p - 1), 1e-12);
        }
        EXPECT_EQ(from_text(to_text(s)), s);
      }
    }
  }
  EXPECT_FALSE(forward_only(make_schedule(ScheduleKind::kGPipe, 2, 2)));
  EXPECT_EQ(parse_schedule_kind("forward"), ScheduleKind::kForward);
}

}  // namespace schedule_test
}  // namespace zeroshard::pipeline
