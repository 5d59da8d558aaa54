// Rendezvous from the environment (torchrun, Slurm, Open MPI) and creation of
// the world communicator.
#include "runtime/host_name.h"
#include "comm/store_wait.h"
#include "comm/tcp_communicator.h"
#include "comm/watchdog.h"
#include "compat/torch_compat.h"
#include "zeroshard/comm.h"
#include "zeroshard/log.h"

#include <nlohmann/json.hpp>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <optional>
#include <random>

namespace zeroshard {
namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int parse_int(const char* name, const std::string& value, int min_value, const char* hint) {
  size_t used = 0;
  long parsed = 0;
  try {
    parsed = std::stol(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK_VALUE(used == value.size() && used > 0 && parsed >= min_value && parsed <= INT32_MAX,
                    "environment variable ", name, "='", value, "' is not an integer >= ", min_value,
                    "; ", hint);
  return static_cast<int>(parsed);
}

int int_env(const char* name, int fallback, int min_value, const char* hint) {
  auto v = env(name);
  return v ? parse_int(name, *v, min_value, hint) : fallback;
}

// Slurm's SLURM_NTASKS_PER_NODE may read "4" or "4(x2)".
int leading_int(const std::string& s, int fallback) {
  size_t i = 0;
  while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) ++i;
  return i == 0 ? fallback : std::stoi(s.substr(0, i));
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// The address of network interface `name`: its IPv4 address, else its first global IPv6 one.
std::string interface_address(const std::string& name) {
  ifaddrs* list = nullptr;
  TORCH_CHECK(getifaddrs(&list) == 0, "getifaddrs failed: ", std::strerror(errno));
  std::string v4, v6;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || name != i->ifa_name) continue;
    char text[INET6_ADDRSTRLEN] = {0};
    if (i->ifa_addr->sa_family == AF_INET && v4.empty()) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
      v4 = text;
    } else if (i->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      const in6_addr& a = reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr;
      if (IN6_IS_ADDR_LINKLOCAL(&a)) continue;  // needs a scope id the peers cannot know
      inet_ntop(AF_INET6, &a, text, sizeof(text));
      v6 = text;
    }
  }
  freeifaddrs(list);
  TORCH_CHECK_VALUE(!v4.empty() || !v6.empty(), "ZS_SOCKET_IFNAME='", name,
                    "' names no network interface with an IPv4 or global IPv6 address; set it to one that "
                    "`ip addr` lists");
  return v4.empty() ? v6 : v4;
}

// The local address the kernel would send from to reach `host` (a UDP socket's connect
// picks the route and sends nothing); empty when `host` does not resolve or no route
// leads there.
std::string route_source(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0) return "";
  std::string source;
  for (addrinfo* a = found; a != nullptr && source.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char text[INET6_ADDRSTRLEN] = {0};
      const void* raw = local.ss_family == AF_INET6
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (inet_ntop(local.ss_family, raw, text, sizeof(text)) != nullptr) source = text;
    }
    close(fd);
  }
  freeaddrinfo(found);
  return source;
}

// The address this rank listens on for its peers: the interface named by socket_ifname,
// else the one this host reaches the master through. A job whose ranks all run on this
// host listens on loopback; one that spans hosts never does: where the master's name
// resolves to loopback here (Debian maps a host's own name to 127.0.1.1), the address
// of the default route's interface is taken instead.
std::string listen_host(const DistEnv& e) {
  if (!e.socket_ifname.empty()) return interface_address(e.socket_ifname);
  if (e.world_size == 1) return "127.0.0.1";
  const std::string to_master = route_source(e.master_addr);
  TORCH_CHECK(!to_master.empty(), "rank ", e.rank, " finds no route to MASTER_ADDR '", e.master_addr,
              "': it does not resolve or no interface reaches it. Set MASTER_ADDR to an address of rank "
              "0's host that this host reaches, or ZS_SOCKET_IFNAME to the interface to use");
  if (!is_loopback(to_master) || e.local_world_size >= e.world_size) return to_master;
  const std::string outward = route_source(to_master.find(':') == std::string::npos ? "192.0.2.1" : "2001:db8::1");
  TORCH_CHECK(!outward.empty() && !is_loopback(outward), "rank ", e.rank, ": MASTER_ADDR '", e.master_addr,
              "' resolves to loopback (", to_master, ") on this host, but the job spans hosts (",
              e.world_size, " ranks, ", e.local_world_size,
              " here) and this host has no default route to take an address from. Set MASTER_ADDR to "
              "this host's address on the network the hosts share, or ZS_SOCKET_IFNAME to its interface");
  log_info("MASTER_ADDR '" + e.master_addr + "' is loopback on this host but the job spans hosts: rank " +
           std::to_string(e.rank) + " listens on " + outward + " (the default route's interface)");
  return outward;
}

// The token every hello of this job attempt carries: drawn by rank 0, shared through the
// store (under the attempt's prefix, so a rank of an earlier attempt is a stranger).
uint64_t job_token(c10d::Store& store, const std::string& prefix, const DistEnv& e,
                   std::chrono::milliseconds timeout, const std::string& failed_key) {
  const std::string key = prefix + "token/0";
  if (e.rank == 0) {
    std::random_device entropy;
    const uint64_t token = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
    const std::string text = std::to_string(token);
    store.set(key, std::vector<uint8_t>(text.begin(), text.end()));
    return token;
  }
  comm::wait_for_keys(store, prefix + "token/", {"0"}, timeout, "the job token (rank 0 draws it)", failed_key);
  const auto value = store.get(key);
  return std::stoull(std::string(value.begin(), value.end()));
}

}  // namespace

DistEnv read_dist_env() {
  DistEnv e;
  const char* launch_hint =
      "launch with zeroshard-run or torchrun (they set RANK, WORLD_SIZE, LOCAL_RANK, "
      "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or set them yourself";
  if (env("RANK") || env("WORLD_SIZE")) {
    TORCH_CHECK_VALUE(env("RANK") && env("WORLD_SIZE"), "only one of RANK and WORLD_SIZE is set; ",
                      launch_hint);
    e.source = "torchrun";
    e.rank = parse_int("RANK", *env("RANK"), 0, launch_hint);
    e.world_size = parse_int("WORLD_SIZE", *env("WORLD_SIZE"), 1, launch_hint);
    e.local_rank = int_env("LOCAL_RANK", e.rank, 0, launch_hint);
    e.local_world_size = int_env("LOCAL_WORLD_SIZE", e.world_size, 1, launch_hint);
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    const char* hint = "these come from srun; run the program through srun";
    e.source = "slurm";
    e.rank = parse_int("SLURM_PROCID", *env("SLURM_PROCID"), 0, hint);
    e.world_size = parse_int("SLURM_NTASKS", *env("SLURM_NTASKS"), 1, hint);
    e.local_rank = int_env("SLURM_LOCALID", 0, 0, hint);
    e.local_world_size = leading_int(env("SLURM_NTASKS_PER_NODE").value_or(""), e.world_size);
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    const char* hint = "these come from mpirun; run the program through mpirun";
    e.source = "openmpi";
    e.rank = parse_int("OMPI_COMM_WORLD_RANK", *env("OMPI_COMM_WORLD_RANK"), 0, hint);
    e.world_size = parse_int("OMPI_COMM_WORLD_SIZE", *env("OMPI_COMM_WORLD_SIZE"), 1, hint);
    e.local_rank = int_env("OMPI_COMM_WORLD_LOCAL_RANK", 0, 0, hint);
    e.local_world_size = int_env("OMPI_COMM_WORLD_LOCAL_SIZE", e.world_size, 1, hint);
  } else {
    e.source = "single";
  }
  TORCH_CHECK_VALUE(e.rank < e.world_size, "rank ", e.rank, " (from ", e.source,
                    " variables) is not below the world size ", e.world_size,
                    "; every rank must be in 0..WORLD_SIZE-1");
  TORCH_CHECK_VALUE(e.local_rank < e.local_world_size, "local rank ", e.local_rank,
                    " is not below the local world size ", e.local_world_size);
  e.restart_count = env("ZS_RESTART_COUNT")
                        ? int_env("ZS_RESTART_COUNT", 0, 0, "zeroshard-run sets it; unset it otherwise")
                        : int_env("TORCHELASTIC_RESTART_COUNT", 0, 0, "torchrun sets it; unset it otherwise");
  e.agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  e.socket_ifname = env("ZS_SOCKET_IFNAME").value_or("");
  e.progress_file = env("ZS_PROGRESS_FILE").value_or("");
  e.error_file = env("TORCHELASTIC_ERROR_FILE").value_or("");

  auto addr = env("MASTER_ADDR");
  auto port = env("MASTER_PORT");
  if (e.world_size > 1) {
    TORCH_CHECK_VALUE(addr && port, "a world of ", e.world_size, " ranks (from ", e.source,
                      " variables) needs MASTER_ADDR and MASTER_PORT: the host of rank 0 and a free "
                      "TCP port on it, for example MASTER_ADDR=$(hostname) MASTER_PORT=29500 ",
                      "(zeroshard-run and torchrun set them)");
  }
  if (addr) e.master_addr = *addr;
  if (port) {
    e.master_port = parse_int("MASTER_PORT", *port, 1, "set a TCP port in 1..65535");
    TORCH_CHECK_VALUE(e.master_port <= 65535, "environment variable MASTER_PORT='", *port,
                      "' is not a TCP port; set a port in 1..65535");
  }
  return e;
}

void publish_step(const DistEnv& e, int64_t step) {
  if (e.progress_file.empty()) return;
  const std::string tmp = e.progress_file + ".tmp";
  if (std::FILE* f = std::fopen(tmp.c_str(), "w")) {
    std::fprintf(f, "%lld\n", static_cast<long long>(step));
    std::fclose(f);
    std::rename(tmp.c_str(), e.progress_file.c_str());
  }
}

namespace {

// torchelastic's error file: "timestamp" (seconds) is torchelastic's, "time_ns"
// what zeroshard-run orders ranks' errors by; "provisional" marks note_failure's.
void write_error_file(const std::string& path, const std::string& message, int64_t ns, bool provisional) {
  nlohmann::json info = {{"py_callstack", ""},
                         {"timestamp", std::to_string(ns / 1'000'000'000)},
                         {"time_ns", std::to_string(ns)}};
  if (provisional) info["provisional"] = "1";
  const nlohmann::json j = {{"message", {{"message", message}, {"extraInfo", info}}}};
  const std::string tmp = path + ".tmp";
  if (std::FILE* f = std::fopen(tmp.c_str(), "w")) {
    const std::string text = j.dump();
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
    std::rename(tmp.c_str(), path.c_str());
  }
}

// The error file's record: its time and whether note_failure wrote it; nullopt without one.
std::optional<std::pair<int64_t, bool>> recorded(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("message") || !j["message"].is_object()) return std::nullopt;
  const auto info = j["message"].value("extraInfo", nlohmann::json::object());
  const std::string ns = info.is_object() ? info.value("time_ns", std::string()) : std::string();
  if (ns.empty()) return std::nullopt;
  return std::make_pair(static_cast<int64_t>(std::strtoll(ns.c_str(), nullptr, 10)),
                        info.value("provisional", std::string()) == "1");
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void record_error(const DistEnv& e, const std::string& message) {
  if (e.error_file.empty()) return;
  // The moment this rank began to fail, when its communicators stamped it while unwinding.
  const auto earlier = recorded(e.error_file);
  write_error_file(e.error_file, message, earlier && earlier->second ? earlier->first : now_ns(), false);
}

namespace comm {

void note_failure(const std::string& error_file, const std::string& message) {
  if (error_file.empty() || recorded(error_file)) return;
  write_error_file(error_file, message, now_ns(), true);
}

}  // namespace comm

std::shared_ptr<Communicator> init_communicator(const DistEnv& e, const CommOptions& options) {
  init_logging(e.rank, e.world_size);
  comm::install_terminate_handler(e.error_file);
  std::shared_ptr<c10d::Store> store;
  if (e.world_size == 1) {
    store = std::make_shared<c10d::HashStore>();
  } else {
    const bool server = e.rank == 0 && !e.agent_store;
    try {
      store = compat::make_tcp_store(e.master_addr, static_cast<uint16_t>(e.master_port), server,
                                     e.world_size, options.rendezvous_timeout);
    } catch (const std::exception& ex) {
      const std::string cause = error_message(ex);
      if (server) {
        TORCH_CHECK(false, "rank 0 cannot serve the rendezvous store on ", e.master_addr, ":",
                    e.master_port, " (", cause,
                    "). If the port is in use, set another MASTER_PORT (zeroshard-run picks a free "
                    "one when --master-port is omitted)");
      }
      TORCH_CHECK(false, "rank ", e.rank, " cannot reach the rendezvous store at ", e.master_addr,
                  ":", e.master_port, " (", cause, "). ",
                  e.agent_store ? "torchrun's agent serves it (TORCHELASTIC_USE_AGENT_STORE=True): check that the "
                                  "agent is running and that MASTER_ADDR/MASTER_PORT are the ones it set"
                                : "Check that rank 0 is running and that MASTER_ADDR/MASTER_PORT name its host "
                                  "and port");
    }
  }
  std::vector<int> world(e.world_size);
  std::iota(world.begin(), world.end(), 0);
  // torchrun's agent store outlives the ranks: each attempt's keys are apart from the last one's.
  // A store of rank 0's own is new with each attempt, and its keys name none: ranks of different
  // restart counts meet there, as when an elastic run takes in a host whose agent is new (count 0)
  // beside agents that restarted after a failure.
  const std::string attempt = e.agent_store ? "zs/r" + std::to_string(e.restart_count) + "/" : "zs/";
  const std::string prefix = attempt + "world/";
  comm::MeshOptions mesh;
  mesh.failed_key = attempt + "failed";
  mesh.error_file = e.error_file;
  std::shared_ptr<Communicator> comm;
  try {
    mesh.host = listen_host(e);
    mesh.token = job_token(*store, prefix, e, options.rendezvous_timeout, mesh.failed_key);
    comm = std::make_shared<comm::TcpCommunicator>(e.rank, e.world_size, world, store, prefix, mesh, options);
  } catch (const std::exception& ex) {
    // The others stop waiting for this rank at once (the first failure's message is the one they see).
    const std::string why = error_message(ex);
    const bool read_it = why.rfind("rendezvous abandoned", 0) == 0;  // counted as a reader already
    if (!read_it) {
      comm::rendezvous_failed(*store, mesh.failed_key, "rank " + std::to_string(e.rank) + " on host " + host_name() +
                                                           " failed: " + why, e.rank != 0);
    }
    // Rank 0 serves the store (unless torchrun's agent does): it stays until the other
    // ranks have read why, so that one that comes late does not find the store gone.
    if (e.rank == 0 && !e.agent_store) {
      comm::linger_after_failure(*store, mesh.failed_key, e.world_size - 1 + (read_it ? 1 : 0),
                                 std::min<std::chrono::milliseconds>(options.rendezvous_timeout, std::chrono::seconds(10)));
    }
    throw;
  }
  log_debug("communicator ready: rank " + std::to_string(e.rank) + " of " +
            std::to_string(e.world_size) + " via " + e.source + " (" + e.master_addr + ":" +
            std::to_string(e.master_port) + ")");
  return comm;
}

std::shared_ptr<Communicator> init_communicator(const CommOptions& options) {
  return init_communicator(read_dist_env(), options);
}

}  // namespace zeroshard
