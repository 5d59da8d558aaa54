// staged_communicator.h — a communicator of device tensors that moves them
// through host memory over a CPU communicator (stage_through_host in comm.h).
//
// What it is for: several ranks on one GPU, which NCCL before 2.30 refuses, so
// that the multi-rank oracle tests run on CUDA tensors with one device; and any
// device without a collective library of its own. Its speed is the host
// copies' and the CPU transport's.
//
// Each operation, when issued, copies its input to a host buffer (a blocking
// copy, so it waits for the work queued before it on the current stream) and
// issues the same operation on the CPU communicator. Its result lands on the
// device when the Work is waited on: wait() copies it on the device's current
// stream, block(stream) on `stream`. Until then the output tensor is unchanged.
//
// Thread-safety: as every Communicator; a Work lands its result once, whichever
// thread waits first.
#pragma once

#include "zeroshard/comm.h"

#include <memory>

namespace zeroshard::comm {

std::shared_ptr<Communicator> make_staged_communicator(std::shared_ptr<Communicator> cpu, c10::Device device);

}  // namespace zeroshard::comm
