// child.h — starting one rank's process for zeroshard-run.
//
// The child runs in its own process group (so a signal can reach the program
// and anything it started), dies with the launcher (PR_SET_PDEATHSIG), and
// has its stdout/stderr connected to pipes the launcher reads.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace zeroshard::launcher {

struct SpawnedChild {
  pid_t pid = -1;
  int stdout_fd = -1;  // read ends, owned by the caller
  int stderr_fd = -1;
};

// `env` entries are "NAME=value" and replace the whole environment.
// Throws std::runtime_error when the process cannot be created. A program
// that cannot be executed exits with status 127 and says why on its stderr.
SpawnedChild spawn_child(const std::vector<std::string>& argv, const std::vector<std::string>& env);

// "exited with code 3", "was killed by signal 9 (SIGKILL)".
std::string describe_status(int wait_status);

// The shell convention: the exit code, or 128 + the signal number.
int exit_code_of(int wait_status);

}  // namespace zeroshard::launcher
