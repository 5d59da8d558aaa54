#include "runtime/launcher/group.h"

#include "runtime/launcher/child.h"

#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace zeroshard::launcher {

std::string seconds_str(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

void say(const std::string& line) {
  const std::string s = "zeroshard-run: " + line + "\n";
  (void)!::write(STDERR_FILENO, s.data(), s.size());
}

void Group::start() {
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
                              return kv.rfind("ZS_PROGRESS_FILE=", 0) == 0 || kv.rfind("ZS_GRACE_PERIOD_S=", 0) == 0 ||
                                     kv.rfind("TORCHELASTIC_ERROR_FILE=", 0) == 0;
                            }),
             base.end());
  base.push_back("ZS_GRACE_PERIOD_S=" + seconds_str(opt_.grace_period_s));  // what a rank has after SIGTERM

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

bool Group::reap() {
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

void Group::stop(int sig) {
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

void Group::finish() {
  kill_timer_.cancel();
  for (auto& r : ranks_) {
    // Also kill what a rank left behind in its process group.
    ::kill(-r.pid, SIGKILL);
  }
}

bool Group::pipes_open() const {
  for (const auto& r : ranks_)
    if (r.out->open() || r.err->open()) return true;
  return false;
}

void Group::close_pipes() {
  for (auto& r : ranks_) {
    r.out->close();
    r.err->close();
  }
}

std::string Group::progress_file(int local) const {
  return progress_dir_ + "/rank-" + std::to_string(local) + ".step";
}

std::string Group::error_file(int local) const {
  return progress_dir_ + "/rank-" + std::to_string(local) + ".error.json";
}

bool Group::recorded(int rank) const {
  const int local = rank - opt_.node_rank * opt_.nproc_per_node;
  return local >= 0 && local < opt_.nproc_per_node && std::filesystem::exists(error_file(local));
}

std::pair<int, std::string> Group::first_recorded_error() const {
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

int64_t Group::reported_step(int local) const {
  std::FILE* f = std::fopen(progress_file(local).c_str(), "r");
  if (f == nullptr) return -1;
  long long step = -1;
  if (std::fscanf(f, "%lld", &step) != 1) step = -1;
  std::fclose(f);
  return step;
}

void Group::check_progress() {
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

int Group::status_of(int global_rank) const {
  for (const auto& r : ranks_)
    if (r.global_rank == global_rank) return r.status;
  return 0;
}

int Group::exit_code() const {
  if (first_failure_ >= 0) return exit_code_of(status_of(first_failure_));
  for (const auto& r : ranks_)
    if (exit_code_of(r.status) != 0) return exit_code_of(r.status);
  return 0;
}

ProgressDir::ProgressDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/zeroshard-run.XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw std::runtime_error("cannot create a directory under " + pattern + ": " + std::strerror(errno));
  }
  path = pattern;
}

ProgressDir::~ProgressDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

}  // namespace zeroshard::launcher
