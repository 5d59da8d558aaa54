// issue_thread.h — the one host thread that makes every NCCL call for a device.
//
// NCCL requires that the communicators of one device launch their operations
// in the same order on every rank, and (before 2.26's implicit launch order)
// from one thread. Operations reach a communicator from several threads (the
// trainer's, autograd's device thread running gradient hooks), so each device
// has one IssueThread: tasks run on it in the order they were posted.
//
// A task returns true when done; false means "not yet" (a communicator whose
// launch NCCL is still working on, a channel whose peer has not arrived): it is
// run again after the tasks posted since, so it holds up nothing. A task that
// throws is dropped with an error in the log; tasks catch what their works
// must see (the thread itself never ends on an exception).
//
// Thread-safety: post() and run() from any thread. The thread lives as long as
// the process (of() returns a static), and is joined at exit.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace zeroshard::comm::nccl {

class NcclApi;

class IssueThread {
 public:
  using Task = std::function<bool()>;

  // The thread of device `device` of `api` (created on first use; it makes
  // `device` current before its first task).
  static IssueThread& of(NcclApi& api, int device);

  IssueThread(NcclApi& api, int device);
  ~IssueThread();
  IssueThread(const IssueThread&) = delete;
  IssueThread& operator=(const IssueThread&) = delete;

  void post(Task task);
  // Posts `fn` and waits for it; rethrows what it threw.
  void run(const std::function<void()>& fn);

 private:
  void loop();

  NcclApi& api_;
  const int device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;    // guarded by mu_
  std::deque<Task> retries_;  // used by the thread only: tasks that said "not yet"
  bool stopping_ = false;     // guarded by mu_
  std::thread thread_;        // owned and joined by this object
};

}  // namespace zeroshard::comm::nccl
