// payload.h — payloads (zeroshard/pipeline_payload.h) crossing a stage boundary.
//
// Nothing about shapes travels except a check: each message is a small int64
// header, naming the send that made it and describing its tensors, followed
// by the tensors, one transport message each, in order. A receive posts all
// of them at once (posted receives hold up nothing) and its wait() compares
// the header with what it expected before handing out the tensors, so a
// message that is not the one expected is an error naming both, never data
// silently taken for another microbatch's.
//
// Thread-safety: a PayloadRecv belongs to one thread.
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/pipeline_payload.h"
#include "zeroshard/pipeline_schedule.h"

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard::pipeline {

// Sends `payload` (made by the action `send`, SEND_F or SEND_B) to rank `dst`
// of `comm`: its header, then each tensor. The caller waits for every Work
// (or keeps them) before writing the tensors again.
std::vector<std::shared_ptr<Work>> send_payload(Communicator& comm, int dst, const Action& send, const Payload& payload);

// The posted receive of the payload the action `recv` (RECV_F or RECV_B)
// takes from rank `src` of `comm`, with the spec `expected`; its tensors are
// allocated on `comm.device()`.
class PayloadRecv {
 public:
  PayloadRecv(Communicator& comm, int src, const Action& recv, PayloadSpec expected);
  // Waits for the header and checks it (the sender's action and the spec),
  // then for the tensors; returns them.
  Payload wait();

 private:
  Action recv_;
  PayloadSpec expected_;
  int src_;
  at::Tensor header_;
  std::shared_ptr<Work> header_work_;
  Payload tensors_;
  std::vector<std::shared_ptr<Work>> works_;
};

}  // namespace zeroshard::pipeline
