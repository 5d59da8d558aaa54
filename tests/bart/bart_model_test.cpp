// BART model: Hugging Face's parameter names and counts, shapes, padding and
// causal masks, tied embeddings.
#include "model/bart_model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
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

// A source known to be unpadded (source_padded false) runs attention without a
// mask: the same logits and loss as with the mask, which then masks nothing.
TEST(BartModel, AnUnpaddedSourceNeedsNoMask) {
  torch::manual_seed(1);
  Tiny t;
  torch::NoGradGuard no_grad;
  const auto src = ids(3, 12, 10), tgt = ids(3, 8, 11);
  EXPECT_TRUE(torch::allclose(t.m->forward(src, tgt, /*source_padded=*/false), t.m->forward(src, tgt), 1e-5, 1e-5));
  EXPECT_NEAR(t.m->loss(src, tgt, false).item<double>(), t.m->loss(src, tgt).item<double>(), 1e-6);
  // and the flag matters: a padded source read as unpadded attends to its padding
  const auto padded = torch::cat({src, torch::full({3, 5}, 1, torch::kLong)}, 1);
  EXPECT_FALSE(torch::allclose(t.m->forward(padded, tgt, false), t.m->forward(padded, tgt), 1e-3, 1e-3));
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
// The attention (fused projections; LibTorch 2.x's scaled_dot_product_attention)
// against the formula written out: q, k, v from the separate projections,
// softmax(q k^T / sqrt(d)) with padded keys and, in the causal case, future
// keys at -inf, times v, through out_proj. fp32, no dropout.
TEST(BartModel, AttentionMatchesTheFormula) {
  torch::manual_seed(3);
  auto c = BartConfig::named("tiny");
  c.attention_dropout = 0;
  bart::BartAttention attn(c);
  const int64_t B = 3, T = 7, S = 5, H = c.attention_heads, d = c.head_dim();
  const auto x = torch::randn({B, T, c.d_model}), mem = torch::randn({B, S, c.d_model});
  auto padding = torch::zeros({B, S}, torch::kBool);
  padding.index_put_({1, torch::indexing::Slice(3)}, true);  // sequence 1 has 3 keys, sequence 2 has 4
  padding.index_put_({2, 4}, true);
  auto formula = [&](const torch::Tensor& q_in, const torch::Tensor& kv_in, const torch::Tensor& pad, bool causal) {
    const int64_t t = q_in.size(1), s = kv_in.size(1);
    auto heads = [&](const torch::Tensor& y, int64_t n) { return y.view({B, n, H, d}).transpose(1, 2); };
    const auto q = heads(attn->q_proj(q_in), t), k = heads(attn->k_proj(kv_in), s), v = heads(attn->v_proj(kv_in), s);
    auto scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(d));
    if (pad.defined()) scores = scores.masked_fill(pad.view({B, 1, 1, s}), -INFINITY);
    if (causal) scores = scores.masked_fill(torch::ones({t, s}, torch::kBool).triu(1), -INFINITY);
    const auto out = torch::matmul(torch::softmax(scores, -1), v).transpose(1, 2).reshape({B, t, H * d});
    return attn->out_proj(out);
  };
  for (bool training : {false, true}) {  // training: dropout 0 takes the same path
    attn->train(training);
    EXPECT_TRUE(torch::allclose(attn(x, mem, padding, false), formula(x, mem, padding, false), 1e-5, 1e-5))
        << "cross-attention over padded keys";
    EXPECT_TRUE(torch::allclose(attn(x, x, torch::Tensor(), true), formula(x, x, torch::Tensor(), true), 1e-5, 1e-5))
        << "causal self-attention";
    const auto xs = x.slice(1, 0, S);
    EXPECT_TRUE(torch::allclose(attn(xs, xs, padding, false), formula(xs, xs, padding, false), 1e-5, 1e-5))
        << "self-attention over padded keys";
  }
}

// The summed cross-entropy (chunked, its gradient computed with the loss)
// against LibTorch's cross_entropy at fp32: the loss and the logits' gradient,
// with ignored rows, in chunks of 1, 3 and all rows; and from bf16 logits,
// within bf16 rounding of the fp32 result.
TEST(BartModel, SummedCrossEntropyMatchesLibTorch) {
  torch::manual_seed(4);
  const int64_t N = 10, V = 37, pad = 1;
  const auto logits = torch::randn({N, V}) * 3;
  auto labels = torch::randint(0, V, {N}, torch::kLong);
  labels.index_put_({torch::tensor({2, 5, 6})}, pad);
  auto want_logits = logits.clone().requires_grad_(true);
  const auto want = torch::nn::functional::cross_entropy(
      want_logits, labels, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(pad).reduction(torch::kSum));
  (want * 0.5).backward();
  for (int64_t chunk : {1, 3, 0}) {
    auto got_logits = logits.clone().requires_grad_(true);
    const auto got = bart::summed_cross_entropy(got_logits, labels, pad, chunk);
    (got * 0.5).backward();
    EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-5 * std::abs(want.item<double>())) << "chunk " << chunk;
    EXPECT_TRUE(torch::allclose(got_logits.grad(), want_logits.grad(), 1e-6, 1e-6)) << "chunk " << chunk;
    EXPECT_EQ(got_logits.grad().select(0, 5).abs().sum().item<double>(), 0.0) << "an ignored row has no gradient";
    torch::NoGradGuard no_grad;
    EXPECT_NEAR(bart::summed_cross_entropy(logits, labels, pad, chunk).item<double>(), want.item<double>(),
                1e-5 * std::abs(want.item<double>())) << "without a gradient, chunk " << chunk;
  }
  auto half = logits.to(torch::kBFloat16).requires_grad_(true);
  const auto got = bart::summed_cross_entropy(half, labels, pad, 4);
  got.backward();
  EXPECT_EQ(got.scalar_type(), torch::kFloat) << "the loss is accumulated in fp32";
  EXPECT_EQ(half.grad().scalar_type(), torch::kBFloat16);
  auto ref = half.detach().to(torch::kFloat).requires_grad_(true);
  torch::nn::functional::cross_entropy(ref, labels, torch::nn::functional::CrossEntropyFuncOptions()
                                                        .ignore_index(pad).reduction(torch::kSum)).backward();
  EXPECT_TRUE(torch::allclose(half.grad().to(torch::kFloat), ref.grad(), 1e-2, 4e-3)) << "bf16 gradient";

  // The trainer backpropagates world / global_tokens, which bf16 cannot hold
  // (4/1003 rounds by 0.27%): the gradient is the unscaled one times the factor
  // taken in fp32, each element rounded once, not times the factor's bf16.
  const double factor = 4.0 / 1003;
  const double in_bf16 = torch::tensor(factor).to(torch::kBFloat16).item<double>();
  ASSERT_GT(std::abs(in_bf16 / factor - 1), 1e-3) << "a factor bf16 holds would not test the rounding";
  auto scaled = logits.to(torch::kBFloat16).requires_grad_(true);
  (bart::summed_cross_entropy(scaled, labels, pad, 4) * factor).backward();
  const auto want_scaled = (half.grad().to(torch::kFloat) * factor).to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(scaled.grad(), want_scaled)) << "each element rounded once, after an fp32 product";
  const auto g = scaled.grad().to(torch::kDouble), w = ref.grad().to(torch::kDouble) * factor;
  const double ratio = ((g * w).sum() / (w * w).sum()).item<double>();
  EXPECT_NEAR(ratio, 1.0, 1e-3) << "the gradient's scale against fp32 cross_entropy's";
}

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
