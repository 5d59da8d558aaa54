// host_copy.h — host copies of the tensors a checkpoint writes, from any device.
//
// A HostCopier is made on the thread that queued the work producing the
// tensors (the training thread): for each device it is given, it records an
// event on that device's current stream. copy() may run on another thread (the
// checkpoint writer): a CPU tensor is cloned; a device tensor is copied into
// pinned host memory on a side stream of its device that first waits for that
// event, so the copy sees everything queued before the snapshot and the
// training stream is never synchronized. finish() waits for the copies.
//
// The caller keeps what the training thread queues next from writing the
// source tensors until finish() has returned (the Checkpointer's fence before
// the next update). Thread-safety: one thread at a time.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>
#include <vector>

namespace zeroshard::ckpt {

class HostCopier {
 public:
  // Records the current stream's position of each device of `tensors` (undefined ones are skipped).
  explicit HostCopier(const std::vector<at::Tensor>& tensors);

  // A contiguous host copy of `t` (queued on the side stream for a device tensor).
  at::Tensor copy(const at::Tensor& t) { return copy(t, t.scalar_type()); }
  // The same, converted to `dtype`. On a device the conversion runs on the side
  // stream too, after the recorded position: never convert on the producer's
  // stream first (t.to(dtype) there would be queued after the position the
  // side stream waits for, and the copy could read it before it is written).
  at::Tensor copy(const at::Tensor& t, at::ScalarType dtype);
  // Waits until every copy of a device tensor has landed in host memory.
  void finish();

 private:
  struct Device {
    c10::Device device;
    std::unique_ptr<c10::Event> ready;   // recorded on the producer's current stream
      c10::optional<c10::Stream> side;     // made on first copy, waits for `ready`
  };
  Device& of(c10::Device device);
  std::vector<Device> devices_;
  std::vector<at::Tensor> sources_;      // device tensors being copied: alive until finish()
};

}  // namespace zeroshard::ckpt
