// Buffers, posting, abort and liveness (tcp_mesh.h); the rendezvous is in
// tcp_mesh_connect.cpp, the mesh's thread in tcp_mesh_io.cpp.
#include "comm/tcp_mesh_internal.h"
#include "runtime/link_stats.h"

#include "zeroshard/trace.h"

#include <c10/util/Exception.h>

#include <boost/asio/post.hpp>

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>

namespace zeroshard::comm {
namespace asio = boost::asio;
using asio::ip::tcp;
using namespace tcp_mesh_detail;

// ---------------------------------------------------------------- Buffer

Buffer::Buffer(TcpMesh& mesh, void* ptr, size_t bytes)
    : mesh_(mesh), ptr_(static_cast<char*>(ptr)), bytes_(bytes) {}

Buffer::~Buffer() { mesh_.forget(*this); }

void Buffer::send(int peer, uint64_t slot, size_t offset, size_t nbytes) {
  mesh_.post(*this, peer, slot, offset, nbytes, false);
}

void Buffer::recv(int peer, uint64_t slot, size_t offset, size_t nbytes) {
  mesh_.post(*this, peer, slot, offset, nbytes, true);
}

bool Buffer::wait_send(std::chrono::milliseconds timeout) { return wait(sends_done_, timeout); }
bool Buffer::wait_recv(std::chrono::milliseconds timeout) { return wait(recvs_done_, timeout); }

bool Buffer::wait(int& done, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mesh_.mu_);
  ++waiters_;
  const bool ok = mesh_.cv_.wait_for(lock, timeout, [&] { return done > 0 || !error_.empty(); });
  --waiters_;
  TORCH_CHECK(error_.empty(), error_);
  if (!ok) return false;
  --done;
  return true;
}

// ---------------------------------------------------------------- TcpMesh

TcpMesh::TcpMesh(int rank, int size, const MeshOptions& options, c10d::Store& store, const std::string& prefix,
                 std::vector<int> world_ranks)
    : rank_(rank), size_(size), liveness_(options.liveness), world_ranks_(std::move(world_ranks)),
      note_links_(options.note_links), blame_(options.blame), io_(std::make_unique<Io>()) {
  TORCH_INTERNAL_ASSERT(static_cast<int>(world_ranks_.size()) == size_, "a world rank per rank");
  if (note_links_) set_link_self(world_ranks_[static_cast<size_t>(rank_)]);
  for (int p = 0; p < size_; ++p) {
    peers_.push_back(std::make_unique<Peer>());
    if (p != rank_) peers_.back()->socket = std::make_unique<tcp::socket>(io_->ctx);
  }
  if (size_ > 1) connect_all(options, store, prefix);
  const auto now = std::chrono::steady_clock::now();
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    peers_[p]->last_heard = peers_[p]->last_sent = now;
    read_frame(p);
  }
  io_->thread = std::thread([this] {
    trace::set_thread_name("transport");
    io_->ctx.run();
  });
}

TcpMesh::~TcpMesh() {
  // Closing gracefully: end this rank's side of every connection (the peer reads
  // everything sent so far, then the end), and keep reading until each peer
  // closed its side too, so no connection is reset with data in flight.
  // The kClose frame tells each peer whom to blame when this close is the
  // consequence of another rank's failure.
  std::vector<int> others;
  for (int p = 0; p < size_; ++p)
    if (p != rank_) others.push_back(p);
  std::unique_lock<std::mutex> lock(mu_);
  const int culprit = failed_peer_;  // a clean close of another peer blames no one
  closing_ = true;
  for (int p : others) {
    if (!peers_[p]->broken.empty()) continue;
    peers_[p]->closing = true;
    peers_[p]->close_culprit = culprit >= 0 ? static_cast<uint64_t>(culprit) : kNoCulprit;
    kick_locked(p);
  }
  cv_.wait_for(lock, std::chrono::seconds(5), [&] {
    for (int p = 0; p < size_; ++p)
      if (p != rank_ && peers_[p]->broken.empty()) return false;
    return true;
  });
  for (int p = 0; p < size_; ++p)
    if (p != rank_) break_locked(p, "this rank closed the communicator");
  // After an abort, its kClose frames go out before the connections close: a peer that
  // read only the end of the stream would blame this rank instead of the one named.
  // abort()'s deadline bounds the wait when a frame cannot drain.
  cv_.wait_for(lock, std::chrono::seconds(2), [&] { return abort_frames_unsent_ == 0; });
  lock.unlock();
  asio::post(io_->ctx, [this] {
    if (io_->abort_timer) io_->abort_timer->cancel();  // the connections are closed: no deadline to wait for
  });
  io_->guard.reset();
  io_->thread.join();
}

// ---------------------------------------------------------------- posting (any thread)

void TcpMesh::post(Buffer& buf, int peer, uint64_t slot, size_t offset, size_t nbytes, bool is_recv) {
  TORCH_INTERNAL_ASSERT(peer >= 0 && peer < size_ && peer != rank_, "bad peer ", peer);
  TORCH_INTERNAL_ASSERT(offset + nbytes <= buf.bytes_, "message [", offset, ", ", offset + nbytes,
                        ") exceeds its buffer of ", buf.bytes_, " bytes");
  std::lock_guard<std::mutex> lock(mu_);
  ops_.push_back(std::make_unique<Op>());
  Op* op = ops_.back().get();
  op->buf = &buf;
  op->peer = peer;
  op->slot = slot;
  op->ptr = buf.ptr_ + offset;
  op->bytes = nbytes;
  op->is_recv = is_recv;
  op->self = std::prev(ops_.end());
  ++buf.pending_;
  Peer& p = *peers_[peer];
  if (is_recv) {
    // A message that arrived before its sender closed the connection is still delivered.
    auto early = p.early.find(slot);
    if (early != p.early.end()) {
      std::vector<char> data = std::move(early->second);
      p.early.erase(early);
      if (data.size() > nbytes) {
        return finish_locked(op, "rank " + std::to_string(peer) + " sent " + std::to_string(data.size()) +
                                     " bytes for a receive of " + std::to_string(nbytes));
      }
      std::memcpy(op->ptr, data.data(), data.size());
      return finish_locked(op, "");
    }
    if (!p.broken.empty()) return finish_locked(op, p.broken);
    TORCH_INTERNAL_ASSERT(p.posted.count(slot) == 0, "two receives posted for slot ", slot);
    p.posted[slot] = op;
    if (nbytes > kEagerBytes) notify_locked(peer, slot, nbytes);
    return;
  }
  if (!p.broken.empty()) return finish_locked(op, p.broken);
  auto ready = p.ready.find(slot);
  const bool announced = ready != p.ready.end();
  if (announced) {
    const uint64_t posted = ready->second;
    p.ready.erase(ready);
    if (nbytes > posted) {
      const std::string why = "rank " + std::to_string(peer) + " posted a receive of " + std::to_string(posted) +
                              " bytes for a send of " + std::to_string(nbytes);
      finish_locked(op, why);
      return break_locked(peer, why);
    }
  }
  if (nbytes <= kEagerBytes || announced) return clear_to_send_locked(peer, op);
  p.waiting[slot] = op;
}

void TcpMesh::forget(Buffer& buf) {
  std::unique_lock<std::mutex> lock(mu_);
  if (buf.pending_ == 0) return;
  // Operations none of whose bytes moved yet are withdrawn.
  auto untouched = [&](Op* op) { return op->buf == &buf && op->moved == 0 && !op->active; };
  for (auto& p : peers_) {
    for (auto* table : {&p->posted, &p->waiting}) {
      for (auto it = table->begin(); it != table->end();) {
        if (untouched(it->second)) {
          finish_locked(it->second, "withdrawn");
          it = table->erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto it = p->sends.begin(); it != p->sends.end();) {
      if (untouched(*it)) {
        finish_locked(*it, "withdrawn");
        it = p->sends.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (buf.pending_ == 0) return;
  // Part of a message moved: stop every connection (the communicator already
  // failed, or is being destroyed) and wait until the thread let go of the memory.
  for (int p = 0; p < size_; ++p)
    if (p != rank_) break_locked(p, "an operation was abandoned while its bytes were moving");
  ++buf.waiters_;
  cv_.wait(lock, [&] { return buf.pending_ == 0; });
  --buf.waiters_;
}

std::pair<int, std::string> TcpMesh::first_broken(const std::vector<int>& peers) {
  std::lock_guard<std::mutex> lock(mu_);
  std::pair<int, std::string> first{-1, ""};
  uint64_t order = 0;
  for (int peer : peers) {
    const Peer& p = *peers_[peer];
    if (!p.broken.empty() && (first.first < 0 || p.broken_order < order)) {
      first = {p.culprit >= 0 ? p.culprit : peer, p.broken};
      order = p.broken_order;
    }
  }
  return first;
}

void TcpMesh::wait_aborted(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return abort_frames_unsent_ == 0; });
}

void TcpMesh::abort(const std::string& why) {
  std::vector<int> others;
  for (int p = 0; p < size_; ++p)
    if (p != rank_) others.push_back(p);
  std::lock_guard<std::mutex> lock(mu_);
  // Whom the close frames blame: the peer whose broken connection failed this mesh, else
  // the rank that failed the family first (when it is a member here), else this rank.
  int culprit = failed_peer_;
  for (int p = 0; p < size_ && culprit < 0; ++p)
    if (world_ranks_[p] == blame_->load()) culprit = p;
  if (failure_.empty()) failure_ = why;
  // Each healthy connection gets a kClose naming whom to blame and why, written right
  // after the frame in flight on it, if any (write_next), and then closes; its posted
  // operations fail now.
  FrameHeader h;
  h.type = kClose;
  h.slot = static_cast<uint64_t>(culprit >= 0 ? culprit : rank_);
  const std::string reason = why.substr(0, kMaxReasonBytes);
  h.bytes = reason.size();
  std::string frame(reinterpret_cast<const char*>(&h), sizeof(h));
  frame += reason;
  for (int p : others) {
    Peer& peer = *peers_[p];
    if (!peer.broken.empty()) continue;
    peer.abort_frame = frame;
    ++abort_frames_unsent_;
    peer.culprit = culprit >= 0 ? culprit : rank_;  // what this rank's waits on `p` blame (first_broken)
    break_locked(p, "this rank aborted: " + why);
  }
  // A connection whose frame in flight never drains (a dead peer) closes anyway after a second.
  asio::post(io_->ctx, [this, others] {
    if (io_->abort_timer) return;
    io_->abort_timer = std::make_unique<asio::steady_timer>(io_->ctx, std::chrono::seconds(1));
    io_->abort_timer->async_wait([this, others](const boost::system::error_code&) {
      for (int p : others) close_socket(p);
      std::lock_guard<std::mutex> lock(mu_);
      for (int p : others) {
        // A frame never started (the write before it failed) is given up.
        if (peers_[p]->abort_frame.empty()) continue;
        peers_[p]->abort_frame.clear();
        --abort_frames_unsent_;
      }
      cv_.notify_all();
    });
  });
}

std::string TcpMesh::async_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void TcpMesh::heartbeat() {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (closing_) return;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    Peer& p = *peers_[peer];
    if (!p.broken.empty()) continue;
    if (now - p.last_heard >= liveness_) {
      break_locked(peer, "no sign of life from " + world_rank_label(peer) + " for " +
                             std::to_string(liveness_.count()) +
                             " ms (CommOptions::liveness): its host died or the network to it is cut");
      continue;
    }
    if (now - p.last_sent >= liveness_ / 3 && p.notices.empty()) {
      FrameHeader h;
      h.type = kHeartbeat;
      p.notices.push_back(h);
      kick_locked(peer);
    }
  }
}

std::string TcpMesh::world_rank_label(int peer) const {
  return "rank " + std::to_string(peer) +
         (world_ranks_[peer] != peer ? " (world rank " + std::to_string(world_ranks_[peer]) + ")" : "");
}

// ---------------------------------------------------------------- under mu_

void TcpMesh::notify_locked(int peer, uint64_t slot, size_t bytes) {
  FrameHeader h;
  h.type = kReady;
  h.slot = slot;
  h.total = bytes;
  peers_[peer]->notices.push_back(h);
  kick_locked(peer);
}

// A receive larger than kEagerBytes sent a ready notice when posted; a sender that wrote at most
// kEagerBytes did not wait for it, and when the notice reaches it after its send, no send of that
// slot will ever take it. The receiver, which has the message now, withdraws it.
void TcpMesh::withdraw_notice_locked(int peer, const Op& op, size_t total) {
  if (op.bytes > kEagerBytes && total <= kEagerBytes) notify_locked(peer, op.slot, 0);
}

void TcpMesh::clear_to_send_locked(int peer, Op* op) {
  peers_[peer]->sends.push_back(op);
  kick_locked(peer);
}

void TcpMesh::kick_locked(int peer) {
  Peer& p = *peers_[peer];
  if (p.writing) return;
  p.writing = true;
  asio::post(io_->ctx, [this, peer] { write_next(peer); });
}

void TcpMesh::finish_locked(Op* op, const std::string& error) {
  Buffer& b = *op->buf;
  if (!error.empty()) {
    if (b.error_.empty()) b.error_ = error;
  } else {
    ++(op->is_recv ? b.recvs_done_ : b.sends_done_);
  }
  --b.pending_;
  ops_.erase(op->self);
  ++events_;
  // Only a thread waiting on this buffer, or for any event, wants to know: the collectives'
  // thread waiting for one receive is not woken by every other send that completes.
  if (b.waiters_ > 0 || event_waiters_ > 0) cv_.notify_all();
}

uint64_t TcpMesh::events() {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

void TcpMesh::signal_event() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++events_;
  }
  cv_.notify_all();
}

void TcpMesh::wait_for_events(uint64_t seen, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  ++event_waiters_;
  cv_.wait_for(lock, timeout, [&] { return events_ != seen; });
  --event_waiters_;
}

void TcpMesh::break_locked(int peer, const std::string& cause) {
  Peer& p = *peers_[peer];
  if (!p.broken.empty()) return;
  p.broken = cause;
  p.broken_order = ++breaks_;
  // Anything but the peer's clean close, or this rank's own, fails the mesh (and its family).
  if (!p.closed_cleanly && !closing_ && failure_.empty()) {
    failed_peer_ = p.culprit >= 0 ? p.culprit : peer;
    int none = -1;
    blame_->compare_exchange_strong(none, world_ranks_[failed_peer_]);
    failure_ = "the connection to " + world_rank_label(failed_peer_) + " broke (" + cause + ")";
  }
  ++events_;
  cv_.notify_all();
  // A chunk moving right now is finished by its read's or write's handler.
  auto fail = [&](Op* op) {
    if (!op->active) finish_locked(op, cause);
  };
  for (auto& [slot, op] : p.posted) fail(op);
  for (auto& [slot, op] : p.waiting) fail(op);
  for (Op* op : p.sends) fail(op);
  p.posted.clear();
  p.waiting.clear();
  p.sends.clear();
  p.notices.clear();
  p.ready.clear();  // `early` stays: what arrived before the break is still delivered
  if (!p.abort_frame.empty()) {
    // The write chain sends the abort's kClose after the frame it may be writing, then closes.
    if (!p.writing) {
      p.writing = true;
      asio::post(io_->ctx, [this, peer] { write_next(peer); });
    }
    return;
  }
  asio::post(io_->ctx, [this, peer] { close_socket(peer); });
}

void TcpMesh::close_socket(int peer) {
  boost::system::error_code ignored;
  peers_[peer]->socket->shutdown(tcp::socket::shutdown_both, ignored);
  peers_[peer]->socket->close(ignored);
}

}  // namespace zeroshard::comm
