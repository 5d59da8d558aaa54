// Checkpoints of pipelined BART: saved at one (pipeline stages, data-parallel
// size, ZeRO stage), loaded at every (pp, dp, ZeRO) of {1, 2, 4}² × {1, 2, 3}
// (pp = 1: the whole model) and as interleaved stages (two per rank), the
// masters and AdamW moments each rank holds after the load are bit-identical
// to the saved ones. Saved pipelined (pp 4 x dp 2, ZeRO-3), interleaved
// (pp 2 x dp 2, two stages per rank, ZeRO-2) and unpipelined (dp 2, ZeRO-1).
//
// The ranks are threads of one process (up to 16), so the oracle is plain
// memory: every saving rank copies its shards of every parameter's master and
// moments, by name, into full tensors, before the save; every loading rank
// compares its shards against them. The tied embedding's copy on the last
// stage (lm_head.weight) is saved once, as model.shared.weight, and loads into
// both copies, or into the whole model where they are one tensor.
#include "train/pipeline_training.h"
#include "test_util.h"

#include <zeroshard/checkpoint.h>
#include <zeroshard/fully_shard.h>
#include <zeroshard/sharded_adamw.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include <mutex>

namespace bart {
namespace pipeline_checkpoint_test {

using namespace zeroshard;
namespace F = torch::nn::functional;

constexpr int kMicrobatches = 4, kSaveAt = 2;
const auto kAdamW = torch::optim::AdamWOptions(3e-3).weight_decay(0.01);

struct Shape {
  int pp, dp, zero;
  int chunks = 1;  // stages per pipeline rank (interleaved 1F1B when 2 or more)
  std::string str() const {
    return "pp=" + std::to_string(pp) + " dp=" + std::to_string(dp) + " ZeRO-" + std::to_string(zero) +
           (chunks > 1 ? " v=" + std::to_string(chunks) : "");
  }
};

BartConfig config() {
  auto c = BartConfig::named("tiny");
  c.dropout = c.attention_dropout = c.activation_dropout = 0;  // the ranks share one process's generator
  return c;
}

// Microbatch `mb` of data-parallel rank `d` at step `step`: 1 row of random tokens.
Microbatch microbatch(const BartConfig& c, int step, int mb, int d) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + 10 * mb + d);
  Microbatch m;
  m.batch.input_ids = torch::randint(4, c.vocab_size, {1, 6}, gen, torch::kLong);
  m.labels = torch::randint(4, c.vocab_size, {1, 5}, gen, torch::kLong);
  m.batch.decoder_input_ids = shift_tokens_right(m.labels, c.pad_token_id, c.decoder_start_token_id);
  return m;
}

// One rank of a shape: the whole model over every rank (pp = 1) or PipelinedBart.
struct RankRun {
  Shape shape;
  std::shared_ptr<Communicator> comm;
  std::unique_ptr<PipelinedBart> pipe;
  BartForConditionalGeneration whole{nullptr};
  std::shared_ptr<ShardedOptimizer> whole_opt;

  RankRun(Shape s, std::shared_ptr<Communicator> c) : shape(s), comm(std::move(c)) {
    if (shape.pp > 1) {
      PipelineOptions o;
      o.pp = shape.pp;
      o.schedule = shape.chunks > 1 ? "interleaved-1f1b" : "gpipe";
      o.chunks = shape.chunks;
      o.micro_batches = kMicrobatches;
      o.zero_stage = shape.zero;
      o.adamw = kAdamW;
      o.max_grad_norm = 1.0;
      pipe = std::make_unique<PipelinedBart>(ProcessGroup(comm), config(), o);
      return;
    }
    whole = BartForConditionalGeneration(config());
    if (shape.zero == 3) {
      whole_opt = std::make_shared<FullyShardedAdamW>(fully_shard(whole, comm), kAdamW);
    } else {
      ShardedAdamWOptions so;
      so.zero_stage = shape.zero;
      whole_opt = std::make_shared<ShardedAdamW>(whole->named_parameters(), comm, kAdamW, so);
    }
  }
  int dp_rank() const { return pipe ? pipe->grid().dp_rank() : comm->rank(); }
  // What the checkpoint holds of this rank: every stage's optimizer and module.
  std::vector<Checkpointer::Part> parts() const {
    return pipe ? pipe->checkpoint_parts() : std::vector<Checkpointer::Part>{{whole_opt.get(), whole.ptr().get()}};
  }
  CheckpointOptions options() const { return pipe ? pipe->checkpoint_options() : CheckpointOptions{}; }

  void train(int steps) {
    const auto c = config();
    for (int step = 0; step < steps; ++step) {
      std::vector<Microbatch> micro;
      for (int mb = 0; mb < kMicrobatches; ++mb) micro.push_back(microbatch(c, step, mb, dp_rank()));
      const double tokens = 5.0 * kMicrobatches * shape.dp;
      if (pipe) {
        pipe->train_step(std::move(micro), tokens);
        continue;
      }
      whole_opt->zero_grad();
      for (const auto& m : micro) {
        const auto logits = whole->forward(m.batch.input_ids, m.batch.decoder_input_ids);
        (F::cross_entropy(logits.reshape({-1, c.vocab_size}), m.labels.reshape(-1),
                          F::CrossEntropyFuncOptions().reduction(torch::kSum)) * (shape.dp / tokens)).backward();
      }
      whole_opt->clip_grad_norm(1.0);
      whole_opt->step();
    }
  }
};

// A rank's shard of one parameter's master and moments, under its checkpoint name.
struct Piece {
  std::string name;
  int64_t numel;  // of the whole parameter
  int64_t begin;
  torch::Tensor master, exp_avg, exp_avg_sq;
};
std::vector<Piece> pieces_of(RankRun& run) {
  const auto saved_names = run.options().saved_names;
  std::vector<Piece> out;
  for (const auto& part : run.parts()) {
  std::unordered_map<const c10::TensorImpl*, std::string> name_of;
  for (const auto& item : part.model->named_parameters()) {
    const auto alias = saved_names.find(item.key());
    name_of[item.value().unsafeGetTensorImpl()] = alias == saved_names.end() ? item.key() : alias->second;
  }
  const ShardedState state = part.optimizer->sharded_state();
  for (const auto& b : state.buckets) {
    for (const auto& seg : shard_segments(b.layout, state.rank)) {
      const Range local = seg.local(b.layout, state.rank);
      const auto slice = [&](const torch::Tensor& t) { return t.slice(0, local.begin, local.end).clone(); };
      const size_t i = b.params[seg.param];
      out.push_back({name_of.at(state.param_tensors.at(i).unsafeGetTensorImpl()), state.params.at(i).numel(),
                     seg.param_offset, slice(b.master), slice(b.exp_avg), slice(b.exp_avg_sq)});
    }
  }
  }
  return out;
}

struct Saved {
  std::mutex mu;
  std::map<std::string, std::array<torch::Tensor, 3>> full;  // name -> master, exp_avg, exp_avg_sq
  void add(const Piece& p) {
    std::lock_guard<std::mutex> lock(mu);
    auto& f = full[p.name];
    if (!f[0].defined()) {
      for (auto& t : f) t = torch::full({p.numel}, NAN);
    }
    const auto n = p.master.numel();
    f[0].slice(0, p.begin, p.begin + n).copy_(p.master);
    f[1].slice(0, p.begin, p.begin + n).copy_(p.exp_avg);
    f[2].slice(0, p.begin, p.begin + n).copy_(p.exp_avg_sq);
  }
};

// Runs `body(run)` on every rank of `shape` (threads); returns their errors.
std::string on_ranks(const Shape& shape, const std::function<void(RankRun&)>& body) {
  const int n = shape.pp * shape.dp, port = zeroshard::testing::free_port();
  CommOptions co;
  co.timeout = std::chrono::seconds(120);
  co.rendezvous_timeout = std::chrono::seconds(120);
  const auto errors = zeroshard::testing::run_ranks(n, [&](int r) {
    RankRun run(shape, init_communicator(zeroshard::testing::thread_env(r, n, port), co));
    body(run);
  });
  std::string all;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) all += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  }
  return all;
}

void expect_loads_everywhere(const Shape& from) {
  const auto dir = zeroshard::testing::make_temp_dir("bart-pp-ckpt");
  Saved saved;
  const std::string save_error = on_ranks(from, [&](RankRun& run) {
    run.train(kSaveAt);
    for (const auto& p : pieces_of(run)) saved.add(p);
    Checkpointer ckpt(dir, run.comm, run.options());
    TrainingProgress progress;
    progress.step = kSaveAt;
    ckpt.save(run.parts(), progress);
  });
  ASSERT_EQ(save_error, "") << "saving at " << from.str();
  int64_t elements = 0;
  for (const auto& [name, f] : saved.full) {
    ASSERT_FALSE(torch::isnan(f[0]).any().item<bool>()) << name << ": the saving ranks' shards do not cover it";
    elements += f[0].numel();
  }
  EXPECT_EQ(saved.full.count("lm_head.weight"), 0u) << "the head's copy is saved under the embedding's name";
  std::vector<Shape> shapes;
  for (int pp : {1, 2, 4}) {
    for (int dp : {1, 2, 4}) {
      for (int zero : {1, 2, 3}) shapes.push_back({pp, dp, zero});
    }
  }
  for (int zero : {1, 3}) shapes.push_back({2, 2, zero, /*chunks=*/2});  // two stages per rank
  {
    {
      for (const Shape& to : shapes) {
        std::mutex mu;
        int64_t compared = 0;
        const std::string error = on_ranks(to, [&](RankRun& run) {
          Checkpointer ckpt(dir, run.comm, run.options());
          const auto progress = ckpt.load(run.parts());
          TORCH_CHECK(progress && progress->step == kSaveAt, "no checkpoint of step ", kSaveAt, " loaded");
          for (const auto& p : pieces_of(run)) {
            const auto& f = saved.full.at(p.name);
            const int64_t n = p.master.numel();
            const char* what[3] = {"master", "exp_avg", "exp_avg_sq"};
            const torch::Tensor got[3] = {p.master, p.exp_avg, p.exp_avg_sq};
            for (int k = 0; k < 3; ++k) {
              TORCH_CHECK(torch::equal(got[k], f[static_cast<size_t>(k)].slice(0, p.begin, p.begin + n)), p.name,
                          "'s ", what[k], " [", p.begin, ", ", p.begin + n, ") differs from the saved one");
            }
            std::lock_guard<std::mutex> lock(mu);
            compared += n;
          }
          for (const auto& part : run.parts()) {
            for (int64_t s : part.optimizer->sharded_state().param_steps) {
              TORCH_CHECK(s == kSaveAt, "a parameter's AdamW step is ", s, " after the load, not ", kSaveAt);
            }
          }
        });
        EXPECT_EQ(error, "") << "saved at " << from.str() << ", loaded at " << to.str();
        // Every element once per stage holding it: the tied embedding twice when pipelined.
        const int64_t tied = saved.full.at("model.shared.weight")[0].numel();
        EXPECT_EQ(compared, elements + (to.pp > 1 ? tied : 0)) << "loaded at " << to.str();
      }
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(BartPipelineCheckpoint, SavedPipelinedLoadsBitExactAtEveryShape) {
  if (zeroshard::testing::world().size() != 1) GTEST_SKIP() << "runs its ranks as threads, once";
  expect_loads_everywhere({4, 2, 3});
}

TEST(BartPipelineCheckpoint, SavedInterleavedLoadsBitExactAtEveryShape) {
  if (zeroshard::testing::world().size() != 1) GTEST_SKIP() << "runs its ranks as threads, once";
  expect_loads_everywhere({2, 2, 2, /*chunks=*/2});
}

TEST(BartPipelineCheckpoint, SavedUnpipelinedLoadsBitExactAtEveryShape) {
  if (zeroshard::testing::world().size() != 1) GTEST_SKIP() << "runs its ranks as threads, once";
  expect_loads_everywhere({1, 2, 1});
}

}  // namespace pipeline_checkpoint_test
}  // namespace bart
