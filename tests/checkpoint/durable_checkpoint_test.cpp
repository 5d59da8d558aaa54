// The durable tier (CheckpointOptions::durable_uri) against a real store: SeaweedFS
// started by tests/checkpoint/s3_store.py around the ranks (ctest's durable_*).
// Each rank keeps its own run directory, as hosts without a shared filesystem do.
//
// DurableCheckpointSave (at N ranks, ZeRO stages 0-3) saves through the store,
// checks what the store holds against the run directories (the same bytes, the
// manifest as the commit, `latest`), loses one rank's disk and resumes bit-identical
// at N, and writes the uninterrupted run's parameters. DurableCheckpointResume (at
// M ranks, every rank's disk empty) loads every N's checkpoint from the store alone
// and must reach the same parameters to float rounding. Oracles: the bytes on disk,
// the uninterrupted run.
#include "checkpoint/checkpoint_models.h"
#include "checksum.h"
#include "durable.h"
#include "s3_client.h"
#include "test_util.h"

#include <zeroshard/checkpoint.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>

namespace fs = std::filesystem;

namespace zeroshard {
namespace checkpoint_test {
namespace {

using namespace std::chrono_literals;
namespace s3 = ckpt::s3;

std::string bucket() {
  const char* b = std::getenv("ZS_TEST_S3_BUCKET");
  EXPECT_NE(b, nullptr) << "run under tests/checkpoint/s3_store.py (ctest's durable_* do)";
  return b ? b : "missing";
}

// The store's prefix for the run saved at N ranks and ZeRO stage s.
std::string durable_run(int n, int stage) { return "durable-test/n" + std::to_string(n) + "_stage" + std::to_string(stage); }

// This rank's own run directory (a disk of its own), empty.
std::string own_disk(const std::string& tag) {
  const fs::path d = fs::path(testing::make_temp_dir(tag + "-rank" + std::to_string(world().rank())));
  return d.string();
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string rank_file(int rank, int world) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "rank-%05d-of-%05d.h5", rank, world);
  return buf;
}

// The line of checkpoints a step directory's manifest was saved on (lineage.h).
std::string line_of(const fs::path& step_dir) {
  const auto m = nlohmann::json::parse(file_bytes(step_dir / "manifest.json"));
  return m.at("lineage").back().at("line").get<std::string>();
}

// The step's commits in the store: the lines that committed it.
std::vector<std::string> committed_lines(s3::Client& store, int64_t step) {
  std::vector<std::string> lines;
  for (const auto& o : store.list_here(step_name(step) + "/")) {
    const std::string n = o.name.substr(step_name(step).size() + 1);
    if (n.rfind("commit-", 0) == 0) lines.push_back(n.substr(7, n.size() - 12));
  }
  return lines;
}

// An empty prefix in the store, on every rank's return (rank 0 clears it), and a client of it.
std::unique_ptr<s3::Client> empty_prefix(const std::string& prefix) {
  auto store = std::make_unique<s3::Client>(s3::Location{bucket(), prefix}, s3::process_environment());
  if (world().rank() == 0) store->remove_all("");
  world().barrier();
  return store;
}

// While alive, this process's Checkpointers reach the store through the fault proxy.
struct ThroughProxy {
  const std::string direct = std::getenv("AWS_ENDPOINT_URL");
  ThroughProxy() { setenv("AWS_ENDPOINT_URL", std::getenv("ZS_TEST_S3_PROXY"), 1); }
  ~ThroughProxy() { setenv("AWS_ENDPOINT_URL", direct.c_str(), 1); }
};

CheckpointOptions durable(const std::string& prefix) {
  CheckpointOptions o;
  o.durable_uri = "s3://" + bucket() + "/" + prefix;
  o.durable_retry_time = 20s;
  return o;
}

TEST(DurableCheckpointSave, CommitsInTheStoreAndResumesOnALostDisk) {
  const int n = world().size(), rank = world().rank();
  for (int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE("ZeRO stage " + std::to_string(stage));
    const std::string prefix = durable_run(n, stage);
    s3::Client store({bucket(), prefix}, s3::process_environment());
    if (rank == 0) store.remove_all("");
    world().barrier();
    const std::string disk = own_disk("durable-save");
    fs::path step_dir;
    torch::Tensor want;
    {
      Checkpointer ckpt(disk, world_ptr(), durable(prefix));
      Trainer run(stage);
      run.train(0, kSaveAt);
      step_dir = run.save(ckpt, kSaveAt);
      ASSERT_TRUE(ckpt.wait_durable(120s));
      const auto status = ckpt.durable_status();
      EXPECT_EQ(status.durable_step, kSaveAt) << status.last_error;
      EXPECT_EQ(status.abandoned, 0);
      world().barrier();  // every rank's upload is done (rank 0 committed after all reported)
      // The store holds this rank's file, byte for byte, under the save's line, and the commit of that
      // line: the manifest and its checksum; `latest` names it.
      const std::string name = fs::path(step_dir).filename().string();
      const std::string mine = rank_file(rank, n);
      const std::string line = line_of(step_dir);
      ASSERT_EQ(line.size(), 16u);
      EXPECT_TRUE(store.get(name + "/" + line + "/" + mine).value_or("") == file_bytes(step_dir / mine)) << mine;
      const auto record = nlohmann::json::parse(store.get(name + "/commit-" + line + ".json").value_or("{}"));
      EXPECT_EQ(record.value("manifest", ""), file_bytes(step_dir / "manifest.json"));
      EXPECT_EQ(record.value("manifest_xxh3", "") + "\n", file_bytes(step_dir / "manifest.xxh3"));
      EXPECT_EQ(nlohmann::json::parse(store.get("latest").value_or("{}")),
                (nlohmann::json{{"step", kSaveAt}, {"line", line}}));
      run.train(kSaveAt, kEnd);
      want = run.flat();
      if (rank == 0) {
        const std::string dir = shared_dir() + "/durable";
        fs::create_directories(dir);
        write_tensor(dir + "/" + std::to_string(n) + "_" + std::to_string(stage) + ".f32", want);
      }
    }
    // The last rank's host is lost with its disk; a replacement starts with an empty one.
    if (rank == n - 1) {
      fs::remove_all(disk);
      fs::create_directories(disk);
    }
    world().barrier();
    Checkpointer again(disk, world_ptr(), durable(prefix));
    Trainer b(stage, /*seed=*/99);
    const auto progress = b.load(again);
    ASSERT_TRUE(progress.has_value());
    EXPECT_EQ(progress->step, kSaveAt);
    EXPECT_TRUE(fs::exists(fs::path(disk) / fs::path(step_dir).filename() / "manifest.json"));
    b.train(kSaveAt, kEnd);
    EXPECT_TRUE(torch::equal(b.flat(), want)) << "max diff " << (b.flat() - want).abs().max().item<double>();
    fs::remove_all(disk);
  }
}

TEST(DurableCheckpointResume, FromTheStoreAloneAtAnyWorldSize) {
  const int m = world().size();
  for (int n = 1; n <= 4; ++n) {
    for (int saved_stage : {0, 1, 2, 3}) {
      const std::string want_path =
          shared_dir() + "/durable/" + std::to_string(n) + "_" + std::to_string(saved_stage) + ".f32";
      if (!fs::exists(want_path)) continue;  // that world size's save is not part of this run
      for (int stage : {0, 3}) {
        SCOPED_TRACE("saved at " + std::to_string(n) + " ranks, stage " + std::to_string(saved_stage) +
                     "; loaded at " + std::to_string(m) + " ranks, stage " + std::to_string(stage));
        const std::string disk = own_disk("durable-resume");
        Checkpointer ckpt(disk, world_ptr(), durable(durable_run(n, saved_stage)));
        Trainer run(stage, /*seed=*/5);
        const auto progress = run.load(ckpt);
        ASSERT_TRUE(progress.has_value());
        EXPECT_EQ(progress->step, kSaveAt);
        // At another world size a rank copies whole at most the file saved at its own rank; the
        // pieces it needs of the others it reads where they are, dataset by dataset (ranged GETs).
        for (int q = 0; q < n; ++q) {
          if (q == world().rank()) continue;
          EXPECT_FALSE(fs::exists(fs::path(disk) / step_name(kSaveAt) / rank_file(q, n))) << rank_file(q, n);
        }
        run.train(kSaveAt, kEnd);
        const auto got = run.flat();
        expect_close(got, read_tensor(want_path, got.numel()));
        fs::remove_all(disk);
      }
    }
  }
}

// The requests the fault proxy saw so far (s3_store.py's /control/log): each request line, then
// " -> " and the store's status when the proxy forwarded it and the store answered.
std::vector<std::string> proxy_requests() {
  ckpt::http::Request r;
  r.url = std::string(std::getenv("ZS_TEST_FAKE_AWS")) + "/control/log";
  const auto got = ckpt::http::perform(r, {});
  EXPECT_EQ(got.status, 200);
  const auto log = nlohmann::json::parse(got.body);
  std::vector<std::string> lines;
  for (const auto& seen : log.at("proxy")) {
    lines.push_back(seen.at(0).get<std::string>() +
                    (seen.at(2).is_number() ? " -> " + std::to_string(seen.at(2).get<int>()) : std::string()));
  }
  return lines;
}

// Another rank's file is read in place by few ranged GETs, not one per dataset: through the
// proxy, a ZeRO-0 load (every rank reads every dataset of both files) of the 2-rank save takes
// one GET per rank of each file: its own file's whole copy, or one ranged GET of the other's
// datasets together (the files are smaller than a GET's 16 MiB span). Counted: the GETs the
// store answered with 206 (a retry after a failed answer is not another read).
TEST(DurableCheckpointResume, AnotherRanksFileTakesOneRangedGet) {
  const int n = 2, m = world().size();
  const std::string want_path = shared_dir() + "/durable/" + std::to_string(n) + "_3.f32";
  ASSERT_TRUE(fs::exists(want_path)) << "runs after DurableCheckpointSave at 2 ranks (ctest's durable_checkpoint)";
  const size_t before = world().rank() == 0 ? proxy_requests().size() : 0;
  world().barrier();
  std::optional<ThroughProxy> proxied(std::in_place);
  const std::string disk = own_disk("durable-ranged");
  {
    Checkpointer ckpt(disk, world_ptr(), durable(durable_run(n, 3)));
    Trainer run(0, /*seed=*/5);
    const auto progress = run.load(ckpt, kSaveAt);
    ASSERT_TRUE(progress.has_value());
    run.train(kSaveAt, kEnd);
    const auto got = run.flat();
    expect_close(got, read_tensor(want_path, got.numel()));
  }
  world().barrier();
  proxied.reset();
  if (world().rank() == 0) {
    const auto lines = proxy_requests();
    s3::Client store({bucket(), durable_run(n, 3)}, s3::process_environment());
    const auto committed = committed_lines(store, kSaveAt);
    ASSERT_EQ(committed.size(), 1u);
    for (int q = 0; q < n; ++q) {
      const std::string object = step_name(kSaveAt) + "/" + committed[0] + "/" + rank_file(q, n) + " ";  // not its .index
      std::vector<std::string> gets;
      std::copy_if(lines.begin() + static_cast<std::ptrdiff_t>(before), lines.end(), std::back_inserter(gets),
                   [&](const std::string& l) {
                     return l.rfind("GET ", 0) == 0 && l.find(object) != std::string::npos &&
                            l.size() > 7 && l.compare(l.size() - 7, 7, " -> 206") == 0;
                   });
      EXPECT_EQ(static_cast<int>(gets.size()), m) << rank_file(q, n) << " at " << m << " ranks:\n"
                                                   << nlohmann::json(gets).dump(1);
    }
  }
  fs::remove_all(disk);
}

// A byte flipped in the store's copy of the 2-rank save's last rank file, inside a dataset: a
// load at this world size reads that dataset (a ranged GET, or the whole file), its checksum
// fails, and the load refuses the step on every rank, naming the damage.
TEST(DurableCheckpointResume, ADamagedDatasetInTheStoreIsRefused) {
  const int n = 2;
  ASSERT_TRUE(fs::exists(shared_dir() + "/durable/" + std::to_string(n) + "_3.f32"))
      << "runs after DurableCheckpointSave at 2 ranks (ctest's durable_checkpoint)";
  s3::Client store({bucket(), durable_run(n, 3)}, s3::process_environment());
  const auto committed = committed_lines(store, kSaveAt);
  ASSERT_EQ(committed.size(), 1u);
  const std::string key = step_name(kSaveAt) + "/" + committed[0] + "/" + rank_file(n - 1, n);
  std::string original;
  if (world().rank() == 0) {
    original = store.get(key).value_or("");
    const auto index = nlohmann::json::parse(store.get(key + ".index").value_or("{}"));
    uint64_t at = 0;
    for (const auto& [name, d] : index.at("datasets").items()) {
      if (name.rfind("/master/", 0) == 0 && d.at("bytes").get<uint64_t>() > 0) at = d.at("offset").get<uint64_t>() + 1;
    }
    ASSERT_GT(at, 0u);
    std::string damaged = original;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x40);
    store.put(key, damaged);
  }
  world().barrier();
  const std::string disk = own_disk("durable-damaged");
  {
    Checkpointer ckpt(disk, world_ptr(), durable(durable_run(n, 3)));
    Trainer run(0, /*seed=*/5);  // ZeRO-0: every rank reads every dataset
    const std::string err = testing::error_of([&] { run.load(ckpt, kSaveAt); });
    EXPECT_NE(err.find("cannot be loaded"), std::string::npos) << err;
    const auto errs = all_gather_text(world(), err);
    EXPECT_TRUE(std::any_of(errs.begin(), errs.end(), [&](const std::string& e) {
      return e.find("the store's copy is damaged") != std::string::npos && e.find(rank_file(n - 1, n)) != std::string::npos;
    })) << err;
  }
  world().barrier();
  if (world().rank() == 0) store.put(key, original);
  world().barrier();
  fs::remove_all(disk);
}

// Through the fault proxy: uploads that keep failing are abandoned on every rank with the
// cause named, training goes on, nothing partial is committed, and the next save is durable.
TEST(DurableCheckpointFaults, AFailingUploadIsAbandonedAndTheNextSaveIsDurable) {
  const int rank = world().rank();
  const char* proxy = std::getenv("ZS_TEST_S3_PROXY");
  ASSERT_NE(proxy, nullptr);
  const std::string prefix = "durable-test/faults-n" + std::to_string(world().size());
  auto store_ptr = empty_prefix(prefix);
  s3::Client& store = *store_ptr;
  std::optional<ThroughProxy> proxied(std::in_place);  // this process's Checkpointers go through the proxy
  const std::string disk = own_disk("durable-faults");
  auto o = durable(prefix);
  o.durable_retry_time = 2s;
  Checkpointer ckpt(disk, world_ptr(), o);
  Trainer run(2);
  run.train(0, 2);
  world().barrier();
  auto control = [](const std::string& body) {
    ckpt::http::Request r;
    r.method = "POST";
    r.url = std::string(std::getenv("ZS_TEST_FAKE_AWS")) + "/control/faults";
    r.body = body;
    return ckpt::http::perform(r, {}).status;
  };
  if (rank == 0) {
    EXPECT_EQ(control("503 100000"), 200);  // every request, for a while
  }
  world().barrier();
  run.save(ckpt, 2);  // the local save commits; its durable copy cannot
  EXPECT_TRUE(ckpt.wait_durable(60s));
  auto status = ckpt.durable_status();
  EXPECT_EQ(status.durable_step, -1);
  EXPECT_EQ(status.abandoned, 1);
  EXPECT_NE(status.last_error.find("SlowDown"), std::string::npos) << status.last_error;
  EXPECT_NE(status.last_error.find("503"), std::string::npos) << status.last_error;
  world().barrier();
  if (rank == 0) {
    EXPECT_EQ(control("pass"), 200);
  }
  world().barrier();
  EXPECT_TRUE(fs::exists(fs::path(disk) / "step-00000002" / "manifest.json")) << "the local tier is unaffected";
  // What an earlier attempt at step 4 left in the store (a rank's failure report, rank 0's word that
  // it was abandoned: a run that saved step 4, failed, restarted from step 2) decides nothing now.
  if (rank == 0) {
    store.put("step-00000004/.ranks/00000000abcd/rank-00001.failed", "an earlier attempt's failure");
    store.put("step-00000004/.ranks/00000000abcd/abandoned", "rank 1: an earlier attempt's failure");
  }
  world().barrier();
  run.train(2, 4);
  run.save(ckpt, 4);
  EXPECT_TRUE(ckpt.wait_durable(60s));
  status = ckpt.durable_status();
  EXPECT_EQ(status.durable_step, 4) << status.last_error;
  world().barrier();
  proxied.reset();
  if (rank == 0) {
    EXPECT_TRUE(committed_lines(store, 2).empty()) << "an abandoned step is never committed";
    EXPECT_EQ(committed_lines(store, 4).size(), 1u);
  }
  fs::remove_all(disk);
}

// make_durable() after two saves in a row, the first one's upload slowed by SlowDowns (so the
// second's upload is skipped for it while it is in flight): the second step ends up durable.
TEST(DurableCheckpointFaults, MakeDurableUploadsTheNewestStep) {
  const int rank = world().rank();
  const std::string prefix = "durable-test/make-durable-n" + std::to_string(world().size());
  auto store_ptr = empty_prefix(prefix);
  s3::Client& store = *store_ptr;
  std::optional<ThroughProxy> proxied(std::in_place);
  const std::string disk = own_disk("durable-make");
  {
    Checkpointer ckpt(disk, world_ptr(), durable(prefix));
    Trainer run(3);
    run.train(0, 2);
    if (rank == 0) {
      ckpt::http::Request r;
      r.method = "POST";
      r.url = std::string(std::getenv("ZS_TEST_FAKE_AWS")) + "/control/faults";
      r.body = "503 6";
      EXPECT_EQ(ckpt::http::perform(r, {}).status, 200);
    }
    world().barrier();
    run.save(ckpt, 2);
    run.train(2, 4);
    run.save(ckpt, 4);
    const bool skipped = ckpt.durable_status().uploading_step == 2;
    EXPECT_TRUE(ckpt.make_durable(60s));
    const auto status = ckpt.durable_status();
    EXPECT_EQ(status.durable_step, 4) << status.last_error << (skipped ? " (step 4's upload was skipped)" : "");
    world().barrier();
  }
  proxied.reset();
  if (rank == 0) {
    EXPECT_EQ(committed_lines(store, 4).size(), 1u);
  }
  fs::remove_all(disk);
}

// Retention (keep 2) through the proxy: the step it removes loses its commit (commit-LINE.json)
// before any of its files, so a removal cut short never leaves a step that looks committed and
// lacks files. Oracle: the order of the DELETEs the proxy forwarded.
TEST(DurableCheckpointFaults, RetentionRemovesAStepsCommitBeforeItsFiles) {
  const int rank = world().rank();
  const std::string prefix = "durable-test/retention-n" + std::to_string(world().size());
  auto store_ptr = empty_prefix(prefix);
  s3::Client& store = *store_ptr;
  std::optional<ThroughProxy> proxied(std::in_place);
  const std::string disk = own_disk("durable-retention");
  {
    auto o = durable(prefix);
    o.keep = 2;
    Checkpointer ckpt(disk, world_ptr(), o);
    Trainer run(2);
    for (int64_t step : {2, 4, 6}) {
      run.train(step - 2, step);
      run.save(ckpt, step);
      ASSERT_TRUE(ckpt.make_durable(60s));
      world().barrier();
    }
  }
  proxied.reset();
  if (rank == 0) {
    std::vector<std::string> deletes;  // of step 2's objects, in the order the proxy forwarded them
    for (const auto& line : proxy_requests()) {
      if (line.rfind("DELETE /" + bucket() + "/" + prefix + "/step-00000002/", 0) == 0) deletes.push_back(line);
    }
    ASSERT_GE(deletes.size(), 4u);
    EXPECT_NE(deletes.front().find("/step-00000002/commit-"), std::string::npos) << deletes.front();
    for (size_t i = 1; i < deletes.size(); ++i) {
      EXPECT_EQ(deletes[i].find("/commit-"), std::string::npos) << "the commit deleted again: " << deletes[i];
    }
    EXPECT_TRUE(committed_lines(store, 2).empty());
    EXPECT_TRUE(store.list("step-00000002/").empty());
    EXPECT_EQ(committed_lines(store, 4).size(), 1u);
    EXPECT_EQ(committed_lines(store, 6).size(), 1u);
  }
  fs::remove_all(disk);
}

// A rollback (load(2) after steps 2, 4, 6, 8 were durable) saves on a line of its own: its steps 4
// and 6 are uploaded and committed beside the old timeline's (not "already committed"), `latest`
// follows them, retention deletes none of the old timeline's, and with every disk lost the next
// launch resumes the new timeline's step 6, never the old one's newer step 8 (which a load by
// number refuses, naming its line); following the old line takes CheckpointOptions::durable_line.
// Oracle: the parameters of each timeline as trained.
TEST(DurableCheckpointLines, ARollbackSavesOnANewLineThatTheNextLaunchFollows) {
  const int rank = world().rank();
  const std::string prefix = "durable-test/rollback-n" + std::to_string(world().size());
  auto store_ptr = empty_prefix(prefix);
  s3::Client& store = *store_ptr;
  const std::string disk = own_disk("durable-rollback");
  torch::Tensor old8, new6;
  std::string old_line, new_line;
  auto keep4 = durable(prefix);
  keep4.keep = 4;  // the old timeline keeps its step 2 (here and in the store) for the rollback
  {
    Checkpointer ckpt(disk, world_ptr(), keep4);
    Trainer run(2);
    for (int64_t step : {2, 4, 6, 8}) {
      run.train(step - 2, step);
      run.save(ckpt, step);
      ASSERT_TRUE(ckpt.make_durable(60s));
    }
    old8 = run.flat();
    old_line = line_of(fs::path(disk) / step_name(8));
    // The rollback: step 2 again, then another timeline (as after a loss spike: other batches).
    ASSERT_EQ(run.load(ckpt, 2)->step, 2);
    for (int64_t step : {4, 6}) {
      run.train(step + 98, step + 100);
      run.save(ckpt, step);
      ASSERT_TRUE(ckpt.make_durable(60s)) << ckpt.durable_status().last_error;
      EXPECT_EQ(ckpt.durable_status().durable_step, step);
    }
    new6 = run.flat();
    new_line = line_of(fs::path(disk) / step_name(6));
    EXPECT_NE(new_line, old_line);
    world().barrier();
  }
  if (rank == 0) {
    for (int64_t step : {4, 6}) {  // both timelines' commits, the new one's holding the manifest saved here
      auto lines = committed_lines(store, step);
      std::sort(lines.begin(), lines.end());
      auto want = std::vector<std::string>{old_line, new_line};
      std::sort(want.begin(), want.end());
      EXPECT_EQ(lines, want) << step;
    }
    const auto record = nlohmann::json::parse(store.get(step_name(6) + "/commit-" + new_line + ".json").value_or("{}"));
    EXPECT_EQ(record.value("manifest", ""), file_bytes(fs::path(disk) / step_name(6) / "manifest.json"));
    EXPECT_EQ(nlohmann::json::parse(store.get("latest").value_or("{}")),
              (nlohmann::json{{"step", 6}, {"line", new_line}}));
    EXPECT_EQ(committed_lines(store, 2).size(), 1u) << "the step both timelines share";
    EXPECT_EQ(committed_lines(store, 8), std::vector<std::string>{old_line});
  }
  fs::remove_all(disk);  // every host lost with its disk
  world().barrier();
  {
    Checkpointer again(own_disk("durable-rollback-again"), world_ptr(), durable(prefix));
    Trainer b(2, /*seed=*/99);
    const std::string refused = testing::error_of([&] { b.load(again, 8); });
    EXPECT_NE(refused.find("is of another line of checkpoints (" + old_line + ")"), std::string::npos) << refused;
    EXPECT_NE(refused.find("durable_line"), std::string::npos) << refused;
    ASSERT_EQ(b.load(again)->step, 6);
    EXPECT_TRUE(torch::equal(b.flat(), new6)) << "not the new timeline's step 6";
    fs::remove_all(again.dir());
  }
  world().barrier();
  {
    auto o = durable(prefix);
    o.durable_line = old_line;  // told to follow the old timeline
    Checkpointer old(own_disk("durable-rollback-old"), world_ptr(), o);
    Trainer b(2, /*seed=*/99);
    ASSERT_EQ(b.load(old)->step, 8);
    EXPECT_TRUE(torch::equal(b.flat(), old8)) << "not the old timeline's step 8";
    fs::remove_all(old.dir());
  }
}

// Two writers of one step on one line (what two jobs sharing a line would be): the second's
// conditional put of the commit loses, it compares the states, and it reports the step not
// durable when its files differ (durable when they are the same files); the first's commit and
// files stay as they were. Rank 0 plays each writer of a 2-rank save (rank 1's report put by
// hand), through the tier itself.
TEST(DurableCheckpointLines, ASecondWriterOfAStepWithOtherFilesIsNotDurable) {
  const int rank = world().rank();
  const int n = world().size();
  const std::string prefix = "durable-test/two-writers-n" + std::to_string(n);
  auto store_ptr = empty_prefix(prefix);
  s3::Client& store = *store_ptr;
  const std::string disk = own_disk("durable-two-writers");
  fs::path step_dir;
  {
    CheckpointOptions no_view;  // (the other tests' saves have a model.h5: this one's states are its files alone)
    no_view.write_model_view = false;
    Checkpointer local(disk, world_ptr(), no_view);  // no durable tier: the step directory the writers upload
    Trainer run(2);
    run.train(0, 2);
    step_dir = run.save(local, 2);
  }
  world().barrier();
  if (rank == 0) {
    auto writer = [&](const fs::path& dir, uint64_t attempt) {
      for (int r = 1; r < n; ++r) {
        char name[64];
        std::snprintf(name, sizeof(name), "%s/.ranks/%012llx/rank-%05d.ok", step_name(2).c_str(),
                      static_cast<unsigned long long>(attempt), r);
        store.put(name, "0");
      }
      ckpt::DurableTier tier({bucket(), prefix}, s3::process_environment(), 0, n, {});
      tier.start_upload(dir, 2, attempt);
      EXPECT_TRUE(tier.wait(60s));
      return tier.status();
    };
    // A copy of the step with one manifest field changed (and its checksum made right again).
    auto variant = [&](const std::string& tag, const std::function<void(nlohmann::json&)>& change) {
      const fs::path dir = fs::path(disk) / tag / step_name(2);
      fs::create_directories(dir.parent_path());
      fs::copy(step_dir, dir, fs::copy_options::recursive);
      auto m = nlohmann::json::parse(file_bytes(dir / "manifest.json"));
      change(m);
      const std::string text = m.dump(1);
      std::ofstream(dir / "manifest.json", std::ios::trunc) << text;
      std::ofstream(dir / "manifest.xxh3", std::ios::trunc)
          << checkpoint::to_hex(checkpoint::digest_bytes(text.data(), text.size())) << "\n";
      return dir;
    };
    const auto first = writer(step_dir, 1);
    EXPECT_EQ(first.durable_step, 2) << first.last_error;
    const fs::path other = variant("other", [](nlohmann::json& m) { m["files"][0]["xxh3"] = "0123456789abcdef"; });
    const auto second = writer(other, 2);
    EXPECT_EQ(second.durable_step, -1);
    EXPECT_EQ(second.abandoned, 1);
    EXPECT_NE(second.last_error.find("committed by another writer with other files"), std::string::npos)
        << second.last_error;
    const fs::path same = variant("same", [](nlohmann::json& m) { m["save_seconds"] = 123.0; });
    const auto third = writer(same, 3);
    EXPECT_EQ(third.durable_step, 2) << third.last_error;
    const std::string line = line_of(step_dir);
    const auto record = nlohmann::json::parse(store.get(step_name(2) + "/commit-" + line + ".json").value_or("{}"));
    EXPECT_EQ(record.value("manifest", ""), file_bytes(step_dir / "manifest.json")) << "the first commit stands";
    EXPECT_EQ(record.value("attempt", ""), "000000000001");
  }
  world().barrier();
  fs::remove_all(disk);
}

// Last in the run (its own suite, defined last): a Checkpointer constructor that throws unwinds
// through the communicators it split, which abort the world's family.
TEST(DurableCheckpointSetup, AWrongKeyFailsAtTheCheckpointerOnEveryRank) {
  const std::string secret = std::getenv("AWS_SECRET_ACCESS_KEY");
  setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-987", 1);
  const std::string disk = own_disk("durable-wrong-key");
  auto o = durable("durable-test/wrong-key");
  o.durable_retry_time = 2s;
  const std::string m = testing::error_of([&] { Checkpointer ckpt(disk, world_ptr(), o); });
  setenv("AWS_SECRET_ACCESS_KEY", secret.c_str(), 1);
  EXPECT_NE(m.find("opening the durable tier"), std::string::npos) << m;
  EXPECT_NE(m.find("secret key"), std::string::npos) << m;
  EXPECT_EQ(m.find("wrong-secret-987"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  fs::remove_all(disk);
}

}  // namespace
}  // namespace checkpoint_test
}  // namespace zeroshard
