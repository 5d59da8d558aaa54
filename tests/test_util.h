// test_util.h — helpers shared by the test files: closed-form patterns,
// the world communicator of a multi-rank run, and running commands.
#pragma once

#include "zeroshard/comm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <memory>
#include <string>

namespace zeroshard::testing {

// f(rank, i) = ((rank*31 + i*7 + salt*3) mod 17) - 8: small integers, exact in every dtype.
at::Tensor pattern(int rank, int64_t numel, at::ScalarType dtype, int salt = 0);

// The world communicator of this process (created on first use from the env, 60 s timeout).
Communicator& world();
std::shared_ptr<Communicator> world_ptr();

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
