// launcher.h — zeroshard-run: starts and supervises the ranks of one node.
//
// torchrun's conventions and environment protocol. Each rank gets RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT, ZS_RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT), plus
// OMP_NUM_THREADS = cores / local ranks (at least 1) unless the user set it.
// Every line a rank prints is prefixed with "[rank N]: ".
//
// Supervision: when a rank fails (non-zero exit or a signal) the survivors
// get SIGTERM, then SIGKILL after the grace period, and the whole group is
// restarted up to max_restarts times. SIGTERM/SIGINT sent to the launcher are
// forwarded to every rank (same grace period), and no restart follows.
// Each rank gets ZS_PROGRESS_FILE, where zeroshard::publish_step() writes its
// step; the launcher reads it for simulate_preemption_at_step.
// Each rank gets TORCHELASTIC_ERROR_FILE, where zeroshard::record_error() writes why it
// fails; the last line repeats the error recorded first (docs/launcher.md).
// The exit status is the first failing rank's (its code, or 128 + signal),
// else 0. Single-threaded (Boost.Asio event loop).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard::launcher {

struct LaunchOptions {
  int nproc_per_node = 1;          // ranks on this node
  int nnodes = 1;                  // nodes in the job
  int node_rank = 0;               // this node, 0..nnodes-1
  std::string master_addr = "127.0.0.1";
  int master_port = 0;             // 0: pick a free port (single node only)
  // Non-empty: the network interface the ranks listen on for their peers
  // (passed as ZS_SOCKET_IFNAME). Default: the one that routes to master_addr.
  std::string ifname;
  int max_restarts = 0;            // group restarts after a failure
  double grace_period_s = 10.0;    // SIGTERM -> SIGKILL delay
  // > 0: on the first attempt, when this node's first rank reports this step
  // (zeroshard::publish_step, through ZS_PROGRESS_FILE), send every rank
  // SIGTERM as a spot preemption notice would. Ranks that save and exit with
  // kPreemptedExitCode are restarted like any failure (needs max_restarts >= 1).
  int64_t simulate_preemption_at_step = 0;
  // > 0: a rank whose reported step (zeroshard::publish_step) has not moved
  // for this many seconds is named on stderr, once per stall. Ranks that
  // never report are not watched. Default: 600.
  double stall_timeout_s = 600.0;
  std::vector<std::string> command;  // program and its arguments
};

// Runs the job to completion; returns the launcher's exit status.
int run(const LaunchOptions& options);

// A TCP port that was free on `host` a moment ago, below the ephemeral range (runtime/free_port.h).
int pick_free_port(const std::string& host);

}  // namespace zeroshard::launcher
