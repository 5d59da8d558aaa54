// Metrics (JSON lines, resume truncation, progress line, memory, progress
// file, plot) and trace records.
#include "test_util.h"

#include "runtime/event_file.h"
#include "runtime/link_stats.h"

#include <zeroshard/comm.h>
#include <zeroshard/metrics.h>
#include <zeroshard/rank_times.h>
#include <zeroshard/step_agreement.h>
#include <zeroshard/trace.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

namespace metrics_test {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::vector<json> read_lines(const std::string& path) {
  std::vector<json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(json::parse(line));
  return out;
}

std::string temp_dir(const std::string& name) {
  const auto d = fs::temp_directory_path() / ("zs_metrics_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

TEST(Metrics, StepLinesCarryEveryFieldAndTheExtraOnes) {
  const auto path = temp_dir("fields") + "/m.jsonl";
  {
    zeroshard::MetricsLog log(path, 0);
    zeroshard::StepMetrics m;
    m.step = 1;
    m.loss = 2.5;
    m.lr = 1e-3;
    m.tokens = 1000;
    m.seconds = 0.5;
    m.exposed_comm_seconds = 0.1;
    m.bytes_sent = 4096;
    m.extra_json = R"({"val_loss": 3.25})";
    log.write(m);
    log.write_event("checkpoint", 1, R"({"stall_s": 0.2})");
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["step"], 1);
  EXPECT_EQ(lines[0]["loss"], 2.5);
  EXPECT_EQ(lines[0]["tokens_per_s"], 2000.0);
  EXPECT_EQ(lines[0]["bytes_sent"], 4096);
  EXPECT_EQ(lines[0]["val_loss"], 3.25);
  EXPECT_TRUE(lines[0]["grad_norm"].is_null()) << "NaN is not JSON: it is written as null";
  for (const char* k : {"compute_s", "exposed_comm_s", "optimizer_s", "checkpoint_stall_s", "peak_rss_bytes", "lr"}) {
    EXPECT_TRUE(lines[0].contains(k)) << k;
  }
  EXPECT_EQ(lines[1]["event"], "checkpoint");
  EXPECT_EQ(lines[1]["stall_s"], 0.2);
}

TEST(Metrics, ResumingDropsTheStepsAfterTheCheckpoint) {
  const auto path = temp_dir("resume") + "/m.jsonl";
  {
    zeroshard::MetricsLog log(path, 0);
    for (int s = 1; s <= 8; ++s) {
      zeroshard::StepMetrics m;
      m.step = s;
      m.loss = 10 - s;
      log.write(m);
    }
    log.write_event("validation", 5, R"({"val_loss": 4})");
    log.write_event("validation", 8, R"({"val_loss": 3})");
  }
  {
    zeroshard::MetricsLog log(path, 5);  // the run resumes from the checkpoint of step 5
    zeroshard::StepMetrics m;
    m.step = 6;
    m.loss = 42;
    log.write(m);
  }
  std::vector<int64_t> steps;
  for (const auto& j : read_lines(path)) steps.push_back(j["step"]);
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 5, 6}));
  EXPECT_EQ(read_lines(path).back()["loss"], 42);
}

// A step's line carried in its checkpoint (step_line) comes back on resume
// only when the file lacks it: the crash came after the commit and before write().
TEST(Metrics, ACarriedStepLineIsRestoredOnlyWhereItIsMissing) {
  const auto path = temp_dir("restore") + "/m.jsonl";
  zeroshard::StepMetrics m;
  m.loss = 1.5;
  m.extra_json = R"({"val_loss": 2.5})";
  {
    zeroshard::MetricsLog log(path, 0);
    EXPECT_EQ(log.last_step(), 0);
    for (int s = 1; s <= 4; ++s) {
      m.step = s;
      log.write(m);
    }
    log.write_event("checkpoint", 5);  // step 5 committed; the run died before its line
    EXPECT_EQ(log.last_step(), 4);
  }
  m.step = 5;
  const std::string carried = zeroshard::MetricsLog::step_line(m);
  {
    zeroshard::MetricsLog log(path, 5);
    EXPECT_EQ(log.last_step(), 4) << "an event line is not a step's line";
    EXPECT_TRUE(log.restore(carried));
    EXPECT_EQ(log.last_step(), 5);
    EXPECT_FALSE(log.restore(carried)) << "written twice";
  }
  {
    zeroshard::MetricsLog log(path, 5);  // a second resume from the same checkpoint: the line is there
    EXPECT_EQ(log.last_step(), 5);
    EXPECT_FALSE(log.restore(carried));
    EXPECT_THROW(log.restore(R"({"event": "checkpoint", "step": 5})"), c10::ValueError);
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_EQ(lines[5]["step"], 5);
  EXPECT_EQ(lines[5]["loss"], 1.5);
  EXPECT_EQ(lines[5]["val_loss"], 2.5);
  EXPECT_EQ(lines[5]["restored"], true);
  EXPECT_FALSE(lines[3].contains("restored"));
  EXPECT_EQ(json::parse(carried), [&] {
    auto j = lines[5];
    j.erase("restored");
    return j;
  }()) << "the restored line is the carried one";
}

// TFRecord's checksum is CRC-32C (Castagnoli), masked: the check value of "123456789" is
// 0xE3069283 (RFC 3720's CRC32C; TensorFlow's crc32c tests use the same vector).
TEST(Metrics, TensorBoardRecordsCarryTheMaskedCrc32c) {
  const uint32_t crc = 0xE3069283u;
  EXPECT_EQ(zeroshard::runtime::EventFile::masked_crc32c("123456789", 9), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
  const uint32_t zero = 0;  // CRC32C of no bytes is 0
  EXPECT_EQ(zeroshard::runtime::EventFile::masked_crc32c("", 0), ((zero >> 15) | (zero << 17)) + 0xa282ead8u);
}

// Every rank's figures travel in the step's agreement (no collective of their own: the agreement's
// count is the steps'), each rank reads all of them, and the straggler rule names rank 2, whose
// compute doubles from step 3 to 8, at the first step its 5-step average reaches 1.3x the other
// ranks' median, once, and sees it come back near it. The oracle: the closed forms of the figures the ranks set.
TEST(Metrics, EveryRanksTimesTravelInTheAgreementAndTheSlowRankIsNamed) {
  const int port = zeroshard::testing::free_port();
  std::mutex mu;
  std::vector<std::vector<std::string>> spreads(3);
  std::vector<std::vector<zeroshard::StragglerEpisode>> named(3), episodes(3);
  std::vector<int64_t> recovered_at(3, -1), agreements(3, 0);
  const auto errors = zeroshard::testing::run_ranks(3, [&](int r) {
    zeroshard::CommOptions co;
    co.timeout = std::chrono::seconds(30);
    auto c = zeroshard::init_communicator(zeroshard::testing::thread_env(r, 3, port), co);
    auto a = std::make_shared<zeroshard::StepAgreement>(c);
    zeroshard::RankTimes times(a, {1.3, 5, {}});
    EXPECT_THROW(times.spread(0), c10::Error);  // no agreement yet
    for (int64_t step = 1; step <= 13; ++step) {
      times.step_began();
      const double compute = (r == 2 && step >= 3 && step <= 8 ? 2.0 : 1.0) + 0.01 * r;
      times.set(compute, 0.1 * r, 0.2 + 0.1 * (2 - r));
      a->agree();
      const auto s = times.spread(step);
      std::lock_guard<std::mutex> lock(mu);
      spreads[static_cast<size_t>(r)].push_back(s.json);
      for (const auto& e : s.named) named[static_cast<size_t>(r)].push_back(e);
      for (const auto& e : s.recovered) recovered_at[static_cast<size_t>(r)] = e.end_step;
    }
    std::lock_guard<std::mutex> lock(mu);
    episodes[static_cast<size_t>(r)] = times.episodes();
    agreements[static_cast<size_t>(r)] = a->agreements();
    EXPECT_EQ(times.hosts(), std::vector<std::string>(3, times.hosts()[0]));
  });
  for (int r = 0; r < 3; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(spreads[static_cast<size_t>(r)], spreads[0]) << "rank " << r << " read other figures";
    EXPECT_EQ(agreements[static_cast<size_t>(r)], 13) << "one agreement per step, no collective of its own";
  }
  const auto first = json::parse(spreads[0][0]);
  EXPECT_DOUBLE_EQ(first["compute_s"]["min"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(first["compute_s"]["median"].get<double>(), 1.01);
  EXPECT_DOUBLE_EQ(first["compute_s"]["max"].get<double>(), 1.02);
  EXPECT_EQ(first["compute_s"]["slowest"].get<int>(), 2);
  EXPECT_DOUBLE_EQ(first["data_wait_s"]["max"].get<double>(), 0.2);
  EXPECT_EQ(first["data_wait_s"]["slowest"].get<int>(), 2);
  EXPECT_DOUBLE_EQ(first["exposed_comm_s"]["max"].get<double>(), 0.4);
  EXPECT_EQ(first["exposed_comm_s"]["slowest"].get<int>(), 0);
  EXPECT_GE(first["arrive_s"]["min"].get<double>(), 0.0);
  // Windows of 5 steps, each rank against the median of the others: steps 1-5 hold rank 2 at 1.02,
  // 1.02, 2.02, 2.02, 2.02 against ranks 0 and 1's median, 1.005: 8.1 / 5.025 = 1.612 >= 1.3, named at
  // step 5; steps 4-8 at 2.02 (ratio 2.01); the episode ends under 1.15 (the midpoint of 1 and 1.3):
  // step 12's window holds one 2.02, 6.1 / 5.025 = 1.214, still in it; step 13's none, 1.015.
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(named[static_cast<size_t>(r)].size(), 1u) << "rank " << r;
    const auto& e = named[static_cast<size_t>(r)][0];
    EXPECT_EQ(e.step, 5);
    EXPECT_EQ(e.rank, 2);
    EXPECT_NEAR(e.ratio, 8.1 / 5.025, 1e-12);
    EXPECT_EQ(recovered_at[static_cast<size_t>(r)], 13);
    ASSERT_EQ(episodes[static_cast<size_t>(r)].size(), 1u);
    EXPECT_NEAR(episodes[static_cast<size_t>(r)][0].peak_ratio, 10.1 / 5.025, 1e-12);
    EXPECT_EQ(episodes[static_cast<size_t>(r)][0].end_step, 13);
  }
  const auto j = json::parse(episodes[0][0].json());
  EXPECT_EQ(j["rank"].get<int>(), 2);
  EXPECT_EQ(j["end_step"].get<int64_t>(), 13);
  EXPECT_EQ(j["host"].get<std::string>(), episodes[0][0].host);
}

// count_waits(): the exposed communication carried is set()'s plus what the trainer's cumulative
// waits grew by from set() to the agreement (0.25 s here); what they grew by before set() is
// set()'s to count (0.5 s here, left out of set()'s 0.1 s on purpose).
TEST(Metrics, TheWaitsBeforeTheAgreementCountAsExposedCommunication) {
  const int port = zeroshard::testing::free_port();
  std::mutex mu;
  std::vector<std::string> spreads(2);
  const auto errors = zeroshard::testing::run_ranks(2, [&](int r) {
    zeroshard::CommOptions co;
    co.timeout = std::chrono::seconds(30);
    auto c = zeroshard::init_communicator(zeroshard::testing::thread_env(r, 2, port), co);
    auto a = std::make_shared<zeroshard::StepAgreement>(c);
    zeroshard::RankTimes times(a, {1.3, 5, {}});
    double waited = 2.0;  // cumulative, from before the run
    times.count_waits([&waited] { return waited; });
    times.step_began();
    waited += 0.5;  // the backward's, which set() carries (here as 0.1 + 0.1 r)
    times.set(1.0, 0, 0.1 + 0.1 * r);
    waited += 0.25 * (r + 1);  // the optimizer's, before the agreement
    a->agree();
    const auto s = times.spread(1);
    std::lock_guard<std::mutex> lock(mu);
    spreads[static_cast<size_t>(r)] = s.json;
  });
  for (int r = 0; r < 2; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  const auto j = json::parse(spreads[0]);
  EXPECT_DOUBLE_EQ(j["exposed_comm_s"]["min"].get<double>(), 0.1 + 0.25);
  EXPECT_DOUBLE_EQ(j["exposed_comm_s"]["max"].get<double>(), 0.2 + 0.5);
  EXPECT_EQ(j["exposed_comm_s"]["slowest"].get<int>(), 1);
  EXPECT_EQ(spreads[1], spreads[0]);
}

// Two hosts of two ranks (RankTimesOptions::host), host h1's ranks both twice as slow for 6 steps:
// the host is named once (not each rank), at its least slow rank's ratio, and comes back as one.
// Each rank's others' median is 1.01 at every step; rank 2's window at step 5 is 8.1 (1.604), rank
// 3's 8.15 (1.614); at step 13 rank 2's is 5.1 (1.0099 < 1.15).
TEST(Metrics, AHostWhoseEveryRankIsSlowIsNamedOnce) {
  const int port = zeroshard::testing::free_port();
  std::mutex mu;
  std::vector<std::vector<zeroshard::StragglerEpisode>> episodes(4);
  const auto errors = zeroshard::testing::run_ranks(4, [&](int r) {
    zeroshard::CommOptions co;
    co.timeout = std::chrono::seconds(30);
    auto c = zeroshard::init_communicator(zeroshard::testing::thread_env(r, 4, port), co);
    auto a = std::make_shared<zeroshard::StepAgreement>(c);
    zeroshard::RankTimes times(a, {1.3, 5, r < 2 ? "h0" : "h1"});
    for (int64_t step = 1; step <= 13; ++step) {
      times.step_began();
      times.set((r >= 2 && step >= 3 && step <= 8 ? 2.0 : 1.0) + 0.01 * r, 0, 0);
      a->agree();
      (void)times.spread(step);
    }
    std::lock_guard<std::mutex> lock(mu);
    episodes[static_cast<size_t>(r)] = times.episodes();
  });
  for (int r = 0; r < 4; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  for (int r = 0; r < 4; ++r) {
    const auto& e = episodes[static_cast<size_t>(r)];
    ASSERT_EQ(e.size(), 1u) << "rank " << r << ": one episode, the host's";
    EXPECT_EQ(e[0].rank, -1);
    EXPECT_EQ(e[0].ranks, (std::vector<int>{2, 3}));
    EXPECT_EQ(e[0].host, "h1");
    EXPECT_EQ(e[0].step, 5);
    EXPECT_NEAR(e[0].ratio, 8.1 / 5.05, 1e-12);
    EXPECT_EQ(e[0].end_step, 13);
    EXPECT_EQ(e[0].who(), "host h1 (all its ranks: 2, 3)");
  }
}

TEST(Metrics, BadExtraJsonIsRefusedNamingIt) {
  const auto path = temp_dir("bad") + "/m.jsonl";
  zeroshard::MetricsLog log(path, 0);
  zeroshard::StepMetrics m;
  m.extra_json = "[1, 2]";
  try {
    log.write(m);
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("extra_json"), std::string::npos) << e.what();
  }
  EXPECT_THROW(zeroshard::MetricsLog("/proc/no/such/dir/m.jsonl", 0), std::exception);
}

TEST(Metrics, ProgressDurationsReadAtAGlance) {
  EXPECT_EQ(zeroshard::ProgressLine::duration(12.4), "12s");
  EXPECT_EQ(zeroshard::ProgressLine::duration(185), "3m05s");
  EXPECT_EQ(zeroshard::ProgressLine::duration(3720), "1h02m");
  EXPECT_EQ(zeroshard::ProgressLine::duration(-1), "?");
  zeroshard::ProgressLine p(10, /*interval_s=*/3600);
  zeroshard::StepMetrics m;
  m.step = 1;
  EXPECT_TRUE(p.update(m)) << "the first update prints";
  m.step = 2;
  EXPECT_FALSE(p.update(m)) << "within the interval it stays quiet";
  m.step = 10;
  EXPECT_TRUE(p.update(m)) << "the last step always prints";
}

TEST(Metrics, ThousandsSeparators) {
  EXPECT_EQ(zeroshard::ProgressLine::with_commas(0), "0");
  EXPECT_EQ(zeroshard::ProgressLine::with_commas(999), "999");
  EXPECT_EQ(zeroshard::ProgressLine::with_commas(1000), "1,000");
  EXPECT_EQ(zeroshard::ProgressLine::with_commas(1234567), "1,234,567");
  EXPECT_EQ(zeroshard::ProgressLine::with_commas(-123456), "-123,456");
  EXPECT_EQ(zeroshard::ProgressLine::with_commas(INT64_MIN), "-9,223,372,036,854,775,808");
}

TEST(Metrics, PeakRssCoversATouchedAllocation) {
  const int64_t before = zeroshard::peak_rss_bytes();
  ASSERT_GT(before, 0);
  auto big = torch::ones({64 << 20}, torch::kByte);  // 64 MiB, touched
  EXPECT_GE(zeroshard::peak_rss_bytes(), before + (48 << 20));
  EXPECT_GE(zeroshard::peak_rss_bytes(), zeroshard::current_rss_bytes());
}

TEST(Metrics, PublishStepWritesTheLaunchersProgressFile) {
  // zeroshard-run sets ZS_PROGRESS_FILE; read_dist_env() reads it once and
  // publish_step() writes there. bart_pretrain_resume covers the launcher reading it.
  const std::string path = temp_dir("progress") + "/rank-0.step";
  const char* launchers = std::getenv("ZS_PROGRESS_FILE");
  const std::string saved = launchers != nullptr ? launchers : "";
  ::setenv("ZS_PROGRESS_FILE", path.c_str(), /*overwrite=*/1);
  const auto env = zeroshard::read_dist_env();
  if (saved.empty()) {
    ::unsetenv("ZS_PROGRESS_FILE");
  } else {
    ::setenv("ZS_PROGRESS_FILE", saved.c_str(), 1);
  }
  EXPECT_EQ(env.progress_file, path);
  zeroshard::publish_step(env, 17);
  zeroshard::publish_step(env, 18);
  std::ifstream in(path);
  int64_t step = 0;
  in >> step;
  EXPECT_EQ(step, 18);
  EXPECT_FALSE(fs::exists(path + ".tmp")) << "written through a temporary file, renamed";
  zeroshard::publish_step(zeroshard::DistEnv{}, 19);  // no progress file: nothing written anywhere
  std::ifstream again(path);
  again >> step;
  EXPECT_EQ(step, 18);
}

TEST(Metrics, PlotDrawsAPngFromTheMetrics) {
  const auto dir = temp_dir("plot");
  {
    zeroshard::MetricsLog log(dir + "/m.jsonl", 0);
    for (int s = 1; s <= 20; ++s) {
      zeroshard::StepMetrics m;
      m.step = s;
      m.loss = 8.0 / s;
      if (s % 10 == 0) m.extra_json = json{{"val_loss", 9.0 / s}}.dump();
      log.write(m);
      if (s % 10 == 0) log.write_event("checkpoint", s, R"({"reason": "every 10 steps"})");
    }
    // The marks' events (gnuplot must take their arrows and labels, quotes in a cause included).
    log.write_event("interruption", 10, R"({"cause": "SIGTERM \"quoted\"", "notice_unix_s": 1.7e9})");
    log.write_event("resume", 10, R"({"restart": 1, "after": "SIGTERM", "to_first_step_s": 12.5})");
    log.write_event("resume", 15, R"({"restart": 2, "after": "a failure"})");
    log.write_event("interruption", 20, R"({"cause": "notice file"})");
  }
  const auto why = zeroshard::plot_metrics(dir + "/m.jsonl", dir + "/loss.png", "a \"quoted\" title");
  ASSERT_EQ(why, "");
  std::ifstream png(dir + "/loss.png", std::ios::binary);
  char sig[8] = {};
  png.read(sig, 8);
  EXPECT_EQ(std::string(sig + 1, 3), "PNG");
  EXPECT_GT(fs::file_size(dir + "/loss.png"), 5000u);
  // No steps: a reason, not a crash.
  std::ofstream(dir + "/empty.jsonl") << R"({"event": "resume", "step": 3})" << "\n";
  EXPECT_NE(zeroshard::plot_metrics(dir + "/empty.jsonl", dir + "/x.png").find("no step"), std::string::npos);
}

TEST(Trace, RecordsKeepNamesCategoriesAndOrder) {
  zeroshard::trace::clear();
  zeroshard::trace::enable(true);
  zeroshard::trace::set_thread_name("tester");
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 5000; ++i) zeroshard::trace::record("event " + std::to_string(i), "compute", t0);  // > one chunk
  { zeroshard::trace::Span span("checkpoint", std::string(200, 'x')); }
  const auto ev = zeroshard::trace::events();
  zeroshard::trace::enable(false);
  ASSERT_EQ(ev.size(), 5001u);
  EXPECT_EQ(ev[0].name, "event 0");
  EXPECT_EQ(ev[4999].name, "event 4999");
  EXPECT_EQ(ev[4999].category, "compute");
  EXPECT_EQ(ev[5000].category, "checkpoint");
  EXPECT_EQ(ev[5000].name, std::string(95, 'x')) << "long names are cut at 95 bytes";
  // The 5000 records share their start (t0) and end one after another; the span begins after the last ended.
  EXPECT_EQ(ev[4999].start_us, ev[0].start_us);
  EXPECT_GE(ev[4999].duration_us, ev[0].duration_us);
  EXPECT_GE(ev[5000].start_us + 1e-3, ev[4999].start_us + ev[4999].duration_us);
  const auto path = temp_dir("trace") + "/t.json";
  EXPECT_EQ(zeroshard::trace::write_chrome_trace(path, 3), 5001u);
  std::ifstream in(path);
  const auto j = json::parse(in);
  size_t complete = 0;
  bool named = false;
  for (const auto& e : j["traceEvents"]) {
    EXPECT_EQ(e["pid"], 3);
    if (e["ph"] == "X") ++complete;
    if (e["name"] == "thread_name" && e["args"]["name"] == "tester") named = e["tid"] == ev[0].thread;
  }
  EXPECT_EQ(complete, 5001u);
  EXPECT_TRUE(named) << "the calling thread's track carries its name";
  zeroshard::trace::clear();
  EXPECT_TRUE(zeroshard::trace::events().empty());
}

}  // namespace metrics_test

namespace rank_links_test {

using json = nlohmann::json;

// One run of the link rule over `steps` steps of a job of n ranks, each its own host
// (RankTimesOptions::host), with the transport's table filled each step in closed form: every
// link that touches rank 1 moves 10 MB in `slow_s`, every other 100 times faster (as if received);
// each step lasts at least 20 ms (the window's time the rule weighs a link's cost against).
// Returns the episodes and the last step's spread.
std::pair<std::vector<zeroshard::StragglerEpisode>, std::string> run_links(double slow_s, int steps) {
  auto c = zeroshard::testing::world().dup();
  const int n = c->size(), me = c->rank();
  EXPECT_EQ(zeroshard::link_self(), zeroshard::testing::world().rank()) << "the transport's world rank";
  auto a = std::make_shared<zeroshard::StepAgreement>(c);
  zeroshard::RankTimes times(a, {1.3, 4, "h" + std::to_string(me)});
  std::string last;
  for (int64_t step = 1; step <= steps; ++step) {
    times.step_began();
    times.set(1.0, 0, 0);  // every rank's compute the same: no compute straggler
    (void)zeroshard::take_links();  // the agreement's frames are small; nothing else moved
    for (int q = 0; q < n; ++q) {
      if (q != me) zeroshard::note_link(q, 10'000'000, q == 1 || me == 1 ? slow_s : slow_s / 100);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    a->agree();
    last = times.spread(step).json;
  }
  return {times.episodes(), last};
}

// At 3 ranks or more, rank 1 (10 MB/s on every link) is the end every slow link shares: named at
// the first full window (step 4) for its links at 10 MB/s against the others' median of 1,000
// (ratio 100: a rank's rate is its fastest link's; the others' fastest are 1,000). At 2 ranks the
// one link is slow at both ends: no one is named. At 1 rank there is no link.
TEST(RankLinks, TheRankEverySlowLinkSharesIsNamedAtItsRate) {
  const int n = zeroshard::testing::world().size();
  const auto [episodes, last] = run_links(1.0, 6);
  const auto j = json::parse(last);
  if (n == 1) {
    EXPECT_FALSE(j.contains("link_mb_s"));
    EXPECT_TRUE(episodes.empty());
    return;
  }
  // Each rank's slowest sender: rank 0's is rank 1 (10 MB/s), the first at the minimum.
  EXPECT_DOUBLE_EQ(j["link_mb_s"]["min"].get<double>(), 10.0);
  EXPECT_EQ(j["link_mb_s"]["slowest"].get<int>(), 0);
  EXPECT_EQ(j["link_mb_s"]["from"].get<int>(), 1);
  if (n == 2) {
    EXPECT_TRUE(episodes.empty()) << episodes[0].json();
    return;
  }
  EXPECT_DOUBLE_EQ(j["link_mb_s"]["max"].get<double>(), 10.0);  // every rank's slowest link touches rank 1
  ASSERT_EQ(episodes.size(), 1u) << episodes.back().json();
  const auto& e = episodes[0];
  EXPECT_EQ(e.kind, "link");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.host, "h1");
  EXPECT_EQ(e.step, 4);
  EXPECT_NEAR(e.mb_s, 10.0, 1e-9);
  EXPECT_NEAR(e.median_mb_s, 1000.0, 1e-6);
  EXPECT_NEAR(e.ratio, 100.0, 1e-9);
  EXPECT_EQ(e.end_step, -1);
  EXPECT_EQ(json::parse(e.json())["kind"].get<std::string>(), "link");
}

// A link 100 times slower than the others that costs the job nothing is no straggler: rank 1's
// links take 0.2 ms per step at 50 GB/s where the others' take 2 us; over a window of 4 steps of
// 20 ms or more its excess is at most 3 x 4 x 0.2 ms = 2.4 ms, under (1.3 - 1) / 2 of 80 ms = 12 ms.
TEST(RankLinks, ASlowerLinkThatCostsNothingIsNotNamed) {
  const auto [episodes, last] = run_links(0.0002, 6);
  (void)last;
  EXPECT_TRUE(episodes.empty()) << episodes.front().json();
}

}  // namespace rank_links_test
