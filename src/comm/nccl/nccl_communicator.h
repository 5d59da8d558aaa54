// nccl_communicator.h — the Communicator over NCCL: CUDA tensors on one device.
//
// How NCCL's rules are kept:
// - Every NCCL call for a device is made by its IssueThread, in the order the
//   operations were issued on the host.
// - Ordering by events, never a host sync: an operation waits on an event
//   recorded on the caller's current stream when it was issued, runs on the
//   communicator's own stream and records its end event. Work::block(stream)
//   makes a stream wait on that event; wait() waits on the host.
// - The operation's tensors stay referenced until the device has finished it.
// - Communicators are non-blocking. A watchdog (watchdog.h), shared by a
//   communicator and everything split from it, polls their asynchronous errors
//   and end events; on an error or a timeout it aborts all of them and names
//   the ranks that never issued the operation (each rank publishes how many
//   operations it issued to the rendezvous store, at most once a second).
// - send/recv are posted: each direction of each pair of ranks has its own
//   2-rank NCCL communicator (a channel), created on first use with its unique
//   id through the store, so a recv waiting for its sender holds up nothing.
// - split() is ncclCommSplit; the unique id of a new communicator travels
//   through the store.
//
// Thread-safety: as every Communicator. Control-plane traffic (flags, norms)
// stays on the CPU communicator this one was made beside (ProcessGroup).
#pragma once

#include "comm/tcp_communicator.h"
#include "comm/watchdog.h"
#include "zeroshard/comm.h"

#include <array>
#include <memory>
#include <string>

namespace zeroshard::comm::nccl {

// The NCCL unique id of a new communicator: rank 0 makes it (`make_id`,
// ncclGetUniqueId by default) and publishes it under `key`; the others wait for
// it (a timeout names rank 0). 128 bytes, as ncclUniqueId.
using UniqueId = std::array<char, 128>;
UniqueId exchange_unique_id(c10d::Store& store, const std::string& key, int rank,
                            std::chrono::milliseconds timeout, const std::function<UniqueId()>& make_id = nullptr);

// A communicator of CUDA tensors on `device` for the ranks of `cpu` (collective
// over them). Its unique id travels through cpu's rendezvous store.
std::shared_ptr<Communicator> make_nccl_communicator(TcpCommunicator& cpu, c10::Device device,
                                                     const CommOptions& options);

}  // namespace zeroshard::comm::nccl
