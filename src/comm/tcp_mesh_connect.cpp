// The rendezvous: listen, publish the address, connect to lower ranks with deadlines
// and backoff, accept higher ones, and refuse strangers (tcp_mesh.h).
#include "comm/store_wait.h"
#include "comm/tcp_mesh_internal.h"
#include "zeroshard/log.h"

#include <c10/util/Exception.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/write.hpp>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <functional>
#include <sstream>
#include <thread>

namespace zeroshard::comm {
namespace asio = boost::asio;
using asio::ip::tcp;
using namespace tcp_mesh_detail;

namespace {

// Sent by the connecting rank right after connect. A rank accepts a connection
// only with this job's token (drawn at rendezvous) and its own protocol version.
constexpr uint32_t kProtocolVersion = 4;  // 4: a ready notice of 0 bytes withdraws one
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
                          const std::function<void()>& between_tries,
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
    between_tries();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    std::this_thread::sleep_for(std::max(std::chrono::milliseconds(0), std::min(pause, left)));
    pause = std::min(pause * 2, std::chrono::milliseconds(2000));
  }
  TORCH_CHECK(false, message(last));
}

}  // namespace

namespace tcp_mesh_detail {
struct Listener {
  tcp::acceptor acceptor;
};
}  // namespace tcp_mesh_detail

namespace {

// Why a connection's hello is refused ("" when it comes from a rank of this job
// this rank expects): a stranger (another program, a rank of another job or
// attempt, a port scanner) is refused and logged, never failing the rendezvous.
std::string refusal(const Hello& hello, const MeshOptions& o, int rank, int size, const std::vector<bool>& joined) {
  if (hello.magic != kFrameMagic) return "it is not a zeroshard rank (wrong magic)";
  if (hello.version != kProtocolVersion) {
    return "it speaks protocol version " + std::to_string(hello.version) + ", this rank " +
           std::to_string(kProtocolVersion) + " (a zeroshard of another version)";
  }
  if (hello.token != o.token) return "wrong job token (a rank of another job, or of an earlier attempt of this one)";
  if (hello.size != size || hello.rank <= rank || hello.rank >= size || joined[hello.rank]) {
    return "it claims to be rank " + std::to_string(hello.rank) + " of " + std::to_string(hello.size) +
           ", which this rank of " + std::to_string(size) + " does not expect";
  }
  return "";
}

}  // namespace

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
  tcp_mesh_detail::Listener listener{tcp::acceptor(io_->ctx)};
  tcp::acceptor& acceptor = listener.acceptor;
  acceptor.open(local.protocol());
  acceptor.bind(local);
  acceptor.listen();
  const auto address = acceptor.local_endpoint();
  const std::string mine = address.address().to_string() + " " + std::to_string(address.port());
  store.set(prefix + "addr/" + std::to_string(rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
  // This rank connects to every lower rank and accepts every higher one.
  connect_lower(o, store, prefix, deadline);
  accept_higher(o, store, prefix, deadline, listener);
  for (int p = 0; p < size_; ++p)
    if (p != rank_) set_liveness_options(*peers_[p]->socket, o.liveness);
}

void TcpMesh::connect_lower(const MeshOptions& o, c10d::Store& store, const std::string& prefix,
                            std::chrono::steady_clock::time_point deadline) {
  std::vector<std::string> lower;
  for (int p = 0; p < rank_; ++p) lower.push_back(std::to_string(p));
  wait_for_keys(store, prefix + "addr/", lower, o.rendezvous_timeout, "their address", o.failed_key);
  for (int p = 0; p < rank_; ++p) {
    const auto value = store.get(prefix + "addr/" + std::to_string(p));
    std::istringstream in(std::string(value.begin(), value.end()));
    std::string ip;
    unsigned short port = 0;
    in >> ip >> port;
    tcp::socket& s = *peers_[p]->socket;
    connect_with_retries(s, tcp::endpoint(asio::ip::make_address(ip), port), deadline, [&] {
      check_rendezvous_alive(store, o.failed_key);
    }, [&](const std::string& why) {
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
}

void TcpMesh::accept_higher(const MeshOptions& o, c10d::Store& store, const std::string& prefix,
                            std::chrono::steady_clock::time_point deadline, tcp_mesh_detail::Listener& listener) {
  tcp::acceptor& acceptor = listener.acceptor;
  acceptor.non_blocking(true);
  std::vector<bool> joined(size_, false);
  for (int accepted = 0; accepted < size_ - 1 - rank_;) {
    tcp::socket s(io_->ctx);
    boost::system::error_code ec;
    acceptor.accept(s, ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      // In slices of 200 ms, between which a rank that gave up on the rendezvous is noticed.
      const auto slice = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(200));
      if (wait_readable(acceptor.native_handle(), slice)) continue;
      if (slice < deadline) {
        check_rendezvous_alive(store, o.failed_key);
        continue;
      }
      std::vector<int> missing;
      for (int p = rank_ + 1; p < size_; ++p)
        if (!joined[p]) missing.push_back(p);
      TORCH_CHECK(false, "rendezvous timed out after ", o.rendezvous_timeout.count(), " ms (store prefix '",
                  prefix, "'): rank(s) [", join(missing), "] never connected to rank ", rank_,
                  ". Check that those ranks are alive and that every host can reach every other one "
                  "over TCP (set ZS_SOCKET_IFNAME to pick the network interface)");
    }
    TORCH_CHECK(!ec, "rank ", rank_, " failed accepting a connection from a peer: ", ec.message());
    // A rank of this job says hello at once.
    const std::string who = describe_endpoint(s);
    Hello hello;
    const auto hello_deadline = std::min(deadline, std::chrono::steady_clock::now() + kHelloTimeout);
    const std::string refused =
        read_fully(s, &hello, sizeof(hello), hello_deadline)
            ? refusal(hello, o, rank_, size_, joined)
            : "it sent no complete hello (it closed, or was silent for " + std::to_string(kHelloTimeout.count()) + " ms)";
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

}  // namespace zeroshard::comm
