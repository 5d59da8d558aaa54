// tcp_mesh.h — the TCP connections between the ranks of one communicator, and
// the thread that moves their bytes (Boost.Asio). Internal to src/comm.
//
// A message is a 64-bit slot (composed by the algorithms, see wire.h) and its
// bytes. Sends and receives are posted on a Buffer (caller-owned memory) and
// matched by (peer, slot): they complete asynchronously, in any order across
// slots, so one rank may receive slot B while its peer still waits for slot A.
//
// Messages of at most kEagerBytes are written at once; a receiver that posted
// nothing for them yet keeps a copy until it does. Larger messages are
// receiver-driven: posting the receive sends the peer a ready notice, and only
// then does the sender write, straight into the posted memory. No large message
// is ever staged, and no sender writes more than its receiver posted. Data is
// written in chunks of kChunkBytes, and ready notices go out ahead of the next
// chunk: a notice never waits behind a large message going the same way.
//
// Closing is graceful: a rank ends its side of each connection with a close
// frame (naming the rank whose failure made it close, if any) and reads on
// until the peer closed too, so nothing sent before is lost, and a rank that
// sees several connections break names the one that failed first.
//
// Ownership: the mesh owns its sockets and its thread (joined by the destructor).
// A Buffer's memory must outlive the Buffer; destroying a Buffer whose bytes are
// still moving fails the mesh (closes every connection) first, so the thread
// never touches freed memory. Thread-safety: Buffers may be created and used on
// any thread; one Buffer's waits on one thread at a time.
#pragma once

#include "comm/watchdog.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard::comm {

namespace tcp_mesh_detail {
struct FrameHeader;  // tcp_mesh_internal.h
struct Listener;     // tcp_mesh_connect.cpp: the socket higher ranks connect to
}  // namespace tcp_mesh_detail

class TcpMesh;

// How a mesh is made: where it listens, the job's token, how long the rendezvous may take.
struct MeshOptions {
  std::string host;      // the address this rank listens on
  uint64_t token = 0;    // drawn once per job attempt at rendezvous; every rank's hello carries it
  std::chrono::milliseconds rendezvous_timeout{std::chrono::minutes(5)};
  std::chrono::milliseconds liveness{std::chrono::seconds(30)};  // CommOptions::liveness
  // The store key a rank that fails its rendezvous sets (store_wait.h): waits for peers
  // stop as soon as it exists. "" for none.
  std::string failed_key;
  // Shared by the meshes of one family: the world rank whose broken connection failed
  // the family first (-1: none yet), so that every member's close frames blame it.
  std::shared_ptr<std::atomic<int>> blame = std::make_shared<std::atomic<int>>(-1);
  // torchelastic's error file of this rank (DistEnv::error_file), "" for none: a
  // communicator aborted while its rank unwinds stamps the moment there (note_failure).
  std::string error_file;
  // Whether this mesh's bulk frames count in the process's link table (runtime/link_stats.h),
  // which is keyed by the job's world ranks: not for a mesh whose "world ranks" number
  // something else (the replica groups' meeting: group indices).
  bool note_links = true;
};

// Caller-owned memory that sends and receives are posted on.
class Buffer {
 public:
  Buffer(TcpMesh& mesh, void* ptr, size_t bytes);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Posts a send of bytes [offset, offset + nbytes) to `peer` under `slot`.
  void send(int peer, uint64_t slot, size_t offset, size_t nbytes);
  // Posts a receive from `peer` under `slot` into [offset, offset + nbytes); the
  // sender may send fewer bytes (at most kEagerBytes then), never more.
  void recv(int peer, uint64_t slot, size_t offset, size_t nbytes);

  // Each returns once one posted send (receive) of this buffer completed: true;
  // false when `timeout` passed first. Throws c10::Error with the cause
  // when the connection carrying one of this buffer's operations broke.
  bool wait_send(std::chrono::milliseconds timeout);
  bool wait_recv(std::chrono::milliseconds timeout);

  TcpMesh& mesh() const { return mesh_; }

 private:
  friend class TcpMesh;
  bool wait(int& done, std::chrono::milliseconds timeout);

  TcpMesh& mesh_;
  char* const ptr_;
  const size_t bytes_;
  // Guarded by the mesh's mutex:
  int sends_done_ = 0;
  int recvs_done_ = 0;
  std::string error_;
  int pending_ = 0;  // posted operations not finished yet
  int waiters_ = 0;  // threads waiting on this buffer (a finished operation wakes them)
};

class TcpMesh final : public WatchedComm {
 public:
  // Sends up to this many bytes without waiting for the receiver (headers and
  // inline payloads fit: at most 4 KiB + 40 bytes).
  static constexpr size_t kEagerBytes = 8192;
  // Data goes out in chunks of this many bytes, ready notices between them.
  static constexpr size_t kChunkBytes = size_t(512) << 10;

  // Listens on options.host, publishes its address in `store` under `prefix`,
  // and connects to every other rank (blocks until all joined). A timeout names
  // the ranks that never published their address or never connected.
  // Connections from strangers (wrong token or protocol version, no hello) are
  // refused with a warning naming their address; they never fail the rendezvous.
  // `world_ranks[i]` is the world rank of rank i (for messages).
  TcpMesh(int rank, int size, const MeshOptions& options, c10d::Store& store, const std::string& prefix,
          std::vector<int> world_ranks);
  // Closes every connection (pending operations fail) and joins the thread.
  ~TcpMesh() override;
  TcpMesh(const TcpMesh&) = delete;
  TcpMesh& operator=(const TcpMesh&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Of `peers`, the one whose connection broke first, and why; {-1, ""} if
  // none broke. (When one rank dies, the others may give up and close their
  // connections too: the first break names the rank to blame.)
  std::pair<int, std::string> first_broken(const std::vector<int>& peers);

  // Transport events so far (operations finished, connections broken), and a
  // wait until there are more than `seen` (or `timeout` passed): how one thread
  // advances many posted operations without blocking on any one of them.
  uint64_t events();
  void wait_for_events(uint64_t seen, std::chrono::milliseconds timeout);
  // Counts as an event: wakes wait_for_events() (after handing it more work).
  void signal_event();

  // As a member of a family (watchdog.h): the mesh's failure, "" while healthy:
  // the first connection that broke other than by its peer's clean close, or
  // the reason given to abort().
  std::string async_error() override;
  // Fails every posted operation with `why` and closes every connection at once
  // (no draining); each peer first gets a close frame saying why, when no other
  // frame is being written to it. Any thread; idempotent.
  void abort(const std::string& why) override;
  // Returns once abort()'s close frames are written (or at `deadline`).
  void wait_aborted(std::chrono::steady_clock::time_point deadline) override;
  // Called every 100 ms (the family's watchdog): writes a heartbeat on each
  // connection idle for a third of the liveness window, and breaks each one
  // silent for the whole window (its peer's host is dead or cut off).
  void heartbeat() override;

 private:
  friend class Buffer;
  struct Op;
  struct Peer;

  void post(Buffer& buf, int peer, uint64_t slot, size_t offset, size_t nbytes, bool is_recv);
  void forget(Buffer& buf);
  void connect_all(const MeshOptions& options, c10d::Store& store, const std::string& prefix);
  // connect_all()'s halves: this rank connects to every lower rank, and accepts every higher one.
  void connect_lower(const MeshOptions& options, c10d::Store& store, const std::string& prefix,
                     std::chrono::steady_clock::time_point deadline);
  void accept_higher(const MeshOptions& options, c10d::Store& store, const std::string& prefix,
                     std::chrono::steady_clock::time_point deadline, tcp_mesh_detail::Listener& listener);

  // On the mesh's thread:
  void read_frame(int peer);
  void on_frame(int peer);
  // on_frame's handlers, one per kind of frame (called with mu_ held by `lock`).
  void on_close_frame(int peer, const tcp_mesh_detail::FrameHeader& h, std::unique_lock<std::mutex>& lock);
  void on_ready_frame(int peer, const tcp_mesh_detail::FrameHeader& h, std::unique_lock<std::mutex>& lock);
  void on_posted_data(int peer, const tcp_mesh_detail::FrameHeader& h, std::unique_lock<std::mutex>& lock);
  void on_unposted_data(int peer, const tcp_mesh_detail::FrameHeader& h, std::unique_lock<std::mutex>& lock);
  void write_next(int peer);  // what comes next on the peer's socket; each of these unlocks `lock` (mu_) and writes:
  void write_abort_frame(int peer, std::unique_lock<std::mutex>& lock);
  void write_close_frame(int peer, std::unique_lock<std::mutex>& lock);
  void write_notices(int peer, std::unique_lock<std::mutex>& lock);
  void write_chunk(int peer, std::unique_lock<std::mutex>& lock);
  void close_socket(int peer);
  std::string world_rank_label(int peer) const;  // "rank 1 (world rank 3)"

  // Under mu_:
  void notify_locked(int peer, uint64_t slot, size_t bytes);  // queue a ready notice
  void withdraw_notice_locked(int peer, const Op& op, size_t total);  // after a receive of `total` bytes
  void clear_to_send_locked(int peer, Op* op);                 // queue a send's data
  void kick_locked(int peer);
  void finish_locked(Op* op, const std::string& error);
  void break_locked(int peer, const std::string& cause);

  const int rank_;
  const int size_;
  const std::chrono::milliseconds liveness_;
  const std::vector<int> world_ranks_;
  const bool note_links_;  // MeshOptions::note_links
  const std::shared_ptr<std::atomic<int>> blame_;
  struct Io;
  std::unique_ptr<Io> io_;  // io_context, acceptor and sockets; used on the mesh's thread

  std::mutex mu_;
  std::condition_variable cv_;             // notified when an operation finishes
  std::vector<std::unique_ptr<Peer>> peers_;  // guarded by mu_ (sockets: the thread only)
  std::list<std::unique_ptr<Op>> ops_;     // guarded by mu_; every posted, unfinished operation
  uint64_t breaks_ = 0;                    // guarded by mu_; connections broken so far
  uint64_t events_ = 0;                    // guarded by mu_; operations finished + connections broken
  int event_waiters_ = 0;                  // guarded by mu_; threads in wait_for_events()
  std::string failure_;                    // guarded by mu_; see async_error()
  int failed_peer_ = -1;                   // guarded by mu_; the rank whose broken connection made failure_
  bool closing_ = false;                   // guarded by mu_; the destructor is closing every connection
  int abort_frames_unsent_ = 0;            // guarded by mu_; abort()'s kClose frames not yet written or given up
};

}  // namespace zeroshard::comm
