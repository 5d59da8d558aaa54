// comm_state.h — one NCCL communicator as its issue thread and its watchdog
// see it, the work of one operation, and point-to-point channels.
//
// Every NCCL call on a communicator is made by its device's IssueThread, the
// watchdog's included: the watchdog never calls NCCL, it posts a probe (one at
// a time) and reads what the probes and launches found. Operations wait in the
// communicator's queue and are launched one at a time in issue order; while
// NCCL is still launching one (a non-blocking communicator says "in
// progress", e.g. while it connects to a peer), the queue's pump task yields
// and the issue thread serves other communicators, so a launch waiting for a
// peer holds up no other communicator of the device.
//
// Thread-safety: members marked "issue thread" are used on that thread only;
// mu_ guards the failure texts; the rest is atomic or immutable.
#pragma once

#include "comm/nccl/issue_thread.h"
#include "comm/nccl/nccl_api.h"
#include "comm/tcp_communicator.h"
#include "comm/watchdog.h"
#include "comm/work.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace zeroshard::comm::nccl {

using Clock = std::chrono::steady_clock;

// An operation's work: its tensors, its ready event (recorded on the caller's
// stream when issued; the operation waits for it) and its end event (recorded
// on the communicator's stream after the launch).
class NcclWork final : public OpWork, public WatchedOp {
 public:
  NcclWork(NcclApi& api, int device, OpKind kind, uint64_t seq, std::string name, std::vector<at::Tensor> tensors,
           std::function<std::string()> missing);
  ~NcclWork() override;
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;

  EventHandle ready() const { return ready_; }
  EventHandle end() const { return end_; }
  // The end event is recorded: block() may make streams wait for it.
  void mark_issued();

  // WatchedOp
  const std::string& name() const override { return OpWork::name(); }
  bool finished_on_device() override;  // also true once the device reported an error (complete() fails then)
  void complete() override;  // nothing once doomed
  void fail(const std::string& message) override;
  void doom() override;
  std::string missing_ranks() override { return missing_ ? missing_() : ""; }

  // Work
  bool is_completed() override;
  void wait(std::chrono::milliseconds timeout) override;
  void block(c10::Stream stream) override;

 private:
  NcclApi& api_;
  const int device_;
  const std::function<std::string()> missing_;
  EventHandle ready_ = nullptr, end_ = nullptr;
  std::mutex issue_mu_;
  std::condition_variable issue_cv_;
  bool issued_ = false;        // guarded by issue_mu_: end_ is recorded
  bool failed_ = false;        // guarded by issue_mu_: fail() was called
  std::string device_error_;   // guarded by issue_mu_: what the end event's query reported
  // Completion and doom exclude each other: a waiter that finds the end event fired
  // completes only if the watchdog has not begun failing the operation.
  std::mutex complete_mu_;
  bool doomed_ = false;        // guarded by complete_mu_
  void complete_locked();      // with complete_mu_ held and not doomed
};

// Enqueues the operation on (comm, stream); kInProgress while NCCL launches it.
using IssueFn = std::function<Status(CommHandle, StreamHandle)>;

struct PendingOp {
  std::shared_ptr<NcclWork> work;
  IssueFn issue;
};

class CommState final : public WatchedComm, public std::enable_shared_from_this<CommState> {
 public:
  CommState(NcclApi& api, IssueThread& issuer, int device, int rank, int size, TcpCommunicator::Meeting meeting);
  ~CommState() override;
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;

  // WatchedComm (any thread; no NCCL call).
  std::string async_error() override;
  void abort(const std::string& why) override;
  void heartbeat() override;

  // Who never issued collective #seq: every rank's last published count.
  std::string missing_ranks(uint64_t seq);
  std::string failed() const;
  void set_failure(const std::string& why);

  // --- Issue thread only.
  // Launches queued operations in order until the queue is empty (true) or
  // NCCL is still launching one (false: call again later).
  bool pump();
  // Fails the queued operations and the one being launched with `why`.
  void fail_queue(const std::string& why);
  // Aborts the NCCL communicator now (why: the failure for later operations).
  void abort_now(const std::string& why);
  // Waits for a non-blocking call on the communicator (init, split, finalize)
  // to end; kInProgress when `timeout` passed first.
  Status settle(std::chrono::milliseconds timeout);
  // One step of closing: launches what is queued (through `pump`: this
  // state's, or its channel's), flushes (finalize) and destroys the
  // communicator, all by `deadline`, or aborts it if it failed or does not
  // flush in time; then fails what was never launched and destroys its stream.
  // Later operations fail. Returns false while a launch or the flush is under
  // way: the caller's task returns "not yet", and the issue thread runs the
  // other communicators' tasks before this one looks again. Once it returned
  // true, `clean` says whether the communicator was flushed and destroyed
  // (true) or aborted (false).
  bool close_step(Clock::time_point deadline, const std::function<bool()>& pump, bool& clean);

  NcclApi& api;
  IssueThread& issuer;
  const int device, rank, size;
  const TcpCommunicator::Meeting meeting;
  CommHandle comm = nullptr;        // issue thread
  StreamHandle stream = nullptr;    // owned; made by the constructor, destroyed by close()
  std::deque<PendingOp> queue;      // issue thread: posted, not yet launched
  bool pumping = false;             // issue thread: a pump task is scheduled
  bool closed = false;              // issue thread: close() ran
  std::atomic<bool> aborted{false};
  std::atomic<uint64_t> issued{0};  // operations issued on the host

 private:
  void launched(PendingOp& op);
  void probe();

  PendingOp launching_;             // issue thread: NCCL is launching it
  enum class Closing { kLaunching, kFlushing } closing_ = Closing::kLaunching;  // issue thread: close_step's
  std::atomic<bool> probing_{false};
  uint64_t published_ = UINT64_MAX;  // the watchdog's thread only
  Clock::time_point published_at_{};
  void publish(uint64_t n);
  mutable std::mutex mu_;
  std::string failure_;             // guarded by mu_: why the communicator is unusable
  std::string async_failure_;       // guarded by mu_: an asynchronous error a probe found
};

// Queues `op` on `state` and makes sure a pump task runs: `pump` (issue
// thread) returns true when it has nothing more to do. An op is queued exactly
// once however often the pump is retried; one pump task per communicator.
void post_op(const std::shared_ptr<CommState>& state, PendingOp op, std::function<bool()> pump);

// One direction between two ranks: a 2-rank NCCL communicator made on first
// use, its unique id published by the sender through the store.
struct Channel {
  std::shared_ptr<CommState> state;
  bool sender = false;
  std::string id_key;
  enum class Phase { kNew, kIniting, kReady } phase = Phase::kNew;  // issue thread
  std::atomic<bool> arrived{false};  // the peer published or fetched the id

  // Issue thread: advances the creation; kOk once ready.
  Status connect();
  // Issue thread: connect, then launch what is queued (a pump for post_op).
  bool pump();
};

}  // namespace zeroshard::comm::nccl
