// The NCCL communicator's host logic against a simulated NCCL (fake_nccl.h):
// ranks as threads, host memory as the device, in every build. What NCCL
// forbids (two threads on one communicator, a call after destroy, a launch
// while the last one is in progress, an event of another device) is recorded
// by the simulation, and every test asserts that nothing was.
#include "comm/fake_nccl.h"
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl_checks.h"
#include "comm/work.h"
#include "test_util.h"

#include <c10/core/StorageImpl.h>
#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <thread>

namespace zeroshard::testing {
namespace {

using comm::nccl::make_nccl_communicator;

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += "\n  " + l;
  return s;
}

// body(rank, nccl, cpu) on `world` thread ranks, each with its simulated-NCCL
// communicator (`options`) on device `rank` beside a CPU one (30 s timeout);
// returns each rank's error ("" if none).
std::vector<std::string> run_nccl_ranks(int world, FakeNccl& fake, CommOptions options,
                                        const std::function<void(int, Communicator&, Communicator&)>& body) {
  const int port = free_port();
  return run_ranks(world, [&](int rank) {
    CommOptions cpu_options;  // the control plane outlives the NCCL timeouts the tests provoke
    cpu_options.timeout = std::chrono::seconds(30);
    auto cpu = init_communicator(thread_env(rank, world, port), cpu_options);
    auto* tcp = dynamic_cast<comm::TcpCommunicator*>(cpu.get());
    auto nccl = make_nccl_communicator(fake, *tcp, c10::Device(c10::kCPU), rank, options);
    body(rank, *nccl, *cpu);
  });
}

CommOptions short_timeout(int ms) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(ms);
  o.rendezvous_timeout = std::chrono::seconds(30);
  return o;
}

TEST(NcclHost, CollectivesAtThreeRanksEqualTheirClosedForms) {
  FakeNccl fake;
  const auto errors = run_nccl_ranks(3, fake, short_timeout(30000), [](int, Communicator& nccl, Communicator&) {
    check_collectives(nccl);
    EXPECT_EQ(nccl.stats().by_kind.at(OpKind::kAllReduce).calls, 3);  // two, and the barrier's
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_TRUE(fake.violations().empty()) << joined(fake.violations());
}

// Each channel's first launch waits for the peer's, and every launch is "in
// progress" for a few polls: an operation queued again on each retry would be
// sent twice, and the replies would stop matching.
TEST(NcclHost, PingPongOfAThousandMixedSizes) {
  FakeNccl::Options o;
  o.launch_polls = 3;
  FakeNccl fake(o);
  std::atomic<int> wrong{0};
  const auto errors = run_nccl_ranks(2, fake, short_timeout(30000), [&](int, Communicator& nccl, Communicator&) {
    wrong += ping_pong(nccl, 1000);
    EXPECT_EQ(nccl.stats().by_kind.at(OpKind::kSend).calls, 1000);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(fake.launches(), 4000);  // every send and recv launched exactly once
  EXPECT_TRUE(fake.violations().empty()) << joined(fake.violations());
}

// Both ranks send first: a launch waiting for its peer must not hold up the
// other direction's (which the peer's launch waits for).
TEST(NcclHost, SendsAndRecvsPostedInBothDirectionsAtOnce) {
  FakeNccl fake;
  std::atomic<int> wrong{0};
  const auto errors = run_nccl_ranks(2, fake, short_timeout(20000), [&](int, Communicator& nccl, Communicator&) {
    wrong += exchange_both_ways(nccl, 50);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_TRUE(fake.violations().empty()) << joined(fake.violations());
}

TEST(NcclHost, ARankThatSkipsAnOperationIsNamedWithinTheTimeout) {
  FakeNccl fake;
  std::vector<std::string> seen(3);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_nccl_ranks(3, fake, short_timeout(1000), [&](int rank, Communicator& nccl, Communicator& cpu) {
    seen[static_cast<size_t>(rank)] = skip_an_operation(nccl);
    cpu.barrier();  // rank 0 serves the store the others' errors read (each rank's count)
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(seen[r].find("all_reduce #1 on rank " + std::to_string(r) + " of 3"), std::string::npos) << seen[r];
    EXPECT_NE(seen[r].find("did not complete within 1000 ms"), std::string::npos) << seen[r];
    EXPECT_NE(seen[r].find("rank(s) [2] never issued it"), std::string::npos) << seen[r];
  }
  EXPECT_LT(seconds, 20.0) << "the timeout is 1 s";
  EXPECT_GE(fake.aborts(), 2) << "the waiting ranks abort their communicators";
  EXPECT_TRUE(fake.violations().empty()) << joined(fake.violations());
}

TEST(NcclHost, SplitGivesMembersACommunicatorAndOthersNone) {
  FakeNccl fake;
  const auto errors = run_nccl_ranks(3, fake, short_timeout(30000), [](int rank, Communicator& nccl, Communicator&) {
    auto part = nccl.split({0, 2});
    EXPECT_EQ(part != nullptr, rank != 1);
    if (part) {
      EXPECT_EQ(part->rank(), rank / 2);
      EXPECT_EQ(part->size(), 2);
      auto t = at::full({5}, static_cast<float>(rank + 1));
      part->all_reduce(t, ReduceOp::kSum)->wait();
      EXPECT_TRUE(at::equal(t, at::full({5}, 4.0f))) << "ranks 0 and 2 hold 1 and 3";
    }
    auto dup = nccl.dup();  // every rank: a communicator of its own, concurrently with the parent
    auto a = at::full({3}, 1.0f), b = at::full({3}, 2.0f);
    auto wa = nccl.all_reduce(a, ReduceOp::kSum);
    auto wb = dup->all_reduce(b, ReduceOp::kSum);
    wb->wait();
    wa->wait();
    EXPECT_TRUE(at::equal(a, at::full({3}, 3.0f)) && at::equal(b, at::full({3}, 6.0f)));
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_TRUE(fake.violations().empty()) << joined(fake.violations());
}

// A launch NCCL never finishes: block() (which waits until the operation is
// launched) must end with the watchdog's error, never hang, and the
// communicator is aborted. Repeated: a wakeup lost between block()'s check and
// its wait would hang one of them.
TEST(NcclHost, ALaunchThatNeverEndsFailsBlockAndAbortsTheCommunicator) {
  FakeNccl::Options o;
  o.launches_never_end = true;
  for (int round = 0; round < 10; ++round) {
    FakeNccl fake(o);
    std::vector<std::string> seen(2);
    const auto errors = run_nccl_ranks(2, fake, short_timeout(150), [&](int rank, Communicator& nccl, Communicator&) {
      auto t = at::ones({4});
      auto work = nccl.all_reduce(t, ReduceOp::kSum);
      seen[static_cast<size_t>(rank)] = error_of([&] { work->block(comm::current_stream(t.device())); });
    });
    for (const auto& e : errors) ASSERT_EQ(e, "");
    for (const auto& s : seen) {
      ASSERT_NE(s.find("did not complete within 150 ms"), std::string::npos) << "round " << round << ": " << s;
    }
    ASSERT_GE(fake.aborts(), 2) << "round " << round;
    ASSERT_TRUE(fake.violations().empty()) << joined(fake.violations());
  }
}

// An operation still in flight when its communicator is destroyed keeps its
// tensors until NCCL has flushed or aborted the communicator, then fails.
TEST(NcclHost, DestroyKeepsInFlightTensorsUntilTheCommunicatorIsClosed) {
  FakeNccl::Options o;
  o.lazy_connect = false;  // the launch ends at once: the operation waits on the stream, for rank 1
  FakeNccl fake(o);
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
  std::atomic<int> alive_at_teardown{0}, teardowns{0};
  fake.on_teardown([&](const std::string& call) {
    if (call == "finalize") return;
    ++teardowns;
    if (storage && !storage->expired()) ++alive_at_teardown;
  });
  std::string error;
  const auto errors = run_nccl_ranks(2, fake, short_timeout(300), [&](int rank, Communicator& nccl, Communicator& cpu) {
    if (rank == 0) {
      auto t = at::ones({1 << 16});
      storage.emplace(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl()));
      auto work = nccl.all_reduce(t, ReduceOp::kSum);  // rank 1 never issues it
      (void)work;  // dropped with t: only the communicator holds them now
    }
    cpu.barrier();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(teardowns.load(), 2) << "each rank destroys or aborts its one communicator";
  EXPECT_GE(alive_at_teardown.load(), 1) << "rank 0's tensor was freed before its communicator was closed";
  ASSERT_TRUE(storage.has_value());
  EXPECT_TRUE(storage->expired()) << "the tensor outlived its communicator";
  EXPECT_TRUE(fake.violations().empty()) << joined(fake.violations());
}

// Closing a communicator that cannot flush (rank 1 never issues its operation)
// takes up to its timeout; meanwhile another communicator of the same device
// launches and completes its operations: the close does not hold the device's
// one issue thread.
TEST(NcclHost, ClosingOneCommunicatorDoesNotStallAnotherOnTheSameDevice) {
  FakeNccl::Options o;
  o.lazy_connect = false;  // the launch ends at once: the operation waits on the stream, for rank 1
  FakeNccl fake(o);
  std::atomic<bool> flushing{false};
  fake.on_teardown([&](const std::string& call) {
    if (call == "finalize") flushing = true;
  });
  std::atomic<bool> other_done{false}, done_while_closing{false};
  const auto errors = run_nccl_ranks(2, fake, short_timeout(3000), [&](int rank, Communicator& nccl, Communicator& cpu) {
    auto* tcp = dynamic_cast<comm::TcpCommunicator*>(&cpu);
    auto stuck = make_nccl_communicator(fake, *tcp, c10::Device(c10::kCPU), rank, short_timeout(3000));
    auto t = at::ones({1 << 10});
    std::thread closer;
    if (rank == 0) {
      auto work = stuck->all_reduce(t, ReduceOp::kSum);  // rank 1 never issues it: the close cannot flush
      (void)work;
      closer = std::thread([&] {
        stuck.reset();
        done_while_closing = other_done.load();
      });
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!flushing && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ASSERT_TRUE(flushing) << "the close never reached its flush";
    }
    cpu.barrier();  // rank 0's stuck communicator is flushing now
    auto x = at::ones({64});
    nccl.all_reduce(x, ReduceOp::kSum)->wait();
    EXPECT_TRUE(x.eq(2).all().item<bool>());
    if (rank == 0) {
      other_done = true;
      closer.join();
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_TRUE(done_while_closing) << "the other communicator's all_reduce waited for the close to end";
  EXPECT_TRUE(fake.violations().empty()) << joined(fake.violations());
}

// A task on the issue thread that throws (here: making a channel's unique id)
// fails the operations it was launching, with the cause; the process goes on.
TEST(NcclHost, AnExceptionInAPostedTaskFailsItsWorks) {
  FakeNccl::Options o;
  o.unique_ids_before_throw = 1;  // the communicator's own id; the channel's throws
  FakeNccl fake(o);
  std::string seen;
  const auto errors = run_nccl_ranks(2, fake, short_timeout(30000), [&](int rank, Communicator& nccl, Communicator& cpu) {
    if (rank == 0) seen = error_of([&] { nccl.send(at::ones({3}), 1)->wait(); });
    cpu.barrier();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_NE(seen.find("send #0 on rank 0 of 2"), std::string::npos) << seen;
  EXPECT_NE(seen.find("unique_id failed (simulated)"), std::string::npos) << seen;
  EXPECT_TRUE(fake.violations().empty()) << joined(fake.violations());
}

// Operations issued from two threads of each rank on a communicator and its
// dup, one of them held back long enough for the watchdog to poll (every
// 100 ms) while it is in flight: the watchdog's questions to NCCL go through
// the issue thread like everything else.
TEST(NcclHost, EveryNcclCallOnACommunicatorComesFromOneThread) {
  FakeNccl fake;
  const auto errors = run_nccl_ranks(2, fake, short_timeout(30000), [&](int rank, Communicator& nccl, Communicator&) {
    auto dup = nccl.dup();
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(350));
    std::thread other([&] {
      for (int i = 0; i < 50; ++i) {
        auto t = at::ones({16});
        dup->all_reduce(t, ReduceOp::kSum)->wait();
      }
    });
    for (int i = 0; i < 50; ++i) {
      auto t = at::ones({16});
      nccl.all_reduce(t, ReduceOp::kSum)->wait();
    }
    other.join();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_TRUE(fake.violations().empty()) << joined(fake.violations());
}

TEST(NcclHost, VersionMismatchNamesBothVersions) {
  EXPECT_EQ(comm::nccl::version_string(22809), "2.28.9");
  EXPECT_EQ(comm::nccl::version_string(23007), "2.30.7");
  EXPECT_EQ(comm::nccl::version_mismatch(23007, 23001), "") << "patch levels may differ";
  const std::string m = comm::nccl::version_mismatch(22809, 23007);
  EXPECT_NE(m.find("NCCL 2.28.9 is loaded"), std::string::npos) << m;
  EXPECT_NE(m.find("against NCCL 2.30.7"), std::string::npos) << m;
}

}  // namespace
}  // namespace zeroshard::testing
