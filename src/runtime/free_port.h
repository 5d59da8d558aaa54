// free_port.h — a TCP port for a rendezvous server that nothing else is about to take.
//
// Binding port 0 returns a port from the kernel's ephemeral range, the range
// every outgoing connection on the machine also takes its local port from: in
// the moment between closing the probe and the server's listen(), any connect()
// can take it (seen as EADDRINUSE when ranks of concurrent jobs connect by the
// hundred). So: a random free port below the ephemeral range, where only
// servers bind; port 0's answer only when that range leaves no room.
//
// Thread-safety: safe to call concurrently.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>

namespace zeroshard {

// Whether `port` (0: any) can be bound on `addr` now; the bound port in *bound.
inline bool try_bind_port(in_addr addr, int port, int* bound) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr = addr;
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  if (ok) *bound = ntohs(a.sin_port);
  return ok;
}

// A free port on `host` (an IPv4 address; anything else: every address).
inline int pick_server_port(const std::string& host) {
  in_addr addr{};
  if (::inet_pton(AF_INET, host.c_str(), &addr) != 1) addr.s_addr = htonl(INADDR_ANY);
  int ephemeral_low = 32768;
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  range >> ephemeral_low;
  constexpr int kLowest = 10000;  // above the ports well-known services register
  if (ephemeral_low - kLowest >= 1024) {
    std::mt19937 gen(std::random_device{}());
    std::uniform_int_distribution<int> pick(kLowest, ephemeral_low - 1);
    for (int tries = 0; tries < 64; ++tries) {
      int port = 0;
      if (try_bind_port(addr, pick(gen), &port)) return port;
    }
  }
  int port = 0;
  if (!try_bind_port(addr, 0, &port)) {
    throw std::runtime_error("cannot find a free port on " + host + ": " + std::strerror(errno));
  }
  return port;
}

}  // namespace zeroshard
