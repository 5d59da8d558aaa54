// nccl_api.h — NCCL and the CUDA runtime, as the NCCL communicator calls them.
//
// The communicator's host logic (its issue thread, per-communicator launch
// queues, point-to-point channels, watchdog, teardown) calls NCCL and CUDA only
// through NcclApi. That logic then compiles in every build and is tested
// without a GPU against a simulated NCCL (tests/comm/fake_nccl.h), with ranks
// as threads; the CUDA build's NcclApi (nccl_api.cpp) maps each call onto
// NCCL's C API and the CUDA runtime.
//
// Handles are opaque: a CommHandle is an ncclComm_t, a StreamHandle a
// cudaStream_t, an EventHandle a cudaEvent_t.
//
// Every call that touches a device names it, and the CUDA implementation makes
// that device current for the call: events, streams and waits are created and
// used on the communicator's device whatever the calling thread had current,
// and no thread binds a context on another GPU by accident.
//
// Thread-safety: NCCL allows one thread at a time on a communicator; the
// communicator makes every call on a CommHandle from its device's issue thread
// (issue_thread.h). The device calls (events, streams) are safe from any thread.
#pragma once

#include "zeroshard/comm.h"

#include <array>
#include <cstddef>
#include <string>

namespace zeroshard::comm::nccl {

using CommHandle = void*;
using StreamHandle = void*;
using EventHandle = void*;

// The 128 bytes of an ncclUniqueId.
using UniqueId = std::array<char, 128>;

// The outcome of a call. kInProgress: a non-blocking communicator is still
// working on it; async_error() says when it is done.
struct Status {
  enum Code { kOk, kInProgress, kError };
  Code code = kOk;
  std::string what;  // kError: the library's message (NCCL's error string and last error)

  static Status ok() { return {}; }
  static Status in_progress() { return {kInProgress, ""}; }
  static Status error(std::string what) { return {kError, std::move(what)}; }
  bool is_ok() const { return code == kOk; }
};

class NcclApi {
 public:
  virtual ~NcclApi() = default;

  // NCCL's version as NCCL_VERSION_CODE (major*10000 + minor*100 + patch): of
  // the library loaded at run time, and of the headers compiled against.
  virtual int runtime_version() = 0;
  virtual int header_version() = 0;

  // --- Communicators (non-blocking: kInProgress until async_error says otherwise).
  virtual Status unique_id(UniqueId* id) = 0;
  // Joins rank `rank` of `nranks` to the communicator of `id`, on `device`.
  virtual Status init_rank(CommHandle* comm, int nranks, const UniqueId& id, int rank, int device) = 0;
  // ncclCommSplit: members (one color) get *child; others pass member = false and get null.
  // *child is written when the split completes (async_error on the parent no longer "in
  // progress"), possibly from another thread: `child` must stay valid until then.
  virtual Status split(CommHandle parent, bool member, int key, CommHandle* child) = 0;
  // kOk once idle, kInProgress while a call is still running, kError once broken.
  virtual Status async_error(CommHandle comm) = 0;
  // Flushes what was issued (kInProgress until done), before destroy().
  virtual Status finalize(CommHandle comm) = 0;
  virtual void destroy(CommHandle comm) = 0;
  // Ends it now: operations in flight never finish. Usable in any state.
  virtual void abort(CommHandle comm) = 0;

  // --- Operations, enqueued on `stream`; counts are elements of `dtype`.
  // Sizes and in-place rules as zeroshard::Communicator's (comm.h).
  virtual Status all_gather(const void* in, void* out, size_t count, at::ScalarType dtype, CommHandle comm,
                            StreamHandle stream) = 0;
  // `count` is the size of `out`, one rank's slice of `in`.
  virtual Status reduce_scatter(const void* in, void* out, size_t count, at::ScalarType dtype, ReduceOp op,
                                CommHandle comm, StreamHandle stream) = 0;
  virtual Status all_reduce(void* data, size_t count, at::ScalarType dtype, ReduceOp op, CommHandle comm,
                            StreamHandle stream) = 0;
  virtual Status broadcast(void* data, size_t count, at::ScalarType dtype, int root, CommHandle comm,
                           StreamHandle stream) = 0;
  virtual Status send(const void* data, size_t count, at::ScalarType dtype, int peer, CommHandle comm,
                      StreamHandle stream) = 0;
  virtual Status recv(void* data, size_t count, at::ScalarType dtype, int peer, CommHandle comm,
                      StreamHandle stream) = 0;

  // --- The device.
  // Makes `device` the calling thread's current device (a thread that will make
  // calls for one device, once at its start).
  virtual void set_device(int device) = 0;
  // A stream of its own on `device`, of the highest priority, not synchronising
  // with the legacy default stream.
  virtual StreamHandle create_stream(int device) = 0;
  virtual void destroy_stream(StreamHandle stream, int device) = 0;
  // The caller's current stream on `device` (what LibTorch queues work on),
  // and the CUDA stream of a c10 stream of `device`.
  virtual StreamHandle current_stream(int device) = 0;
  virtual StreamHandle stream_of(const c10::Stream& stream, int device) = 0;
  // Events without timing, on `device`.
  virtual EventHandle create_event(int device) = 0;
  virtual void destroy_event(EventHandle event, int device) = 0;
  virtual Status record(EventHandle event, StreamHandle stream, int device) = 0;
  // Makes `stream` wait for `event`'s last record.
  virtual Status wait_event(StreamHandle stream, EventHandle event, int device) = 0;
  // kOk once everything queued before `event`'s last record has finished,
  // kInProgress before, kError when the device reports an error.
  virtual Status query(EventHandle event, int device) = 0;
};

// "NCCL 2.28.9 (headers 2.30.7): the library loaded is not the one compiled
// against; ..." when the major or minor versions differ, else "".
std::string version_mismatch(int runtime_version, int header_version);
// "2.28.9" from NCCL_VERSION_CODE.
std::string version_string(int version_code);

#ifdef ZS_WITH_CUDA
// NCCL and the CUDA runtime of this process (nccl_api.cpp).
NcclApi& cuda_nccl_api();
// Operations issued through cuda_nccl_api() by this process since it started.
struct IssuedCounts {
  int64_t collectives = 0;
  int64_t point_to_point = 0;
};
IssuedCounts cuda_nccl_issued();
#endif

}  // namespace zeroshard::comm::nccl
