// Checkpoints of pipelined runs: several data-parallel groups (pipeline
// stages) save one checkpoint, which loads at any other (pipeline stages,
// data-parallel size, ZeRO stage).
//
// The test model runs as two stages (world rank = stage * dp + dp rank):
// stage 0 computes embed, frozen and block0 and sends its activations to the
// same dp rank of stage 1, which computes block1, block2 and head (and holds
// the buffer), takes the loss and sends the activations' gradient back. Each
// stage's optimizer shards that stage's parameters over its own group.
// CheckpointSave.AsTwoPipelineStages (at N = 2 and 4 ranks, in the
// checkpoint_save fixture) checks the trajectory against single-process
// torch::optim::AdamW on the whole model, saves at kSaveAt and writes the
// uninterrupted run's parameters; CheckpointResume loads those checkpoints
// unpipelined (checkpoint_test.cpp) and every checkpoint into two stages (here).
#include "checkpoint/checkpoint_models.h"
#include "test_util.h"

#include <zeroshard/checkpoint.h>
#include <zeroshard/fully_shard.h>
#include <zeroshard/sharded_adamw.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace zeroshard {
namespace checkpoint_test {

constexpr int kStages = 2;

// The test model as two pipeline stages over the world (its size even).
struct PipelineTrainer {
  int dp = 1, stage = 0, dp_rank = 0;
  std::shared_ptr<Communicator> group;  // this stage's data-parallel group
  Net net;                              // the whole model on every rank (as Trainer builds it); each stage trains its part
  std::shared_ptr<torch::nn::Module> part;
  std::shared_ptr<FullyShardedModel> sharded;
  std::unique_ptr<ShardedOptimizer> opt;

  // tie_embed: stage 1 holds (and its optimizer shards) its own copy of stage 0's embed layer too,
  // a parameter several stages hold, as a tied embedding is.
  explicit PipelineTrainer(int zero_stage, int seed = 1, bool tie_embed = false) {
    dp = world().size() / kStages;
    stage = world().rank() / dp;
    dp_rank = world().rank() % dp;
    for (int s = 0; s < kStages; ++s) {  // split() is collective: every rank takes part in both
      std::vector<int> ranks;
      for (int d = 0; d < dp; ++d) ranks.push_back(s * dp + d);
      auto c = world().split(ranks);
      if (c) group = c;
    }
    torch::manual_seed(seed);
    net = Net();
    part = std::make_shared<torch::nn::Module>();
    if (stage == 0) {
      part->register_module("embed", net->embed);
      part->register_module("frozen", net->frozen);
      part->register_module("block0", net->blocks[0]);
    } else {
      if (tie_embed) part->register_module("embed", net->embed);
      part->register_module("block1", net->blocks[1]);
      part->register_module("block2", net->blocks[2]);
      part->register_module("head", net->head);
      part->register_buffer("offset", net->offset);
    }
    if (zero_stage == 3) {
      sharded = fully_shard(part, group);
      opt = std::make_unique<FullyShardedAdamW>(sharded, kAdamW);
    } else {
      torch::OrderedDict<std::string, torch::Tensor> named;
      for (const auto& item : part->named_parameters()) {
        if (item.value().requires_grad()) named.insert(item.key(), item.value());
      }
      ShardedAdamWOptions so;
      so.zero_stage = zero_stage;
      opt = std::make_unique<ShardedAdamW>(named, group, kAdamW, so);
    }
  }
  CheckpointOptions options() const {
    CheckpointOptions o;
    o.pp_stages = kStages;
    o.pp_stage = stage;
    return o;
  }
  void train(int64_t from, int64_t to) {
    const int local = kBatch / dp, peer = stage == 0 ? dp + dp_rank : dp_rank;
    for (int64_t s = from; s < to; ++s) {
      auto [x, y] = batch(s);
      x = x.slice(0, dp_rank * local, (dp_rank + 1) * local);
      y = y.slice(0, dp_rank * local, (dp_rank + 1) * local);
      opt->zero_grad();
      if (stage == 0) {
        auto h = net->blocks[0]->forward(net->frozen(net->embed(x)));
        world().send(h.detach().contiguous(), peer)->wait();
        auto grad = torch::empty_like(h);
        world().recv(grad, peer)->wait();
        h.backward(grad);
      } else {
        auto h = torch::empty({local, kWidth});
        world().recv(h, peer)->wait();
        h.requires_grad_(true);
        auto out = net->head(net->blocks[2]->forward(net->blocks[1]->forward(h))) + net->offset.to(torch::kFloat);
        torch::mse_loss(out, y).backward();
        world().send(h.grad().contiguous(), peer)->wait();
      }
      opt->step();
    }
  }
  std::string save(Checkpointer& c, int64_t step) {
    TrainingProgress p;
    p.step = step;
    p.epoch = 1;
    p.extra_json = R"({"sampler": 42})";
    return c.save(*opt, *part, p);
  }
  // Every parameter and buffer of the whole model, in module order (as
  // Trainer::flat), on every rank: each stage's first rank contributes its part.
  // `sizes`: each one's name and number of elements.
  torch::Tensor flat(std::vector<std::pair<std::string, int64_t>>* sizes = nullptr) {
    std::optional<FullyShardedModel::FullParamsGuard> guard;
    if (sharded) guard.emplace(sharded->summon_full_params());
    std::set<std::string> mine;
    for (const auto& item : part->named_parameters()) mine.insert(item.key());
    for (const auto& item : part->named_buffers()) mine.insert(item.key());
    std::vector<torch::Tensor> ps;
    auto add = [&](const std::string& name, const torch::Tensor& t) {
      auto v = t.detach().to(torch::kFloat).reshape(-1).clone();
      if (sizes != nullptr) sizes->emplace_back(name, v.numel());
      ps.push_back(mine.count(name) && dp_rank == 0 ? v : torch::zeros_like(v));
    };
    for (const auto& item : net->named_parameters()) add(item.key(), item.value());
    for (const auto& item : net->named_buffers()) add(item.key(), item.value());
    auto all = torch::cat(ps);
    world().all_reduce(all, ReduceOp::kSum)->wait();  // x + 0 + ... is exact
    return all;
  }
};

// flat()'s values by name.
nlohmann::json by_name(const torch::Tensor& flat, const std::vector<std::pair<std::string, int64_t>>& sizes) {
  nlohmann::json out;
  int64_t at = 0;
  for (const auto& [name, numel] : sizes) {
    auto v = flat.slice(0, at, at + numel).to(torch::kDouble).contiguous();
    out[name] = std::vector<double>(v.data_ptr<double>(), v.data_ptr<double>() + v.numel());
    at += numel;
  }
  return out;
}

TEST(CheckpointSave, AsTwoPipelineStages) {
  const int n = world().size();
  if (n % kStages != 0) GTEST_SKIP() << "two pipeline stages need an even number of ranks";
  for (int zero_stage : {0, 2, 3}) {
    SCOPED_TRACE("ZeRO stage " + std::to_string(zero_stage));
    const fs::path dir = fs::path(shared_dir()) / ("pp2_n" + std::to_string(n) + "_stage" + std::to_string(zero_stage));
    if (world().rank() == 0) fs::remove_all(dir);
    world().barrier();
    PipelineTrainer run(zero_stage);
    Checkpointer ckpt(dir.string(), world_ptr(), run.options());
    run.train(0, kSaveAt);
    {  // the oracle: single-process torch::optim::AdamW on the whole model, the whole batch
      torch::manual_seed(1);
      Net ref;
      std::vector<torch::Tensor> trained;
      for (auto& p : ref->parameters()) {
        if (p.requires_grad()) trained.push_back(p);
      }
      torch::optim::AdamW adamw(trained, kAdamW);
      for (int64_t s = 0; s < kSaveAt; ++s) {
        auto [x, y] = batch(s);
        adamw.zero_grad();
        torch::mse_loss(ref->forward(x), y).backward();
        adamw.step();
      }
      std::vector<torch::Tensor> ps;
      for (auto& p : ref->parameters()) ps.push_back(p.detach().reshape(-1));
      for (auto& b : ref->buffers()) ps.push_back(b.detach().to(torch::kFloat).reshape(-1));
      expect_close(run.flat(), torch::cat(ps));
    }
    const fs::path step_dir = run.save(ckpt, kSaveAt);
    {  // one checkpoint: one manifest for both stages, one file per rank saying where it sits
      nlohmann::json m;
      std::ifstream(step_dir / "manifest.json") >> m;
      EXPECT_EQ(m.at("world_size").get<int>(), n);
      EXPECT_EQ(m.at("topology").at("pp_stages").get<int>(), kStages);
      EXPECT_EQ(m.at("topology").at("dp_size").get<int>(), n / kStages);
      ASSERT_EQ(m.at("files").size(), static_cast<size_t>(n));
      for (int q = 0; q < n; ++q) {
        const auto& f = m.at("files").at(static_cast<size_t>(q));
        EXPECT_EQ(f.at("pp_stage").get<int>(), q / run.dp) << q;
        EXPECT_EQ(f.at("dp_rank").get<int>(), q % run.dp) << q;
        EXPECT_EQ(static_cast<int64_t>(fs::file_size(step_dir / f.at("name").get<std::string>())),
                  f.at("bytes").get<int64_t>());
      }
      std::set<std::string> listed;  // both stages' trained parameters (ZeRO-3 also holds the frozen layer's)
      for (const auto& p : m.at("params")) {
        const auto name = p.at("name").get<std::string>();
        EXPECT_TRUE(listed.insert(name).second) << name << " is listed twice";
        for (const auto& pc : p.at("pieces")) {  // stage 0's parameters in stage 0's files, and so on
          const bool first_stage = name.rfind("embed.", 0) == 0 || name.rfind("frozen.", 0) == 0 ||
                                   name.rfind("block0.", 0) == 0;
          EXPECT_EQ(pc.at(0).get<int>() / run.dp, first_stage ? 0 : 1) << name;
          if (zero_stage == 0) {
            EXPECT_EQ(pc.at(0).get<int>() % run.dp, 0) << name << ": replicated, saved by dp rank 0";
          }
        }
      }
      for (const auto& item : run.net->named_parameters()) {
        if (item.value().requires_grad()) {
          EXPECT_TRUE(listed.count(item.key())) << item.key() << " is not in the manifest";
        }
      }
      bool offset = false;
      for (const auto& r : m.at("replicated")) {
        const auto name = r.at("name").get<std::string>();
        EXPECT_FALSE(listed.count(name)) << name;
        // Written by the first rank of the stage holding it: the buffer by stage 1's, the frozen layer by stage 0's.
        EXPECT_EQ(r.at("rank").get<int>(), name == "offset" ? run.dp : 0) << name;
        offset = offset || name == "offset";
      }
      EXPECT_TRUE(offset) << "the buffer is not in the manifest";
    }
    std::vector<std::pair<std::string, int64_t>> sizes;
    const auto saved = run.flat(&sizes);
    if (world().rank() == 0) std::ofstream(dir / "expected.json") << by_name(saved, sizes).dump();  // check_h5.py
    run.train(kSaveAt, kEnd);
    const auto final_params = run.flat();
    if (world().rank() == 0) write_tensor((dir / "uninterrupted.f32").string(), final_params);
    world().barrier();
  }
}

// At M ranks (even): every checkpoint of the fixture, pipelined or not, loaded
// into two stages at ZeRO stage 0, 1, 2 or 3, trained to kEnd, matches the run
// that saved it.
TEST(CheckpointResume, IntoTwoPipelineStages) {
  const int m = world().size();
  if (m % kStages != 0) GTEST_SKIP() << "two pipeline stages need an even number of ranks";
  for (const auto& name : saved_runs()) {
    for (int zero_stage : {0, 1, 2, 3}) {
      SCOPED_TRACE(name + " resumed as two stages of " + std::to_string(m / kStages) + " ranks, ZeRO stage " +
                   std::to_string(zero_stage));
      const fs::path dir = fs::path(shared_dir()) / name;
      ASSERT_TRUE(fs::exists(dir / "latest")) << dir << ": run checkpoint_save_np* first";
      PipelineTrainer run(zero_stage, /*seed=*/5);
      Checkpointer ckpt(dir.string(), world_ptr(), run.options());
      const auto progress = ckpt.load(*run.opt, *run.part);
      ASSERT_TRUE(progress.has_value());
      ASSERT_EQ(progress->step, kSaveAt);
      run.train(kSaveAt, kEnd);
      const auto got = run.flat();
      expect_close(got, read_tensor((dir / "uninterrupted.f32").string(), got.numel()));
    }
  }
}

TEST(CheckpointBadInput, PipelineTopologyThatDoesNotFitIsNamed) {
  const auto dir = common_temp_dir("ckpt_topology");
  CheckpointOptions o;
  o.pp_stages = 2;
  o.pp_stage = 2;
  auto what = testing::error_of([&] { Checkpointer(dir, world_ptr(), o); });
  EXPECT_NE(what.find("pp_stage 2 of pp_stages 2"), std::string::npos) << what;
  if (world().size() % kStages != 0) {
    GTEST_SKIP() << "the pipelined half needs a world divisible by " << kStages << " stages; checkpoint_np2/np4 run it";
  }
  PipelineTrainer run(2);
  run.train(0, 1);
  // Each stage's optimizer, but the checkpointer told there is no pipeline.
  Checkpointer flat(dir, world_ptr());
  what = testing::error_of([&] { run.save(flat, 1); });
  EXPECT_NE(what.find("the Checkpointer's communicator has " + std::to_string(world().size()) + " ranks"),
            std::string::npos) << what;
  EXPECT_NE(what.find("CheckpointOptions::pp_stages"), std::string::npos) << what;
  // Every rank saying it is stage 0.
  o.pp_stage = 0;
  Checkpointer same(dir, world_ptr(), o);
  what = testing::error_of([&] { run.save(same, 1); });
  EXPECT_NE(what.find("both say they are rank 0 of pipeline stage 0"), std::string::npos) << what;
  EXPECT_FALSE(fs::exists(fs::path(dir) / "latest"));
}

// Each stage on a disk of its own (no shared filesystem), with a parameter both
// stages hold: stage 1 writes its pieces of it too (an alternate set of the
// manifest's), so a resume at the same topology reads only its own disk.
TEST(CheckpointDisksPipeline, AParameterTwoStagesHoldResumesFromEachStagesDisk) {
  if (world().size() % kStages != 0) GTEST_SKIP() << "two pipeline stages need an even number of ranks";
  const fs::path base = common_temp_dir("ckpt_disks_tied");
  for (int zero_stage : {2, 3}) {
    SCOPED_TRACE("ZeRO stage " + std::to_string(zero_stage));
    PipelineTrainer a(zero_stage, /*seed=*/1, /*tie_embed=*/true);
    const auto dir = (base / ("zero" + std::to_string(zero_stage)) / ("disk" + std::to_string(a.stage))).string();
    // This rank's part in full: its parameters, as its optimizer holds them.
    auto part_flat = [](PipelineTrainer& t) {
      std::optional<FullyShardedModel::FullParamsGuard> guard;
      if (t.sharded) guard.emplace(t.sharded->summon_full_params());
      std::vector<torch::Tensor> ps;
      for (const auto& p : t.part->parameters()) ps.push_back(p.detach().reshape(-1).clone());
      return torch::cat(ps);
    };
    {
      Checkpointer ckpt(dir, world_ptr(), a.options());
      a.train(0, 2);
      a.save(ckpt, 2);
    }
    const auto want = part_flat(a);
    nlohmann::json m;
    std::ifstream(fs::path(dir) / "step-00000002" / "manifest.json") >> m;
    for (const auto& e : m.at("params")) {
      const auto name = e.at("name").get<std::string>();
      if (name.rfind("embed.", 0) != 0) continue;
      ASSERT_EQ(e.at("alternates").size(), 1u) << "stage 1's pieces of " << name;
      for (const auto& pc : e.at("alternates")[0]) EXPECT_GE(pc[0].get<int>(), world().size() / kStages) << pc;
      for (const auto& pc : e.at("pieces")) EXPECT_LT(pc[0].get<int>(), world().size() / kStages) << pc;
    }
    PipelineTrainer b(zero_stage, /*seed=*/9, /*tie_embed=*/true);
    Checkpointer ckpt(dir, world_ptr(), b.options());
    const auto progress = ckpt.load(*b.opt, *b.part);
    ASSERT_TRUE(progress.has_value());
    EXPECT_EQ(progress->step, 2);
    EXPECT_TRUE(torch::equal(part_flat(b), want));
  }
}

}  // namespace checkpoint_test
}  // namespace zeroshard
