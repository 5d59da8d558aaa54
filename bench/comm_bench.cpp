// comm_bench: algorithm and bus bandwidth of all_gather, reduce_scatter and
// all_reduce, beside a raw-TCP anchor measured in the same run.
//
// The anchor: plain TCP streams between the same processes (each rank sends to
// rank+1 and receives from rank-1 at the same time, a ring) moving the same
// bytes in the same pattern: n-1 steps of S/n bytes for all_gather and
// reduce_scatter, 2(n-1) steps for all_reduce. No reduction, no copies: what
// the network (loopback, or the links between hosts) can physically carry for
// that traffic. Each rank's anchor socket listens on the address its host
// reaches MASTER_ADDR from (loopback when MASTER_ADDR is a loopback address).
//
//   zeroshard-run --nproc-per-node 4 -- ./comm_bench [--min-kib 4] [--max-mib 64]
//                 [--algorithm auto|ring|pairwise]   (CommOptions::algorithm)
//
// Bus bandwidth = algorithm bandwidth (S / time) x (n-1)/n for all_gather and
// reduce_scatter, x 2(n-1)/n for all_reduce (NCCL's convention): the rate at
// which each rank's link carries the payload, comparable across world sizes.
#include <zeroshard/comm.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace comm_bench {

using Clock = std::chrono::steady_clock;

void check(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string("comm_bench: ") + what + ": " + std::strerror(errno));
}

// The IPv4 address this host reaches MASTER_ADDR from (a UDP connect picks the
// route and sends nothing); loopback when MASTER_ADDR is unset or a loopback address.
in_addr local_address() {
  in_addr loopback{htonl(INADDR_LOOPBACK)};
  const char* master = std::getenv("MASTER_ADDR");
  if (master == nullptr) return loopback;
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(master, "9", &hints, &found) != 0 || found == nullptr)
    throw std::runtime_error(std::string("comm_bench: MASTER_ADDR ") + master + " has no IPv4 address");
  const auto to = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
  freeaddrinfo(found);
  if ((ntohl(to.sin_addr.s_addr) >> 24) == 127) return loopback;
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  check(fd >= 0, "socket");
  check(connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) == 0, "connect (route to MASTER_ADDR)");
  sockaddr_in me{};
  socklen_t len = sizeof(me);
  check(getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0, "getsockname");
  close(fd);
  return me.sin_addr;
}

// A TCP ring: a connection to rank+1 (sending) and one from rank-1 (receiving).
class TcpRing {
 public:
  explicit TcpRing(zeroshard::Communicator& comm) {
    const int n = comm.size(), r = comm.rank();
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    check(listener >= 0, "socket");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr = local_address();
    socklen_t len = sizeof(a);
    check(bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0, "bind");
    check(listen(listener, 1) == 0, "listen");
    check(getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len) == 0, "getsockname");
    // Exchange the listening addresses and ports through the communicator itself.
    auto mine = torch::tensor({static_cast<int64_t>(ntohl(a.sin_addr.s_addr)), static_cast<int64_t>(ntohs(a.sin_port))},
                              torch::kLong);
    auto all = torch::zeros({2 * n}, torch::kLong);
    comm.all_gather(all, mine)->wait();

    const int right_rank = (r + 1) % n;
    sockaddr_in right{};
    right.sin_family = AF_INET;
    right.sin_addr.s_addr = htonl(static_cast<uint32_t>(all[2 * right_rank].item<int64_t>()));
    right.sin_port = htons(static_cast<uint16_t>(all[2 * right_rank + 1].item<int64_t>()));
    send_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    check(connect(send_fd_, reinterpret_cast<sockaddr*>(&right), sizeof(right)) == 0, "connect");
    recv_fd_ = accept(listener, nullptr, nullptr);
    check(recv_fd_ >= 0, "accept");
    close(listener);
    for (int fd : {send_fd_, recv_fd_}) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    }
  }
  ~TcpRing() {
    close(send_fd_);
    close(recv_fd_);
  }

  // One ring step: send `bytes` to the right while receiving `bytes` from the left.
  void step(const char* src, char* dst, size_t bytes) {
    size_t sent = 0, got = 0;
    while (sent < bytes || got < bytes) {
      // Ask only for what is still to do (a finished direction would make poll spin).
      pollfd fds[2] = {{send_fd_, static_cast<short>(sent < bytes ? POLLOUT : 0), 0},
                       {recv_fd_, static_cast<short>(got < bytes ? POLLIN : 0), 0}};
      check(poll(fds, 2, 60000) > 0, "poll");
      if (sent < bytes && (fds[0].revents & POLLOUT)) {
        ssize_t w = ::send(send_fd_, src + sent, bytes - sent, MSG_NOSIGNAL);
        if (w > 0) sent += static_cast<size_t>(w);
        else check(errno == EAGAIN || errno == EINTR, "send");
      }
      if (got < bytes && (fds[1].revents & (POLLIN | POLLHUP))) {
        ssize_t rd = ::recv(recv_fd_, dst + got, bytes - got, 0);
        if (rd > 0) got += static_cast<size_t>(rd);
        else check(rd < 0 && (errno == EAGAIN || errno == EINTR), "recv");
      }
    }
  }

 private:
  int send_fd_ = -1, recv_fd_ = -1;
};

struct Row {
  const char* op;
  int64_t bytes;
  double ours_s, tcp_s;
  double factor;
};

// Seconds per call of `fn`: the slowest rank's mean over `iters` calls.
template <typename F>
double trial(zeroshard::Communicator& comm, int iters, F& fn) {
  comm.barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) fn();
  auto t = torch::full({1}, std::chrono::duration<double>(Clock::now() - t0).count() / iters, torch::kDouble);
  comm.all_reduce(t, zeroshard::ReduceOp::kMax)->wait();
  return t.item<double>();
}

// An operation and its anchor, each the best of three trials, taken in turn
// (anchor, ours, anchor, ours, ...): on shared cores the loopback rate drifts
// by tens of percent within a run, and alternating keeps that drift out of
// the ratio.
struct Pair {
  double ours_s, anchor_s;
};
template <typename F, typename A>
Pair timed(zeroshard::Communicator& comm, int iters, F fn, A anchor) {
  fn();  // warm-up
  anchor();
  Pair best{1e30, 1e30};
  for (int k = 0; k < 3; ++k) {
    best.anchor_s = std::min(best.anchor_s, trial(comm, iters, anchor));
    best.ours_s = std::min(best.ours_s, trial(comm, iters, fn));
  }
  return best;
}

std::string human(int64_t bytes) {
  char buf[32];
  if (bytes >= (1 << 20)) std::snprintf(buf, sizeof(buf), "%lld MiB", static_cast<long long>(bytes >> 20));
  else std::snprintf(buf, sizeof(buf), "%lld KiB", static_cast<long long>(bytes >> 10));
  return buf;
}

}  // namespace comm_bench

int comm_bench_main(int argc, char** argv) {
  using namespace comm_bench;
  int64_t min_kib = 4, max_mib = 64;
  std::string algorithm = "auto";
  CLI::App app{"comm_bench: collective bandwidth beside a raw TCP ring"};
  app.add_option("--min-kib", min_kib, "smallest buffer, KiB")->capture_default_str();
  app.add_option("--max-mib", max_mib, "largest buffer, MiB")->capture_default_str();
  app.add_option("--algorithm", algorithm, "large operations on 3+ ranks: auto (a ring across hosts, or from 2 MiB slices), ring or pairwise")
      ->check(CLI::IsMember({"auto", "ring", "pairwise"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  zeroshard::CommOptions options;
  if (algorithm == "ring") options.algorithm = zeroshard::CommOptions::Algorithm::kRing;
  if (algorithm == "pairwise") options.algorithm = zeroshard::CommOptions::Algorithm::kPairwise;
  auto comm = zeroshard::init_communicator(options);
  const int n = comm->size(), r = comm->rank();
  if (n < 2) {
    std::fprintf(stderr, "comm_bench needs at least 2 ranks (zeroshard-run --nproc-per-node 2 ...)\n");
    return 2;
  }
  TcpRing ring(*comm);
  // How many hosts: distinct host names among the ranks.
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  auto host_hash = torch::full({1}, static_cast<int64_t>(std::hash<std::string>{}(name) >> 1), torch::kLong);
  auto hashes = torch::zeros({n}, torch::kLong);
  comm->all_gather(hashes, host_hash)->wait();
  std::set<int64_t> hosts(hashes.data_ptr<int64_t>(), hashes.data_ptr<int64_t>() + n);
  std::vector<Row> rows;
  for (int64_t bytes = min_kib << 10; bytes <= (max_mib << 20); bytes *= 4) {
    const int64_t numel = bytes / 4 / n * n;  // float32, divisible by n
    const int64_t chunk = numel / n;
    const int iters = static_cast<int>(std::max<int64_t>(3, std::min<int64_t>(100, (int64_t(128) << 20) / bytes)));
    auto full = torch::randn({numel});
    auto part = torch::randn({chunk});
    std::vector<char> scratch(chunk * 4);
    const char* src = static_cast<const char*>(full.data_ptr());

    auto ring_steps = [&](int steps) {
      for (int s = 0; s < steps; ++s) ring.step(src + ((r - s + 2 * n) % n) * chunk * 4, scratch.data(), chunk * 4);
    };
    auto tcp_one = [&] { ring_steps(n - 1); };
    auto tcp_two = [&] { ring_steps(2 * (n - 1)); };
    const Pair ag = timed(*comm, iters, [&] { comm->all_gather(full, part)->wait(); }, tcp_one);
    // In place (this rank's shard is a slice of the output), as sharded parameters are gathered.
    auto own = full.slice(0, r * chunk, (r + 1) * chunk);
    const Pair ag_in_place = timed(*comm, iters, [&] { comm->all_gather(full, own)->wait(); }, tcp_one);
    const Pair rs =
        timed(*comm, iters, [&] { comm->reduce_scatter(part, full, zeroshard::ReduceOp::kSum)->wait(); }, tcp_one);
    const Pair ar = timed(*comm, iters, [&] { comm->all_reduce(full, zeroshard::ReduceOp::kSum)->wait(); }, tcp_two);
    const double f1 = double(n - 1) / n, f2 = 2.0 * (n - 1) / n;
    rows.push_back({"all_gather", numel * 4, ag.ours_s, ag.anchor_s, f1});
    rows.push_back({"all_gather in place", numel * 4, ag_in_place.ours_s, ag_in_place.anchor_s, f1});
    rows.push_back({"reduce_scatter", numel * 4, rs.ours_s, rs.anchor_s, f1});
    rows.push_back({"all_reduce", numel * 4, ar.ours_s, ar.anchor_s, f2});
  }

  if (r == 0) {
    std::printf("comm_bench: %d ranks on %zu host(s), zeroshard TCP (algorithm %s), float32, %u cores\n", n,
                hosts.size(), algorithm.c_str(), std::thread::hardware_concurrency());
    std::printf("| op | size | ours us | ours algbw GB/s | ours busbw GB/s | tcp ring busbw GB/s | ours/tcp |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
    for (const auto& row : rows) {
      const double alg = row.bytes / row.ours_s / 1e9;
      const double bus = alg * row.factor;
      const double tcp_bus = row.bytes / row.tcp_s / 1e9 * row.factor;
      std::printf("| %s | %s | %.0f | %.2f | %.2f | %.2f | %.2f |\n", row.op, human(row.bytes).c_str(),
                  row.ours_s * 1e6, alg, bus, tcp_bus, bus / tcp_bus);
    }
  }
  comm->barrier();
  return 0;
}
