// collectives.h — the algorithms behind each operation, over the TCP mesh (tcp_mesh.h).
//
// Every collective exchanges a header with every peer (kind, sequence number,
// numel, dtype, op/root) and refuses to move data when any rank disagrees,
// naming it. Receives of up to 256 KiB are posted first, sized from this rank's
// own arguments, so the transport's ready notices travel while headers are checked; data
// is sent only after every header matched, so no rank ever sends a peer more
// than it posted, and a mismatch moves no data at all. Payloads of at most
// kInlineBytes ride inside the header message: one exchange instead of two.
//
// Large operations on 3 or more ranks run as rings (ring.h: each rank talks to
// rank-1 and rank+1 only); the rest move pairwise: each rank sends exactly the
// bytes the receiver needs. Either way the payload equals the theory:
//   all_gather / reduce_scatter: (n-1)/n of the full buffer per rank;
//   all_reduce = reduce_scatter + all_gather of the reduced slices: 2(n-1)/n;
//   broadcast: the root sends the buffer to each other rank (pairwise), or each
//   rank forwards it to the next (a chain, for large buffers).
// reduce_scatter is pipelined in segments: while one segment's contributions
// are reduced (in rank order, float32 accumulation for 16-bit types), the
// next segment is already on the wire.
//
// Functions here run on a communicator's thread; they are not thread-safe.
#pragma once

#include "comm/tcp_mesh.h"
#include "comm/work.h"
#include "zeroshard/comm.h"


#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard::comm {

// Sent ahead of every operation's data (48 bytes). Payloads up to
// kInlineBytes travel in the same message, right after the header.
struct WireHeader {
  uint32_t magic = 0;
  uint32_t kind = 0;
  uint64_t seq = 0;
  int64_t numel = 0;
  int32_t dtype = 0;
  int32_t extra = 0;         // ReduceOp for reductions, root for broadcast
  int64_t inline_bytes = 0;  // payload bytes following the header in this message
  uint64_t host = 0;         // the sender's host: every rank learns whether the ranks span hosts
};
constexpr int64_t kInlineBytes = 4096;

// Staging memory reused by successive operations on one communicator thread
// (allocated once at the largest size seen, never zero-filled).
class Scratch {
 public:
  char* get(size_t bytes) {
    if (bytes > size_) {
      data_.reset(new char[bytes]);
      size_ = bytes;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<char[]> data_;
  size_t size_ = 0;
};

// One operation being executed.
struct Exchange {
  TcpMesh& mesh;
  int rank;
  int size;
  const std::vector<int>& world_ranks;  // this communicator's rank -> world rank, for messages
  OpWork& work;
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds timeout;
  OpStats stats;  // filled in by the algorithm
  Scratch& scratch;
  CommOptions::Algorithm algorithm;
  uint64_t host;  // this rank's host (a hash of its listen address), sent in every header
};

// all_gather, reduce_scatter, all_reduce, broadcast, barrier.
void run_collective(Exchange& ex);

// A send or recv posted to the transport. Posting never waits; advance()
// moves it on as far as the transport allows without blocking, so one thread
// can carry any number of them and no receive holds up another operation.
//   send: header (with the payload when small) written, then the data
//         (receiver-driven: it moves once the receiver posted its memory).
//   recv: header posted; once it arrived it is checked against the tensor,
//         then the data receive is posted straight into the tensor.
struct PostedP2P {
  std::shared_ptr<OpWork> work;
  bool is_recv = false;
  uint64_t p2p_seq = 0;
  std::vector<char> message;  // header, then the payload when inlined
  std::unique_ptr<Buffer> header_buf;
  std::unique_ptr<Buffer> data_buf;
  bool header_done = false;
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds timeout;
};
PostedP2P post_send(Exchange& ex, std::shared_ptr<OpWork> work, uint64_t p2p_seq);
PostedP2P post_recv(Exchange& ex, std::shared_ptr<OpWork> work, uint64_t p2p_seq);
// True once the operation completed. Throws, naming the peer, when its
// connection broke, its deadline passed, or (recv) the sender's tensor differs.
bool advance(PostedP2P& op, TcpMesh& mesh, const std::vector<int>& world_ranks);

// "rank 3", or "rank 3 (world rank 7)" inside a split communicator.
std::string rank_label(int rank, const std::vector<int>& world_ranks);

}  // namespace zeroshard::comm
