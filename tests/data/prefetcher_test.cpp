// Prefetcher: batches come out in draw order whatever order the workers
// finish in, draws happen one at a time in order, at most `ahead` batches
// are drawn before the one taken, errors reach the consumer, and a consumer
// that outruns the builders is seen waiting.
#include <zeroshard/prefetcher.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
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

TEST(Prefetcher, ADrawOrBuildErrorReachesTheConsumerAtItsBatch) {
  Prefetcher<int, int> builds([n = 0]() mutable { return n++; },
                              [](const int& n) {
                                if (n == 3) throw std::runtime_error("batch 3 cannot be read");
                                return n;
                              });
  for (int k = 0; k < 3; ++k) EXPECT_EQ(builds.next(), k);
  EXPECT_THROW(
      {
        try {
          builds.next();
        } catch (const std::runtime_error& e) {
          EXPECT_STREQ(e.what(), "batch 3 cannot be read");
          throw;
        }
      },
      std::runtime_error);
  Prefetcher<int, int> draws([n = 0]() mutable {
                               if (n == 2) throw std::runtime_error("the sampler ran out");
                               return n++;
                             },
                             [](const int& n) { return n; });
  EXPECT_EQ(draws.next(), 0);
  EXPECT_EQ(draws.next(), 1);
  EXPECT_THROW(draws.next(), std::runtime_error);
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
