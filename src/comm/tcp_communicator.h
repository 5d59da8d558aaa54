// tcp_communicator.h — the Communicator over TCP (CPU tensors).
//
// Owns a TcpMesh (a connection to every peer, and the thread that moves their
// bytes), a thread that executes queued operations in issue order, and a
// thread that waits for
// posted sends to be taken by their receivers. Arguments are checked when an
// operation is issued (in the caller's thread); agreement between ranks is
// checked when it executes. After any failure the communicator refuses further
// work with the original error: collectives cannot resynchronise; it aborts its
// mesh, which closes every connection, tells each peer why, and fails the
// family (watchdog.h: the communicators split from one init_communicator).
#pragma once

#include "comm/collectives.h"
#include "comm/work.h"
#include "zeroshard/comm.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace zeroshard::comm {

// Stamps `error_file` (torchelastic's, as record_error writes it) with the
// moment this rank began to fail, unless an error is recorded there already:
// the error the rank records later keeps that moment, so the launcher's last
// line, which repeats the earliest recorded error, names this rank and not a
// peer that failed because this rank aborted. "" does nothing.
void note_failure(const std::string& error_file, const std::string& message);

class TcpCommunicator final : public Communicator {
 public:
  // Connects to every rank (blocks until all joined; a timeout names the missing ranks).
  // `world_ranks[i]` is the world rank of this communicator's rank i (for messages).
  // `mesh` says where this rank listens and the job's token (its splits use them too);
  // its rendezvous timeout and liveness window are options'. `family`: the family of the
  // communicator this one is split from; null for a new family.
  TcpCommunicator(int rank, int size, std::vector<int> world_ranks,
                  std::shared_ptr<c10d::Store> store, std::string prefix, MeshOptions mesh,
                  CommOptions options, std::shared_ptr<Family> family = nullptr);
  // Executes what is still queued, then joins both threads; aborts instead
  // (nothing queued or posted waits for its peers) when the communicator failed
  // or an exception is propagating.
  ~TcpCommunicator() override;
  TcpCommunicator(const TcpCommunicator&) = delete;
  TcpCommunicator& operator=(const TcpCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }

  std::shared_ptr<Work> all_gather(at::Tensor out, at::Tensor in) override;
  std::shared_ptr<Work> reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op) override;
  std::shared_ptr<Work> all_reduce(at::Tensor t, ReduceOp op) override;
  std::shared_ptr<Work> broadcast(at::Tensor t, int root) override;
  std::shared_ptr<Work> send(at::Tensor t, int dst) override;
  std::shared_ptr<Work> recv(at::Tensor t, int src) override;
  void barrier() override;
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks) override;
  // split(ranks), but the new communicator heads a family of its own: its failure
  // fails neither this communicator nor the rest of its family. For tests that
  // break a group on purpose and go on with the others.
  std::shared_ptr<Communicator> split_new_family(const std::vector<int>& ranks);
  CommStats stats() const override;
  void abort(const std::string& why) override;

  // Where a communicator made beside this one, of the same ranks (NCCL's),
  // meets its peers: the rendezvous store, a key prefix unique to this call,
  // and the world rank of each rank. Collective in the sense that every rank
  // must call it in the same order (it counts calls, as split() does).
  struct Meeting {
    std::shared_ptr<c10d::Store> store;
    std::string prefix;
    std::vector<int> world_ranks;
  };
  Meeting meeting_point(const std::string& purpose);

 private:
  struct Queued {
    std::shared_ptr<OpWork> work;
    uint64_t p2p_seq = 0;  // for send/recv: position in the pair's stream
  };

  std::shared_ptr<Communicator> split_into(const std::vector<int>& ranks, std::shared_ptr<Family> family,
                                          std::shared_ptr<std::atomic<int>> blame);
  std::shared_ptr<OpWork> enqueue(OpKind kind, std::vector<at::Tensor> tensors, ReduceOp op,
                                  int peer);
  void worker_loop();
  void reaper_loop();
  void record(OpKind kind, const OpStats& s);
  void set_failure(const std::string& message);
  // `reduces`: the op sums `t` (float and int dtypes); the others move bytes (uint8 and int8 too).
  void check_tensor(const char* op, const char* arg, const at::Tensor& t, bool reduces = false) const;
  void check_peer(const char* op, const char* arg, int peer) const;

  const int rank_;
  const int size_;
  const std::vector<int> world_ranks_;
  const std::shared_ptr<c10d::Store> store_;
  const std::string prefix_;
  const MeshOptions mesh_options_;
  const CommOptions options_;
  const std::shared_ptr<Family> family_;
  // Declared before everything that holds Buffers on it (posted_), so it is destroyed after them.
  // Shared with the family's watchdog, which may look at it once more after forget().
  const std::shared_ptr<TcpMesh> mesh_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;              // guarded by mu_
  uint64_t next_seq_ = 0;                 // guarded by mu_; collectives, same on every rank
  std::vector<uint64_t> send_seq_;        // guarded by mu_; per destination
  std::vector<uint64_t> recv_seq_;        // guarded by mu_; per source
  uint64_t split_count_ = 0;              // guarded by mu_
  std::string failure_;                   // guarded by mu_; first error, empty while healthy
  bool stopping_ = false;                 // guarded by mu_

  std::mutex reaper_mu_;
  std::condition_variable reaper_cv_;
  std::deque<PostedP2P> posted_;          // guarded by reaper_mu_; sends and recvs just posted
  bool reaper_stopping_ = false;          // guarded by reaper_mu_

  Scratch scratch_;                       // used by the worker thread only

  mutable std::mutex stats_mu_;
  CommStats stats_;                       // guarded by stats_mu_

  std::thread worker_;                    // owned and joined by this object
  std::thread reaper_;                    // owned and joined by this object
};

}  // namespace zeroshard::comm
