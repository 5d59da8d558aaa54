// The device communicators' watchdog as a state machine: fake operations and
// communicators, a fake clock. No device needed.
#include "comm/watchdog.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>

namespace zeroshard::comm {
namespace watchdog_test {

using namespace std::chrono_literals;
using Time = std::chrono::steady_clock::time_point;

struct FakeOp : WatchedOp {
  FakeOp(std::string n, uint64_t s) : name_(std::move(n)), seq_(s) {}
  const std::string& name() const override { return name_; }
  bool finished_on_device() override { return on_device; }
  void complete() override { ++completed; }
  void fail(const std::string& m) override {
    ++failed;
    message = m;
  }
  void doom() override { doomed = true; }
  std::string missing_ranks() override {
    ++asked;
    return "rank(s) [3] never issued #" + std::to_string(seq_);
  }
  std::string name_;
  uint64_t seq_;
  int asked = 0;
  bool on_device = false;
  int completed = 0, failed = 0;
  bool doomed = false;
  std::string message;
};

struct FakeComm : WatchedComm {
  std::string async_error() override { return error; }
  void abort(const std::string& w) override {
    ++aborts;
    why = w;
    if (on_abort) on_abort();
  }
  std::function<void()> on_abort;  // what the device does meanwhile (an abort fires end events)
  void heartbeat() override { ++heartbeats; }
  std::string error, why;
  int aborts = 0, heartbeats = 0;
};

struct Fixture {
  Time now{};
  Watchdog dog{1000ms, [this] { return now; }};
  std::shared_ptr<FakeComm> a = std::make_shared<FakeComm>(), b = std::make_shared<FakeComm>();
  Fixture() {
    dog.add(a);
    dog.add(b);
  }
  std::shared_ptr<FakeOp> issue(FakeComm& comm, const std::string& name, uint64_t seq) {
    auto op = std::make_shared<FakeOp>(name, seq);
    dog.watch(&comm, op);
    return op;
  }
};

TEST(Watchdog, CompletesWhatTheDeviceFinishedAndKeepsTheRest) {
  Fixture f;
  auto op1 = f.issue(*f.a, "all_gather #0", 0);
  auto op2 = f.issue(*f.b, "reduce_scatter #0", 0);
  EXPECT_EQ(f.dog.poll(), 2u);
  op1->on_device = true;
  EXPECT_EQ(f.dog.poll(), 1u);
  EXPECT_EQ(op1->completed, 1);
  EXPECT_EQ(op2->completed + op2->failed, 0);
  EXPECT_EQ(f.dog.poll(), 1u);
  EXPECT_EQ(op1->completed, 1) << "a completed operation was completed again";
  op2->on_device = true;
  EXPECT_EQ(f.dog.poll(), 0u);
  EXPECT_EQ(op2->completed, 1);
  EXPECT_EQ(f.a->aborts + f.b->aborts, 0);
  EXPECT_EQ(f.a->heartbeats, 4) << "every poll gives each communicator a heartbeat";
}

TEST(Watchdog, TimesOutAtTheDeadlineNotBeforeAndAbortsEveryCommunicatorOnce) {
  Fixture f;
  auto first = f.issue(*f.a, "all_reduce #5 on rank 0 of 4", 5);
  f.now += 900ms;
  auto later = f.issue(*f.b, "send #0", 0);
  f.now += 99ms;  // 999 ms after the first
  EXPECT_EQ(f.dog.poll(), 2u);
  EXPECT_EQ(first->failed, 0);
  f.now += 1ms;
  EXPECT_EQ(f.dog.poll(), 0u);
  EXPECT_EQ(first->asked, 1) << "the timed-out operation was not asked who is missing";
  EXPECT_EQ(later->asked, 0) << "an operation that did not time out was asked who is missing";
  for (auto* op : {first.get(), later.get()}) {
    EXPECT_EQ(op->failed, 1);
    EXPECT_EQ(op->completed, 0);
    EXPECT_NE(op->message.find("all_reduce #5 on rank 0 of 4 did not complete within 1000 ms"), std::string::npos)
        << op->message;
    EXPECT_NE(op->message.find("rank(s) [3] never issued #5"), std::string::npos) << op->message;
  }
  EXPECT_EQ(f.a->aborts, 1);
  EXPECT_EQ(f.b->aborts, 1);
  f.now += 10s;
  f.dog.poll();
  EXPECT_EQ(f.a->aborts, 1) << "aborted twice";
  EXPECT_EQ(first->failed, 1);
}

TEST(Watchdog, TheTimeoutCountsFromEachOperationsIssue) {
  Fixture f;
  auto first = f.issue(*f.a, "all_gather #0", 0);
  f.now += 900ms;
  auto second = f.issue(*f.a, "all_gather #1", 1);
  f.now += 100ms;
  first->on_device = true;
  EXPECT_EQ(f.dog.poll(), 1u);
  f.now += 899ms;  // second: 999 ms
  EXPECT_EQ(f.dog.poll(), 1u);
  EXPECT_EQ(second->failed, 0);
  f.now += 1ms;
  EXPECT_EQ(f.dog.poll(), 0u);
  EXPECT_NE(second->message.find("all_gather #1 did not complete"), std::string::npos) << second->message;
  EXPECT_EQ(first->failed, 0);
  EXPECT_EQ(first->completed, 1);
}

TEST(Watchdog, AnAsynchronousErrorFailsEverythingAtOnce) {
  Fixture f;
  auto op = f.issue(*f.a, "broadcast #2", 2);
  auto other = f.issue(*f.b, "recv #0", 0);
  f.b->error = "unhandled system error (run with NCCL_DEBUG=INFO for details)";
  EXPECT_EQ(f.dog.poll(), 0u);
  for (auto* o : {op.get(), other.get()}) {
    EXPECT_EQ(o->failed, 1);
    EXPECT_NE(o->message.find("unhandled system error"), std::string::npos) << o->message;
  }
  EXPECT_EQ(f.a->aborts, 1);
  EXPECT_EQ(f.b->aborts, 1);
  EXPECT_NE(f.dog.failure().find("asynchronous error"), std::string::npos);
}

TEST(Watchdog, AfterAFailureNewWorkFailsWithTheFirstError) {
  Fixture f;
  f.issue(*f.a, "all_gather #0", 0);
  f.now += 2s;
  f.dog.poll();
  const std::string first = f.dog.failure();
  ASSERT_FALSE(first.empty());
  auto late = f.issue(*f.b, "all_gather #1", 1);
  EXPECT_EQ(late->failed, 1);
  EXPECT_EQ(late->message, first);
}

TEST(Watchdog, AForgottenCommunicatorIsNotWatched) {
  Fixture f;
  auto op = f.issue(*f.a, "all_gather #0", 0);
  f.dog.forget(f.a.get());
  f.a->error = "gone";
  f.now += 5s;
  EXPECT_EQ(f.dog.poll(), 0u);
  EXPECT_EQ(op->failed, 0);
  EXPECT_EQ(f.a->aborts, 0);
  EXPECT_TRUE(f.dog.failure().empty());
}

TEST(Watchdog, MissingRanksAreNamedFromWhatEachIssued) {
  // #4 is the fifth operation: a rank that issued 5 has issued it.
  EXPECT_EQ(describe_missing(4, {5, 5, 5}, {0, 1, 2}), "");
  EXPECT_EQ(describe_missing(4, {5, 4, std::nullopt, 0}, {8, 9, 10, 11}),
            "rank(s) [9, 10, 11] never issued it (rank 9 issued up to #3; rank 10 never reported; "
            "rank 11 issued nothing)");
}

// An abort ends the operations on the device: their end events fire before the
// watchdog has failed them. Every operation is doomed before any communicator is
// aborted, so that a waiter looking in between (NcclWork::is_completed) cannot
// take the fired event for success; the failure comes after.
TEST(Watchdog, DoomsEveryOperationBeforeItAbortsACommunicator) {
  Fixture f;
  auto op1 = f.issue(*f.a, "all_reduce #4", 4);
  auto op2 = f.issue(*f.b, "all_gather #2", 2);
  int aborts_seen_undoomed = 0;
  for (auto* comm : {f.a.get(), f.b.get()}) {
    comm->on_abort = [&] {
      aborts_seen_undoomed += (op1->doomed && op2->doomed) ? 0 : 1;
      EXPECT_EQ(op1->failed + op2->failed, 0) << "failing releases tensors the device may still use";
      op1->on_device = op2->on_device = true;  // the abort fires the end events
    };
  }
  f.now += 1001ms;
  EXPECT_EQ(f.dog.poll(), 0u);
  EXPECT_EQ(f.a->aborts + f.b->aborts, 2);
  EXPECT_EQ(aborts_seen_undoomed, 0);
  EXPECT_EQ(op1->failed, 1);
  EXPECT_EQ(op2->failed, 1);
  EXPECT_EQ(op1->completed + op2->completed, 0);
}

}  // namespace watchdog_test
}  // namespace zeroshard::comm
