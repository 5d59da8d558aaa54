// zeroshard-run, driven as a user would: real processes, real signals.
#include "test_util.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

namespace zeroshard {
namespace launcher_test {

using testing::run_command;

std::string launcher() { return testing::build_dir() + "/zeroshard-run"; }

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(Launcher, SetsTheEnvProtocolAndPrefixesOutput) {
  auto r = run_command("ZS_GRACE_PERIOD_S=99 " + launcher() + " --nproc-per-node 3 --grace-period 7.5 -- bash -c "
                       "'echo \"env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR "
                       "$ZS_RESTART_COUNT $OMP_NUM_THREADS grace=$ZS_GRACE_PERIOD_S port=$MASTER_PORT\"'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const std::string omp = std::to_string(std::max(1u, cores / 3));
  for (int rank = 0; rank < 3; ++rank) {
    const std::string line = "[rank" + std::to_string(rank) + "]: env " + std::to_string(rank) + " " +
                             std::to_string(rank) + " 3 3 127.0.0.1 0 " + omp + " grace=7.5 port=";
    EXPECT_NE(r.output.find(line), std::string::npos) << "missing '" << line << "' in\n" << r.output;
  }
  // A free port was picked, the same for every rank.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("port=(\\d+)"))) << r.output;
  EXPECT_GT(std::stoi(m[1]), 0);
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '='), 6);  // grace= and port= on each of 3 lines
  auto first = r.output.find("port=" + m[1].str());
  EXPECT_NE(r.output.find("port=" + m[1].str(), first + 1), std::string::npos);
}

// Ranks report steps through ZS_PROGRESS_FILE (zeroshard::publish_step writes
// it; a shell writes it the same way here).
TEST(Launcher, NamesARankThatStopsMakingProgress) {
  auto r = run_command(launcher() + " --nproc-per-node 2 --stall-timeout 1 -- bash -c "
                       "'for s in 1 2 3 4 5 6 7 8; do echo $s > $ZS_PROGRESS_FILE; "
                       "if [ $RANK = 1 ] && [ $s -ge 3 ]; then sleep 3; break; fi; sleep 0.3; done'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("has reported no progress for"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("still at step 3"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("rank 0 (pid"), std::string::npos) << "rank 0 kept reporting\n" << r.output;
}

TEST(Launcher, SimulatesASpotPreemptionAtAReportedStep) {
  // Rank 0 reports steps; at step 3 every rank gets SIGTERM and exits 75
  // (as a PreemptionGuard program does); the group is restarted once, and the
  // second attempt runs to the end (no second preemption).
  auto r = run_command(launcher() + " --nproc-per-node 2 --max-restarts 1 --simulate-preemption-at-step 3 -- bash -c "
                       "'trap \"echo got-term; exit 75\" TERM; echo attempt=$ZS_RESTART_COUNT; "
                       "for s in 1 2 3 4 5 6 7 8 9 10; do echo $s > $ZS_PROGRESS_FILE; sleep 0.2 & wait; done; echo done'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("simulating a spot preemption: rank 0 reached step 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank1]: got-term"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restarting all ranks (restart 1 of 1)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank0]: attempt=1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank0]: done"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("simulating", r.output.find("restarting all ranks")), std::string::npos)
      << "the restarted attempt must not be preempted again\n" << r.output;
}

TEST(Launcher, KeepsTheUsersOmpNumThreads) {
  auto r = run_command("OMP_NUM_THREADS=7 " + launcher() +
                       " --nproc-per-node 2 -- bash -c 'echo omp=$OMP_NUM_THREADS'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank1]: omp=7"), std::string::npos) << r.output;
}

TEST(Launcher, PropagatesTheFailingRanksExitCodeAndStopsTheOthers) {
  auto r = run_command(launcher() + " --nproc-per-node 3 --grace-period 5 -- bash -c "
                       "'if [ $RANK = 1 ]; then sleep 0.2; exit 7; fi; sleep 60'");
  EXPECT_EQ(r.exit_code, 7) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 7"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0) << "the survivors must be stopped, not waited for";
}

TEST(Launcher, NamesARankKilledBySignal) {
  auto r = run_command(launcher() + " --nproc-per-node 2 -- bash -c "
                       "'if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 60'");
  EXPECT_EQ(r.exit_code, 128 + 9) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0);
}

TEST(Launcher, RestartsTheWholeGroupUpToMaxRestarts) {
  const auto dir = testing::make_temp_dir("restart");
  // Rank 0 fails on the first two attempts (after the others logged their start);
  // every start of every rank is logged.
  const std::string script = "'echo \"$RANK $ZS_RESTART_COUNT\" >> " + dir +
                             "/starts; if [ $RANK = 0 ] && [ $ZS_RESTART_COUNT -lt 2 ]; then sleep 0.5; exit 3; fi; "
                             "sleep 0.3'";
  auto ok = run_command(launcher() + " --nproc-per-node 2 --max-restarts 2 -- bash -c " + script);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("restart 2 of 2"), std::string::npos) << ok.output;
  const std::string starts = read_file(dir + "/starts");
  for (const char* line : {"0 0", "1 0", "0 1", "1 1", "0 2", "1 2"})
    EXPECT_NE(starts.find(line), std::string::npos) << "no start '" << line << "' in\n" << starts;

  std::filesystem::remove(dir + "/starts");
  auto fail = run_command(launcher() + " --nproc-per-node 2 --max-restarts 1 -- bash -c " + script);
  EXPECT_EQ(fail.exit_code, 3) << fail.output;
  EXPECT_NE(fail.output.find("no restarts left"), std::string::npos) << fail.output;
  EXPECT_EQ(read_file(dir + "/starts").find(" 2"), std::string::npos) << "restarted more than asked";
  std::filesystem::remove_all(dir);
}

// A shell command: zeroshard-run starts 2 ranks that run `trap` and then loop;
// once both said they are ready the launcher gets SIGTERM. Prints the time from
// SIGTERM to the launcher's exit as "elapsed_ms=N" and exits with its status.
std::string sigterm_once_ready(const std::string& dir, const std::string& flags, const std::string& trap) {
  return launcher() + " --nproc-per-node 2 " + flags + " -- bash -c '" + trap + "; echo ready > " + dir +
         "/ready.$RANK; while true; do sleep 0.05; done' & pid=$!; "
         "while [ ! -f " + dir + "/ready.0 ] || [ ! -f " + dir + "/ready.1 ]; do sleep 0.05; done; "
         "start=$(date +%s%N); kill -TERM $pid; wait $pid; rc=$?; end=$(date +%s%N); "
         "echo \"elapsed_ms=$(( (end - start) / 1000000 ))\"; exit $rc";
}

TEST(Launcher, ForwardsSigtermAndWaitsForAGracefulExit) {
  const auto dir = testing::make_temp_dir("sigterm");
  // Ranks trap SIGTERM, take 0.5 s to "save", write a marker and exit 0.
  auto r = run_command(sigterm_once_ready(
      dir, "--grace-period 10", "trap \"sleep 0.5; echo saved > " + dir + "/saved.$RANK; exit 0\" TERM"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("received SIGTERM; forwarding it"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir + "/saved.0")) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir + "/saved.1")) << r.output;
  EXPECT_EQ(r.output.find("restarting"), std::string::npos) << "a stop request must not restart";
  std::filesystem::remove_all(dir);
}

TEST(Launcher, KillsRanksThatIgnoreSigtermAfterTheGracePeriod) {
  const auto dir = testing::make_temp_dir("grace");
  auto r = run_command(sigterm_once_ready(dir, "--grace-period 1.5", "trap \"\" TERM"));
  EXPECT_EQ(r.exit_code, 128 + 9) << r.output;
  EXPECT_NE(r.output.find("still running 1.5"), std::string::npos) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("elapsed_ms=([0-9]+)"))) << r.output;
  const double elapsed = std::stod(m[1]) / 1000.0;
  EXPECT_GE(elapsed, 1.4) << "SIGKILL came before the grace period";
  EXPECT_LT(elapsed, 5.0) << "SIGKILL came long after the grace period";
  std::filesystem::remove_all(dir);
}

TEST(Launcher, RejectsBadFlagsWithAMessage) {
  auto r = run_command(launcher() + " --nnodes 2 --nproc-per-node 1 -- true");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("pass --master-port"), std::string::npos) << r.output;
  r = run_command(launcher() + " --nproc-per-node 0 -- true");
  EXPECT_NE(r.exit_code, 0);
  r = run_command(launcher() + " --nproc-per-node 1 -- /nonexistent/program");
  EXPECT_EQ(r.exit_code, 127) << r.output;
  EXPECT_NE(r.output.find("cannot execute /nonexistent/program"), std::string::npos) << r.output;
}

// Two launchers on one host stand in for two nodes: global ranks follow
// node_rank * nproc + local rank, and the four ranks form one world.
TEST(Launcher, TwoNodesFormOneWorld) {
  const int port = testing::free_port();
  const std::string node = launcher() + " --nnodes 2 --nproc-per-node 2 --master-port " +
                           std::to_string(port) + " --node-rank ";
  const std::string prog = " -- " + testing::build_dir() +
                           "/tests/zs_tests --gtest_filter=Collectives.SendRecvBetweenEveryPair:"
                           "Collectives.AllReduceOtherDtypes";
  auto r = run_command(node + "1" + prog + " > /dev/null 2>&1 & other=$!; " + node + "0" + prog +
                       "; rc=$?; wait $other; rc1=$?; echo \"node0=$rc node1=$rc1\"");
  EXPECT_NE(r.output.find("node0=0 node1=0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank1]: [  PASSED  ] 2 tests"), std::string::npos) << r.output;
}

// A rank SIGKILLed in the middle of a collective: the others fail fast naming it,
// and the launcher exits non-zero naming the rank and the signal.
TEST(Launcher, RankKilledMidCollective) {
  auto r = run_command(launcher() + " --nproc-per-node 3 --grace-period 20 -- " +
                       testing::build_dir() + "/tests/zs_tests --helper kill_mid_collective");
  EXPECT_EQ(r.exit_code, 128 + 9) << r.output;
  EXPECT_NE(r.output.find("rank 2 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << r.output;
  for (int rank : {0, 1}) {
    const std::string tag = "[rank" + std::to_string(rank) + "]: survivor error: all_reduce #";
    auto at = r.output.find(tag);
    ASSERT_NE(at, std::string::npos) << r.output;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    // Rank 2 is named; the other survivor may be named too if it already exited.
    std::smatch m;
    ASSERT_TRUE(std::regex_search(line, m, std::regex("rank\\(s\\) \\[([0-9, ]+)\\]"))) << line;
    EXPECT_NE(m[1].str().find('2'), std::string::npos) << line;
  }
  EXPECT_LT(r.seconds, 20.0) << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << "a C++ backtrace in what a person reads:\n" << r.output;
  // The cause, although the survivors recorded errors: the first rank to fail recorded none.
  EXPECT_NE(r.output.find("zeroshard-run: failed: rank 2 was killed by signal 9 (SIGKILL); exit status 137"),
            std::string::npos)
      << r.output;
}

// A rank that fails with an error it records (zeroshard::record_error, torchelastic's
// error file): the launcher's last line repeats its message, although the ranks that lost
// it exit and record their errors first (its communicator, aborted as the error unwound
// the stack, stamped the moment: note_failure); no backtrace anywhere.
TEST(Launcher, LastLineRepeatsTheFirstFailingRanksError) {
  auto r = run_command(launcher() + " --nproc-per-node 3 --grace-period 5 -- " + testing::build_dir() +
                       "/tests/zs_tests --helper fail_with_error");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  std::string last = r.output;
  last.erase(last.find_last_not_of('\n') + 1);
  last = last.substr(last.rfind('\n') + 1);
  EXPECT_EQ(last, "zeroshard-run: failed: rank 1: rank 1 of this test fails on purpose (step 7, file 'x.h5'); "
                  "exit status 1")
      << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
}

// The line `rank` reported its error on ("[rankN]: error: ..."), "" if none.
std::string error_line(const std::string& output, int rank) {
  const auto at = output.find("[rank" + std::to_string(rank) + "]: error: ");
  return at == std::string::npos ? std::string() : output.substr(at, output.find('\n', at) - at);
}

// A rank that dies of an exception nobody caught (std::terminate) still tells its
// peers why before its sockets close: their errors carry its message, not a bare
// end of stream, and the launcher's last line repeats it (the handler recorded it).
TEST(Launcher, AnUncaughtExceptionReachesThePeersWithItsMessage) {
  auto r = run_command(launcher() + " --nproc-per-node 3 --grace-period 5 -- " + testing::build_dir() +
                       "/tests/zs_tests --helper fail_uncaught");
  EXPECT_EQ(r.exit_code, 128 + 6) << r.output;  // SIGABRT, from std::terminate
  const std::string message = "rank 1 of this test throws on purpose, caught by no one";
  for (int rank : {0, 2}) {
    const std::string line = error_line(r.output, rank);
    EXPECT_NE(line.find("rank 1 aborted: this rank ended with an uncaught exception: " + message), std::string::npos)
        << r.output;
  }
  EXPECT_NE(r.output.find("zeroshard-run: failed: rank 1: this rank ended with an uncaught exception: " + message),
            std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 20.0) << r.output;
}

// A rank that aborts its communicator and lives on (8 s): its peers fail at once,
// naming it and its reason, without waiting for it to exit, and the launcher's last
// line names it, the first cause (abort() recorded it), not a peer that failed of it.
TEST(Launcher, PeersOfAnAbortingRankFailAtOnceAndTheLauncherNamesIt) {
  auto r = run_command(launcher() + " --nproc-per-node 3 --grace-period 5 -- " + testing::build_dir() +
                       "/tests/zs_tests --helper abort_and_linger");
  for (int rank : {0, 2}) {
    EXPECT_NE(error_line(r.output, rank).find("rank 1 aborted: rank 1 of this test aborts on purpose"),
              std::string::npos)
        << r.output;
  }
  EXPECT_NE(r.output.find("zeroshard-run: failed: rank 1: rank 1 of this test aborts on purpose"), std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 8.0) << "the peers waited for the aborting rank's exit:\n" << r.output;
}

// Communicators destroyed in different orders on different ranks (a mesh closes
// gracefully, reading until its peers closed their side): no rank waits for a peer
// to reach the same communicator's destructor. 3 splits at 4 ranks, even ranks
// first to last and odd ranks last to first: each rank's teardown takes
// milliseconds, far from the 5 s a mesh would give its peers.
TEST(Launcher, CommunicatorsDestroyedInAnyOrderDoNotWaitForEachOther) {
  auto r = run_command(launcher() + " --nproc-per-node 4 --grace-period 5 -- " + testing::build_dir() +
                       "/tests/zs_tests --helper destroy_in_any_order");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::regex line("\\[rank([0-9])\\]: destroyed 3 splits in ([0-9.e+-]+) s");
  int ranks = 0;
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), line); it != std::sregex_iterator(); ++it) {
    ++ranks;
    EXPECT_LT(std::stod((*it)[2].str()), 2.5) << "rank " << (*it)[1].str() << "\n" << r.output;
  }
  EXPECT_EQ(ranks, 4) << r.output;
}

}  // namespace launcher_test
}  // namespace zeroshard
