// Point-to-point send/recv over the TCP mesh: a header (with the payload inside when it
// is small), then the data; the receiver checks the header against its tensor.
#include "comm/wire.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace zeroshard::comm {

PostedSend post_send(Exchange& ex, std::shared_ptr<OpWork> work, uint64_t p2p_seq) {
  PostedSend ps;
  const at::Tensor& t = work->tensors()[0];
  const int dst = work->peer;
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
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
  ps.deadline = ex.deadline;
  ps.timeout = ex.timeout;
  return ps;
}

void wait_send(PostedSend& send, const std::vector<int>& world_ranks) {
  const WaitScope ex{*send.work, world_ranks, send.deadline, send.timeout};
  const int dst = send.work->peer;
  wait_all(ex, {{dst, send.header_buf.get(), 1, false}}, "matching recv");
  if (send.data_buf) wait_all(ex, {{dst, send.data_buf.get(), 1, false}}, "receipt of the send data");
}

void run_recv(Exchange& ex, uint64_t p2p_seq) {
  OpWork& w = ex.work;
  at::Tensor t = w.tensors()[0];
  const int src = w.peer;
  std::vector<char> message(sizeof(WireHeader) + kInlineBytes);
  auto hbuf = make_buffer(ex.mesh, message.data(), message.size());
  hbuf->recv(src, make_slot(kP2PHeader, p2p_seq, 0), 0, message.size());
  wait_all(ex, {{src, hbuf.get(), 1, true}}, "matching send");
  ex.stats.control_bytes += sizeof(WireHeader);
  WireHeader theirs;
  std::memcpy(&theirs, message.data(), sizeof(WireHeader));
  TORCH_CHECK(theirs.magic == kMagic, w.name(), ": received a corrupt header from ",
              rank_label(src, ex.world_ranks));
  const auto their_dtype = static_cast<c10::ScalarType>(theirs.dtype);
  TORCH_CHECK_VALUE(theirs.numel == t.numel() && their_dtype == t.scalar_type(), w.name(), ": ",
                    rank_label(src, ex.world_ranks), " sent ", theirs.numel, " elements of ",
                    c10::toString(their_dtype), " but this rank's tensor has ", t.numel(),
                    " elements of ", c10::toString(t.scalar_type()),
                    "; the receiving tensor must match the sent one");
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  ex.stats.bytes_received += bytes;
  if (bytes == 0) return;
  if (theirs.inline_bytes > 0) {
    std::memcpy(t.data_ptr(), message.data() + sizeof(WireHeader), bytes);
    return;
  }
  auto dbuf = make_buffer(ex.mesh, t.data_ptr(), bytes);
  dbuf->recv(src, make_slot(kP2PData, p2p_seq, 0), 0, bytes);
  wait_all(ex, {{src, dbuf.get(), 1, true}}, "send data");
}
}  // namespace zeroshard::comm
