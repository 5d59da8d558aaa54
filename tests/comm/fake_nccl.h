// fake_nccl.h — a simulated NCCL and CUDA for the NCCL communicator's host
// logic, with ranks as threads of one process and host memory as the device.
//
// What it simulates: communicators made from one unique id form a group;
// init, split and every launch are non-blocking ("in progress" for a few
// polls of async_error); the first operation of a 2-rank communicator stays
// "in progress" until the peer has issued one too (NCCL connects lazily);
// operations queue on streams, in order; a collective runs once every rank's
// stream has it at its head, a send with its matching recv; events complete
// when their stream reaches them; finalize waits for the communicator's
// operations; abort drops them. A split's child handle is written through the
// caller's pointer only when the split completes, as NCCL's non-blocking
// ncclCommSplit does.
//
// What it checks (violations(), one line each): every call on a communicator
// from one thread (NCCL allows one thread at a time; the communicator promises
// one thread); no call on a communicator after destroy or abort; no operation
// issued while the previous call on its communicator is still in progress;
// events recorded and waited for on their own device's streams; a recv of the
// size of its send.
//
// Thread-safety: every method may be called from any thread (mu_).
#pragma once

#include "comm/nccl/nccl_api.h"

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace zeroshard::testing {

class FakeNccl final : public comm::nccl::NcclApi {
 public:
  using Status = comm::nccl::Status;
  using CommHandle = comm::nccl::CommHandle;
  using StreamHandle = comm::nccl::StreamHandle;
  using EventHandle = comm::nccl::EventHandle;
  using UniqueId = comm::nccl::UniqueId;

  struct Options {
    int launch_polls = 2;            // async_error says "in progress" this often after each launch
    bool lazy_connect = true;        // a 2-rank communicator's first launch waits for the peer's
    bool launches_never_end = false; // every launch stays "in progress"
    int unique_ids_before_throw = -1;  // unique_id() throws after this many calls (-1: never)
    int runtime_version = 22809, header_version = 22809;
  };
  explicit FakeNccl(Options options) : options_(options) {}
  FakeNccl() : FakeNccl(Options{}) {}

  std::vector<std::string> violations() const;
  int64_t aborts() const;
  int64_t launches() const;
  // Called (without the lock) at every finalize, destroy and abort, with the call's name.
  void on_teardown(std::function<void(const std::string&)> hook);

  int runtime_version() override { return options_.runtime_version; }
  int header_version() override { return options_.header_version; }
  Status unique_id(UniqueId* id) override;
  Status init_rank(CommHandle* comm, int nranks, const UniqueId& id, int rank, int device) override;
  Status split(CommHandle parent, bool member, int key, CommHandle* child) override;
  Status async_error(CommHandle comm) override;
  Status finalize(CommHandle comm) override;
  void destroy(CommHandle comm) override;
  void abort(CommHandle comm) override;
  Status all_gather(const void* in, void* out, size_t count, at::ScalarType dtype, CommHandle comm,
                    StreamHandle stream) override;
  Status reduce_scatter(const void* in, void* out, size_t count, at::ScalarType dtype, ReduceOp op, CommHandle comm,
                        StreamHandle stream) override;
  Status all_reduce(void* data, size_t count, at::ScalarType dtype, ReduceOp op, CommHandle comm,
                    StreamHandle stream) override;
  Status broadcast(void* data, size_t count, at::ScalarType dtype, int root, CommHandle comm,
                   StreamHandle stream) override;
  Status send(const void* data, size_t count, at::ScalarType dtype, int peer, CommHandle comm,
              StreamHandle stream) override;
  Status recv(void* data, size_t count, at::ScalarType dtype, int peer, CommHandle comm,
              StreamHandle stream) override;
  void set_device(int device) override;
  StreamHandle create_stream(int device) override;
  void destroy_stream(StreamHandle stream, int device) override;
  StreamHandle current_stream(int device) override;
  StreamHandle stream_of(const c10::Stream& stream, int device) override;
  EventHandle create_event(int device) override;
  void destroy_event(EventHandle event, int device) override;
  Status record(EventHandle event, StreamHandle stream, int device) override;
  Status wait_event(StreamHandle stream, EventHandle event, int device) override;
  Status query(EventHandle event, int device) override;

 private:
  struct Group;
  struct Op;
  struct Comm {
    Group* group = nullptr;
    int rank = 0, device = 0;
    std::thread::id owner;
    bool dead = false;          // destroyed or aborted
    bool initialized = false;
    bool finalizing = false;    // finalize() was called: in progress until its operations ran
    int polls_left = 0;         // a launch in progress
    bool waits_for_peer = false;  // a first 2-rank launch, until the peer launched too
    int64_t launched = 0;
    uint64_t collectives = 0;   // index of the next collective
    uint64_t splits = 0;
    int64_t pending_split = -1; // a split in progress on this parent
    CommHandle* split_out = nullptr;  // where that split's child goes when it completes, as NCCL does
    Comm* split_child = nullptr;
    std::map<int, uint64_t> sends, recvs;  // next index per peer
  };
  struct Group {
    int nranks = 0;
    std::vector<Comm*> members;
    std::map<uint64_t, std::vector<std::shared_ptr<Op>>> collectives;  // index -> one op per rank
    std::map<std::tuple<int, int, uint64_t>, std::pair<std::shared_ptr<Op>, std::shared_ptr<Op>>> p2p;
    struct SplitCall {
      int rank;
      bool member;
      int key;
      Comm* child;
    };
    std::map<uint64_t, std::vector<SplitCall>> splits;
  };
  struct Event {
    int device = 0;
    uint64_t recorded = 0, reached = 0;  // records made, and the last one its stream reached
    bool dead = false;
  };
  struct Stream {
    int device = 0;
    std::deque<std::shared_ptr<Op>> ops;
    bool dead = false;
  };
  struct Op {
    enum Kind { kCollective, kSend, kRecv, kRecord, kWait } kind;
    Stream* stream = nullptr;
    Comm* comm = nullptr;
    std::function<void(const std::vector<std::shared_ptr<Op>>&)> run;  // collectives: with every rank's op
    const void* in = nullptr;
    void* out = nullptr;
    size_t bytes = 0;
    Event* event = nullptr;
    uint64_t generation = 0;
  };

  Comm* comm_of(CommHandle c, const char* call);  // checks ownership and liveness (mu_ held)
  Stream* stream_of_handle(StreamHandle s, int device, const char* call);
  Event* event_of_handle(EventHandle e, int device, const char* call);
  Status launch(Comm* c, Stream* s, std::shared_ptr<Op> op, const char* call);
  Status collective(const char* call, CommHandle comm, StreamHandle stream,
                    std::function<void(const std::vector<std::shared_ptr<Op>>&)> run, const void* in, void* out);
  Status p2p(bool send, const void* data, size_t bytes, int peer, CommHandle comm, StreamHandle stream);
  bool runnable(const std::shared_ptr<Op>& op);
  void progress();
  void violation(std::string what);
  void teardown(const std::string& call);

  const Options options_;
  mutable std::mutex mu_;
  std::vector<std::string> violations_;
  int64_t aborts_ = 0, launches_ = 0, unique_ids_ = 0;
  std::map<std::string, std::unique_ptr<Group>> groups_;  // by unique id, or by parent and split index
  std::vector<std::unique_ptr<Comm>> comms_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::vector<std::unique_ptr<Event>> events_;
  std::map<int, Stream*> user_streams_;  // the "current stream" of each device
  std::function<void(const std::string&)> on_teardown_;
};

}  // namespace zeroshard::testing
