// launcher.cpp — zeroshard-run's supervision: each attempt starts the group
// of ranks (group.h) and runs the io_context until every rank is gone,
// forwarding signals, reaping, flagging stalls and simulating a preemption;
// then it decides: done, restart, or fail naming the cause.
#include "runtime/launcher/launcher.h"

#include "runtime/free_port.h"
#include "runtime/launcher/child.h"
#include "runtime/launcher/group.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>

#include <signal.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

namespace zeroshard::launcher {
namespace asio = boost::asio;

int pick_free_port(const std::string& host) { return pick_server_port(host); }

namespace {

// One attempt's supervision on the io_context: signals forwarded to the ranks
// (SIGCHLD reaps them), a 50 ms poll for exits and closed pipes, the stall
// check and the simulated preemption. It stops the io_context once every rank
// exited and their pipes closed (2 s at most for pipes a rank's descendants
// keep open).
class Attempt {
 public:
  Attempt(asio::io_context& io, asio::signal_set& signals, const LaunchOptions& opt, Group& group, int attempt,
          int& received_signal)
      : io_(io), signals_(signals), opt_(opt), group_(group), attempt_(attempt), received_signal_(received_signal),
        drain_(io), poll_(io), stall_(io), preempt_(io) {}

  void run() {
    signals_.async_wait([this](boost::system::error_code ec, int sig) { on_signal(ec, sig); });
    try {
      group_.start();
    } catch (const std::exception& e) {
      say(std::string("cannot start the ranks: ") + e.what());
      group_.stop(SIGKILL);
    }
    every(poll_, std::chrono::milliseconds(50), [this] {
      all_exited_ = group_.reap();
      maybe_done();
      return true;
    });
    if (opt_.stall_timeout_s > 0) {
      every(stall_, std::chrono::seconds(1), [this] {
        group_.check_progress();
        return true;
      });
    }
    if (opt_.simulate_preemption_at_step > 0 && attempt_ == 0) {
      every(preempt_, std::chrono::milliseconds(20), [this] { return !preempt_now(); });
    }
    io_.restart();
    io_.run();
    poll_.cancel();
    preempt_.cancel();
    stall_.cancel();
    group_.finish();
    signals_.cancel();
    io_.restart();
    io_.poll();
  }

 private:
  // Runs `tick` every `period` on `timer` for as long as it returns true.
  void every(asio::steady_timer& timer, std::chrono::milliseconds period, std::function<bool()> tick) {
    timer.expires_after(period);
    timer.async_wait([this, &timer, period, tick = std::move(tick)](boost::system::error_code ec) {
      if (!ec && tick()) every(timer, period, tick);
    });
  }

  void on_signal(boost::system::error_code ec, int sig) {
    if (ec) return;
    if (sig == SIGCHLD) {
      all_exited_ = group_.reap();
    } else {
      if (received_signal_ == 0) {
        say(std::string("received SIG") + sigabbrev_np(sig) + "; forwarding it to every rank (" +
            seconds_str(opt_.grace_period_s) + " s grace period)");
      }
      received_signal_ = sig;
      group_.stop(sig);
    }
    maybe_done();
    signals_.async_wait([this](boost::system::error_code e, int s) { on_signal(e, s); });
  }

  void maybe_done() {
    if (!all_exited_) return;
    if (!group_.pipes_open()) {
      io_.stop();
      return;
    }
    if (draining_) return;
    // A rank's descendants may hold its pipes open; do not wait for them forever.
    draining_ = true;
    drain_.expires_after(std::chrono::seconds(2));
    drain_.async_wait([this](boost::system::error_code ec) {
      if (ec) return;
      group_.close_pipes();
      io_.stop();
    });
  }

  // The simulated spot preemption: SIGTERM to every rank once rank 0 reported the step.
  // True once it was sent (or the ranks are stopping anyway).
  bool preempt_now() {
    if (group_.stopping()) return true;
    const int64_t step = group_.reported_step();
    if (step < opt_.simulate_preemption_at_step) return false;
    say("simulating a spot preemption: rank 0 reached step " + std::to_string(step) +
        "; sending SIGTERM to every rank (" + seconds_str(opt_.grace_period_s) + " s grace period)");
    group_.stop(SIGTERM);
    return true;
  }

  asio::io_context& io_;
  asio::signal_set& signals_;
  const LaunchOptions& opt_;
  Group& group_;
  const int attempt_;
  int& received_signal_;
  bool all_exited_ = false, draining_ = false;
  asio::steady_timer drain_, poll_, stall_, preempt_;
};

// The last line of a failed run: its cause. The first rank to fail, when it recorded
// nothing (a signal, a crash: the others' errors follow from it); else the error
// recorded first (zeroshard::record_error), which may be another rank's than the first to exit.
void say_why_it_failed(const Group& group, int exit_code) {
  const int first = group.first_failure();
  const auto [rank, why] = group.recorded(first) ? group.first_recorded_error() : std::pair<int, std::string>{-1, ""};
  say("failed: rank " +
      (rank >= 0 ? std::to_string(rank) + ": " + why : std::to_string(first) + " " + describe_status(group.status_of(first))) +
      "; exit status " + std::to_string(exit_code));
}

}  // namespace

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
    Attempt(io, signals, opt, group, attempt, received_signal).run();
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
    say_why_it_failed(group, exit_code);
  }
  return exit_code;
}

}  // namespace zeroshard::launcher
