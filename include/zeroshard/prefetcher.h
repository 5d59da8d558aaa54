// zeroshard/prefetcher.h — a training loop's batches, built ahead on threads of
// their own, so the step never waits for data it could have had.
//
//   Prefetcher<Plan, Batch> loader(draw, build, options);
//   for (...) { Batch b = loader.next(); ... }
//
// `draw()` says what the next batch is (e.g. its sample indices from a sampler of the loader's
// own) and is called in batch order, one call at a time; `build(plan)` makes the batch (reads,
// padding, pinned host tensors) on `threads` workers at once, at most `ahead` batches before the
// one next() returns. next() hands the batches out in draw order and blocks only when the next
// one is not built yet.
// Thread-safety: draw and build run on the workers, and build must be thread-safe; next() is
// for one thread, the consumer. Ownership: the Prefetcher owns its workers; the destructor
// stops and joins them (batches not handed out are dropped).
// Errors: an exception from draw or build is rethrown by the next() that would have returned
// its batch, and ends the stream: nothing is drawn after it, and every later next() rethrows
// the same error at once. Used by: docs/bart.md ("Data").
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace zeroshard {

struct PrefetchOptions {
  int threads = 2;  // workers building batches. Default: 2
  int ahead = 4;    // batches built before the one the consumer takes. Default: 4
};

template <typename Plan, typename Batch>
class Prefetcher {
 public:
  Prefetcher(std::function<Plan()> draw, std::function<Batch(const Plan&)> build, PrefetchOptions options = {})
      : draw_(std::move(draw)), build_(std::move(build)), ahead_(std::max(1, options.ahead)) {
    for (int t = 0; t < std::max(1, options.threads); ++t) {
      workers_.emplace_back([this, t] {
        worker_ = t;
        work();
      });
    }
  }
  ~Prefetcher() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The next batch, in draw order.
  Batch next() {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    if (ended_) std::rethrow_exception(ended_);
    cv_.wait(lock, [&] { return ready_.count(taken_) > 0; });
    auto slot = std::move(ready_.at(taken_));
    ready_.erase(taken_);
    ++taken_;
    waited_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (slot.error) {
      ended_ = slot.error;
      ready_.clear();  // batches built after it are not handed out
      std::rethrow_exception(slot.error);
    }
    lock.unlock();
    cv_.notify_all();  // room for one more
    return std::move(slot.batch);
  }

  // In draw() or build(): the index of the worker running it (0 .. threads - 1),
  // for state of each worker's own (a cache); -1 on any other thread.
  static int worker() { return worker_; }

  // Seconds next() has blocked, in all.
  double waited_seconds() const {
    std::lock_guard<std::mutex> lock(mu_);
    return waited_;
  }

 private:
  struct Slot {
    Batch batch{};
    std::exception_ptr error;
  };

  void work() {
    for (;;) {
      int64_t n = 0;
      Plan plan{};
      std::exception_ptr error;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || (!failed_ && drawn_ < taken_ + ahead_); });
        if (stop_) return;
        n = drawn_++;
        try {
          plan = draw_();  // in order: under the lock
        } catch (...) {
          error = std::current_exception();
          failed_ = true;  // nothing after a failed draw is drawn
        }
      }
      Slot slot;
      if (error) {
        slot.error = error;
      } else {
        try {
          slot.batch = build_(plan);
        } catch (...) {
          slot.error = std::current_exception();
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (slot.error) failed_ = true;  // nothing after a failed build is drawn either
        ready_.emplace(n, std::move(slot));
      }
      cv_.notify_all();
    }
  }

  static inline thread_local int worker_ = -1;
  std::function<Plan()> draw_;
  std::function<Batch(const Plan&)> build_;
  const int64_t ahead_;
  std::vector<std::thread> workers_;
  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::map<int64_t, Slot> ready_;
  int64_t drawn_ = 0, taken_ = 0;
  double waited_ = 0;
  bool stop_ = false, failed_ = false;  // failed_: a draw or build failed, so no more draws
  std::exception_ptr ended_;              // the error next() rethrew: every later next() rethrows it
};

}  // namespace zeroshard
