// BART trained as pipeline stages through the executor, against the whole
// model trained in one process by torch::optim::AdamW with the same
// microbatches: tiny BART with dropout on (keyed by seed, step, microbatch and
// block), the tied embedding on the first and the last stage, the token loss
// scaled by dp / global tokens, the gradient clipped. Every schedule, ZeRO
// stage and pipeline depth that divides the world size (2 x 1, 3 x 1, 2 x 2,
// 4 x 1 at 2, 3 and 4 ranks), 20 steps each.
#include "model/bart_pipeline.h"
#include "train/pipeline_training.h"
#include "test_util.h"

#include <zeroshard/fully_shard.h>
#include <zeroshard/pipeline_executor.h>
#include <zeroshard/sharded_optimizer.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace bart {
namespace {

using namespace zeroshard::pipeline;
using zeroshard::testing::world;
using zeroshard::testing::world_ptr;

constexpr int kSteps = 10, kGlobalBatch = 8, kMicrobatches = 4, kSource = 10, kTarget = 8;
constexpr uint64_t kSeed = 3, kDropoutSeed = 5;
constexpr double kMaxNorm = 0.5;
const auto kAdamW = torch::optim::AdamWOptions(3e-3).weight_decay(0.01);

namespace F = torch::nn::functional;

// Step `step`'s global batch: random tokens, the sources padded at their end.
struct GlobalBatch {
  torch::Tensor input_ids, labels, decoder_input_ids;
  double tokens = 0;  // labels that are not padding
};
GlobalBatch global_batch(const BartConfig& c, int step) {
  torch::manual_seed(1000 + step);
  GlobalBatch b;
  b.input_ids = torch::randint(4, c.vocab_size, {kGlobalBatch, kSource}, torch::kLong);
  b.labels = torch::randint(4, c.vocab_size, {kGlobalBatch, kTarget}, torch::kLong);
  for (int i = 0; i < kGlobalBatch; ++i) {
    b.input_ids[i].slice(0, kSource - i % 3).fill_(c.pad_token_id);
    b.labels[i].slice(0, kTarget - i % 2).fill_(c.pad_token_id);
  }
  b.decoder_input_ids = shift_tokens_right(b.labels, c.pad_token_id, c.decoder_start_token_id);
  b.tokens = b.labels.ne(c.pad_token_id).sum().item<double>();
  return b;
}

// Rows of microbatch `mb` on data-parallel rank `d` of `dp`; its dropout key
// counts microbatches over the global batch: mb * dp + d.
StageBatch rows_of(const GlobalBatch& g, int step, int mb, int d, int dp, torch::Tensor* labels) {
  const int per = kGlobalBatch / kMicrobatches / dp, from = (mb * dp + d) * per;
  StageBatch b;
  b.input_ids = g.input_ids.slice(0, from, from + per);
  b.decoder_input_ids = g.decoder_input_ids.slice(0, from, from + per);
  b.dropout = DropoutKey{kDropoutSeed, step, mb * dp + d};
  *labels = g.labels.slice(0, from, from + per);
  return b;
}

torch::Tensor summed_ce(const BartConfig& c, const torch::Tensor& logits, const torch::Tensor& labels) {
  return F::cross_entropy(logits.reshape({-1, c.vocab_size}), labels.reshape(-1),
                          F::CrossEntropyFuncOptions().ignore_index(c.pad_token_id).reduction(torch::kSum));
}

struct Oracle {
  std::vector<double> losses;
  torch::OrderedDict<std::string, torch::Tensor> params;
};

// The whole model, one process, the same rows and keys (dp ranks in turn).
Oracle unpipelined(const BartConfig& c, int dp) {
  torch::manual_seed(kSeed);
  BartForConditionalGeneration model(c);
  std::vector<torch::Tensor> params = model->parameters();
  torch::optim::AdamW opt(params, kAdamW);
  Oracle o;
  for (int step = 0; step < kSteps; ++step) {
    const GlobalBatch g = global_batch(c, step);
    opt.zero_grad();
    double sum = 0;
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      for (int d = 0; d < dp; ++d) {
        torch::Tensor labels;
        const StageBatch b = rows_of(g, step, mb, d, dp, &labels);
        model->dropout_key = b.dropout;
        auto loss = summed_ce(c, model->forward(b.input_ids, b.decoder_input_ids), labels) / g.tokens;
        loss.backward();
        sum += loss.item<double>();
      }
    }
    torch::nn::utils::clip_grad_norm_(params, kMaxNorm);
    opt.step();
    o.losses.push_back(sum);
  }
  for (const auto& item : model->named_parameters()) o.params.insert(item.key(), item.value().detach().clone());
  return o;
}

void expect_pipelined_matches(int pp, ScheduleKind kind, int chunks, int zero, const Oracle& want) {
  SCOPED_TRACE(to_string(kind) + " pp=" + std::to_string(pp) + " v=" + std::to_string(chunks) + " ZeRO-" +
               std::to_string(zero));
  const auto c = BartConfig::named("tiny");
  PipelineOptions po;
  po.pp = pp;
  po.schedule = to_string(kind);
  po.chunks = chunks;
  po.micro_batches = kMicrobatches;
  po.zero_stage = zero;
  po.adamw = kAdamW;
  po.max_grad_norm = kMaxNorm;
  po.seed = kSeed;
  PipelinedBart pipe(world_ptr(), c, po);
  const int dp = pipe.grid().dp();
  double worst = 0;
  for (int step = 0; step < kSteps; ++step) {
    const GlobalBatch g = global_batch(c, step);
    std::vector<Microbatch> micro(kMicrobatches);
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      micro[static_cast<size_t>(mb)].batch = rows_of(g, step, mb, pipe.grid().dp_rank(), dp, &micro[static_cast<size_t>(mb)].labels);
    }
    const StepResult r = pipe.train_step(std::move(micro), g.tokens);
    const double w = want.losses[static_cast<size_t>(step)];
    worst = std::max(worst, std::abs(r.loss - w) / w);
    EXPECT_NEAR(r.loss, w, 1e-5 * w) << "step " << step;
  }
  std::vector<zeroshard::FullyShardedModel::FullParamsGuard> full;
  for (const auto& st : pipe.stages()) {
    if (st.sharded) full.push_back(st.sharded->summon_full_params());
  }
  // Parameters against the oracle's: float rounding of other summation
  // orders (the data-parallel mean, the tied gradient's two halves, the
  // clipping factor), amplified by AdamW where a gradient is small; the worst
  // element of a 0.5M-element embedding sits far in that tail, so the mean is
  // held tighter than the worst. Not compared: the attention key projections'
  // biases, whose gradient is zero in exact arithmetic (softmax ignores a
  // shift shared by every key), so AdamW follows their rounding noise.
  double worst_param = 0, worst_mean = 0;
  for (const auto& st : pipe.stages()) {
    for (const auto& item : st.module->named_parameters()) {
      if (item.key().find("k_proj.bias") != std::string::npos) continue;
      const std::string name = item.key() == "lm_head.weight" ? "model.shared.weight" : item.key();
      const auto& w = want.params[name];
      const auto rel = (item.value().detach() - w).abs() / (w.abs() + 1e-2);
      const double err = rel.max().item<double>(), mean = rel.mean().item<double>();
      worst_param = std::max(worst_param, err);
      worst_mean = std::max(worst_mean, mean);
      EXPECT_LT(err, 1e-2) << item.key();
      EXPECT_LT(mean, 3e-5) << item.key();
    }
  }
  if (pipe.grid().world().data->rank() == 0) {
    std::printf("  %s pp=%d dp=%d v=%d ZeRO-%d: loss within %.1e relative; parameters %.1e worst, %.1e mean\n",
                to_string(kind).c_str(), pp, dp, chunks, zero, worst, worst_param, worst_mean);
  }
}

TEST(BartPipelineTraining, EveryScheduleAndZeroStageMatchesTheWholeModel) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks for a pipeline";
  const auto c = BartConfig::named("tiny");
  const int blocks = static_cast<int>(bart_blocks(c).size());
  for (int pp = 2; pp <= n; ++pp) {
    if (n % pp != 0) continue;
    const Oracle want = unpipelined(c, n / pp);
    for (int zero = 1; zero <= 3; ++zero) {
      expect_pipelined_matches(pp, ScheduleKind::kGPipe, 1, zero, want);
      expect_pipelined_matches(pp, ScheduleKind::k1F1B, 1, zero, want);
      if (blocks >= 2 * pp && kMicrobatches % pp == 0) {
        expect_pipelined_matches(pp, ScheduleKind::kInterleaved1F1B, 2, zero, want);
      }
    }
  }
}

}  // namespace
}  // namespace bart
