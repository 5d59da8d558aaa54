// BART as pipeline stages, against the whole model in one process: each stage
// built alone holds the model's values under the model's names, and the
// stages chained compute the model's logits and gradients (the tied
// embedding's as the sum of its two copies').
#include "model/bart_pipeline.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace bart {
namespace {

using zeroshard::pipeline::Payload;
using zeroshard::pipeline::partition_uniform;

BartConfig tiny_without_dropout() {
  auto c = BartConfig::named("tiny");
  c.dropout = c.attention_dropout = c.activation_dropout = 0;
  return c;
}

StageBatch batch_of(const BartConfig& c, torch::Tensor& labels) {
  torch::manual_seed(11);
  StageBatch b;
  b.input_ids = torch::randint(4, c.vocab_size, {3, 9}, torch::kLong);
  b.input_ids[0][8] = c.pad_token_id;  // padding in the source
  labels = torch::randint(4, c.vocab_size, {3, 7}, torch::kLong);
  b.decoder_input_ids = shift_tokens_right(labels, c.pad_token_id, c.decoder_start_token_id);
  return b;
}

TEST(BartPipeline, BlockParameterCountsAreTheStagesOwn) {
  const auto c = tiny_without_dropout();
  const auto blocks = bart_blocks(c);
  ASSERT_EQ(blocks.size(), static_cast<size_t>(2 + c.encoder_layers + c.decoder_layers));
  int64_t total = 0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    BartStage stage(c, std::vector<size_t>{b});
    int64_t n = 0;
    for (const auto& p : stage->parameters()) n += p.numel();
    EXPECT_EQ(blocks[b].params, n) << blocks[b].name;
    total += n;
  }
  torch::manual_seed(0);
  BartForConditionalGeneration whole(c);
  int64_t whole_n = 0;
  for (const auto& p : whole->parameters()) whole_n += p.numel();
  EXPECT_EQ(total, whole_n + c.vocab_size * c.d_model) << "the stages hold the model and one copy of the embedding";
}

TEST(BartPipeline, StagesOfEveryPartitionMatchTheWholeModel) {
  const auto c = tiny_without_dropout();
  torch::manual_seed(3);
  BartForConditionalGeneration whole(c);
  torch::Tensor labels;
  const StageBatch batch = batch_of(c, labels);
  auto ce = [&](const torch::Tensor& logits) {
    return torch::nn::functional::cross_entropy(
        logits.reshape({-1, c.vocab_size}), labels.reshape(-1),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(c.pad_token_id).reduction(torch::kSum));
  };
  const auto want_logits = whole->forward(batch.input_ids, batch.decoder_input_ids);
  ce(want_logits).backward();
  const auto whole_params = whole->named_parameters();

  const auto blocks = bart_blocks(c);
  for (size_t stages : {2, 3, static_cast<int>(blocks.size())}) {
    SCOPED_TRACE(std::to_string(stages) + " stages");
    const auto part = partition_uniform(blocks, static_cast<int>(stages));
    std::vector<BartStage> built;
    for (const auto& s : part.stages) {
      torch::manual_seed(3);  // the seed the whole model was built with: its values, whatever else ran since
      built.emplace_back(c, s);
    }
    // Values under the model's names.
    for (auto& st : built) {
      for (const auto& item : st->named_parameters()) {
        const std::string name = item.key() == "lm_head.weight" ? "model.shared.weight" : item.key();
        ASSERT_TRUE(whole_params.contains(name)) << item.key();
        EXPECT_TRUE(torch::equal(item.value(), whole_params[name])) << item.key();
      }
    }
    // Chained: the model's logits and gradients.
    Payload x;
    for (auto& st : built) x = st->forward(x, batch);
    ASSERT_EQ(x.size(), 1u);
    EXPECT_TRUE(torch::equal(x[0].second, want_logits)) << "logits";
    ce(x[0].second).backward();
    torch::Tensor tied_grad;
    for (auto& st : built) {
      for (const auto& item : st->named_parameters()) {
        const auto& g = item.value().grad();
        if (item.key() == "model.shared.weight" || item.key() == "lm_head.weight") {
          tied_grad = tied_grad.defined() ? tied_grad + g : g;
          continue;
        }
        EXPECT_TRUE(torch::allclose(g, whole_params[item.key()].grad(), 1e-5, 1e-7)) << item.key();
      }
    }
    EXPECT_TRUE(torch::allclose(tied_grad, whole_params["model.shared.weight"].grad(), 1e-5, 1e-7))
        << "the two copies' gradients add up to the tied embedding's";
  }
}

// Dropout on: keyed by (seed, step, microbatch, block), the stages of every
// partition draw the whole model's masks, so the logits are the same bits;
// another microbatch's key draws other masks.
TEST(BartPipeline, KeyedDropoutGivesEveryPartitionTheSameMasks) {
  const auto c = BartConfig::named("tiny");
  ASSERT_GT(c.dropout, 0);
  torch::manual_seed(3);
  BartForConditionalGeneration whole(c);
  torch::Tensor labels;
  StageBatch batch = batch_of(c, labels);
  batch.dropout = DropoutKey{5, 3, 1};
  whole->dropout_key = batch.dropout;
  const auto want = whole->forward(batch.input_ids, batch.decoder_input_ids);
  whole->dropout_key.microbatch = 2;
  EXPECT_FALSE(torch::equal(whole->forward(batch.input_ids, batch.decoder_input_ids), want)) << "the key is not used";
  const auto blocks = bart_blocks(c);
  // One stage of every block would hold two copies of the embedding: refused, naming the whole model.
  const auto what = zeroshard::testing::error_of([&] { BartStage(c, partition_uniform(blocks, 1).stages[0]); });
  EXPECT_NE(what.find("use BartForConditionalGeneration"), std::string::npos) << what;
  for (int stages : {2, 3, static_cast<int>(blocks.size())}) {
    Payload x;
    torch::manual_seed(3);
    for (const auto& s : partition_uniform(blocks, stages).stages) {
      torch::manual_seed(3);
      x = BartStage(c, s)->forward(x, batch);
    }
    EXPECT_TRUE(torch::equal(x.at(0).second, want)) << stages << " stages";
  }
}

}  // namespace
}  // namespace bart
