// BART model: Hugging Face's parameter names and counts, shapes, padding and
// causal masks, tied embeddings.
#include "bart_model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>

namespace bart_model_test {

using bart::BartConfig;
using bart::BartForConditionalGeneration;

int64_t count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// Hugging Face's counts for facebook/bart-base and bart-large (50,265 tokens;
// the head is tied, final_logits_bias is a buffer).
TEST(BartModel, ParameterCountsAndNamesMatchHuggingFace) {
  for (const auto& [name, want] : std::map<std::string, int64_t>{{"base", 139420416}, {"large", 406291456}}) {
    torch::manual_seed(0);
    BartForConditionalGeneration m(BartConfig::named(name));
    const int64_t got = count(*m);
    std::printf("BART %s: %lld parameters (%.1fM)\n", name.c_str(), static_cast<long long>(got), got / 1e6);
    EXPECT_EQ(got, want) << name;
    const auto params = m->named_parameters();
    const int64_t d = m->config.d_model;
    EXPECT_EQ(params["model.shared.weight"].sizes(), (std::vector<int64_t>{50265, d}));
    EXPECT_EQ(params["model.encoder.embed_positions.weight"].sizes(), (std::vector<int64_t>{1026, d}));
    for (const char* n : {"model.encoder.layers.0.self_attn.q_proj.weight", "model.encoder.layers.0.fc1.bias",
                          "model.encoder.layers.0.final_layer_norm.weight", "model.encoder.layernorm_embedding.bias",
                          "model.decoder.layers.1.encoder_attn.k_proj.weight",
                          "model.decoder.layers.1.encoder_attn_layer_norm.bias",
                          "model.decoder.layers.1.self_attn.out_proj.bias", "model.decoder.embed_positions.weight"}) {
      EXPECT_TRUE(params.contains(n)) << n;
    }
    EXPECT_EQ(m->named_buffers()["final_logits_bias"].sizes(), (std::vector<int64_t>{1, 50265}));
    int64_t vocab_sized = 0;
    for (const auto& p : m->parameters()) vocab_sized += p.size(0) == 50265 ? 1 : 0;
    EXPECT_EQ(vocab_sized, 1) << "input embeddings and head are one tensor";
  }
}

struct Tiny {
  BartForConditionalGeneration m{BartConfig::named("tiny")};
  Tiny() { m->eval(); }  // no dropout: outputs are deterministic
};

torch::Tensor ids(int64_t b, int64_t len, int64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(4, 4096, {b, len}, torch::kLong);  // above the special tokens
}

TEST(BartModel, ShapesOfTheLogits) {
  torch::manual_seed(1);
  Tiny t;
  EXPECT_EQ(t.m->forward(ids(3, 17, 2), ids(3, 9, 3)).sizes(), (std::vector<int64_t>{3, 9, 4096}));
  const auto loss = t.m->loss(ids(2, 11, 4), ids(2, 7, 5));
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_NEAR(loss.item<double>(), std::log(4096.0), 0.5) << "an untrained model is near uniform";
}

// Padding the source changes no output (masked keys), and padded labels add no loss.
TEST(BartModel, PaddingChangesNothing) {
  torch::manual_seed(1);
  Tiny t;
  torch::NoGradGuard no_grad;
  const auto src = ids(2, 10, 6), tgt = ids(2, 8, 7);
  const auto padded = torch::cat({src, torch::full({2, 5}, 1, torch::kLong)}, 1);
  EXPECT_TRUE(torch::allclose(t.m->forward(src, tgt), t.m->forward(padded, tgt), 1e-5, 1e-5));
  const auto labels = torch::cat({tgt, torch::full({2, 3}, 1, torch::kLong)}, 1);
  EXPECT_NEAR(t.m->loss(src, tgt).item<double>(), t.m->loss(src, labels).item<double>(), 1e-5);
}

// The decoder is causal: changing the target at position t changes no logits before t.
TEST(BartModel, DecoderSeesNoFutureTokens) {
  torch::manual_seed(1);
  Tiny t;
  torch::NoGradGuard no_grad;
  const auto src = ids(2, 10, 8);
  auto tgt = ids(2, 9, 9);
  const auto a = t.m->forward(src, tgt);
  tgt.select(1, 6).fill_(42);
  const auto b = t.m->forward(src, tgt);
  EXPECT_TRUE(torch::allclose(a.slice(1, 0, 6), b.slice(1, 0, 6), 1e-6, 1e-6));
  EXPECT_FALSE(torch::allclose(a.slice(1, 6), b.slice(1, 6), 1e-3, 1e-3)) << "position 6 and later do change";
}

// The output projection is model.shared: zero a token's row and its logit is
// final_logits_bias alone; the embedding and the head share the gradient.
TEST(BartModel, HeadIsTiedToTheSharedEmbedding) {
  torch::manual_seed(1);
  Tiny t;
  {
    torch::NoGradGuard no_grad;
    t.m->model->shared->weight[123].zero_();
    t.m->final_logits_bias[0][123] = 0.75;
  }
  const auto logits = t.m->forward(ids(1, 6, 10), ids(1, 5, 11));
  EXPECT_TRUE(torch::allclose(logits.select(2, 123), torch::full({1, 5}, 0.75)));
  t.m->loss(ids(1, 6, 10), ids(1, 5, 11)).backward();
  const auto g = t.m->model->shared->weight.grad();
  ASSERT_TRUE(g.defined());
  EXPECT_GT(g[123].abs().sum().item<double>(), 0) << "the head's gradient reaches the shared rows of unseen tokens";
}

TEST(BartModel, ShiftTokensRight) {
  const auto labels = torch::tensor({{10, 11, 12, 1}}, torch::kLong);
  EXPECT_TRUE(torch::equal(bart::shift_tokens_right(labels, 1, 2), torch::tensor({{2, 10, 11, 12}}, torch::kLong)));
}

}  // namespace bart_model_test

namespace bart_model_test {

// Cross-attention works end to end: a small BART learns to copy random
// sequences (which only attending to the encoder can do: the tokens are
// independent), and greedy decoding then reproduces an unseen one.
TEST(BartModel, LearnsToCopyThroughCrossAttention) {
  BartConfig c;
  c.vocab_size = 24;
  c.d_model = 64;
  c.encoder_layers = c.decoder_layers = 2;
  c.attention_heads = 4;
  c.ffn_dim = 128;
  c.max_position_embeddings = 32;
  c.dropout = c.attention_dropout = c.activation_dropout = 0;
  torch::manual_seed(0);
  BartForConditionalGeneration m(c);
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(3e-3));
  auto sequences = [&](int64_t n) {  // bos, 8 tokens from 4..23, eos
    auto body = torch::randint(4, c.vocab_size, {n, 8}, torch::kLong);
    return torch::cat({torch::full({n, 1}, c.bos_token_id, torch::kLong), body,
                       torch::full({n, 1}, c.eos_token_id, torch::kLong)}, 1);
  };
  float first = 0, last = 0;
  for (int step = 0; step < 400; ++step) {
    const auto x = sequences(32);
    opt.zero_grad();
    auto loss = m->loss(x, x);
    loss.backward();
    opt.step();
    if (step == 0) first = loss.item<float>();
    last = loss.item<float>();
  }
  std::printf("copy task: loss %.3f -> %.4f (chance: ln 20 = %.3f)\n", first, last, std::log(20.0));
  EXPECT_LT(last, 0.05) << "a working encoder-decoder copies; chance is ln(20) = 3.0";
  m->eval();
  const auto x = sequences(3);
  const auto out = m->generate(x, 12);  // a batch decodes each sequence as alone
  ASSERT_EQ(out.size(), 3u);
  for (int64_t r = 0; r < 3; ++r) {
    std::vector<int64_t> want(x[r].data_ptr<int64_t>(), x[r].data_ptr<int64_t>() + x.size(1));
    EXPECT_EQ(out[static_cast<size_t>(r)], want) << "sequence " << r;
    EXPECT_EQ(m->generate(x.slice(0, r, r + 1), 12).at(0), want) << "sequence " << r << " alone";
  }
}

}  // namespace bart_model_test
