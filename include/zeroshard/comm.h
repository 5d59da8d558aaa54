// zeroshard/comm.h — the communicator: the collectives and point-to-point operations that
// sharding and pipelines run on, over TCP (CPU tensors) or NCCL (CUDA tensors).
//
//   auto comm = zeroshard::init_communicator();            // from the launcher's environment
//   comm->all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
//
// Every operation is asynchronous: it is queued, runs in issue order on the communicator's own
// thread and returns a Work. Ownership: the caller keeps every tensor passed to an operation
// alive and untouched until its Work's wait() returned (the Work holds a reference, but writing
// races). Matching: every rank issues the collectives in the same order with matching sizes and
// dtypes; a mismatch fails on every rank, naming it. Thread-safety: every method may be called
// from any thread; operations from several threads run in the order their calls returned.
// dtypes: float32, bfloat16, float16, float64, int32, int64.
// How it works: docs/communicator.md.
#pragma once

#include "zeroshard/dist_env.h"

#include <ATen/ATen.h>

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace zeroshard {

// What a reduction promises depends on the backend:
// - TCP (init_communicator; stage_through_host too): a fixed order (rank order, or ring order
//   for large operations: CommOptions::algorithm), so every rank, and every rerun at the same
//   world size, gets the same bits; 16-bit values accumulate in float32 and round once; integer
//   sums wrap in the element type but never overflow mid-sum; integer kAvg truncates toward
//   zero; kMax/kMin propagate a NaN held by any rank, as torch.maximum/minimum do.
// - NCCL (init_nccl): NCCL's own order, 16-bit values reduced in 16 bits: the ranks agree, but
//   may differ from TCP in the last bits (more for bf16 sums over many ranks).
enum class ReduceOp { kSum, kAvg, kMax, kMin };
std::string to_string(ReduceOp op);

enum class OpKind { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kSend, kRecv, kBarrier };
std::string to_string(OpKind kind);

// Means "the communicator's own timeout" wherever a timeout is taken.
constexpr std::chrono::milliseconds kDefaultTimeout{-1};

// Traffic of one operation kind since the communicator was created.
struct OpStats {
  int64_t calls = 0;
  int64_t bytes_sent = 0;      // payload bytes this rank sent
  int64_t bytes_received = 0;  // payload bytes this rank received
  int64_t control_bytes = 0;   // header bytes (size/dtype checks), sent + received
  double seconds = 0.0;        // time the communication thread spent executing
  OpStats& operator+=(const OpStats& other);
};

struct CommStats {
  std::map<OpKind, OpStats> by_kind;
  OpStats total() const;
  CommStats& operator+=(const CommStats& other);  // traffic of two communicators together
};

// A queued or running operation.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation completes. Throws its error: a c10::Error naming the operation,
  // its sequence number and the ranks that did not arrive. kDefaultTimeout: waits until the
  // operation ends (which itself fails after CommOptions::timeout); a shorter `timeout` throws
  // if it is not done by then.
  virtual void wait(std::chrono::milliseconds timeout = kDefaultTimeout) = 0;
  // True once the operation finished, successfully or not (wait() reports which).
  virtual bool is_completed() = 0;
  // Makes work queued later on `stream` wait for this operation without blocking the host
  // (a device communicator: an event). A communicator of CPU tensors has no stream: it waits.
  virtual void block(c10::Stream stream) {
    (void)stream;
    wait();
  }
};

struct CommOptions {
  // How long one operation waits for the other ranks before it fails, naming them.
  // Default: 5 minutes.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // How long creating a communicator (or a split) waits for every rank to join before it
  // fails, naming the missing ones. Default: 5 minutes.
  std::chrono::milliseconds rendezvous_timeout = std::chrono::minutes(5);
  // TCP: how long a peer may stay silent (idle connections carry heartbeats) before operations
  // waiting on it fail, naming it, and the family aborts (see abort()).
  // REQUIRES: longer than moving 512 KiB over the slowest link (4.2 s at 1 Mbit/s).
  // Default: 30 seconds.
  std::chrono::milliseconds liveness = std::chrono::seconds(30);
  // TCP: the algorithm of operations on 3 or more ranks whose largest per-rank slice holds
  // 64 KiB or more (smaller ones are pairwise). kAuto: a ring when the ranks span several
  // hosts; on one host a ring from 2 MiB slices, pairwise below. kRing, kPairwise: always that
  // one. Default: kAuto. docs/communicator.md compares them.
  enum class Algorithm { kAuto, kRing, kPairwise };
  Algorithm algorithm = Algorithm::kAuto;
};

// `size()` ranks connected. An argument that breaks a REQUIRES below throws at the call,
// naming the operation, the argument, what it got and what it needs.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where the tensors this communicator moves live (CPU for the TCP one).
  virtual c10::Device device() const = 0;

  // out = concatenation of every rank's `in`, in rank order.
  // REQUIRES: out.numel() == size() * in.numel(); same dtype and device; both contiguous;
  //           out does not overlap in, except in == the slice rank() of out (in place).
  virtual std::shared_ptr<Work> all_gather(at::Tensor out, at::Tensor in) = 0;

  // out = reduction over ranks of slice rank() of every rank's `in`
  // (slice r = elements [r*out.numel(), (r+1)*out.numel())).
  // REQUIRES: in.numel() == size() * out.numel(); same dtype and device; contiguous;
  //           out does not overlap in.
  virtual std::shared_ptr<Work> reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op) = 0;

  // t = reduction of every rank's t, in place. Any numel (no divisibility needed).
  virtual std::shared_ptr<Work> all_reduce(at::Tensor t, ReduceOp op) = 0;

  // t on every rank = t on `root`, in place. REQUIRES: same numel/dtype everywhere.
  virtual std::shared_ptr<Work> broadcast(at::Tensor t, int root) = 0;

  // Point to point, posted: neither waits for its peer on the communication thread, so a pair
  // may issue them in any order on either side (both recv-then-send completes), and a recv
  // whose sender has not arrived holds up no other operation. Sends and recvs between a pair
  // match in issue order, per direction. A completed send means its tensor may be reused, not
  // that `dst` has received it.
  // REQUIRES: the receiver's tensor has the sender's numel and dtype.
  virtual std::shared_ptr<Work> send(at::Tensor t, int dst) = 0;
  virtual std::shared_ptr<Work> recv(at::Tensor t, int src) = 0;

  // Blocks until every rank has reached the barrier (or the timeout names those that did not).
  virtual void barrier() = 0;

  // A communicator of `ranks`, whose rank i is ranks[i], with a thread of its own (it runs
  // concurrently with this one); nullptr on the other ranks. Collective over this communicator.
  // REQUIRES: every rank passes the same list: ranks of this communicator, ascending, no
  // duplicates.
  virtual std::shared_ptr<Communicator> split(const std::vector<int>& ranks) = 0;
  // split() of every rank: the same ranks on a thread of their own. Collective.
  std::shared_ptr<Communicator> dup();

  virtual CommStats stats() const = 0;

  // Fails this communicator and its family (every one linked to it by split() or dup(), through
  // any chain) at once: pending and later operations fail with `why`, and over TCP so do the
  // peers' with this rank. Call it before unwinding from this rank's own failure (a TCP
  // communicator destroyed while an exception propagates aborts by itself). Any thread;
  // idempotent (the first `why` stays). After any failure a communicator refuses further work.
  virtual void abort(const std::string& why) = 0;
};

// A data communicator and the CPU communicator of its control plane (flags, norms, checksums,
// votes: small host values that must not wait behind bulk or device traffic), of the same
// ranks. What the optimizers and fully_shard take: a CPU communicator converts to one
// implicitly; a device communicator comes as one (init_nccl, stage_through_host, device_group).
struct ProcessGroup {
  std::shared_ptr<Communicator> data;
  std::shared_ptr<Communicator> control;

  ProcessGroup() = default;
  // REQUIRES: both non-null; control on the CPU, with data's rank and size.
  ProcessGroup(std::shared_ptr<Communicator> data, std::shared_ptr<Communicator> control);
  // ProcessGroup::of(comm).
  template <class C, class = std::enable_if_t<std::is_base_of<Communicator, C>::value>>
  ProcessGroup(std::shared_ptr<C> comm) : ProcessGroup(of(std::move(comm))) {}  // NOLINT: implicit on purpose

  // For a CPU communicator both are `comm` (control values share its queue, in issue order).
  // A device communicator needs its CPU one named: ProcessGroup{device_comm, cpu_comm}.
  static ProcessGroup of(std::shared_ptr<Communicator> comm);
};

// Every rank's `text`, indexed by rank (two all-gathers). Collective; for descriptions and
// small records, not bulk data.
std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text);
// The ranks whose `failed` is true, ascending, the same on every rank (one all-reduce of size()
// doubles): the vote after something each rank did alone (opened a file, wrote its part), so
// that every rank goes on, or every rank stops naming who failed. Empty: every rank succeeded.
// Collective. REQUIRES: `comm` moves CPU tensors.
std::vector<int> failed_ranks(Communicator& comm, bool failed);
// `root`'s `text` on every rank (two broadcasts): e.g. a file one rank read, for ranks that
// cannot read its disk. Collective; `wait` bounds how long a rank waits for the root.
std::string broadcast_text(Communicator& comm, const std::string& text, int root,
                           std::chrono::milliseconds wait = std::chrono::minutes(5));

// A NCCL communicator of CUDA tensors on `device` for the ranks of `cpu`, paired with `cpu` as
// its control plane; operations run on a stream of their own after the caller's current one.
// An operation that fails or outlasts options.timeout aborts every communicator made from it,
// naming the ranks that never issued it. Collective over `cpu`.
// REQUIRES: a zeroshard built with CUDA (else throws, saying so: see cuda_enabled()); `cpu`
// from init_communicator (or a split or dup of one); each rank names its own device (usually
// cuda:LOCAL_RANK). NCCL before 2.30 refuses two ranks on one GPU.
ProcessGroup init_nccl(std::shared_ptr<Communicator> cpu, c10::Device device, const CommOptions& options = {});
// Whether this zeroshard was built with CUDA and NCCL (init_nccl works).
bool cuda_enabled();

// A communicator of `device` tensors that moves them through host memory over `cpu` (a CPU
// communicator), paired with `cpu` as its control plane: for several ranks on one GPU (tests,
// debugging) and devices without a collective library. Inputs are copied to the host when an
// operation is issued (after the work queued on the current stream); results land on the
// device when the Work is waited on (wait(): the current stream; block(stream): `stream`).
// Not collective: it makes no connection.
ProcessGroup stage_through_host(std::shared_ptr<Communicator> cpu, c10::Device device);

// How device_group moves a GPU's tensors.
enum class DeviceTransport {
  kAuto,    // NCCL when this node's ranks have a GPU each, else staged through host memory
  kNccl,    // NCCL always: several ranks on one GPU need NCCL 2.30's NCCL_MULTI_RANK_GPU_ENABLE or,
            // before it, a NCCL_HOSTID of their own per process (then NCCL's socket transport on lo)
  kStaged,  // stage_through_host always
};
std::string to_string(DeviceTransport transport);

// The process group of a trainer whose model is on `device`: `cpu` itself for the CPU; for
// CUDA, by `transport` (kAuto: init_nccl when this host's ranks are no more than its visible
// GPUs, else stage_through_host, with a warning). Collective over `cpu`.
ProcessGroup device_group(std::shared_ptr<Communicator> cpu, c10::Device device, const CommOptions& options = {},
                          DeviceTransport transport = DeviceTransport::kAuto);

// The world's communicator: rendezvous through a c10d::TCPStore (rank 0 serves it at
// MASTER_ADDR:MASTER_PORT) and a TCP connection between every pair of ranks. Collective.
// Throws on every rank when one fails its rendezvous (naming it and its reason), or after
// options.rendezvous_timeout (naming the ranks that never arrived).
std::shared_ptr<Communicator> init_communicator(const DistEnv& env, const CommOptions& options = {});
// Same, from read_dist_env().
std::shared_ptr<Communicator> init_communicator(const CommOptions& options = {});

}  // namespace zeroshard
