#include "comm/tcp_mesh.h"

#include "comm/store_wait.h"
#include "zeroshard/log.h"
#include "zeroshard/trace.h"

#include <c10/util/Exception.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <c10/util/Exception.h>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <functional>
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
enum FrameType : uint32_t { kData = 1, kReady = 2, kClose = 3, kHeartbeat = 4 };
constexpr uint64_t kNoCulprit = ~uint64_t(0);
constexpr size_t kMaxReasonBytes = 1024;
// At most this many messages of one peer wait for a receive (each at most kEagerBytes: 32 MiB
// in all), and as many ready notices for sends: a peer that exceeds it is not following the
// protocol, and its connection breaks instead of growing this rank's memory.
constexpr size_t kMaxUnmatched = 4096;

// Precedes every frame on a connection (40 bytes). kData: bytes [offset,
// offset + bytes) of a message of `total` bytes follow. kReady: the sender of
// this frame posted a receive of `total` bytes for `slot`. kClose: the sender
// closes the connection next; `slot` is the rank whose failure made it close
// (kNoCulprit: it closed on its own), and `bytes` bytes of text follow (at most
// kMaxReasonBytes): why it aborted, "" for a clean close.
// kHeartbeat: nothing follows; the sender is alive (written on an idle connection).
struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint32_t type = kData;
  uint64_t slot = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t total = 0;
};

// Sent by the connecting rank right after connect. A rank accepts a connection
// only with this job's token (drawn at rendezvous) and its own protocol version.
constexpr uint32_t kProtocolVersion = 3;
struct Hello {
  uint32_t magic = kFrameMagic;
  uint32_t version = kProtocolVersion;
  int32_t rank = -1;
  int32_t size = 0;
  uint64_t token = 0;
};
// How long a connected peer has to say hello before it is refused as a stranger.
constexpr std::chrono::milliseconds kHelloTimeout{10000};

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

// Reads exactly `bytes` into `out` before `deadline`; false when the peer closed or was too slow.
bool read_fully(tcp::socket& s, void* out, size_t bytes, std::chrono::steady_clock::time_point deadline) {
  s.non_blocking(true);
  size_t got = 0;
  while (got < bytes) {
    boost::system::error_code ec;
    got += s.read_some(asio::buffer(static_cast<char*>(out) + got, bytes - got), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      if (!wait_readable(s.native_handle(), deadline)) return false;
    } else if (ec) {
      return false;
    }
  }
  s.non_blocking(false);
  return true;
}

// The kernel's own liveness on a connection, under the heartbeat: keepalive probes
// after a third of `liveness` idle, and data unacknowledged for `liveness` breaks it.
void set_liveness_options(tcp::socket& s, std::chrono::milliseconds liveness) {
  const int fd = s.native_handle();
  const int on = 1;
  const int idle_s = std::max<int>(1, static_cast<int>(liveness.count() / 3000));
  const int interval_s = std::max(1, idle_s / 3);
  const int probes = 3;
  const unsigned user_timeout_ms = static_cast<unsigned>(liveness.count());
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

// "10.0.0.5 port 41234" (the remote end), or "an unknown address".
std::string describe_endpoint(const tcp::socket& s) {
  boost::system::error_code ec;
  const auto remote = s.remote_endpoint(ec);
  return ec ? std::string("an unknown address") : remote.address().to_string() + " port " + std::to_string(remote.port());
}

// Connects `s` to `to` before `deadline`: each try waits at most 10 s (a partitioned
// host answers nothing), a refused or unreachable one is retried after a pause that
// doubles from 50 ms to 2 s. Throws message(last error) at the deadline.
void connect_with_retries(tcp::socket& s, const tcp::endpoint& to, std::chrono::steady_clock::time_point deadline,
                          const std::function<std::string(const std::string&)>& message) {
  auto pause = std::chrono::milliseconds(50);
  std::string last = "the rendezvous timed out before a connection was tried";
  while (std::chrono::steady_clock::now() < deadline) {
    boost::system::error_code ec;
    if (s.is_open()) s.close(ec);
    s.open(to.protocol());
    s.non_blocking(true);
    s.connect(to, ec);
    if (ec == asio::error::in_progress || ec == asio::error::would_block) {
      const auto try_deadline = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(10));
      pollfd p{s.native_handle(), POLLOUT, 0};
      int rc = 0;
      while (rc == 0 && std::chrono::steady_clock::now() < try_deadline) {
        rc = ::poll(&p, 1, 100);
      }
      int error = 0;
      socklen_t length = sizeof(error);
      if (rc <= 0) {
        error = ETIMEDOUT;
      } else if (::getsockopt(s.native_handle(), SOL_SOCKET, SO_ERROR, &error, &length) != 0) {
        error = errno;
      }
      ec = boost::system::error_code(error, boost::system::system_category());
    }
    if (!ec) {
      s.non_blocking(false);
      return;
    }
    last = ec.message();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    std::this_thread::sleep_for(std::max(std::chrono::milliseconds(0), std::min(pause, left)));
    pause = std::min(pause * 2, std::chrono::milliseconds(2000));
  }
  TORCH_CHECK(false, message(last));
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
  std::unordered_map<uint64_t, uint64_t> ready;            // ready notices (slot -> bytes posted) for sends not posted yet
  std::unordered_map<uint64_t, Op*> waiting;               // large sends waiting for a ready notice
  std::string broken;                                      // why the connection failed; "" if healthy
  uint64_t broken_order = 0;                               // 1 for the mesh's first break, 2 next, ...
  int culprit = -1;                                        // the rank the peer's kClose blamed
  bool closed_cleanly = false;                             // the peer's kClose blamed no one and gave no reason
  std::string close_reason;                                // the reason the peer's kClose gave
  std::string abort_frame;                                 // abort(): a kClose to write before closing
  std::string out_abort;                                   // that frame being written (the thread's)
  std::chrono::steady_clock::time_point last_heard;        // when a read from the peer last completed
  std::chrono::steady_clock::time_point last_sent;         // when a write to the peer last completed
  bool closing = false;                                    // write a kClose after the queued frames
  uint64_t close_culprit = kNoCulprit;                     // what that kClose says
};

struct TcpMesh::Io {
  asio::io_context ctx;
  asio::executor_work_guard<asio::io_context::executor_type> guard{ctx.get_executor()};
  std::unique_ptr<asio::steady_timer> abort_timer;  // the thread's: abort()'s closing deadline
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

TcpMesh::TcpMesh(int rank, int size, const MeshOptions& options, c10d::Store& store, const std::string& prefix,
                 std::vector<int> world_ranks)
    : rank_(rank), size_(size), liveness_(options.liveness), world_ranks_(std::move(world_ranks)),
      blame_(options.blame), io_(std::make_unique<Io>()) {
  TORCH_INTERNAL_ASSERT(static_cast<int>(world_ranks_.size()) == size_, "a world rank per rank");
  for (int p = 0; p < size_; ++p) {
    peers_.push_back(std::make_unique<Peer>());
    if (p != rank_) peers_.back()->socket = std::make_unique<tcp::socket>(io_->ctx);
  }
  if (size_ > 1) connect_all(options, store, prefix);
  const auto now = std::chrono::steady_clock::now();
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    peers_[p]->last_heard = peers_[p]->last_sent = now;
    set_liveness_options(*peers_[p]->socket, liveness_);
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
  lock.unlock();
  asio::post(io_->ctx, [this] {
    if (io_->abort_timer) io_->abort_timer->cancel();  // the connections are closed: no deadline to wait for
  });
  io_->guard.reset();
  io_->thread.join();
}

void TcpMesh::connect_all(const MeshOptions& o, c10d::Store& store, const std::string& prefix) {
  const auto deadline = std::chrono::steady_clock::now() + o.rendezvous_timeout;
  // Listen before publishing the address, so every connect finds the port open.
  tcp::resolver resolver(io_->ctx);
  tcp::endpoint local;
  try {
    local = *resolver.resolve(o.host, "0").begin();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "cannot resolve this host's address '", o.host, "' (", e.what(),
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
  wait_for_keys(store, prefix + "addr/", lower, o.rendezvous_timeout);
  for (int p = 0; p < rank_; ++p) {
    const auto value = store.get(prefix + "addr/" + std::to_string(p));
    std::istringstream in(std::string(value.begin(), value.end()));
    std::string ip;
    unsigned short port = 0;
    in >> ip >> port;
    tcp::socket& s = *peers_[p]->socket;
    connect_with_retries(s, tcp::endpoint(asio::ip::make_address(ip), port), deadline, [&](const std::string& why) {
      return "connecting rank " + std::to_string(rank_) + " of " + std::to_string(size_) + " to rank " +
             std::to_string(p) + " at " + ip + " port " + std::to_string(port) + " failed: " + why +
             ". Check that rank " + std::to_string(p) + " is alive and that every host reaches every other one "
             "over TCP (set ZS_SOCKET_IFNAME to pick the network interface)";
    });
    s.set_option(tcp::no_delay(true));
    Hello hello;
    hello.rank = rank_;
    hello.size = size_;
    hello.token = o.token;
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
        TORCH_CHECK(false, "rendezvous timed out after ", o.rendezvous_timeout.count(), " ms (store prefix '",
                    prefix, "'): rank(s) [", join(missing), "] never connected to rank ", rank_,
                    ". Check that those ranks are alive and that every host can reach every other one "
                    "over TCP (set ZS_SOCKET_IFNAME to pick the network interface)");
      }
      continue;
    }
    TORCH_CHECK(!ec, "rank ", rank_, " failed accepting a connection from a peer: ", ec.message());
    // A stranger (another program, a rank of another job or attempt, a port scanner) is
    // refused and logged; it never fails the rendezvous. A rank of this job says hello at once.
    const std::string who = describe_endpoint(s);
    Hello hello;
    const auto hello_deadline = std::min(deadline, std::chrono::steady_clock::now() + kHelloTimeout);
    std::string refused;
    if (!read_fully(s, &hello, sizeof(hello), hello_deadline)) {
      refused = "it sent no complete hello (it closed, or was silent for " + std::to_string(kHelloTimeout.count()) + " ms)";
    } else if (hello.magic != kFrameMagic) {
      refused = "it is not a zeroshard rank (wrong magic)";
    } else if (hello.version != kProtocolVersion) {
      refused = "it speaks protocol version " + std::to_string(hello.version) + ", this rank " +
                std::to_string(kProtocolVersion) + " (a zeroshard of another version)";
    } else if (hello.token != o.token) {
      refused = "wrong job token (a rank of another job, or of an earlier attempt of this one)";
    } else if (hello.size != size_ || hello.rank <= rank_ || hello.rank >= size_ || joined[hello.rank]) {
      refused = "it claims to be rank " + std::to_string(hello.rank) + " of " + std::to_string(hello.size) +
                ", which this rank of " + std::to_string(size_) + " does not expect";
    }
    if (!refused.empty()) {
      log_warn("rank " + std::to_string(rank_) + " refused a connection from " + who + ": " + refused);
      continue;  // `s` closes
    }
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
    peer.culprit = culprit >= 0 ? culprit : rank_;  // what this rank's waits on `p` blame (first_broken)
    break_locked(p, "this rank aborted: " + why);
  }
  // A connection whose frame in flight never drains (a dead peer) closes anyway after a second.
  asio::post(io_->ctx, [this, others] {
    if (io_->abort_timer) return;
    io_->abort_timer = std::make_unique<asio::steady_timer>(io_->ctx, std::chrono::seconds(1));
    io_->abort_timer->async_wait([this, others](const boost::system::error_code&) {
      for (int p : others) close_socket(p);
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

void TcpMesh::on_frame(int peer) {
  Peer& p = *peers_[peer];
  const FrameHeader h = p.in;
  const std::string from = "rank " + std::to_string(peer);
  std::unique_lock<std::mutex> lock(mu_);
  p.last_heard = std::chrono::steady_clock::now();
  if (h.magic != kFrameMagic || (h.type != kData && h.type != kReady && h.type != kClose && h.type != kHeartbeat))
    return break_locked(peer, "received a corrupt frame (is another program using this port?)");
  if (h.type == kHeartbeat) {
    lock.unlock();
    return read_frame(peer);
  }
  if (h.type == kClose) {
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
    return;
  }
  if (h.type == kReady) {
    auto w = p.waiting.find(h.slot);
    if (w == p.waiting.end()) {
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
                       p.last_heard = std::chrono::steady_clock::now();
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
  if (!p.broken.empty() && !p.abort_frame.empty()) {
    // Aborting: the close frame that says why, then the socket closes.
    p.out_abort.swap(p.abort_frame);
    p.abort_frame.clear();
    lock.unlock();
    asio::async_write(*p.socket, asio::buffer(p.out_abort), [this, peer](const boost::system::error_code&, size_t) {
      close_socket(peer);
      std::lock_guard<std::mutex> lock(mu_);
      peers_[peer]->writing = false;
    });
    return;
  }
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
                        {
                          std::lock_guard<std::mutex> lock(mu_);
                          if (ec) return break_locked(peer, ec.message());
                          peers_[peer]->last_sent = std::chrono::steady_clock::now();
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
