#include "comm/tcp_mesh.h"

#include "comm/store_wait.h"
#include "zeroshard/trace.h"

#include <c10/util/Exception.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <c10/util/Exception.h>

#include <poll.h>

#include <array>
#include <cstring>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard::comm {
namespace asio = boost::asio;
using asio::ip::tcp;

// The frame format and helpers: a named namespace, not an anonymous one, since
// TcpMesh::Peer (external linkage) holds FrameHeaders.
namespace tcp_mesh_detail {

constexpr uint32_t kFrameMagic = 0x5A535446;  // "ZSTF"
enum FrameType : uint32_t { kData = 1, kReady = 2, kClose = 3 };
constexpr uint64_t kNoCulprit = ~uint64_t(0);

// Precedes every frame on a connection (40 bytes). kData: bytes [offset,
// offset + bytes) of a message of `total` bytes follow. kReady: the sender of
// this frame posted a receive of `total` bytes for `slot`. kClose: the sender
// closes the connection next; `slot` is the rank whose failure made it close
// (kNoCulprit: it closed on its own).
struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint32_t type = kData;
  uint64_t slot = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t total = 0;
};

// Sent by the connecting rank right after connect.
struct Hello {
  uint32_t magic = kFrameMagic;
  int32_t rank = -1;
  int32_t size = 0;
  int32_t pad = 0;
};

std::string join(const std::vector<int>& ranks) {
  std::ostringstream s;
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  return s.str();
}

// Waits until `fd` is readable or `deadline` passed; false on timeout.
bool wait_readable(int fd, std::chrono::steady_clock::time_point deadline) {
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 100)));
    if (rc > 0) return true;
  }
}

}  // namespace tcp_mesh_detail
using namespace tcp_mesh_detail;

struct TcpMesh::Op {
  Buffer* buf = nullptr;
  int peer = -1;
  uint64_t slot = 0;
  char* ptr = nullptr;
  size_t bytes = 0;
  bool is_recv = false;
  size_t moved = 0;     // bytes sent or received so far
  bool active = false;  // a chunk is moving to or from `ptr` on the mesh's thread
  std::list<std::unique_ptr<Op>>::iterator self;
};

// Per connection. The socket, `in` and the `out_*` buffers belong to the mesh's
// thread; the rest is guarded by mu_.
struct TcpMesh::Peer {
  std::unique_ptr<tcp::socket> socket;
  FrameHeader in;                                          // the frame header being read
  std::vector<FrameHeader> out_notices;                    // the ready notices being written
  FrameHeader out_header;                                  // the data frame header being written
  std::vector<FrameHeader> notices;                        // ready notices to write, ahead of data
  std::list<Op*> sends;                                    // sends cleared to go, written in order
  bool writing = false;                                    // a write chain is scheduled or running
  std::unordered_map<uint64_t, Op*> posted;                // receives not complete yet
  std::unordered_map<uint64_t, std::vector<char>> early;   // small messages that arrived first
  std::unordered_set<uint64_t> ready;                      // ready notices for sends not posted yet
  std::unordered_map<uint64_t, Op*> waiting;               // large sends waiting for a ready notice
  std::string broken;                                      // why the connection failed; "" if healthy
  uint64_t broken_order = 0;                               // 1 for the mesh's first break, 2 next, ...
  int culprit = -1;                                        // the rank the peer's kClose blamed
  bool closing = false;                                    // write a kClose after the queued frames
  uint64_t close_culprit = kNoCulprit;                     // what that kClose says
};

struct TcpMesh::Io {
  asio::io_context ctx;
  asio::executor_work_guard<asio::io_context::executor_type> guard{ctx.get_executor()};
  std::thread thread;
};

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
  const bool ok = mesh_.cv_.wait_for(lock, timeout, [&] { return done > 0 || !error_.empty(); });
  TORCH_CHECK(error_.empty(), error_);
  if (!ok) return false;
  --done;
  return true;
}

// ---------------------------------------------------------------- TcpMesh

TcpMesh::TcpMesh(int rank, int size, const std::string& host, c10d::Store& store, const std::string& prefix,
                 std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), io_(std::make_unique<Io>()) {
  for (int p = 0; p < size_; ++p) {
    peers_.push_back(std::make_unique<Peer>());
    if (p != rank_) peers_.back()->socket = std::make_unique<tcp::socket>(io_->ctx);
  }
  if (size_ > 1) connect_all(host, store, prefix, timeout);
  for (int p = 0; p < size_; ++p)
    if (p != rank_) read_frame(p);
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
  const int culprit = first_broken(others).first;
  std::unique_lock<std::mutex> lock(mu_);
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
  lock.unlock();
  io_->guard.reset();
  io_->thread.join();
}

void TcpMesh::connect_all(const std::string& host, c10d::Store& store, const std::string& prefix,
                          std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Listen before publishing the address, so every connect finds the port open.
  tcp::resolver resolver(io_->ctx);
  tcp::endpoint local;
  try {
    local = *resolver.resolve(host, "0").begin();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "cannot resolve this host's address '", host, "' (", e.what(),
                "); set ZS_SOCKET_IFNAME to the network interface the ranks reach each other on");
  }
  tcp::acceptor acceptor(io_->ctx);
  acceptor.open(local.protocol());
  acceptor.bind(local);
  acceptor.listen();
  const auto address = acceptor.local_endpoint();
  const std::string mine = address.address().to_string() + " " + std::to_string(address.port());
  store.set(prefix + "addr/" + std::to_string(rank_), std::vector<uint8_t>(mine.begin(), mine.end()));

  // This rank connects to every lower rank and accepts every higher one.
  std::vector<std::string> lower;
  for (int p = 0; p < rank_; ++p) lower.push_back(std::to_string(p));
  wait_for_keys(store, prefix + "addr/", lower, timeout);
  for (int p = 0; p < rank_; ++p) {
    const auto value = store.get(prefix + "addr/" + std::to_string(p));
    std::istringstream in(std::string(value.begin(), value.end()));
    std::string ip;
    unsigned short port = 0;
    in >> ip >> port;
    tcp::socket& s = *peers_[p]->socket;
    boost::system::error_code ec;
    s.connect(tcp::endpoint(asio::ip::make_address(ip), port), ec);
    TORCH_CHECK(!ec, "connecting rank ", rank_, " of ", size_, " to rank ", p, " at ", ip, ":", port,
                " failed: ", ec.message(),
                ". Check that every host can reach every other one over TCP (set ZS_SOCKET_IFNAME to "
                "pick the network interface)");
    s.set_option(tcp::no_delay(true));
    Hello hello;
    hello.rank = rank_;
    hello.size = size_;
    asio::write(s, asio::buffer(&hello, sizeof(hello)));
  }

  acceptor.non_blocking(true);
  std::vector<bool> joined(size_, false);
  for (int accepted = 0; accepted < size_ - 1 - rank_;) {
    tcp::socket s(io_->ctx);
    boost::system::error_code ec;
    acceptor.accept(s, ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      if (!wait_readable(acceptor.native_handle(), deadline)) {
        std::vector<int> missing;
        for (int p = rank_ + 1; p < size_; ++p)
          if (!joined[p]) missing.push_back(p);
        TORCH_CHECK(false, "rendezvous timed out after ", timeout.count(), " ms (store prefix '", prefix,
                    "'): rank(s) [", join(missing), "] never connected to rank ", rank_,
                    ". Check that those ranks are alive and that every host can reach every other one "
                    "over TCP (set ZS_SOCKET_IFNAME to pick the network interface)");
      }
      continue;
    }
    TORCH_CHECK(!ec, "rank ", rank_, " failed accepting a connection from a peer: ", ec.message());
    Hello hello;
    TORCH_CHECK(wait_readable(s.native_handle(), deadline), "rendezvous timed out after ", timeout.count(),
                " ms: a peer connected to rank ", rank_, " but never said which rank it is");
    asio::read(s, asio::buffer(&hello, sizeof(hello)));
    TORCH_CHECK(hello.magic == kFrameMagic && hello.size == size_ && hello.rank > rank_ && hello.rank < size_ &&
                    !joined[hello.rank],
                "rank ", rank_, " of ", size_, " received an unexpected connection (claimed rank ", hello.rank,
                " of ", hello.size, "); is another program using this port?");
    s.set_option(tcp::no_delay(true));
    *peers_[hello.rank]->socket = std::move(s);
    joined[hello.rank] = true;
    ++accepted;
  }
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
  const bool announced = p.ready.erase(slot) > 0;
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
  cv_.wait(lock, [&] { return buf.pending_ == 0; });
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

// ---------------------------------------------------------------- under mu_

void TcpMesh::notify_locked(int peer, uint64_t slot, size_t bytes) {
  FrameHeader h;
  h.type = kReady;
  h.slot = slot;
  h.total = bytes;
  peers_[peer]->notices.push_back(h);
  kick_locked(peer);
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
  cv_.notify_all();
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
  cv_.wait_for(lock, timeout, [&] { return events_ != seen; });
}

void TcpMesh::break_locked(int peer, const std::string& cause) {
  Peer& p = *peers_[peer];
  if (!p.broken.empty()) return;
  p.broken = cause;
  p.broken_order = ++breaks_;
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
  asio::post(io_->ctx, [this, peer] {
    boost::system::error_code ignored;
    peers_[peer]->socket->shutdown(tcp::socket::shutdown_both, ignored);
    peers_[peer]->socket->close(ignored);
  });
}

// ---------------------------------------------------------------- the mesh's thread

void TcpMesh::read_frame(int peer) {
  Peer& p = *peers_[peer];
  asio::async_read(*p.socket, asio::buffer(&p.in, sizeof(FrameHeader)),
                   [this, peer](const boost::system::error_code& ec, size_t) {
                     if (ec) {
                       std::lock_guard<std::mutex> lock(mu_);
                       return break_locked(peer, ec.message());
                     }
                     on_frame(peer);
                   });
}

void TcpMesh::on_frame(int peer) {
  Peer& p = *peers_[peer];
  const FrameHeader h = p.in;
  const std::string from = "rank " + std::to_string(peer);
  std::unique_lock<std::mutex> lock(mu_);
  if (h.magic != kFrameMagic || (h.type != kData && h.type != kReady && h.type != kClose))
    return break_locked(peer, "received a corrupt frame (is another program using this port?)");
  if (h.type == kClose) {
    if (h.slot != kNoCulprit && h.slot < static_cast<uint64_t>(size_) && h.slot != static_cast<uint64_t>(rank_))
      p.culprit = static_cast<int>(h.slot);
    lock.unlock();
    return read_frame(peer);  // the end of the stream follows
  }
  if (h.type == kReady) {
    auto w = p.waiting.find(h.slot);
    if (w == p.waiting.end()) {
      p.ready.insert(h.slot);
    } else {
      Op* op = w->second;
      p.waiting.erase(w);
      if (op->bytes > h.total) {
        return break_locked(peer, from + " posted a receive of " + std::to_string(h.total) + " bytes for a send of " +
                                      std::to_string(op->bytes));
      }
      clear_to_send_locked(peer, op);
    }
    lock.unlock();
    return read_frame(peer);
  }
  auto posted = p.posted.find(h.slot);
  if (posted != p.posted.end()) {
    Op* op = posted->second;
    if (h.total > op->bytes || h.offset != op->moved || h.offset + h.bytes > h.total) {
      return break_locked(peer, from + " sent bytes [" + std::to_string(h.offset) + ", " +
                                    std::to_string(h.offset + h.bytes) + ") of " + std::to_string(h.total) +
                                    " for a receive of " + std::to_string(op->bytes) + " that has " +
                                    std::to_string(op->moved));
    }
    op->active = true;
    lock.unlock();
    asio::async_read(*p.socket, asio::buffer(op->ptr + h.offset, h.bytes),
                     [this, peer, op, total = h.total](const boost::system::error_code& ec, size_t n) {
                       std::unique_lock<std::mutex> lock(mu_);
                       Peer& p = *peers_[peer];
                       op->active = false;
                       if (ec) {
                         p.posted.erase(op->slot);
                         finish_locked(op, ec.message());
                         return break_locked(peer, ec.message());
                       }
                       op->moved += n;
                       if (op->moved == total) {
                         p.posted.erase(op->slot);
                         finish_locked(op, "");
                       } else if (!p.broken.empty()) {
                         finish_locked(op, p.broken);  // the break skipped it while it was active
                       }
                       if (!p.broken.empty()) return;
                       lock.unlock();
                       read_frame(peer);
                     });
    return;
  }
  if (h.offset != 0 || h.bytes != h.total || h.total > kEagerBytes) {
    return break_locked(peer, from + " sent " + std::to_string(h.total) + " bytes that no receive was posted for");
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
                       p.early[slot] = std::move(*staged);
                     } else {
                       Op* op = posted->second;
                       p.posted.erase(posted);
                       if (staged->size() > op->bytes) {
                         finish_locked(op, "rank " + std::to_string(peer) + " sent " + std::to_string(staged->size()) +
                                               " bytes for a receive of " + std::to_string(op->bytes));
                       } else {
                         std::memcpy(op->ptr, staged->data(), staged->size());
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
  if (!p.broken.empty() || (p.notices.empty() && p.sends.empty() && !p.closing)) {
    p.writing = false;
    return;
  }
  if (p.notices.empty() && p.sends.empty()) {
    // Closing: the kClose frame, then the end of this side of the stream.
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
    return;
  }
  if (!p.notices.empty()) {
    // Every pending ready notice in one write, ahead of the next chunk of data.
    p.out_notices.swap(p.notices);
    p.notices.clear();
    lock.unlock();
    asio::async_write(*p.socket, asio::buffer(p.out_notices),
                      [this, peer](const boost::system::error_code& ec, size_t) {
                        if (ec) {
                          std::lock_guard<std::mutex> lock(mu_);
                          return break_locked(peer, ec.message());
                        }
                        write_next(peer);
                      });
    return;
  }
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
  asio::async_write(*p.socket, bufs, [this, peer, op, chunk](const boost::system::error_code& ec, size_t) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      Peer& p = *peers_[peer];
      op->active = false;
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
