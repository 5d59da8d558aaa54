// Prefetcher: batches come out in draw order whatever order the workers
// finish in, draws happen one at a time in order, at most `ahead` batches
// are drawn before the one taken, errors reach the consumer, and a consumer
// that outruns the builders is seen waiting.
#include <zeroshard/prefetcher.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

namespace zeroshard {
namespace prefetcher_test {

TEST(Prefetcher, HandsOutBatchesInDrawOrderWithinTheWindow) {
  std::atomic<int64_t> drawn{0}, taken{0}, max_ahead{0}, in_draw{0};
  std::atomic<bool> overlapped{false};
  PrefetchOptions o;
  o.threads = 3;
  o.ahead = 2;
  Prefetcher<int64_t, int64_t> p(
      [&] {
        if (in_draw.fetch_add(1) != 0) overlapped = true;
        const int64_t n = drawn++;
        max_ahead = std::max<int64_t>(max_ahead.load(), n - taken.load());
        in_draw.fetch_sub(1);
        return n;
      },
      [](const int64_t& n) {
        // Later batches finish first now and then: the workers' order is not the draw order.
        std::this_thread::sleep_for(std::chrono::microseconds((n * 7919) % 5 * 300));
        return n * n;
      },
      o);
  for (int64_t k = 0; k < 60; ++k) {
    EXPECT_EQ(p.next(), k * k);
    taken = k + 1;
  }
  EXPECT_FALSE(overlapped) << "two draws ran at once";
  // The batch taken, plus `ahead` more: the one being taken when a draw read `taken` counts too.
  EXPECT_LE(max_ahead.load(), o.ahead + 1);
  EXPECT_GE(drawn.load(), 60);
}

// What next() throws, run on a thread of its own: a call that has not
// returned within 20 s is a hang, which ends the test program (a hung next()
// cannot be abandoned).
std::string next_error(const std::function<void()>& next) {
  auto done = std::async(std::launch::async, [&]() -> std::string {
    try {
      next();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no error)";
  });
  if (done.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    std::fprintf(stderr, "Prefetcher::next() after an error blocked for 20 s\n");
    std::_Exit(1);
  }
  return done.get();
}

// The error comes at its batch, the batches before it come, and every next()
// after it rethrows it at once: no later batch, no wait.
TEST(Prefetcher, ADrawOrBuildErrorReachesTheConsumerAtItsBatch) {
  Prefetcher<int, int> builds([n = 0]() mutable { return n++; },
                              [](const int& n) {
                                if (n == 3) throw std::runtime_error("batch 3 cannot be read");
                                return n;
                              });
  for (int k = 0; k < 3; ++k) EXPECT_EQ(builds.next(), k);
  for (int again = 0; again < 3; ++again) {
    EXPECT_EQ(next_error([&] { builds.next(); }), "batch 3 cannot be read") << "call " << again;
  }
  Prefetcher<int, int> draws([n = 0]() mutable {
                               if (n == 2) throw std::runtime_error("the sampler ran out");
                               return n++;
                             },
                             [](const int& n) { return n; });
  EXPECT_EQ(draws.next(), 0);
  EXPECT_EQ(draws.next(), 1);
  for (int again = 0; again < 3; ++again) {
    EXPECT_EQ(next_error([&] { draws.next(); }), "the sampler ran out") << "call " << again;
  }
}

// worker() names the worker that runs a draw or build (for state of each
// worker's own): each of `threads` in turn, never another; -1 on the consumer.
TEST(Prefetcher, NamesTheWorkerRunningABuild) {
  PrefetchOptions o;
  o.threads = 3;
  using P = Prefetcher<int, int>;
  std::atomic<int> outside{0}, arrived{0};
  P p([n = 0]() mutable { return n++; },
      [&](const int& n) {
        if (n < 3) {  // the first three builds run at once, so on three workers
          ++arrived;
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while (arrived.load() < 3 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
        }
        const int w = P::worker();
        if (w < 0 || w >= 3) ++outside;
        return w;
      },
      o);
  std::set<int> seen;
  for (int i = 0; i < 60; ++i) seen.insert(p.next());
  EXPECT_EQ(outside.load(), 0);
  EXPECT_EQ(seen, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(P::worker(), -1);
}

TEST(Prefetcher, CountsTheConsumersWait) {
  PrefetchOptions o;
  o.threads = 1;
  Prefetcher<int, int> p([n = 0]() mutable { return n++; },
                         [](const int& n) {
                           std::this_thread::sleep_for(std::chrono::milliseconds(30));
                           return n;
                         },
                         o);
  EXPECT_EQ(p.next(), 0);  // built after the 30 ms that started with the constructor: waited for
  EXPECT_GE(p.waited_seconds(), 0.01);
}

}  // namespace prefetcher_test
}  // namespace zeroshard
