// The mesh's thread: reading frames and acting on them, writing notices, data and
// close frames (tcp_mesh.h).
#include "comm/tcp_mesh_internal.h"
#include "runtime/link_stats.h"

#include <c10/util/Exception.h>

#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <cstring>
#include <string>

namespace zeroshard::comm {
namespace asio = boost::asio;
using namespace tcp_mesh_detail;

namespace {
// A completion condition for asio::async_read / async_write that moves as much as the socket
// takes in each system call. asio's own (transfer_all, transfer_exactly) cap every call at
// 64 KiB: a 512 KiB chunk took 8 sendmsg and as many recv and wakeups, and over loopback that
// per-call cost, not the copies, set the rate.
struct Unbounded {
  size_t operator()(const boost::system::error_code& ec, size_t) const { return ec ? 0 : ~size_t(0) >> 1; }
};
}  // namespace

// ---------------------------------------------------------------- the mesh's thread

void TcpMesh::read_frame(int peer) {
  Peer& p = *peers_[peer];
  asio::async_read(*p.socket, asio::buffer(&p.in, sizeof(FrameHeader)),
                   [this, peer](const boost::system::error_code& ec, size_t) {
                     if (ec) {
                       std::lock_guard<std::mutex> lock(mu_);
                       const Peer& p = *peers_[peer];
                       return break_locked(peer, p.close_reason.empty()
                                                     ? ec.message()
                                                     : "rank " + std::to_string(peer) + " aborted: " + p.close_reason);
                     }
                     on_frame(peer);
                   });
}

// One frame's header has arrived from `peer`: what follows it is read by the
// handler of its type, which reads the next header when done (read_frame).
void TcpMesh::on_frame(int peer) {
  Peer& p = *peers_[peer];
  const FrameHeader h = p.in;
  std::unique_lock<std::mutex> lock(mu_);
  p.last_heard = std::chrono::steady_clock::now();
  if (h.magic != kFrameMagic || (h.type != kData && h.type != kReady && h.type != kClose && h.type != kHeartbeat))
    return break_locked(peer, "received a corrupt frame (is another program using this port?)");
  if (h.type == kHeartbeat) {
    lock.unlock();
    return read_frame(peer);
  }
  if (h.type == kClose) return on_close_frame(peer, h, lock);
  if (h.type == kReady) return on_ready_frame(peer, h, lock);
  if (p.posted.count(h.slot)) return on_posted_data(peer, h, lock);
  on_unposted_data(peer, h, lock);
}

// The peer closes next: whom it blames (the culprit), and why (the text that follows).
void TcpMesh::on_close_frame(int peer, const FrameHeader& h, std::unique_lock<std::mutex>& lock) {
  Peer& p = *peers_[peer];
  if (h.bytes > kMaxReasonBytes) return break_locked(peer, "received a corrupt frame (a reason of " +
                                                               std::to_string(h.bytes) + " bytes)");
  if (h.slot != kNoCulprit && h.slot < static_cast<uint64_t>(size_) && h.slot != static_cast<uint64_t>(rank_))
    p.culprit = static_cast<int>(h.slot);
  p.closed_cleanly = h.slot == kNoCulprit && h.bytes == 0;
  lock.unlock();
  if (h.bytes == 0) return read_frame(peer);  // the end of the stream follows
  auto reason = std::make_shared<std::string>(h.bytes, '\0');
  asio::async_read(*p.socket, asio::buffer(&(*reason)[0], reason->size()),
                   [this, peer, reason](const boost::system::error_code& ec, size_t) {
                     std::unique_lock<std::mutex> lock(mu_);
                     if (ec) return break_locked(peer, ec.message());
                     peers_[peer]->close_reason = *reason;
                     lock.unlock();
                     read_frame(peer);
                   });
}

// The peer posted a receive of h.total bytes for h.slot (0: withdrawn, the send went
// eagerly): a send waiting for it goes, else the notice waits for the send.
void TcpMesh::on_ready_frame(int peer, const FrameHeader& h, std::unique_lock<std::mutex>& lock) {
  Peer& p = *peers_[peer];
  const std::string from = "rank " + std::to_string(peer);
  auto w = p.waiting.find(h.slot);
  if (h.total == 0) {
    p.ready.erase(h.slot);
  } else if (w == p.waiting.end()) {
    if (p.ready.size() >= kMaxUnmatched) {
      return break_locked(peer, from + " posted more than " + std::to_string(kMaxUnmatched) +
                                    " receives that this rank sent nothing for yet (not a zeroshard rank of this job?)");
    }
    p.ready[h.slot] = h.total;
  } else {
    Op* op = w->second;
    p.waiting.erase(w);
    if (op->bytes > h.total) {
      // Out of every table now, so the break cannot reach it: fail it here.
      const std::string why = from + " posted a receive of " + std::to_string(h.total) + " bytes for a send of " +
                              std::to_string(op->bytes);
      finish_locked(op, why);
      return break_locked(peer, why);
    }
    clear_to_send_locked(peer, op);
  }
  lock.unlock();
  read_frame(peer);
}

// Bytes [h.offset, h.offset + h.bytes) of a message for a posted receive: read
// straight into its memory.
void TcpMesh::on_posted_data(int peer, const FrameHeader& h, std::unique_lock<std::mutex>& lock) {
  Peer& p = *peers_[peer];
  Op* op = p.posted.at(h.slot);
  if (h.total > op->bytes || h.offset != op->moved || h.offset + h.bytes > h.total) {
    return break_locked(peer, "rank " + std::to_string(peer) + " sent bytes [" + std::to_string(h.offset) + ", " +
                                  std::to_string(h.offset + h.bytes) + ") of " + std::to_string(h.total) +
                                  " for a receive of " + std::to_string(op->bytes) + " that has " +
                                  std::to_string(op->moved));
  }
  op->active = true;
  lock.unlock();
  const auto header_at = std::chrono::steady_clock::now();  // the link's time: from here to the last byte
  asio::async_read(*p.socket, asio::buffer(op->ptr + h.offset, h.bytes), Unbounded{},
                   [this, peer, op, total = h.total, header_at](const boost::system::error_code& ec, size_t n) {
                     const auto now = std::chrono::steady_clock::now();
                     if (!ec && note_links_) {
                       note_link(world_ranks_[static_cast<size_t>(peer)], n,
                                 std::chrono::duration<double>(now - header_at).count());
                     }
                     std::unique_lock<std::mutex> lock(mu_);
                     Peer& p = *peers_[peer];
                     op->active = false;
                     p.last_heard = now;
                     if (ec) {
                       p.posted.erase(op->slot);
                       finish_locked(op, ec.message());
                       return break_locked(peer, ec.message());
                     }
                     op->moved += n;
                     if (op->moved == total) {
                       p.posted.erase(op->slot);
                       withdraw_notice_locked(peer, *op, total);
                       finish_locked(op, "");
                     } else if (!p.broken.empty()) {
                       finish_locked(op, p.broken);  // the break skipped it while it was active
                     }
                     if (!p.broken.empty()) return;
                     lock.unlock();
                     read_frame(peer);
                   });
}

// A whole small message (at most kEagerBytes) no receive was posted for when its
// header arrived: staged, then given to the receive posted meanwhile, or kept
// (`early`) until one is.
void TcpMesh::on_unposted_data(int peer, const FrameHeader& h, std::unique_lock<std::mutex>& lock) {
  Peer& p = *peers_[peer];
  if (h.offset != 0 || h.bytes != h.total || h.total > kEagerBytes) {
    return break_locked(peer, "rank " + std::to_string(peer) + " sent " + std::to_string(h.total) +
                                  " bytes that no receive was posted for");
  }
  lock.unlock();
  auto staged = std::make_shared<std::vector<char>>(h.bytes);
  asio::async_read(*p.socket, asio::buffer(*staged),
                   [this, peer, staged, slot = h.slot](const boost::system::error_code& ec, size_t) {
                     std::unique_lock<std::mutex> lock(mu_);
                     if (ec) return break_locked(peer, ec.message());
                     Peer& p = *peers_[peer];
                     if (!p.broken.empty()) return;
                     auto posted = p.posted.find(slot);
                     if (posted == p.posted.end()) {
                       if (p.early.size() >= kMaxUnmatched) {
                         return break_locked(peer, "rank " + std::to_string(peer) + " sent more than " +
                                                       std::to_string(kMaxUnmatched) +
                                                       " small messages that no receive was posted for (not a "
                                                       "zeroshard rank of this job?)");
                       }
                       p.early[slot] = std::move(*staged);
                     } else {
                       Op* op = posted->second;
                       p.posted.erase(posted);
                       if (staged->size() > op->bytes) {
                         finish_locked(op, "rank " + std::to_string(peer) + " sent " + std::to_string(staged->size()) +
                                               " bytes for a receive of " + std::to_string(op->bytes));
                       } else {
                         std::memcpy(op->ptr, staged->data(), staged->size());
                         withdraw_notice_locked(peer, *op, staged->size());
                         finish_locked(op, "");
                       }
                     }
                     lock.unlock();
                     read_frame(peer);
                   });
}

void TcpMesh::write_next(int peer) {
  Peer& p = *peers_[peer];
  std::unique_lock<std::mutex> lock(mu_);
  if (!p.broken.empty() && !p.abort_frame.empty()) return write_abort_frame(peer, lock);
  if (!p.broken.empty() || (p.notices.empty() && p.sends.empty() && !p.closing)) {
    p.writing = false;
    return;
  }
  if (p.notices.empty() && p.sends.empty()) return write_close_frame(peer, lock);
  if (!p.notices.empty()) return write_notices(peer, lock);
  write_chunk(peer, lock);
}

// Aborting: the close frame that says why, then the socket closes.
void TcpMesh::write_abort_frame(int peer, std::unique_lock<std::mutex>& lock) {
  Peer& p = *peers_[peer];
  p.out_abort.swap(p.abort_frame);
  p.abort_frame.clear();
  lock.unlock();
  asio::async_write(*p.socket, asio::buffer(p.out_abort), [this, peer](const boost::system::error_code&, size_t) {
    close_socket(peer);
    std::lock_guard<std::mutex> guard(mu_);
    peers_[peer]->writing = false;
    --abort_frames_unsent_;
    cv_.notify_all();
  });
}

// Closing: the kClose frame, then the end of this side of the stream.
void TcpMesh::write_close_frame(int peer, std::unique_lock<std::mutex>& lock) {
  Peer& p = *peers_[peer];
  p.closing = false;
  p.out_header = FrameHeader{};
  p.out_header.type = kClose;
  p.out_header.slot = p.close_culprit;
  lock.unlock();
  asio::async_write(*p.socket, asio::buffer(&p.out_header, sizeof(FrameHeader)),
                    [this, peer](const boost::system::error_code& ec, size_t) {
                      boost::system::error_code ignored;
                      if (!ec) peers_[peer]->socket->shutdown(tcp::socket::shutdown_send, ignored);
                      write_next(peer);
                    });
}

// Every pending ready notice in one write, ahead of the next chunk of data.
void TcpMesh::write_notices(int peer, std::unique_lock<std::mutex>& lock) {
  Peer& p = *peers_[peer];
  p.out_notices.swap(p.notices);
  p.notices.clear();
  lock.unlock();
  asio::async_write(*p.socket, asio::buffer(p.out_notices),
                    [this, peer](const boost::system::error_code& ec, size_t) {
                      {
                        std::lock_guard<std::mutex> guard(mu_);
                        if (ec) return break_locked(peer, ec.message());
                        peers_[peer]->last_sent = std::chrono::steady_clock::now();
                      }
                      write_next(peer);
                    });
}

// The next chunk of the first send in the queue.
void TcpMesh::write_chunk(int peer, std::unique_lock<std::mutex>& lock) {
  Peer& p = *peers_[peer];
  Op* op = p.sends.front();
  const size_t chunk = std::min(kChunkBytes, op->bytes - op->moved);
  p.out_header = FrameHeader{};
  p.out_header.slot = op->slot;
  p.out_header.offset = op->moved;
  p.out_header.bytes = chunk;
  p.out_header.total = op->bytes;
  op->active = true;
  lock.unlock();
  std::array<asio::const_buffer, 2> bufs{asio::buffer(&p.out_header, sizeof(FrameHeader)),
                                         asio::buffer(op->ptr + op->moved, chunk)};
  asio::async_write(*p.socket, bufs, Unbounded{}, [this, peer, op, chunk](const boost::system::error_code& ec, size_t) {
    {
      std::lock_guard<std::mutex> guard(mu_);
      Peer& p = *peers_[peer];
      op->active = false;
      p.last_sent = std::chrono::steady_clock::now();
      if (ec) {
        p.sends.remove(op);
        finish_locked(op, ec.message());
        return break_locked(peer, ec.message());
      }
      op->moved += chunk;
      if (op->moved == op->bytes) {
        p.sends.remove(op);
        finish_locked(op, "");
      } else if (!p.broken.empty()) {
        finish_locked(op, p.broken);  // the break skipped it while it was active
      }
    }
    write_next(peer);
  });
}

}  // namespace zeroshard::comm
