// zeroshard/dist_env.h — where this process sits in the job (rank, world, the
// rendezvous address), read from the variables a launcher sets (zeroshard-run,
// torchrun, Slurm, Open MPI), and what a rank tells its launcher: how far it is
// (publish_step) and why it fails (record_error). init_communicator (comm.h)
// takes a DistEnv. Thread-safety: DistEnv is a plain value; call publish_step() and
// record_error() from one thread.
// The variables: docs/communicator.md ("Creating one"); the launcher: docs/launcher.md.
#pragma once

#include <cstdint>
#include <string>

namespace zeroshard {

// Where this process sits in the job, read from the environment.
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Restarts of the group so far: ZS_RESTART_COUNT (zeroshard-run), else
  // TORCHELASTIC_RESTART_COUNT (torchrun).
  int restart_count = 0;
  // torchrun's agent serves the rendezvous store at MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 too, is its client.
  bool agent_store = false;
  std::string source;     // "torchrun", "slurm", "openmpi" or "single" (no variables)
  // ZS_SOCKET_IFNAME: the network interface this rank listens on for its peers
  // (its IPv4 address, else its global IPv6 one). Default (empty): the address
  // this host reaches MASTER_ADDR from, which is loopback only when every rank
  // runs on this host (LOCAL_WORLD_SIZE == WORLD_SIZE); IPv4 or IPv6 alike.
  std::string socket_ifname;
  // ZS_PROGRESS_FILE (zeroshard-run sets it): where publish_step() reports the step.
  std::string progress_file;
  // TORCHELASTIC_ERROR_FILE (zeroshard-run and torchrun set it): where record_error() writes.
  std::string error_file;
};

// Reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), else Slurm's (SLURM_*), else Open MPI's (OMPI_COMM_WORLD_*); with none, a world
// of one rank. Throws, saying what to set, on malformed values, and when a world of more than
// one rank lacks MASTER_ADDR or MASTER_PORT.
DistEnv read_dist_env();

// Tells the launcher how far this rank is (for zeroshard-run's --stall-timeout and
// --simulate-preemption-at-step): writes `step` to env.progress_file; nothing without one.
// Cheap (a small write and a rename).
void publish_step(const DistEnv& env, int64_t step);

// Tells the launcher why this rank is about to fail: writes `message` to env.error_file in
// torchelastic's format (nothing without one), which zeroshard-run's and torchrun's error
// summaries repeat. Call it where the program catches the error it exits with.
void record_error(const DistEnv& env, const std::string& message);

}  // namespace zeroshard
