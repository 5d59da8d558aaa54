// zeroshard-run: launch N local ranks of a training program (torchrun's conventions).
//   zeroshard-run --nproc-per-node 4 [--nnodes 2 --node-rank 0 --master-addr HOST --master-port P]
//                 [--max-restarts K] [--grace-period S] [--simulate-preemption-at-step N] -- program args...
#include "runtime/launcher/launcher.h"

#include <CLI/CLI.hpp>

#include <iostream>

int main(int argc, char** argv) {
  zeroshard::launcher::LaunchOptions opt;
  CLI::App app{"zeroshard-run: start and supervise the ranks of a zeroshard program on this node"};
  app.add_option("--nproc-per-node", opt.nproc_per_node, "ranks to start on this node")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--nnodes", opt.nnodes, "nodes in the job")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--node-rank", opt.node_rank, "this node's index, 0..nnodes-1")->capture_default_str();
  app.add_option("--master-addr", opt.master_addr, "host of rank 0 (serves the rendezvous store)")
      ->capture_default_str();
  app.add_option("--master-port", opt.master_port, "rendezvous port; 0 picks a free one (single node)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--ifname", opt.ifname,
                 "network interface the ranks listen on for their peers (default: the one that routes to "
                 "--master-addr)");
  app.add_option("--max-restarts", opt.max_restarts, "restarts of the whole group after a failure")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--grace-period", opt.grace_period_s, "seconds between SIGTERM and SIGKILL")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  app.add_option("--simulate-preemption-at-step", opt.simulate_preemption_at_step,
                 "first attempt only: send every rank SIGTERM (a spot notice) when rank 0 reports this step "
                 "(zeroshard::publish_step); use with --max-restarts >= 1 to see the resume")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 62));
  app.add_option("--stall-timeout", opt.stall_timeout_s,
                 "seconds without a new step (zeroshard::publish_step) before a rank is named as stalled; 0: off")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  app.add_option("command", opt.command, "the program and its arguments (after --)")->required();
  app.positionals_at_end();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (opt.node_rank < 0 || opt.node_rank >= opt.nnodes) {
    std::cerr << "zeroshard-run: --node-rank " << opt.node_rank << " must be in 0.." << opt.nnodes - 1
              << " (--nnodes " << opt.nnodes << ")\n";
    return 2;
  }
  if (opt.nnodes > 1 && opt.master_port == 0) {
    std::cerr << "zeroshard-run: with --nnodes " << opt.nnodes
              << " every node must use the same port: pass --master-port (and --master-addr, the "
                 "host of node 0)\n";
    return 2;
  }
  try {
    return zeroshard::launcher::run(opt);
  } catch (const std::exception& e) {
    std::cerr << "zeroshard-run: " << e.what() << "\n";
    return 1;
  }
}
