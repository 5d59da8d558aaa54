// PreemptionGuard: a signal on one rank stops every rank after the same step.
#include "test_util.h"

#include <zeroshard/preemption.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <thread>

namespace zeroshard {
namespace preemption_test {

using testing::world;
using testing::world_ptr;

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The last rank gets SIGTERM at step 4, and (at 2 ranks and more) rank 0
// SIGUSR1 300 ms later: every rank stops after step 4, and every rank's
// notice_time() is the last rank's moment (the earliest), not its own.
TEST(Preemption, SignalOnOneRankStopsEveryRankAfterTheSameStep) {
  const int n = world().size(), r = world().rank();
  PreemptionGuard guard(world_ptr());
  EXPECT_TRUE(std::isnan(guard.notice_time()));
  int stopped_at = -1;
  double before = 0, after = 0;
  for (int step = 0; step < 10; ++step) {
    const bool last = r == n - 1, late = r == 0 && n > 1;
    if (step == 4 && (last || late)) {
      if (late) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      before = unix_now();
      std::raise(last ? SIGTERM : SIGUSR1);  // handled by the guard: the process lives on
      // The guard's thread records it a moment later.
      for (int i = 0; i < 2000 && !guard.signaled(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ASSERT_TRUE(guard.signaled());
      after = unix_now();
    }
    if (guard.should_stop()) {
      stopped_at = step;
      break;
    }
  }
  auto all = torch::zeros({n}, torch::kLong);
  world().all_gather(all, torch::tensor({static_cast<int64_t>(stopped_at)}, torch::kLong))->wait();
  for (int k = 0; k < n; ++k) EXPECT_EQ(all[k].item<int64_t>(), 4) << "rank " << k;
  EXPECT_EQ(guard.signaled(), r == n - 1 || r == 0);
  EXPECT_EQ(guard.cause(), r == n - 1 ? "SIGTERM" : r == 0 ? "SIGUSR1" : "another rank's notice");
  auto times = torch::zeros({n, 3}, torch::kDouble);
  world().all_gather(times, torch::tensor({guard.notice_time(), before, after}, torch::kDouble))->wait();
  const double t_last = times[n - 1][0].item<double>();
  EXPECT_GE(t_last, times[n - 1][1].item<double>()) << "the notice cannot precede the signal";
  EXPECT_LE(t_last, times[n - 1][2].item<double>()) << "the guard's thread saw the signal before the rank went on";
  for (int k = 0; k < n; ++k) EXPECT_EQ(times[k][0].item<double>(), t_last) << "rank " << k << ": not the earliest notice";
  if (n > 1) {
    EXPECT_LT(t_last, times[0][1].item<double>()) << "rank 0's own later signal taken";
  }
  EXPECT_TRUE(guard.should_stop()) << "stays stopped";
  EXPECT_EQ(guard.exit_code(), 75);
}

TEST(Preemption, NoticeFileStopsEveryRank) {
  const auto dir = world().rank() == 0 ? testing::make_temp_dir("notice") : std::string();
  PreemptionOptions o;
  o.notice_file = "/tmp/zs-preemption-notice-" + std::to_string(::getppid());  // the launcher: shared by the ranks
  std::filesystem::remove(o.notice_file);
  world().barrier();
  PreemptionGuard guard(world_ptr(), o);
  EXPECT_FALSE(guard.should_stop());
  if (world().rank() == 0) std::ofstream(o.notice_file) << "spot termination in 2 minutes\n";
  world().barrier();
  EXPECT_TRUE(guard.should_stop());
  EXPECT_FALSE(guard.signaled());
  EXPECT_EQ(guard.cause(), "notice file");
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove(o.notice_file);
}

// A metadata-style URL (here: python's http.server on the last rank): 404 and
// "FALSE" are no notice; "TRUE" is, and every rank stops at the same call.
TEST(Preemption, NoticeUrlStopsEveryRank) {
  const int n = world().size(), r = world().rank();
  PreemptionOptions o;
  std::string dir, pid;
  if (r == n - 1) {
    dir = testing::make_temp_dir("notice_url");
    const int port = testing::free_port();
    pid = testing::run_command("/usr/bin/python3 -m http.server " + std::to_string(port) + " --bind 127.0.0.1 --directory " +
                               dir + " >/dev/null 2>&1 & echo $!")
              .output;
    o.notice_url = "http://127.0.0.1:" + std::to_string(port) + "/preempted";
    o.notice_poll_interval_s = 0.05;
  }
  PreemptionGuard guard(world_ptr(), o);
  int stopped_at = -1;
  for (int i = 0; i < 200 && stopped_at < 0; ++i) {
    if (r == n - 1 && i == 5) std::ofstream(dir + "/preempted") << "FALSE\n";  // GCP's answer until preempted
    if (r == n - 1 && i == 40) std::ofstream(dir + "/preempted") << "TRUE\n";
    if (guard.should_stop()) stopped_at = i;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (r == n - 1) testing::run_command("kill " + pid);
  auto all = torch::zeros({n}, torch::kLong);
  world().all_gather(all, torch::tensor({static_cast<int64_t>(stopped_at)}, torch::kLong))->wait();
  for (int k = 0; k < n; ++k) {
    EXPECT_GE(all[k].item<int64_t>(), 40) << "rank " << k << ": a 404 or FALSE is no notice";
    EXPECT_EQ(all[k].item<int64_t>(), all[0].item<int64_t>()) << "rank " << k;
  }
  EXPECT_LT(stopped_at, 200);
}

TEST(Preemption, WarnsWhenASaveWouldNotFitTheGracePeriod) {
  PreemptionOptions o;
  o.grace_period_s = 2;
  PreemptionGuard guard(world_ptr(), o);
  EXPECT_TRUE(guard.check_save_fits(1.5));
  EXPECT_FALSE(guard.check_save_fits(2.5));
}

}  // namespace preemption_test
}  // namespace zeroshard
