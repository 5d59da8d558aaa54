// Point-to-point send/recv over the TCP mesh: a header (with the payload inside when it
// is small), then the data; the receiver checks the header against its tensor. Both
// are posted and advanced without blocking (collectives.h).
#include "comm/wire.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace zeroshard::comm {
namespace {

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Whether `buf`'s one posted operation completed. On a broken connection or
// past the deadline, wait_all() throws the error that names the peer.
bool finished(PostedP2P& op, Buffer& buf, const std::vector<int>& world_ranks, const char* what) {
  const WaitScope scope{*op.work, world_ranks, op.deadline, op.timeout};
  const Pending pending{op.work->peer, &buf, 1, op.is_recv};
  bool done = false;
  try {
    done = op.is_recv ? buf.wait_recv(std::chrono::milliseconds(0)) : buf.wait_send(std::chrono::milliseconds(0));
  } catch (const std::exception&) {
    wait_all(scope, {pending}, what);  // the connection broke: throws, naming the rank to blame
  }
  if (!done && std::chrono::steady_clock::now() >= op.deadline) wait_all(scope, {pending}, what);  // times out
  return done;
}

}  // namespace

PostedP2P post_send(Exchange& ex, std::shared_ptr<OpWork> work, uint64_t p2p_seq) {
  PostedP2P ps;
  const at::Tensor& t = work->tensors()[0];
  const int dst = work->peer;
  const int64_t bytes = bytes_of(t);
  WireHeader h = header_for(*work, t.numel(), t.scalar_type(), 0);
  h.seq = p2p_seq;
  h.inline_bytes = bytes <= kInlineBytes ? bytes : 0;
  ps.message.resize(sizeof(WireHeader) + h.inline_bytes);
  std::memcpy(ps.message.data(), &h, sizeof(WireHeader));
  if (h.inline_bytes > 0) std::memcpy(ps.message.data() + sizeof(WireHeader), t.data_ptr(), bytes);
  ps.header_buf = make_buffer(ex.mesh, ps.message.data(), ps.message.size());
  ps.header_buf->send(dst, make_slot(kP2PHeader, p2p_seq, 0), 0, ps.message.size());
  ex.stats.control_bytes += sizeof(WireHeader);
  if (bytes > 0 && h.inline_bytes == 0) {
    ps.data_buf = make_buffer(ex.mesh, t.data_ptr(), bytes);
    ps.data_buf->send(dst, make_slot(kP2PData, p2p_seq, 0), 0, bytes);
  }
  ex.stats.bytes_sent += bytes;
  ps.work = std::move(work);
  ps.p2p_seq = p2p_seq;
  ps.deadline = ex.deadline;
  ps.timeout = ex.timeout;
  return ps;
}

PostedP2P post_recv(Exchange& ex, std::shared_ptr<OpWork> work, uint64_t p2p_seq) {
  PostedP2P pr;
  pr.is_recv = true;
  pr.message.resize(sizeof(WireHeader) + kInlineBytes);
  pr.header_buf = make_buffer(ex.mesh, pr.message.data(), pr.message.size());
  pr.header_buf->recv(work->peer, make_slot(kP2PHeader, p2p_seq, 0), 0, pr.message.size());
  ex.stats.control_bytes += sizeof(WireHeader);
  ex.stats.bytes_received += bytes_of(work->tensors()[0]);
  pr.work = std::move(work);
  pr.p2p_seq = p2p_seq;
  pr.deadline = ex.deadline;
  pr.timeout = ex.timeout;
  return pr;
}

bool advance(PostedP2P& op, TcpMesh& mesh, const std::vector<int>& world_ranks) {
  if (!op.header_done) {
    if (!finished(op, *op.header_buf, world_ranks, op.is_recv ? "matching send" : "matching recv")) return false;
    op.header_done = true;
    if (op.is_recv) {  // check what arrived; take an inlined payload, or post the data receive
      const OpWork& w = *op.work;
      at::Tensor t = w.tensors()[0];
      const int src = w.peer;
      WireHeader theirs;
      std::memcpy(&theirs, op.message.data(), sizeof(WireHeader));
      TORCH_CHECK(theirs.magic == kMagic, w.name(), ": received a corrupt header from ", rank_label(src, world_ranks));
      const auto their_dtype = static_cast<c10::ScalarType>(theirs.dtype);
      TORCH_CHECK_VALUE(theirs.numel == t.numel() && their_dtype == t.scalar_type(), w.name(), ": ",
                        rank_label(src, world_ranks), " sent ", theirs.numel, " elements of ",
                        c10::toString(their_dtype), " but this rank's tensor has ", t.numel(), " elements of ",
                        c10::toString(t.scalar_type()), "; the receiving tensor must match the sent one");
      const int64_t bytes = bytes_of(t);
      if (bytes > 0 && theirs.inline_bytes > 0) {
        std::memcpy(t.data_ptr(), op.message.data() + sizeof(WireHeader), bytes);
      } else if (bytes > 0) {
        op.data_buf = make_buffer(mesh, t.data_ptr(), bytes);
        op.data_buf->recv(src, make_slot(kP2PData, op.p2p_seq, 0), 0, bytes);
      }
    }
  }
  if (!op.data_buf) return true;
  return finished(op, *op.data_buf, world_ranks, op.is_recv ? "send data" : "receipt of the send data");
}

}  // namespace zeroshard::comm
