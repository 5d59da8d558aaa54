// zeroshard/comm.h — the communicator: the collectives sharding and pipelines need.
//
// A Communicator connects `size()` ranks (processes). Every operation is
// asynchronous: it is queued, executed in issue order on the communicator's own
// thread (so computation overlaps it), and returns a Work to wait on.
//
// Ownership: the caller keeps every tensor passed to an operation alive and
// untouched until the returned Work's wait() has returned (the Work also holds
// a reference, so the memory cannot be freed early, but writing to it races).
//
// Matching: collectives must be issued by every rank of the communicator in
// the same order with matching sizes and dtypes; each carries a sequence number
// and a small header, so a rank that issues a different operation, size or
// dtype is reported by name instead of corrupting memory or hanging.
//
// Thread-safety: all methods may be called from any thread; operations issued
// from several threads are ordered by the order their calls return.
//
// dtypes: float32, bfloat16 and float16 everywhere; float64, int32 and int64
// as well. What a reduction promises depends on the backend:
//   - The TCP communicator (init_communicator; stage_through_host too, which
//     reduces on it): 16-bit values accumulate in float32 and round once;
//     integer sums wrap around in the element type but never overflow
//     mid-sum, and an integer average truncates toward zero; kMax/kMin
//     propagate a NaN held by any rank, as torch.maximum/minimum do. Every
//     element is reduced in rank order 0, 1, ..., size()-1, so every rank and
//     every rerun sees the same bits.
//   - NCCL (init_nccl): NCCL's own order (rings and trees, by message size
//     and topology), and 16-bit values are reduced in 16 bits; results agree
//     across ranks but may differ from the TCP communicator's in the last bits
//     (in more for bf16 sums over many ranks: fully_shard's reduce_dtype =
//     Float reduces 16-bit gradients in float32 where that matters).
//
// Bytes on the wire (payload, counted in stats()), per rank, for a buffer of
// B bytes: all_gather and reduce_scatter (n-1)/n·B, all_reduce 2(n-1)/n·B,
// broadcast (n-1)·B from the root and B into each other rank.
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
  // Blocks until the operation completes; rethrows its error (a c10::Error
  // naming the operation, its sequence number and the ranks that did not
  // arrive). With kDefaultTimeout it waits until the communication thread
  // finishes the operation, which itself gives up after the communicator's
  // timeout; a shorter `timeout` throws if the operation is not done by then.
  virtual void wait(std::chrono::milliseconds timeout = kDefaultTimeout) = 0;
  // True once the operation finished, successfully or not (wait() reports which).
  virtual bool is_completed() = 0;
  // Makes work later queued on `stream` wait for this operation, without
  // blocking the host (a device communicator records an event and makes the
  // stream wait on it). For a communicator of CPU tensors there is no stream to
  // order: it waits, as wait() does.
  virtual void block(c10::Stream stream) {
    (void)stream;
    wait();
  }
};

struct CommOptions {
  // How long one operation may wait for the other ranks before it fails and
  // names them. Default: 5 minutes.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // How long creating a communicator (or a split) waits for every rank to
  // join before it fails and names the missing ones; ranks of a large job can
  // start minutes apart. Default: 5 minutes.
  std::chrono::milliseconds rendezvous_timeout = std::chrono::minutes(5);
  // How long a peer may stay silent before its host is taken for dead or cut
  // off (TCP transport). Every idle connection carries a heartbeat (every third
  // of this), so silence means a dead host or a partition, not a slow rank: the
  // operations waiting on it fail naming it within this window, not the
  // timeout, and the family aborts. Must exceed the time to move 512 KiB over
  // the slowest link (4.2 s at 1 Mbit/s). Default: 30 seconds.
  std::chrono::milliseconds liveness = std::chrono::seconds(30);
  // The TCP transport's algorithm for large operations on 3 or more ranks: those
  // whose largest per-rank slice (all_gather's input, reduce_scatter's output,
  // 1/n of an all_reduce, a whole broadcast) holds 64 KiB or more.
  //   kAuto: a ring when the ranks span more than one host; on one host a
  //     ring from slices of 2 MiB, pairwise below.
  //   kRing: each rank sends only to the next and receives only from the
  //     previous; ranks are numbered host by host, so a host's link carries
  //     (n-1)/n of the buffer however many ranks share it.
  //   kPairwise: every rank sends each peer its part at once: fewer steps,
  //     faster over one host's loopback for mid-sized slices, but with 2 ranks
  //     per host on 4 hosts 1.5x the buffer crosses each host's link.
  // Smaller operations are always pairwise. docs/performance.md has the numbers.
  enum class Algorithm { kAuto, kRing, kPairwise };
  Algorithm algorithm = Algorithm::kAuto;
};

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
  // The TCP transport runs it as a reduce-scatter then an all-gather of the reduced
  // slices; NCCL runs ncclAllReduce.
  virtual std::shared_ptr<Work> all_reduce(at::Tensor t, ReduceOp op) = 0;

  // t on every rank = t on `root`, in place. REQUIRES: same numel/dtype everywhere.
  virtual std::shared_ptr<Work> broadcast(at::Tensor t, int root) = 0;

  // Point to point. Sends and recvs between a pair match in issue order (per
  // direction). A completed send means its tensor may be reused, not that
  // `dst` has received it: on TCP its bytes are in the socket (a message of
  // up to 8 KiB is sent without waiting for the receiver's recv), on NCCL the
  // device has handed it over. Both are
  // posted: neither waits for its peer on the communication thread, so they
  // may be issued in any order on either side (rank 0 recv-then-send while
  // rank 1 does recv-then-send too completes), and a recv whose sender has not
  // arrived holds up no other operation.
  // REQUIRES: the receiver's tensor has the sender's numel and dtype.
  virtual std::shared_ptr<Work> send(at::Tensor t, int dst) = 0;
  virtual std::shared_ptr<Work> recv(at::Tensor t, int src) = 0;

  // Blocks until every rank has reached the barrier (or the timeout names those that did not).
  virtual void barrier() = 0;

  // Collective over this communicator: every rank calls it with the same list
  // (ranks of this communicator, ascending, no duplicates). Members get a new
  // communicator whose rank i is ranks[i]; other ranks get nullptr. The new
  // communicator has its own thread, so it runs concurrently with this one.
  virtual std::shared_ptr<Communicator> split(const std::vector<int>& ranks) = 0;
  // A communicator of the same ranks with a thread of its own: split() of every
  // rank. Collective.
  std::shared_ptr<Communicator> dup();

  virtual CommStats stats() const = 0;

  // Fails this communicator and its family (the communicator it was split or
  // duplicated from, those split from it, and theirs) at once: every queued or
  // posted operation fails with `why`, connections close without draining,
  // and later operations are refused with `why`. Peers learn at once: their
  // operations with this rank fail naming it and `why` (over TCP), instead of
  // waiting for their timeout. For a rank that fails on its own (an exception
  // in its training step, a bad batch): call it before unwinding. A TCP
  // communicator destroyed while an exception propagates aborts by itself.
  // Any thread; idempotent (the first `why` stays).
  virtual void abort(const std::string& why) = 0;
};

// A data communicator and the communicator of its control plane: flags, norms,
// checksums and votes, small host values that must not wait behind bulk or
// device traffic. The control communicator is always a CPU one, of the same
// ranks. What the optimizers and fully_shard take: a CPU communicator converts
// to a group implicitly, a device communicator comes as one (init_nccl,
// stage_through_host).
struct ProcessGroup {
  std::shared_ptr<Communicator> data;
  std::shared_ptr<Communicator> control;

  ProcessGroup() = default;
  // REQUIRES: both non-null; control on the CPU, with data's rank and size.
  ProcessGroup(std::shared_ptr<Communicator> data, std::shared_ptr<Communicator> control);
  // ProcessGroup::of(comm).
  template <class C, class = std::enable_if_t<std::is_base_of<Communicator, C>::value>>
  ProcessGroup(std::shared_ptr<C> comm) : ProcessGroup(of(std::move(comm))) {}  // NOLINT: implicit on purpose

  // For a CPU communicator both are `comm` (control values share its queue,
  // in the order they were issued); a device communicator needs its CPU one
  // named: ProcessGroup{device_comm, cpu_comm}.
  static ProcessGroup of(std::shared_ptr<Communicator> comm);
};

// Every rank's `text`, indexed by rank (two all-gathers: the lengths, then the
// bytes packed into int64 words). Collective; for descriptions and small
// records, not bulk data.
std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text);
// The ranks whose `failed` is true, ascending, the same on every rank (one
// all-reduce of size() doubles): the vote after something each rank did on
// its own (opened a file, wrote its part), so that every rank goes on, or
// every rank stops naming who failed. Empty: every rank succeeded.
// Collective; `comm` moves CPU tensors.
std::vector<int> failed_ranks(Communicator& comm, bool failed);
// `root`'s `text` on every rank (two broadcasts: the length, then the bytes packed
// into int64 words): files one rank read, for ranks that cannot read its disk.
// Collective; `wait` bounds how long a rank waits for the root to arrive.
std::string broadcast_text(Communicator& comm, const std::string& text, int root,
                           std::chrono::milliseconds wait = std::chrono::minutes(5));

// NCCL (a zeroshard built against a CUDA LibTorch; one built without CUDA
// throws, saying so, as does zeroshard::cuda_enabled() == false): a communicator of CUDA
// tensors on `device` for the ranks of `cpu`, paired with `cpu` as its control
// plane. Collective over `cpu`, which must come from init_communicator (or a
// split or dup of one): the NCCL unique id travels through its rendezvous
// store. Every rank names its own device (usually cuda:LOCAL_RANK).
// Its operations enqueue on their own stream after the caller's current stream
// (nothing waits on the host); Work::block(stream) orders a stream after one.
// Send and recv are posted, as for every communicator. A watchdog aborts every
// communicator made from it (its splits too) when an operation fails or takes
// longer than options.timeout, and the error names the ranks that never issued it.
// NCCL before 2.30 refuses two ranks on one GPU.
ProcessGroup init_nccl(std::shared_ptr<Communicator> cpu, c10::Device device, const CommOptions& options = {});
// Whether this zeroshard was built with CUDA and NCCL (init_nccl works).
bool cuda_enabled();

// A communicator of `device` tensors that moves them through host memory over
// `cpu` (a CPU communicator), paired with `cpu` as its control plane. For
// several ranks on one GPU, which NCCL before 2.30 refuses (tests, debugging),
// and for devices without a collective library; as fast as the host copies and
// the CPU transport. Inputs are copied to the host when an operation is issued
// (after the work queued before it on the current stream); results land on the
// device when the Work is waited on (wait(): the current stream;
// Work::block(stream): `stream`). Not collective: it makes no connection.
ProcessGroup stage_through_host(std::shared_ptr<Communicator> cpu, c10::Device device);

// How device_group moves a GPU's tensors.
enum class DeviceTransport {
  kAuto,    // NCCL when this node's ranks have a GPU each, else staged through host memory
  kNccl,    // NCCL always: several ranks on one GPU need NCCL 2.30's NCCL_MULTI_RANK_GPU_ENABLE or,
            // before it, a NCCL_HOSTID of their own per process (then NCCL's socket transport on lo)
  kStaged,  // stage_through_host always
};
std::string to_string(DeviceTransport transport);

// The process group of a trainer whose model is on `device`: `cpu` itself for
// the CPU; for CUDA, by `transport`: with kAuto NCCL (init_nccl) when this
// host's ranks have a GPU each (the ranks of `cpu` with this host name, counted
// by one all-gather, <= the GPUs visible), else
// stage_through_host, with a warning (NCCL before 2.30 refuses two ranks on one
// GPU). Collective over `cpu`.
ProcessGroup device_group(std::shared_ptr<Communicator> cpu, c10::Device device, const CommOptions& options = {},
                          DeviceTransport transport = DeviceTransport::kAuto);

// Rendezvous through a c10d::TCPStore (rank 0 serves it at MASTER_ADDR:MASTER_PORT)
// and connect every pair of ranks over TCP (src/comm/tcp_mesh.h).
std::shared_ptr<Communicator> init_communicator(const DistEnv& env, const CommOptions& options = {});
// Same, from read_dist_env().
std::shared_ptr<Communicator> init_communicator(const CommOptions& options = {});

}  // namespace zeroshard
