// nccl_communicator.h — the Communicator over NCCL: CUDA tensors on one device.
//
// How NCCL's rules are kept:
// - Every NCCL call for a device is made by its IssueThread (issue_thread.h),
//   the watchdog's queries included; a communicator's operations are launched
//   in the order they were issued on the host, one at a time (comm_state.h).
// - Ordering by events, never a host sync: an operation waits on an event
//   recorded on the caller's current stream when it was issued, runs on the
//   communicator's own stream and records its end event. Work::block(stream)
//   makes a stream wait on that event; wait() waits on the host.
// - The operation's tensors stay referenced until the device has finished it.
// - Communicators are non-blocking. A watchdog (watchdog.h), shared by a
//   communicator and everything split from it, polls their end events and
//   (through the issue thread) their asynchronous errors; on an error or a
//   timeout it aborts all of them and names the ranks that never issued the
//   operation (each rank publishes how many operations it issued to the
//   rendezvous store, at most once a second).
// - Several communicators on one device (a communicator, its dups, its
//   channels) launch independently: a launch NCCL is still working on holds
//   up only its own communicator. NCCL itself asks that the kernels of several
//   communicators on one device be issued in one order on every rank (without
//   NCCL_LAUNCH_ORDER_IMPLICIT). ZeRO-3's gathers and reductions run on two
//   communicators whose relative order can differ between ranks: that relies
//   on the GPU running both communicators' kernels at once (not yet seen on a
//   GPU; the constraint is NCCL's "Using multiple NCCL communicators
//   concurrently").
// - send/recv are posted: each direction of each pair of ranks has its own
//   2-rank NCCL communicator (a channel), created on first use with its unique
//   id through the store, so a recv waiting for its sender holds up nothing.
// - split() is ncclCommSplit; the unique id of a new communicator travels
//   through the store.
//
// Thread-safety: as every Communicator. Control-plane traffic (flags, norms)
// stays on the CPU communicator this one was made beside (ProcessGroup).
#pragma once

#include "comm/nccl/nccl_api.h"
#include "comm/tcp_communicator.h"
#include "zeroshard/comm.h"

#include <memory>
#include <string>

namespace zeroshard::comm::nccl {

// The NCCL unique id of a new communicator: rank 0 makes it (`make_id`) and
// publishes it under `key`; the others wait for it (a timeout names rank 0).
UniqueId exchange_unique_id(c10d::Store& store, const std::string& key, int rank,
                            std::chrono::milliseconds timeout, const std::function<UniqueId()>& make_id);

// A communicator of the ranks of `cpu` (collective over them) through `api` on
// its device `device_index`, moving tensors of `device` (cuda:device_index;
// the CPU for a simulated NCCL). Its unique id travels through cpu's
// rendezvous store. Logs NCCL's run-time version once per process, with a
// warning when it is not the headers'.
std::shared_ptr<Communicator> make_nccl_communicator(NcclApi& api, TcpCommunicator& cpu, c10::Device device,
                                                     int device_index, const CommOptions& options);

}  // namespace zeroshard::comm::nccl
