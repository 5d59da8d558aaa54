// test_util.h — helpers shared by the test files: closed-form patterns,
// the world communicator of a multi-rank run, and running commands.
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/preemption.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard::testing {

// f(rank, i) = ((rank*31 + i*7 + salt*3) mod 17) - 8: small integers, exact in every dtype.
at::Tensor pattern(int rank, int64_t numel, at::ScalarType dtype, int salt = 0);

// The tests' communicator options: a timeout of ZS_TEST_TIMEOUT_S seconds
// (default 60), so that a hang fails the test within a minute.
CommOptions test_comm_options();

// The world communicator of this process (created on first use from the env,
// test_comm_options()).
Communicator& world();
std::shared_ptr<Communicator> world_ptr();

// Where the oracle tests of the sharded optimizers train, and what they shard
// over, chosen by the environment (scripts/gpu-check.sh sets them):
//   ZS_TEST_DEVICE  cpu (default) or cuda (this rank's cuda:LOCAL_RANK modulo
//                   the GPUs present, so several ranks may share one GPU)
//   ZS_TEST_COMM    tcp: the world itself (CPU only); staged: the world with
//                   tensors staged through host memory (stage_through_host,
//                   any device, any number of ranks per GPU), whose data plane
//                   refuses int64/float64 host values; nccl: init_nccl.
//                   Default: tcp on the CPU, nccl on cuda.
c10::Device test_device();
ProcessGroup& test_group();
// "cpu/tcp", "cuda:0/nccl", ...: for the tests' printed lines.
std::string test_setup();

// How far a run's parameters `got` are from a reference run's `want`, relative
// to how far the reference moved from the parameters both started from:
// |got - want| / |want - init| (2-norms). A run that lost a fraction f of its
// updates scores about f, so a bound on it bounds the updates lost; a
// difference in the last bits of values that barely moved does not dominate it.
double relative_displacement_error(const at::Tensor& got, const at::Tensor& want, const at::Tensor& init);

// Directory holding the build's executables (zeroshard-run, examples/...).
std::string build_dir();

struct CommandResult {
  int exit_code = -1;   // the shell's exit status (128 + signal for a signal)
  std::string output;   // stdout and stderr together
  double seconds = 0;
};
// Runs `command` through /bin/sh, capturing stdout+stderr.
CommandResult run_command(const std::string& command);

// A TCP port free on 127.0.0.1 right now.
int free_port();

// Ranks as threads of this process, each with its own communicator, so a test
// controls exactly who arrives and who dies: the DistEnv of rank `rank` of
// `world` with the store on 127.0.0.1:`port` (free_port()), and body(rank)
// run on `world` threads, returning each thread's error text ("" if none).
DistEnv thread_env(int rank, int world, int port);
std::vector<std::string> run_ranks(int world, const std::function<void(int)>& body);

// PreemptionOptions that handle no signal: a test's guard leaves the process's signals alone.
inline PreemptionOptions no_signals() {
  PreemptionOptions o;
  o.signals = {};
  return o;
}

// A fresh empty directory under the system temp dir.
std::string make_temp_dir(const std::string& tag);

// The message (without backtrace) of the c10::Error that f() throws, or "(no error)".
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

}  // namespace zeroshard::testing
