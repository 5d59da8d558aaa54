#include "runtime/launcher/launcher.h"

#include "runtime/free_port.h"

#include "runtime/launcher/child.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <cstring>
#include <iostream>
#include <sstream>
#include <memory>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace zeroshard::launcher {
namespace asio = boost::asio;

namespace {

std::string seconds_str(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

void say(const std::string& line) {
  const std::string s = "zeroshard-run: " + line + "\n";
  (void)!::write(STDERR_FILENO, s.data(), s.size());
}

// Reads one child stream and writes it line by line, each line prefixed.
class PrefixedPipe : public std::enable_shared_from_this<PrefixedPipe> {
 public:
  PrefixedPipe(asio::io_context& io, int fd, int out_fd, std::string prefix)
      : stream_(io, fd), out_fd_(out_fd), prefix_(std::move(prefix)) {}

  void start() { read(); }
  bool open() const { return open_; }
  void close() {
    boost::system::error_code ec;
    stream_.close(ec);
  }

 private:
  void read() {
    auto self = shared_from_this();
    stream_.async_read_some(asio::buffer(chunk_), [self](boost::system::error_code ec, size_t n) {
      if (n > 0) self->consume(self->chunk_.data(), n);
      if (ec) {
        if (!self->partial_.empty()) self->emit(self->partial_ + "\n");
        self->partial_.clear();
        self->open_ = false;
        return;
      }
      self->read();
    });
  }

  void consume(const char* data, size_t n) {
    size_t start = 0;
    for (size_t i = 0; i < n; ++i) {
      if (data[i] != '\n') continue;
      partial_.append(data + start, i + 1 - start);
      emit(partial_);
      partial_.clear();
      start = i + 1;
    }
    partial_.append(data + start, n - start);
  }

  void emit(const std::string& line) {
    const std::string s = prefix_ + line;
    size_t off = 0;
    while (off < s.size()) {
      const ssize_t w = ::write(out_fd_, s.data() + off, s.size() - off);
      if (w <= 0) {
        if (w < 0 && errno == EINTR) continue;
        return;  // our own output is gone; keep draining the child
      }
      off += static_cast<size_t>(w);
    }
  }

  asio::posix::stream_descriptor stream_;
  const int out_fd_;
  const std::string prefix_;
  std::array<char, 64 * 1024> chunk_;
  std::string partial_;
  bool open_ = true;
};

struct Rank {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int64_t last_step = -1;  // from its progress file
  std::chrono::steady_clock::time_point last_change{};
  bool flagged = false;    // said to have stalled (until it moves again)
  int status = 0;
  std::shared_ptr<PrefixedPipe> out, err;
};

// One attempt: start every local rank, supervise until all are gone.
class Group {
 public:
  Group(asio::io_context& io, const LaunchOptions& opt, int port, int attempt, std::string progress_dir)
      : io_(io), opt_(opt), port_(port), attempt_(attempt), progress_dir_(std::move(progress_dir)), kill_timer_(io) {}

  void start() {
    const int world = opt_.nnodes * opt_.nproc_per_node;
    std::vector<std::string> base;
    bool user_omp = false;
    const char* skip[] = {"RANK=", "LOCAL_RANK=", "WORLD_SIZE=", "LOCAL_WORLD_SIZE=", "GROUP_RANK=",
                          "MASTER_ADDR=", "MASTER_PORT=", "ZS_RESTART_COUNT=",
                          "TORCHELASTIC_RESTART_COUNT="};
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv(*e);
      if (kv.rfind("OMP_NUM_THREADS=", 0) == 0) user_omp = true;
      bool replaced = false;
      for (const char* s : skip) replaced = replaced || kv.rfind(s, 0) == 0;
      if (!replaced) base.push_back(kv);
    }
    if (!user_omp) {
      const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
      const int threads = std::max(1, static_cast<int>(cores) / opt_.nproc_per_node);
      base.push_back("OMP_NUM_THREADS=" + std::to_string(threads));
    }
    base.push_back("WORLD_SIZE=" + std::to_string(world));
    base.push_back("LOCAL_WORLD_SIZE=" + std::to_string(opt_.nproc_per_node));
    base.push_back("GROUP_RANK=" + std::to_string(opt_.node_rank));
    base.push_back("MASTER_ADDR=" + opt_.master_addr);
    base.push_back("MASTER_PORT=" + std::to_string(port_));
    base.push_back("ZS_RESTART_COUNT=" + std::to_string(attempt_));
    base.push_back("TORCHELASTIC_RESTART_COUNT=" + std::to_string(attempt_));
    if (!opt_.ifname.empty()) {
      base.erase(std::remove_if(base.begin(), base.end(),
                                [](const std::string& kv) { return kv.rfind("ZS_SOCKET_IFNAME=", 0) == 0; }),
                 base.end());
      base.push_back("ZS_SOCKET_IFNAME=" + opt_.ifname);
    }
    base.erase(std::remove_if(base.begin(), base.end(),
                              [](const std::string& kv) {
                                return kv.rfind("ZS_PROGRESS_FILE=", 0) == 0 ||
                                       kv.rfind("TORCHELASTIC_ERROR_FILE=", 0) == 0;
                              }),
               base.end());

    for (int local = 0; local < opt_.nproc_per_node; ++local) {
      Rank r;
      r.local_rank = local;
      r.global_rank = opt_.node_rank * opt_.nproc_per_node + local;
      auto env = base;
      env.push_back("ZS_PROGRESS_FILE=" + progress_file(local));
      ::unlink(progress_file(local).c_str());
      env.push_back("TORCHELASTIC_ERROR_FILE=" + error_file(local));
      ::unlink(error_file(local).c_str());
      env.push_back("RANK=" + std::to_string(r.global_rank));
      env.push_back("LOCAL_RANK=" + std::to_string(local));
      SpawnedChild c = spawn_child(opt_.command, env);
      r.pid = c.pid;
      r.running = true;
      const std::string prefix = "[rank" + std::to_string(r.global_rank) + "]: ";
      r.out = std::make_shared<PrefixedPipe>(io_, c.stdout_fd, STDOUT_FILENO, prefix);
      r.err = std::make_shared<PrefixedPipe>(io_, c.stderr_fd, STDERR_FILENO, prefix);
      r.out->start();
      r.err->start();
      ranks_.push_back(std::move(r));
    }
  }

  // Reaps exited children; returns true when every rank has exited.
  bool reap() {
    while (true) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (auto& r : ranks_) {
        if (r.pid != pid || !r.running) continue;
        r.running = false;
        r.status = status;
        const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (failed && first_failure_ < 0 && !stopping_) {
          first_failure_ = r.global_rank;
          say("rank " + std::to_string(r.global_rank) + " (pid " + std::to_string(pid) + ") " +
              describe_status(status) + "; stopping the other ranks");
          stop(SIGTERM);
        } else if (failed && stopping_) {
          say("rank " + std::to_string(r.global_rank) + " (pid " + std::to_string(pid) + ") " +
              describe_status(status));
        }
      }
    }
    for (const auto& r : ranks_)
      if (r.running) return false;
    return true;
  }

  // Sends `sig` to every running rank, then SIGKILL after the grace period.
  void stop(int sig) {
    stopping_ = true;
    for (auto& r : ranks_)
      if (r.running) ::kill(-r.pid, sig);
    if (kill_armed_) return;
    kill_armed_ = true;
    kill_timer_.expires_after(std::chrono::milliseconds(static_cast<int64_t>(opt_.grace_period_s * 1000)));
    kill_timer_.async_wait([this](boost::system::error_code ec) {
      if (ec) return;
      for (auto& r : ranks_) {
        if (!r.running) continue;
        say("rank " + std::to_string(r.global_rank) + " still running " +
            seconds_str(opt_.grace_period_s) + " s after SIGTERM; sending SIGKILL");
        ::kill(-r.pid, SIGKILL);
      }
    });
  }

  void finish() {
    kill_timer_.cancel();
    for (auto& r : ranks_) {
      // Also kill what a rank left behind in its process group.
      ::kill(-r.pid, SIGKILL);
    }
  }

  bool pipes_open() const {
    for (const auto& r : ranks_)
      if (r.out->open() || r.err->open()) return true;
    return false;
  }
  void close_pipes() {
    for (auto& r : ranks_) {
      r.out->close();
      r.err->close();
    }
  }

  // Where local rank `local` writes its step (zeroshard::publish_step).
  std::string progress_file(int local) const {
    return progress_dir_ + "/rank-" + std::to_string(local) + ".step";
  }
  // Where local rank `local` writes why it failed (zeroshard::record_error; torchelastic's format).
  std::string error_file(int local) const {
    return progress_dir_ + "/rank-" + std::to_string(local) + ".error.json";
  }
  // Whether global rank `rank` (of this node) recorded why it failed.
  bool recorded(int rank) const {
    const int local = rank - opt_.node_rank * opt_.nproc_per_node;
    return local >= 0 && local < opt_.nproc_per_node && std::filesystem::exists(error_file(local));
  }
  // The error recorded first among this node's ranks (the cause; the others' errors follow from
  // it, and the first rank to exit need not be the one that failed first): {global rank, message},
  // or {-1, ""} when none wrote one.
  std::pair<int, std::string> first_recorded_error() const {
    std::pair<int, std::string> first{-1, ""};
    long double when = 0;
    for (int local = 0; local < opt_.nproc_per_node; ++local) {
      std::ifstream in(error_file(local));
      if (!in) continue;
      const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object() || !j.contains("message")) continue;
      const auto& m = j.at("message");  // torchelastic's {"message": {"message": ..., "extraInfo": ...}}, or {"message": ...}
      const auto& text = m.is_object() && m.contains("message") ? m.at("message") : m;
      if (!text.is_string()) continue;
      // When it was recorded: zeroshard::record_error's "time_ns", else torchelastic's "timestamp" (seconds).
      long double t = 0;
      if (m.is_object() && m.contains("extraInfo") && m.at("extraInfo").is_object()) {
        const auto& info = m.at("extraInfo");
        const auto number = [&](const char* key, long double scale) -> long double {
          if (!info.contains(key) || !info.at(key).is_string()) return -1;
          try {
            return std::stold(info.at(key).get<std::string>()) * scale;
          } catch (const std::exception&) {
            return -1;
          }
        };
        t = number("time_ns", 1);
        if (t < 0) t = number("timestamp", 1e9L);
      }
      if (first.first >= 0 && t >= when) continue;
      first = {opt_.node_rank * opt_.nproc_per_node + local, text.get<std::string>()};
      when = t;
    }
    return first;
  }
  // The step local rank 0 last reported; -1 before any.
  int64_t reported_step(int local = 0) const {
    std::FILE* f = std::fopen(progress_file(local).c_str(), "r");
    if (f == nullptr) return -1;
    long long step = -1;
    if (std::fscanf(f, "%lld", &step) != 1) step = -1;
    std::fclose(f);
    return step;
  }
  bool stopping() const { return stopping_; }

  // Flags every running rank whose reported step has not moved for
  // stall_timeout_s since it last did (ranks that never report are left alone).
  void check_progress() {
    if (opt_.stall_timeout_s <= 0 || stopping_) return;
    const auto now = std::chrono::steady_clock::now();
    int64_t furthest = -1;
    for (auto& r : ranks_) {
      const int64_t step = reported_step(r.local_rank);
      if (step != r.last_step) {
        if (r.flagged) say("rank " + std::to_string(r.global_rank) + " is making progress again (step " + std::to_string(step) + ")");
        r.last_step = step;
        r.last_change = now;
        r.flagged = false;
      }
      furthest = std::max(furthest, r.last_step);
    }
    for (auto& r : ranks_) {
      if (!r.running || r.flagged || r.last_step < 0) continue;
      const double idle = std::chrono::duration<double>(now - r.last_change).count();
      if (idle < opt_.stall_timeout_s) continue;
      r.flagged = true;
      say("rank " + std::to_string(r.global_rank) + " (pid " + std::to_string(r.pid) + ") has reported no progress for " +
          seconds_str(std::round(idle)) + " s: still at step " + std::to_string(r.last_step) +
          (furthest > r.last_step ? " while another rank of this node is at step " + std::to_string(furthest) : "") +
          " (a hang, or a step slower than --stall-timeout)");
    }
  }

  int first_failure() const { return first_failure_; }
  int status_of(int global_rank) const {
    for (const auto& r : ranks_)
      if (r.global_rank == global_rank) return r.status;
    return 0;
  }
  // The first non-zero rank status in rank order, as an exit code; 0 if all succeeded.
  int exit_code() const {
    if (first_failure_ >= 0) return exit_code_of(status_of(first_failure_));
    for (const auto& r : ranks_)
      if (exit_code_of(r.status) != 0) return exit_code_of(r.status);
    return 0;
  }

 private:
  asio::io_context& io_;
  const LaunchOptions& opt_;
  const int port_;
  const int attempt_;
  const std::string progress_dir_;
  std::vector<Rank> ranks_;
  asio::steady_timer kill_timer_;
  bool kill_armed_ = false;
  bool stopping_ = false;
  int first_failure_ = -1;
};

// A private directory for the ranks' progress files, removed at exit.
struct ProgressDir {
  std::string path;
  ProgressDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/zeroshard-run.XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw std::runtime_error("cannot create a directory under " + pattern + ": " + std::strerror(errno));
    }
    path = pattern;
  }
  ~ProgressDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

}  // namespace

int pick_free_port(const std::string& host) { return pick_server_port(host); }

int run(const LaunchOptions& opt) {
  asio::io_context io;
  asio::signal_set signals(io, SIGTERM, SIGINT, SIGCHLD);
  ::signal(SIGPIPE, SIG_IGN);
  int received_signal = 0;
  int exit_code = 0;
  ProgressDir progress_dir;

  for (int attempt = 0; attempt <= opt.max_restarts; ++attempt) {
    const int port = opt.master_port != 0 ? opt.master_port : pick_free_port(opt.master_addr);
    Group group(io, opt, port, attempt, progress_dir.path);
    bool all_exited = false;
    asio::steady_timer drain(io);
    bool draining = false;

    std::function<void()> maybe_done = [&] {
      if (!all_exited) return;
      if (!group.pipes_open()) {
        io.stop();
        return;
      }
      if (draining) return;
      // A rank's descendants may hold its pipes open; do not wait for them forever.
      draining = true;
      drain.expires_after(std::chrono::seconds(2));
      drain.async_wait([&](boost::system::error_code ec) {
        if (ec) return;
        group.close_pipes();
        io.stop();
      });
    };
    std::function<void(boost::system::error_code, int)> on_signal =
        [&](boost::system::error_code ec, int sig) {
          if (ec) return;
          if (sig == SIGCHLD) {
            all_exited = group.reap();
          } else {
            if (received_signal == 0) {
              say(std::string("received SIG") + sigabbrev_np(sig) + "; forwarding it to every rank (" +
                  seconds_str(opt.grace_period_s) + " s grace period)");
            }
            received_signal = sig;
            group.stop(sig);
          }
          maybe_done();
          signals.async_wait(on_signal);
        };
    signals.async_wait(on_signal);
    try {
      group.start();
    } catch (const std::exception& e) {
      say(std::string("cannot start the ranks: ") + e.what());
      group.stop(SIGKILL);
    }
    // A poll timer keeps checking for pipe EOF after every child exited.
    asio::steady_timer poll(io);
    std::function<void(boost::system::error_code)> tick = [&](boost::system::error_code ec) {
      if (ec) return;
      all_exited = group.reap();
      maybe_done();
      poll.expires_after(std::chrono::milliseconds(50));
      poll.async_wait(tick);
    };
    poll.expires_after(std::chrono::milliseconds(50));
    poll.async_wait(tick);
    // Ranks that stop making progress are flagged (once per stall).
    asio::steady_timer stall(io);
    std::function<void(boost::system::error_code)> stall_check = [&](boost::system::error_code ec) {
      if (ec) return;
      group.check_progress();
      stall.expires_after(std::chrono::seconds(1));
      stall.async_wait(stall_check);
    };
    if (opt.stall_timeout_s > 0) {
      stall.expires_after(std::chrono::seconds(1));
      stall.async_wait(stall_check);
    }
    // The simulated spot preemption: SIGTERM to every rank at the reported step.
    asio::steady_timer preempt(io);
    std::function<void(boost::system::error_code)> watch = [&](boost::system::error_code ec) {
      if (ec || group.stopping()) return;
      const int64_t step = group.reported_step();
      if (step >= opt.simulate_preemption_at_step) {
        say("simulating a spot preemption: rank 0 reached step " + std::to_string(step) +
            "; sending SIGTERM to every rank (" + seconds_str(opt.grace_period_s) + " s grace period)");
        group.stop(SIGTERM);
        return;
      }
      preempt.expires_after(std::chrono::milliseconds(20));
      preempt.async_wait(watch);
    };
    if (opt.simulate_preemption_at_step > 0 && attempt == 0) {
      preempt.expires_after(std::chrono::milliseconds(20));
      preempt.async_wait(watch);
    }

    io.restart();
    io.run();
    poll.cancel();
    preempt.cancel();
    stall.cancel();
    group.finish();
    signals.cancel();
    io.restart();
    io.poll();

    exit_code = group.exit_code();
    if (received_signal != 0) {
      say("stopped by SIG" + std::string(sigabbrev_np(received_signal)) + "; exit status " +
          std::to_string(exit_code));
      return exit_code;
    }
    if (group.first_failure() < 0 && exit_code == 0) return 0;
    if (attempt < opt.max_restarts) {
      say("restarting all ranks (restart " + std::to_string(attempt + 1) + " of " +
          std::to_string(opt.max_restarts) + ")");
      continue;
    }
    if (opt.max_restarts > 0) say("no restarts left (--max-restarts " + std::to_string(opt.max_restarts) + ")");
    // The cause: the first rank to fail, when it recorded nothing (a signal, a crash: the others'
    // errors follow from it); else the error recorded first (zeroshard::record_error), which may be
    // another rank's than the first to exit.
    const int first = group.first_failure();
    const auto [rank, why] = group.recorded(first) ? group.first_recorded_error() : std::pair<int, std::string>{-1, ""};
    say("failed: rank " +
        (rank >= 0 ? std::to_string(rank) + ": " + why : std::to_string(first) + " " + describe_status(group.status_of(first))) +
        "; exit status " + std::to_string(exit_code));
  }
  return exit_code;
}

}  // namespace zeroshard::launcher
