// Sharded checkpoints: round trips, resharding N -> M across stages 0 to 3,
// the commit protocol and bad input.
//
// CheckpointSave (run at N = 1..4 ranks, ctest fixture) trains the test model
// kSaveAt steps at stages 0, 2 and 3, saves, trains on to kEnd and writes
// the uninterrupted run's parameters; CheckpointResume (at M = 1..4 ranks)
// loads every N's checkpoints into every stage and must reach the same
// parameters to float rounding. ZS_CKPT_TEST_DIR names the shared directory.
#include "checkpoint/checkpoint_models.h"
#include "test_util.h"

#include <zeroshard/checkpoint.h>
#include <zeroshard/fully_shard.h>
#include <zeroshard/sharded_adamw.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

namespace fs = std::filesystem;

namespace zeroshard {
namespace checkpoint_test {

// ---------------------------------------------------------------- same world

class CheckpointRoundTrip : public ::testing::TestWithParam<int> {};

// Save, train on; load into a fresh model (other initial values, other RNG
// state), train on: bit-identical to the uninterrupted run, RNG stream included.
TEST_P(CheckpointRoundTrip, ResumeIsBitIdentical) {
  const int stage = GetParam();
  const auto dir = common_temp_dir("ckpt_roundtrip");
  Checkpointer ckpt(dir, world_ptr());
  Trainer a(stage);
  a.train(0, kSaveAt);
  const auto saved_dir = a.save(ckpt, kSaveAt);
  EXPECT_TRUE(fs::exists(fs::path(saved_dir) / "manifest.json"));
  const auto rng_after_save = torch::rand({4});
  a.train(kSaveAt, kEnd);
  const auto want = a.flat();

  Trainer b(stage, /*seed=*/99);
  torch::manual_seed(12345);
  const auto progress = b.load(ckpt);
  ASSERT_TRUE(progress.has_value());
  EXPECT_EQ(progress->step, kSaveAt);
  EXPECT_EQ(progress->epoch, 1);
  EXPECT_EQ(nlohmann::json::parse(progress->extra_json).at("sampler"), 42);
  EXPECT_TRUE(torch::equal(torch::rand({4}), rng_after_save)) << "the RNG stream resumes where it was saved";
  b.train(kSaveAt, kEnd);
  EXPECT_TRUE(torch::equal(b.flat(), want)) << "max diff " << (b.flat() - want).abs().max().item<double>();
}
INSTANTIATE_TEST_SUITE_P(Stages, CheckpointRoundTrip, ::testing::Values(0, 2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

// Async: save() returns after copying the state; training goes on while the
// files are written; what gets committed is the state at save() time.
TEST_P(CheckpointRoundTrip, AsyncSaveCommitsTheStateAtSaveTime) {
  const int stage = GetParam();
  const auto dir = common_temp_dir("ckpt_async");
  CheckpointOptions o;
  o.async = true;
  Checkpointer ckpt(dir, world_ptr(), o);
  Trainer a(stage);
  a.train(0, kSaveAt);
  const auto at_save = a.flat();
  a.save(ckpt, kSaveAt);
  a.train(kSaveAt, kEnd);  // overlaps the write
  a.save(ckpt, kEnd);      // waits for the first, then starts the second
  ckpt.wait();
  EXPECT_EQ(latest_of(dir), "step-00000012");
  // The last save's bytes: every rank's file of it, as on disk.
  int64_t on_disk = 0;
  for (const auto& f : fs::directory_iterator(fs::path(dir) / "step-00000012")) {
    if (f.path().filename().string().rfind("rank-", 0) == 0) on_disk += static_cast<int64_t>(f.file_size());
  }
  EXPECT_EQ(ckpt.last_save_times().bytes, on_disk);
  Trainer b(stage, /*seed=*/99);
  ASSERT_TRUE(b.load(ckpt, kSaveAt).has_value());
  EXPECT_TRUE(torch::equal(b.flat(), at_save));
  Trainer c(stage, /*seed=*/98);
  ASSERT_TRUE(c.load(ckpt).has_value());
  EXPECT_TRUE(torch::equal(c.flat(), a.flat()));
}

// Saved in the middle of a 4-micro-batch accumulation (after 2 backwards): the
// reduced gradients so far are in the checkpoint, and the resumed run's step
// equals the uninterrupted one, bit for bit.
TEST_P(CheckpointRoundTrip, MidAccumulationResumeIsBitIdentical) {
  const int stage = GetParam();
  const int n = world().size(), r = world().rank(), local = kBatch / n;
  const auto dir = common_temp_dir("ckpt_midacc");
  Checkpointer ckpt(dir, world_ptr());
  auto micro = [&](Trainer& t, int k) {
    auto [x, y] = batch(100 + k);
    (torch::mse_loss(t.net->forward(x.slice(0, r * local, (r + 1) * local)), y.slice(0, r * local, (r + 1) * local)) /
     4)
        .backward();
  };
  Trainer a(stage);
  a.train(0, 3);
  a.opt().zero_grad();
  micro(a, 0);
  micro(a, 1);
  a.save(ckpt, 3);
  micro(a, 2);
  micro(a, 3);
  a.opt().step();
  const auto want = a.flat();
  Trainer b(stage, /*seed=*/77);
  ASSERT_TRUE(b.load(ckpt).has_value());
  micro(b, 2);
  micro(b, 3);
  b.opt().step();
  EXPECT_TRUE(torch::equal(b.flat(), want)) << "max diff " << (b.flat() - want).abs().max().item<double>();
}

// Hybrid sharding (shard groups of N / 2 ranks): save, train on, load into a
// fresh model at the same topology: bit-identical, at stages 2 and 3.
TEST(CheckpointHybrid, ResumeIsBitIdentical) {
  const int n = world().size();
  if (n % 2 != 0) GTEST_SKIP() << "two replicas need an even number of ranks";
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const auto dir = common_temp_dir("ckpt_hybrid");
    Checkpointer ckpt(dir, world_ptr());
    Trainer a(stage, 1, world_ptr(), n / 2);
    a.train(0, kSaveAt);
    a.save(ckpt, kSaveAt);
    a.train(kSaveAt, kEnd);
    const auto want = a.flat();
    Trainer b(stage, /*seed=*/99, world_ptr(), n / 2);
    ASSERT_TRUE(b.load(ckpt).has_value());
    b.train(kSaveAt, kEnd);
    EXPECT_TRUE(torch::equal(b.flat(), want)) << "max diff " << (b.flat() - want).abs().max().item<double>();
  }
}

// ---------------------------------------------------------------- N -> M

// At N ranks: checkpoints of both stages at kSaveAt, and the uninterrupted
// runs' final parameters.
TEST(CheckpointSave, AtThisWorldSize) {
  const int n = world().size();
  for (int stage : {0, 2, 3}) {
    const fs::path dir = fs::path(shared_dir()) / ("n" + std::to_string(n) + "_stage" + std::to_string(stage));
    if (world().rank() == 0) fs::remove_all(dir);
    world().barrier();
    Checkpointer ckpt(dir.string(), world_ptr());
    Trainer run(stage);
    run.train(0, kSaveAt);
    const fs::path step_dir = run.save(ckpt, kSaveAt);
    {  // what was committed: one file per rank, a manifest saying who wrote it, `latest` naming it
      EXPECT_EQ(step_dir.filename().string(), "step-00000006");
      EXPECT_EQ(latest_of(dir.string()), "step-00000006");
      nlohmann::json m;
      std::ifstream(step_dir / "manifest.json") >> m;
      EXPECT_EQ(m.at("world_size").get<int>(), n);
      EXPECT_EQ(m.at("zero_stage").get<int>(), stage);
      EXPECT_EQ(m.at("step").get<int64_t>(), kSaveAt);
      ASSERT_EQ(m.at("files").size(), static_cast<size_t>(n));
      for (int q = 0; q < n; ++q) {
        const auto& f = m.at("files").at(static_cast<size_t>(q));
        char name[48];
        std::snprintf(name, sizeof(name), "rank-%05d-of-%05d.h5", q, n);
        EXPECT_EQ(f.at("name").get<std::string>(), name);
        EXPECT_EQ(static_cast<int64_t>(fs::file_size(step_dir / name)), f.at("bytes").get<int64_t>()) << name;
      }
      // The optimizer's parameters: every trained one (fully_shard also holds the frozen layer's).
      std::set<std::string> listed;
      for (const auto& p : m.at("params")) listed.insert(p.at("name").get<std::string>());
      const auto named = run.net->named_parameters();
      for (const auto& name : listed) EXPECT_TRUE(named.contains(name)) << name << " is not a parameter of the model";
      if (stage == 0) {  // replicated state is written once, by rank 0
        for (const auto& p : m.at("params")) {
          for (const auto& pc : p.at("pieces")) EXPECT_EQ(pc.at(0).get<int>(), 0) << p.at("name");
        }
      }
      for (const auto& item : named) {
        if (item.value().requires_grad()) {
          EXPECT_TRUE(listed.count(item.key())) << item.key() << " is not in the manifest";
        }
      }
      EXPECT_TRUE(fs::exists(step_dir / "manifest.xxh3"));
    }
    {  // what h5py must find in the files (tests/checkpoint/check_h5.py)
      std::optional<FullyShardedModel::FullParamsGuard> guard;
      if (run.sharded) guard.emplace(run.sharded->summon_full_params());
      nlohmann::json expected;
      for (const auto& item : run.net->named_parameters()) {
        auto v = item.value().detach().to(torch::kDouble).reshape(-1).contiguous();
        expected[item.key()] = std::vector<double>(v.data_ptr<double>(), v.data_ptr<double>() + v.numel());
      }
      for (const auto& item : run.net->named_buffers()) {
        auto v = item.value().detach().to(torch::kDouble).reshape(-1).contiguous();
        expected[item.key()] = std::vector<double>(v.data_ptr<double>(), v.data_ptr<double>() + v.numel());
      }
      if (world().rank() == 0) std::ofstream(dir / "expected.json") << expected.dump();
    }
    run.train(kSaveAt, kEnd);
    const auto final_params = run.flat();
    if (world().rank() == 0) write_tensor((dir / "uninterrupted.f32").string(), final_params);
    world().barrier();
  }
  // Hybrid sharding over shard groups of N / 2 ranks: each shard is written once,
  // by the ranks of the first shard group (replica 0).
  for (int stage : {2, 3}) {
    if (n % 2 != 0) break;
    const int shard_size = n / 2;
    const fs::path dir = fs::path(shared_dir()) / hybrid_run(n, stage);
    if (world().rank() == 0) fs::remove_all(dir);
    world().barrier();
    Checkpointer ckpt(dir.string(), world_ptr());
    Trainer run(stage, 1, world_ptr(), shard_size);
    run.train(0, kSaveAt);
    const fs::path step_dir = run.save(ckpt, kSaveAt);
    nlohmann::json m;
    std::ifstream(step_dir / "manifest.json") >> m;
    int64_t saved = 0;
    for (const auto& p : m.at("params")) {
      for (const auto& pc : p.at("pieces")) {
        EXPECT_LT(pc.at(0).get<int>(), shard_size) << p.at("name") << ": written by a rank of another replica";
        saved += pc.at(2).get<int64_t>() - pc.at(1).get<int64_t>();
      }
    }
    int64_t trained = 0;
    for (const auto& item : run.net->named_parameters()) {
      if (item.value().requires_grad() || stage == 3) trained += item.value().numel();
    }
    if (run.sharded) {
      trained = 0;
      auto guard = run.sharded->summon_full_params();
      for (const auto& item : run.net->named_parameters()) trained += item.value().numel();
    }
    EXPECT_EQ(saved, trained) << "every element saved exactly once";
    run.train(kSaveAt, kEnd);
    const auto final_params = run.flat();
    if (world().rank() == 0) write_tensor((dir / "uninterrupted.f32").string(), final_params);
    world().barrier();
  }
}

// At M ranks: every checkpoint of the fixture (N ranks, ZeRO stage 0, 2 or 3,
// with or without pipeline stages), loaded into ZeRO stage 0, 1, 2 or 3, trained
// to kEnd, matches the run that saved it to float rounding.
TEST(CheckpointResume, FromEveryWorldSizeAndStage) {
  const int m = world().size();
  // ZeRO stages 0-3 over every rank, and at an even M stages 2 and 3 with hybrid
  // sharding over M / 2 ranks (stage, shard size).
  std::vector<std::pair<int, int>> into{{0, 0}, {1, 0}, {2, 0}, {3, 0}};
  if (m % 2 == 0) into.insert(into.end(), {{2, m / 2}, {3, m / 2}});
  for (const auto& name : saved_runs()) {
    for (const auto& [stage, shard_size] : into) {
      SCOPED_TRACE(name + " resumed at " + std::to_string(m) + " ranks, stage " + std::to_string(stage) +
                   (shard_size > 0 ? ", shard groups of " + std::to_string(shard_size) : std::string()));
      const fs::path dir = fs::path(shared_dir()) / name;
      ASSERT_TRUE(fs::exists(dir / "latest")) << dir << ": run checkpoint_save_np* first";
      Checkpointer ckpt(dir.string(), world_ptr());
      Trainer run(stage, /*seed=*/5, world_ptr(), shard_size);
      const auto progress = run.load(ckpt);
      ASSERT_TRUE(progress.has_value());
      ASSERT_EQ(progress->step, kSaveAt);
      run.train(kSaveAt, kEnd);
      const auto got = run.flat();
      expect_close(got, read_tensor((dir / "uninterrupted.f32").string(), got.numel()));
    }
  }
}

// zeroshard-ckpt export --safetensors, then import: a run started from the
// imported checkpoint holds exactly the exported weights (any world size, any
// stage), with fresh optimizer state; and it trains.
TEST(CheckpointImport, FromASafetensorsExport) {
  const int m = world().size();
  const fs::path src = fs::path(shared_dir()) / "n3_stage2";
  ASSERT_TRUE(fs::exists(src / "latest")) << "run checkpoint_save_np3 first";
  const auto dir = common_temp_dir("ckpt_import");
  const std::string tool = testing::build_dir() + "/zeroshard-ckpt";
  if (world().rank() == 0) {
    const auto st = dir + "/weights.safetensors";
    auto r = testing::run_command(tool + " export " + src.string() + " " + st + " --safetensors --buffers");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = testing::run_command(tool + " import " + st + " " + dir + "/run --safetensors");
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  world().barrier();
  std::ifstream in(src / "expected.json");
  const auto expected = nlohmann::json::parse(in);
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage) + " at " + std::to_string(m) + " ranks");
    Checkpointer ckpt(dir + "/run", world_ptr());
    Trainer t(stage, /*seed=*/31);
    const auto progress = t.load(ckpt);
    ASSERT_TRUE(progress.has_value());
    EXPECT_EQ(progress->step, 0);
    {
      std::optional<FullyShardedModel::FullParamsGuard> guard;
      if (t.sharded) guard.emplace(t.sharded->summon_full_params());
      for (const auto& item : t.net->named_parameters()) {
        const auto want = torch::tensor(expected.at(item.key()).get<std::vector<double>>(), torch::kDouble);
        EXPECT_TRUE(torch::equal(item.value().detach().to(torch::kDouble).reshape(-1), want)) << item.key();
      }
      for (const auto& item : t.net->named_buffers()) {
        const auto want = torch::tensor(expected.at(item.key()).get<std::vector<double>>(), torch::kDouble);
        EXPECT_TRUE(torch::equal(item.value().detach().to(torch::kDouble).reshape(-1), want)) << item.key();
      }
    }
    const auto before = t.flat();
    t.train(0, 2);
    EXPECT_FALSE(torch::equal(t.flat(), before));
  }
}

// ---------------------------------------------------------------- commit protocol and bad input

struct Saved {
  std::string dir;
  std::vector<std::string> steps;  // step directories, oldest first
};

Saved three_checkpoints(Trainer& run, Checkpointer& ckpt) {
  Saved s{ckpt.dir(), {}};
  for (int64_t step : {2, 4, 6}) {
    run.train(step - 2, step);
    s.steps.push_back(run.save(ckpt, step));
  }
  return s;
}


TEST(CheckpointCommit, KeepsTheLastKAndCleansLeftovers) {
  const auto dir = common_temp_dir("ckpt_keep");
  CheckpointOptions o;
  o.keep = 2;
  Checkpointer ckpt(dir, world_ptr(), o);
  Trainer run(3);
  if (world().rank() == 0) fs::create_directories(fs::path(dir) / "step-00000001.tmp");  // a crashed save
  world().barrier();
  three_checkpoints(run, ckpt);
  EXPECT_EQ(latest_of(dir), "step-00000006");
  EXPECT_FALSE(fs::exists(fs::path(dir) / "step-00000002"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "step-00000004" / "manifest.json"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "step-00000001.tmp")) << "an uncommitted leftover is cleaned up";
  world().barrier();
  CheckpointOptions keep_one;
  keep_one.keep = 1;
  EXPECT_NE(testing::error_of([&] { Checkpointer("x", world_ptr(), keep_one); })
                .find("at least 2 committed checkpoints are kept"),
            std::string::npos);
}

// ---------------------------------------------------------------- hosts without a shared filesystem

// The ranks' first half has a run directory of its own and the second half
// another, at different paths here, as hosts with disks of their own have at
// the same path.
class CheckpointDisks : public ::testing::TestWithParam<int> {};

std::string rank_file(int r, int n) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "rank-%05d-of-%05d.h5", r, n);
  return buf;
}

// Every disk gets its own ranks' files, the manifest and `latest` (the model view
// stays on rank 0's); replicated tensors (a frozen layer, a buffer; at stage 0
// every parameter) get a copy on the second disk. A resume at the same topology
// reads only its own disk and is bit-identical; after a crash between the two
// disks' commits every rank resumes the step both hold; a resume at another ZeRO
// stage, which reads pieces of the other disk's files, names them and their host,
// and loads once the files are brought together; a disk with no checkpoint
// beside one with checkpoints is refused, not taken for a fresh start.
TEST_P(CheckpointDisks, EachDiskHoldsItsRanksFilesAndResumesAlone) {
  const int stage = GetParam(), n = world().size(), rank = world().rank();
  if (n < 2) GTEST_SKIP() << "two disks need two ranks";
  const fs::path base = common_temp_dir("ckpt_disks");
  auto disk_of = [&](int r) { return r * 2 / n; };
  auto run_dir = [&](int d) { return base / ("disk" + std::to_string(d)) / "run"; };
  const std::string dir = run_dir(disk_of(rank)).string();
  Trainer a(stage);
  torch::Tensor at_save;
  {
    Checkpointer ckpt(dir, world_ptr());
    a.train(0, kSaveAt);
    a.save(ckpt, kSaveAt);
    at_save = a.flat();
    a.train(kSaveAt, kEnd);
    a.save(ckpt, kEnd);
  }
  int second = 0;  // the second disk's first rank
  while (disk_of(second) == 0) ++second;
  if (rank == 0) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    for (int d : {0, 1}) {
      SCOPED_TRACE("disk " + std::to_string(d));
      const fs::path step = run_dir(d) / "step-00000012";
      EXPECT_EQ(latest_of(run_dir(d).string()), "step-00000012");
      EXPECT_EQ(fs::exists(step / "model.h5"), d == 0) << "the model view is on rank 0's disk alone";
      for (int r = 0; r < n; ++r) EXPECT_EQ(fs::exists(step / rank_file(r, n)), disk_of(r) == d) << rank_file(r, n);
      nlohmann::json m;
      std::ifstream(step / "manifest.json") >> m;
      EXPECT_EQ(m.at("files").at(static_cast<size_t>(n - 1)).at("host"), host);
      // The buffer, and (outside fully_shard's units) the frozen layer's weight and bias.
      EXPECT_EQ(m.at("replicated").size(), stage == 3 ? 1u : 3u) << m.at("replicated").dump();
      for (const auto& e : m.at("replicated")) {
        EXPECT_EQ(e.at("rank"), 0);
        EXPECT_EQ(e.at("copies"), nlohmann::json::array({second})) << e.dump();
      }
      for (const auto& e : m.at("params")) {  // at stage 0, the whole parameter on the second disk too
        int64_t numel = 1;
        for (const auto& d : e.at("shape")) numel *= d.get<int64_t>();
        EXPECT_EQ(e.value("alternates", nlohmann::json::array()),
                  stage == 0 ? nlohmann::json::parse("[[[" + std::to_string(second) + ", 0, " + std::to_string(numel) + "]]]")
                             : nlohmann::json::array())
            << e.at("name");
      }
    }
  }
  world().barrier();
  {
    Checkpointer ckpt(dir, world_ptr());
    Trainer b(stage, /*seed=*/99);
    const auto progress = b.load(ckpt);
    ASSERT_TRUE(progress.has_value());
    EXPECT_EQ(progress->step, kEnd);
    EXPECT_TRUE(torch::equal(b.flat(), a.flat()));
  }
  world().barrier();
  if (rank == 0) {  // the second disk as a crash between the commits leaves it
    fs::remove_all(run_dir(1) / "step-00000012");
    std::ofstream(run_dir(1) / "latest", std::ios::trunc) << "step-00000006\n";
  }
  world().barrier();
  {
    Checkpointer ckpt(dir, world_ptr());
    Trainer c(stage, /*seed=*/98);
    const auto progress = c.load(ckpt);
    ASSERT_TRUE(progress.has_value());
    EXPECT_EQ(progress->step, kSaveAt) << "the step both disks hold";
    EXPECT_TRUE(torch::equal(c.flat(), at_save));
  }
  // Another ZeRO stage places the pieces elsewhere. At stage 0 every piece is on both disks.
  // (The Checkpointer and the model outlive the failing loads: a communicator destroyed while
  // its rank unwinds from an exception aborts its family, the world's.)
  const int other = stage == 3 ? 2 : 3;
  Checkpointer elsewhere(dir, world_ptr());
  Trainer d(other, /*seed=*/97);
  auto load_other = [&] {
    const auto progress = d.load(elsewhere);
    EXPECT_TRUE(progress.has_value() && progress->step == kSaveAt);
    expect_close(d.flat(), at_save);
  };
  if (stage != 0) {
    const auto err = testing::error_of(load_other);
    EXPECT_NE(err.find("failed on rank(s)"), std::string::npos) << "every rank fails: " << err;
    const auto errs = all_gather_text(world(), err);  // the ranks that read the other disk's files name them
    EXPECT_TRUE(std::any_of(errs.begin(), errs.end(), [](const std::string& e) {
      return e.find("is not on this host's disk") != std::string::npos &&
             e.find("Bring every host's step-00000006 files together") != std::string::npos;
    })) << err;
    if (rank == 0) {  // brought together, as a sync from an object store would
      for (int d : {0, 1}) {
        for (const auto& e : fs::directory_iterator(run_dir(1 - d) / "step-00000006")) {
          const auto to = run_dir(d) / "step-00000006" / e.path().filename();
          if (!fs::exists(to)) fs::copy_file(e.path(), to);
        }
      }
    }
    world().barrier();
  }
  load_other();
  world().barrier();
  if (rank == 0) fs::remove_all(run_dir(1));  // a fresh host in place of the second
  world().barrier();
  Checkpointer fresh_host(dir, world_ptr());
  Trainer e(stage, /*seed=*/96);
  const auto err = testing::error_of([&] { e.load(fresh_host); });
  EXPECT_NE(err.find("hold no committed step in common"), std::string::npos) << err;
}
INSTANTIATE_TEST_SUITE_P(Stages, CheckpointDisks, ::testing::Values(0, 2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

// Hybrid sharding with a shard group per disk (as with a group per host): the
// first group's ranks write the shards, and the second's write a copy of them
// on their own disk, so each disk holds every shard. A resume at the same
// topology reads only its own disk (bit-identical), and one over every rank
// (flat ZeRO-3) finds every piece on its disk too.
TEST(CheckpointDisksHybrid, EachDiskHoldsEveryShard) {
  const int n = world().size(), rank = world().rank();
  if (n % 2 != 0) GTEST_SKIP() << "two shard groups need an even number of ranks";
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const fs::path base = common_temp_dir("ckpt_disks_hybrid");
    const fs::path dir = base / ("disk" + std::to_string(rank * 2 / n)) / "run";
    Trainer a(stage, 1, world_ptr(), n / 2);
    torch::Tensor at_save;
    {
      Checkpointer ckpt(dir.string(), world_ptr());
      a.train(0, kSaveAt);
      a.save(ckpt, kSaveAt);
      at_save = a.flat();
      a.train(kSaveAt, kEnd);
    }
    if (rank == 0) {
      nlohmann::json m;
      std::ifstream(dir / "step-00000006" / "manifest.json") >> m;
      for (const auto& e : m.at("params")) {
        int64_t numel = 1, main = 0, copy = 0;
        for (const auto& d : e.at("shape")) numel *= d.get<int64_t>();
        for (const auto& pc : e.at("pieces")) {
          EXPECT_LT(pc.at(0).get<int>(), n / 2) << e.at("name") << ": saved by the first shard group";
          main += pc.at(2).get<int64_t>() - pc.at(1).get<int64_t>();
        }
        ASSERT_EQ(e.value("alternates", nlohmann::json::array()).size(), 1u) << e.dump();
        for (const auto& pc : e.at("alternates").at(0)) {
          EXPECT_GE(pc.at(0).get<int>(), n / 2) << e.at("name") << ": the copy is the second group's";
          copy += pc.at(2).get<int64_t>() - pc.at(1).get<int64_t>();
        }
        EXPECT_EQ(main, numel) << e.at("name");
        EXPECT_EQ(copy, numel) << e.at("name");
      }
    }
    world().barrier();
    {
      Checkpointer ckpt(dir.string(), world_ptr());
      Trainer b(stage, /*seed=*/99, world_ptr(), n / 2);
      ASSERT_TRUE(b.load(ckpt).has_value());
      b.train(kSaveAt, kEnd);
      EXPECT_TRUE(torch::equal(b.flat(), a.flat()));
    }
    {
      Checkpointer ckpt(dir.string(), world_ptr());
      Trainer c(3, /*seed=*/98);
      ASSERT_TRUE(c.load(ckpt).has_value());
      expect_close(c.flat(), at_save);
    }
    world().barrier();
  }
}

// A load into a fresh stage-2 trainer (other initial values): what it loaded,
// the parameters it ends with, and what it logged.
struct Loaded {
  std::optional<TrainingProgress> progress;
  torch::Tensor params;
  std::string log;
};
Loaded load_fresh(Checkpointer& ckpt) {
  Trainer fresh(2, 7);
  ::testing::internal::CaptureStderr();
  auto progress = fresh.load(ckpt);
  auto log = ::testing::internal::GetCapturedStderr();
  return {progress, fresh.flat(), log};
}

// Rewrites a step directory's manifest.json through `edit` (as a person with an
// editor would: manifest.xxh3 is left as it was).
void edit_manifest(const fs::path& step_dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json m;
  std::ifstream(step_dir / "manifest.json") >> m;
  edit(m);
  std::ofstream(step_dir / "manifest.json", std::ios::trunc) << m.dump(1);
}
void bump_first_piece(nlohmann::json& m) {
  auto& piece = m.at("params").at(0).at("pieces").at(0);
  piece[2] = piece[2].get<int64_t>() + 1;
}
void bump_first_shape(nlohmann::json& m) {
  auto& shape = m.at("params").at(0).at("shape");
  shape[0] = shape[0].get<int64_t>() + 1;
}

// Damage to the newest checkpoint: the load says why and falls back to the
// previous one.
TEST(CheckpointBadInput, DamagedNewestFallsBackToThePrevious) {
  const int n = world().size();
  const std::string file0 = "rank-00000-of-" + std::string(5 - std::to_string(n).size(), '0') + std::to_string(n) + ".h5";
  const std::vector<std::pair<std::string, std::function<void(const fs::path&)>>> cases{
      {"truncated", [&](const fs::path& d) { fs::resize_file(d / file0, fs::file_size(d / file0) / 2); }},
      {"flipped byte",
       [&](const fs::path& d) {
         std::fstream f(d / file0, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(static_cast<std::streamoff>(fs::file_size(d / file0) / 2));
         char c = 0;
         f.read(&c, 1);
         c = static_cast<char>(c ^ 0x5a);
         f.seekp(static_cast<std::streamoff>(fs::file_size(d / file0) / 2));
         f.write(&c, 1);
       }},
      {"missing rank file", [&](const fs::path& d) { fs::remove(d / file0); }},
      {"no manifest", [&](const fs::path& d) { fs::remove(d / "manifest.json"); }},
      // The manifest edited by hand: the first piece ends one element later, or a shape changed.
      {"edited piece", [&](const fs::path& d) { edit_manifest(d, [](nlohmann::json& m) { bump_first_piece(m); }); }},
      {"edited shape", [&](const fs::path& d) { edit_manifest(d, [](nlohmann::json& m) { bump_first_shape(m); }); }},
      // The same edits where no checksum can tell (checkpoints from before manifest.xxh3):
      // the pieces no longer cover the parameter exactly once.
      {"edited piece, no checksum",
       [&](const fs::path& d) {
         edit_manifest(d, [](nlohmann::json& m) { bump_first_piece(m); });
         fs::remove(d / "manifest.xxh3");
       }},
      {"edited shape, no checksum",
       [&](const fs::path& d) {
         edit_manifest(d, [](nlohmann::json& m) { bump_first_shape(m); });
         fs::remove(d / "manifest.xxh3");
       }},
      {"torn manifest", [&](const fs::path& d) { fs::resize_file(d / "manifest.json", fs::file_size(d / "manifest.json") / 2); }},
  };
  const std::vector<std::string> reasons{"truncated",        "checksum",         "is missing",
                                         "no manifest.json", "fails its checksum", "fails its checksum",
                                         "do not cover",     "do not cover",       "fails its checksum"};
  ASSERT_EQ(reasons.size(), cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE(cases[k].first);
    const auto dir = common_temp_dir("ckpt_damage");
    Checkpointer ckpt(dir, world_ptr());
    Trainer run(2);
    const auto saved = three_checkpoints(run, ckpt);
    Trainer at4(2);  // what step 4 holds
    at4.load(ckpt, 4);
    const auto want = at4.flat();
    if (world().rank() == 0) cases[k].second(saved.steps.back());
    world().barrier();
    const auto got = load_fresh(ckpt);
    ASSERT_TRUE(got.progress.has_value());
    EXPECT_EQ(got.progress->step, 4) << "fell back to the previous committed checkpoint";
    EXPECT_TRUE(torch::equal(got.params, want));
    if (world().rank() == 0) {
      EXPECT_NE(got.log.find("not loading " + saved.steps.back()), std::string::npos) << got.log;
      EXPECT_NE(got.log.find(reasons[k]), std::string::npos) << got.log;
    }
    EXPECT_EQ(latest_of(dir), "step-00000006") << "a load never rewrites latest";
  }
}

// `latest` is only ever a step directory's name: one naming a path outside the
// run (edited, or corrupt) is not followed; the load says why and takes the
// newest committed checkpoint.
TEST(CheckpointBadInput, LatestNamingAnythingButAStepDirectoryIsNotFollowed) {
  const auto dir = common_temp_dir("ckpt_latest");
  Checkpointer ckpt(dir, world_ptr());
  Trainer run(2);
  three_checkpoints(run, ckpt);
  const auto want = run.flat();
  for (const std::string bad : {"../../../etc", "step-00000006/../../..", "step-00000004.tmp"}) {
    SCOPED_TRACE(bad);
    world().barrier();
    if (world().rank() == 0) std::ofstream(fs::path(dir) / "latest") << bad << "\n";
    world().barrier();
    const auto got = load_fresh(ckpt);
    ASSERT_TRUE(got.progress.has_value());
    EXPECT_EQ(got.progress->step, 6) << "the newest committed checkpoint";
    EXPECT_TRUE(torch::equal(got.params, want));
    EXPECT_NE(got.log.find("names '" + bad + "', which is not a step directory of this run"), std::string::npos)
        << got.log;
  }
}

// A manifest from before manifest.xxh3 and "zero_stage" (it said "stage")
// still loads, without a word about damage.
TEST(CheckpointCommit, ManifestWithoutChecksumOrZeroStageStillLoads) {
  const auto dir = common_temp_dir("ckpt_legacy");
  Checkpointer ckpt(dir, world_ptr());
  Trainer run(2);
  const auto saved = three_checkpoints(run, ckpt);
  const auto want = run.flat();
  if (world().rank() == 0) {
    const fs::path newest = saved.steps.back();
    edit_manifest(newest, [](nlohmann::json& m) {
      m["stage"] = m.at("zero_stage");
      m.erase("zero_stage");
    });
    fs::remove(newest / "manifest.xxh3");
  }
  world().barrier();
  const auto got = load_fresh(ckpt);
  ASSERT_TRUE(got.progress.has_value());
  EXPECT_EQ(got.progress->step, 6);
  EXPECT_TRUE(torch::equal(got.params, want));
  EXPECT_EQ(got.log.find("not loading"), std::string::npos) << got.log;
}

// Unreduced gradients (no_sync: full, per rank, in p.grad()) cannot be saved
// in shards: refused, saying what to do; after step() the save works.
TEST(CheckpointBadInput, SaveWithUnreducedGradientsIsRefused) {
  const auto dir = common_temp_dir("ckpt_pending");
  Checkpointer ckpt(dir, world_ptr());
  Trainer t(3);
  auto [x, y] = batch(0);
  t.opt().zero_grad();
  {
    auto guard = t.zero3->no_sync();
    torch::mse_loss(t.net->forward(x), y).backward();
  }
  const auto what = testing::error_of([&] { t.save(ckpt, 1); });
  EXPECT_NE(what.find("this step's gradients are still in p.grad()"), std::string::npos) << what;
  EXPECT_FALSE(fs::exists(fs::path(dir) / "latest"));
  t.opt().step();
  t.save(ckpt, 1);
  EXPECT_EQ(latest_of(dir), "step-00000001");
}

TEST(CheckpointBadInput, AnotherModelIsRefusedNamingTheDifference) {
  const auto dir = common_temp_dir("ckpt_other_model");
  Checkpointer ckpt(dir, world_ptr());
  Trainer run(2);
  run.train(0, 1);
  run.save(ckpt, 1);
  torch::nn::Linear other(kIn, kWidth + 1);
  ShardedAdamW opt(other->named_parameters(), world_ptr());
  const auto what = testing::error_of([&] { ckpt.load(opt, *other); });
  EXPECT_NE(what.find("was saved from a different model"), std::string::npos) << what;
  EXPECT_NE(what.find("'weight' is not in the checkpoint"), std::string::npos) << what;
}

// A run directory that cannot be created (a path through a regular file:
// fails even for root, unlike permission bits).
TEST(CheckpointBadInput, UnwritableDirectoryIsNamed) {
  const auto dir = common_temp_dir("ckpt_unwritable");
  if (world().rank() == 0) std::ofstream(fs::path(dir) / "file") << "x";
  world().barrier();
  const auto bad = (fs::path(dir) / "file" / "run").string();
  const auto what = testing::error_of([&] { Checkpointer c(bad, world_ptr()); });
  EXPECT_NE(what.find("opening the run directory failed on rank(s) 0"), std::string::npos) << what;
  if (world().rank() == 0) {
    EXPECT_NE(what.find("'" + bad + "'"), std::string::npos) << what;
  }
}

// A full disk, as a file-size limit on the last rank: every rank throws, the
// message names that rank and its file, and `latest` still names the previous
// checkpoint, which loads.
TEST(CheckpointBadInput, FullDiskFailsEveryRankAndKeepsLatest) {
  const auto dir = common_temp_dir("ckpt_full");
  Checkpointer ckpt(dir, world_ptr());
  Trainer run(3);
  run.train(0, 2);
  run.save(ckpt, 2);
  const auto want = run.flat();
  run.train(2, 4);
  const int last = world().size() - 1;
  struct rlimit old {};
  getrlimit(RLIMIT_FSIZE, &old);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // write() then fails with EFBIG instead of killing us
  if (world().rank() == last) {
    struct rlimit small = old;
    small.rlim_cur = 4096;
    setrlimit(RLIMIT_FSIZE, &small);
  }
  const auto what = testing::error_of([&] { run.save(ckpt, 4); });
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(what.find("writing rank files failed on rank(s) " + std::to_string(last)), std::string::npos) << what;
  if (world().rank() == last) {
    EXPECT_NE(what.find("rank-"), std::string::npos) << what;
  }
  EXPECT_EQ(latest_of(dir), "step-00000002");
  EXPECT_FALSE(fs::exists(fs::path(dir) / "step-00000004"));
  Trainer fresh(3, 7);
  ASSERT_TRUE(fresh.load(ckpt).has_value());
  EXPECT_TRUE(torch::equal(fresh.flat(), want));
  run.train(4, 6);
  run.save(ckpt, 6);  // the next save works and cleans up the failed one
  world().barrier();
  EXPECT_FALSE(fs::exists(fs::path(dir) / "step-00000004.tmp"));
}

}  // namespace checkpoint_test
}  // namespace zeroshard
