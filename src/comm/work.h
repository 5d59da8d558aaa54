// work.h — OpWork, the Work returned by every communicator operation.
//
// An OpWork is created when an operation is issued, executed later by the
// communicator's thread, and finished exactly once (complete() or fail()).
// It keeps the operation's tensors alive until it is finished. Thread-safe:
// mu_ guards done_, error_ and progress_.
#pragma once

#include "zeroshard/comm.h"

#include <ATen/ATen.h>

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

namespace zeroshard::comm {

// The error of an operation (`what`: "all_gather #12 on rank 0 of 4", "split")
// that did not run because the communicator had failed: the earlier failure
// first, as it is the cause a person needs, then what was not run.
std::string not_run_after(const std::string& earlier, const std::string& what);

class OpWork : public Work {
 public:
  // `name` reads like "all_gather #12 on rank 0 of 4"; it prefixes every error.
  OpWork(OpKind kind, uint64_t seq, std::string name, std::vector<at::Tensor> tensors);

  void wait(std::chrono::milliseconds timeout = kDefaultTimeout) override;
  bool is_completed() override;

  void complete();
  void fail(const std::string& message);
  // Fails an operation that never ran because the communicator failed before
  // it: the error reads as not_run_after(earlier, name()).
  void fail_after(const std::string& earlier);
  // What the operation is waiting for right now, for a wait() that times out.
  void set_progress(std::string progress);

  OpKind kind() const { return kind_; }
  uint64_t seq() const { return seq_; }
  const std::string& name() const { return name_; }
  const std::vector<at::Tensor>& tensors() const { return tensors_; }

  // Operation parameters, written once before the work is queued.
  ReduceOp reduce_op = ReduceOp::kSum;
  int peer = -1;  // root for broadcast, dst/src for send/recv

 private:
  void set_failed(std::string error);  // once: later completions and failures are ignored

  const OpKind kind_;
  const uint64_t seq_;
  const std::string name_;
  std::vector<at::Tensor> tensors_;  // released when finished

  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;         // guarded by mu_
  std::string error_;         // guarded by mu_; empty on success
  std::string progress_;      // guarded by mu_
};

// The stream work on `device` is queued on now: CUDA's current stream of that
// device; for the CPU a placeholder (Work::block on it waits on the host).
c10::Stream current_stream(c10::Device device);

// Makes what the caller queues next on `device` come after `work`:
// Work::block on the current stream (a host wait for a CPU communicator).
// Before an operation's output is used, and before its input is written again.
void block_current(Work& work, c10::Device device);

}  // namespace zeroshard::comm
