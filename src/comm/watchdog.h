// watchdog.h — watches a device communicator's operations in flight.
//
// A device communicator's operations finish on the device: nothing on the host
// learns that a peer never arrived unless something looks. The watchdog looks.
// Each poll() it asks every operation in flight whether the device finished it
// (its end event) and every communicator whether it failed (NCCL's async
// error). An error, or an operation in flight longer than the timeout, aborts
// every watched communicator (collectives cannot resynchronise, and a job with
// one broken group is broken) and fails all their work with one message naming
// the operation and the ranks that never issued it.
//
// The device is behind two small interfaces and the clock is a parameter, so
// the state machine is tested without a GPU (tests/comm/watchdog_test.cpp).
//
// Thread-safety: every method may be called from any thread (mu_ guards all state).
// The communicator's callbacks are called without mu_ held.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace zeroshard::comm {

// One operation as the watchdog sees it.
class WatchedOp {
 public:
  virtual ~WatchedOp() = default;
  // The operation's name for messages, e.g. "all_reduce #12 on rank 0 of 4".
  virtual const std::string& name() const = 0;
  // True once the device finished it (its end event fired).
  virtual bool finished_on_device() = 0;
  // Finishes the host side: success releases its tensors; failure makes
  // wait() throw `message`. Each is called at most once, and only one of them.
  virtual void complete() = 0;
  virtual void fail(const std::string& message) = 0;
  // Called before the watchdog aborts the communicators and fails the operation:
  // from then on it must not complete, since an abort ends it on the device too
  // (its end event fires) without its result.
  virtual void doom() {}
  // Which ranks never issued it, for the timeout's message, e.g.
  // "rank(s) [2] never issued it (rank 2 issued up to #10)"; "" if unknown.
  virtual std::string missing_ranks() = 0;
};

// A communicator as the watchdog sees it.
class WatchedComm {
 public:
  virtual ~WatchedComm() = default;
  // The communicator's asynchronous error ("" while healthy).
  virtual std::string async_error() = 0;
  // Aborts it: no operation in flight will finish; later ones fail with `why`.
  virtual void abort(const std::string& why) = 0;
  // Called on every poll: a communicator may publish its progress (rate-limited
  // by itself) so that other ranks' timeouts can name the missing ranks.
  virtual void heartbeat() = 0;
  // After abort(): returns once what abort() tells the peers (why, and whom to
  // blame) has gone out, or at `deadline`.
  virtual void wait_aborted(std::chrono::steady_clock::time_point deadline) { (void)deadline; }
};

// The timeout message's account of who is missing, from the number of
// operations each rank had issued when last heard of (nullopt: never heard of):
// "rank(s) [2, 3] never issued it (rank 2 issued up to #10; rank 3 never reported)".
// Ranks are named by `world_ranks[i]`; "" when every rank issued it.
std::string describe_missing(uint64_t seq, const std::vector<std::optional<uint64_t>>& issued,
                             const std::vector<int>& world_ranks);

class Watchdog {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;

  // Default clock: std::chrono::steady_clock::now.
  explicit Watchdog(std::chrono::milliseconds timeout, Clock clock = nullptr);

  // Watches `comm` (until forget()); its operations are added with watch().
  void add(std::shared_ptr<WatchedComm> comm);
  // Stops watching `comm`; returns its operations still in flight, which the
  // caller keeps (and with them their tensors) until the device is done with
  // them. A poll already under way may still look at them once.
  std::vector<std::shared_ptr<WatchedOp>> forget(const WatchedComm* comm);
  // Watches `op` of `comm` from now; after the watchdog has failed, fails it at once.
  void watch(WatchedComm* comm, std::shared_ptr<WatchedOp> op);

  // One look at everything: finished operations complete, an error or a
  // timeout fails everything. Returns the number still in flight.
  size_t poll();

  // Fails now with `why`, as a timeout would: aborts every watched communicator
  // and fails their operations. No-op once failed.
  void fail(const std::string& why);

  // Every watched communicator's wait_aborted(deadline).
  void wait_aborted(std::chrono::steady_clock::time_point deadline);

  // The first failure ("" while healthy): every later operation fails with it.
  std::string failure() const;
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  struct InFlight {
    WatchedComm* comm;
    std::shared_ptr<WatchedOp> op;
    std::chrono::steady_clock::time_point issued;
  };
  // Aborts every communicator and fails every operation with `why`.
  void fail_all(const std::string& why, std::vector<InFlight> in_flight);

  const std::chrono::milliseconds timeout_;
  const Clock clock_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<WatchedComm>> comms_;  // guarded by mu_
  std::vector<InFlight> in_flight_;                  // guarded by mu_; in issue order
  std::string failure_;                              // guarded by mu_
};

// A communicator and those made from it (its splits and dups; an NCCL one's
// channels): one watchdog, polled every 100 ms by a thread of its own, so that
// the first failure of any member aborts every member with one cause. Every
// family alive is known to the process's terminate handler (install_terminate_handler).
struct Family {
  // `timeout` bounds the operations watched (watch()); members that watch none
  // (the TCP transport times its own) share fate only.
  explicit Family(std::chrono::milliseconds timeout);
  ~Family();
  Family(const Family&) = delete;
  Family& operator=(const Family&) = delete;
  Watchdog dog;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // guarded by mu_
  std::thread poller_;     // owned and joined by this object
};

// When the process ends by std::terminate (an exception nobody caught, say),
// its sockets would close with no word of why, and peers would blame this rank
// for a bare end of stream. The handler this installs (once per process; later
// calls only update `error_file`) first fails every family alive with the
// exception's message (their peers read it, and whom to blame) and waits up to a
// second for that to go out; before that it prints the message and records it in
// `error_file` (torchelastic's, "" for none), so its moment precedes the peers'
// errors. Then it calls the handler installed before it.
void install_terminate_handler(const std::string& error_file);

}  // namespace zeroshard::comm
