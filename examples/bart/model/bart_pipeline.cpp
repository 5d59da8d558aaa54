// bart_pipeline.cpp — BART's blocks and pipeline stages (see bart_pipeline.h).
#include "model/bart_pipeline.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/StringUtil.h>

namespace bart {

namespace {

enum class Kind { kEmbed, kEncoder, kDecoder, kHead };

Kind kind_of(const BartConfig& c, size_t block) {
  const auto b = static_cast<int64_t>(block);
  if (b == 0) return Kind::kEmbed;
  if (b <= c.encoder_layers) return Kind::kEncoder;
  if (b <= c.encoder_layers + c.decoder_layers) return Kind::kDecoder;
  return Kind::kHead;
}

int64_t numel_of(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// The child `name` of `parent`, made empty when missing.
std::shared_ptr<torch::nn::Module> child(torch::nn::Module& parent, const std::string& name) {
  for (const auto& item : parent.named_children()) {
    if (item.key() == name) return item.value();
  }
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

}  // namespace

std::vector<zeroshard::pipeline::Block> bart_blocks(const BartConfig& c) {
  const int64_t d = c.d_model, positions = (c.max_position_embeddings + 2) * d, norm = 2 * d;
  std::vector<zeroshard::pipeline::Block> out;
  out.push_back({"embeddings", "E", c.vocab_size * d + 2 * (positions + norm)});
  const int64_t encoder = numel_of(*BartEncoderLayer(c)), decoder = numel_of(*BartDecoderLayer(c));
  for (int64_t i = 0; i < c.encoder_layers; ++i) out.push_back({"model.encoder.layers." + std::to_string(i), "e", encoder});
  for (int64_t i = 0; i < c.decoder_layers; ++i) out.push_back({"model.decoder.layers." + std::to_string(i), "d", decoder});
  out.push_back({"lm_head", "L", c.vocab_size * d});
  return out;
}

TokenEmbeddingImpl::TokenEmbeddingImpl(int64_t vocab, int64_t dim) {
  weight = register_parameter("weight", torch::zeros({vocab, dim}));
}
torch::Tensor TokenEmbeddingImpl::forward(const torch::Tensor& ids) { return torch::embedding(weight, ids); }

LmHeadImpl::LmHeadImpl(int64_t vocab, int64_t dim) { weight = register_parameter("weight", torch::zeros({vocab, dim})); }
torch::Tensor LmHeadImpl::forward(const torch::Tensor& dec) { return torch::matmul(dec, weight.t()); }

BartStageImpl::BartStageImpl(const BartConfig& c, std::vector<size_t> blocks_, std::optional<uint64_t> seed)
    : config(c), blocks(std::move(blocks_)) {
  const size_t total = static_cast<size_t>(2 + c.encoder_layers + c.decoder_layers);
  TORCH_CHECK_VALUE(!blocks.empty(), "BartStage: no blocks");
  for (size_t i = 0; i < blocks.size(); ++i) {
    TORCH_CHECK_VALUE(blocks[i] < total && (i == 0 || blocks[i] == blocks[i - 1] + 1), "BartStage: blocks must be ",
                      "consecutive indices below ", total, " (E, ", c.encoder_layers, " e, ", c.decoder_layers,
                      " d, L); got ", c10::Join(", ", blocks));
  }
  TORCH_CHECK_VALUE(blocks.front() != 0 || blocks.back() != total - 1, "BartStage: one stage holding every block, "
                    "the embeddings and the head, is the whole model: use BartForConditionalGeneration (its head "
                    "is the embedding itself), or at least two stages");
  const auto ln = torch::nn::LayerNormOptions({c.d_model});
  const int64_t positions = c.max_position_embeddings + 2;
  for (size_t b : blocks) {
    switch (kind_of(c, b)) {
      case Kind::kEmbed: {
        auto model = child(*this, "model");
        shared = model->register_module("shared", zeroshard::Sharded<TokenEmbedding>(c.vocab_size, c.d_model));
        auto encoder = child(*model, "encoder");
        encoder_positions = encoder->register_module("embed_positions", torch::nn::Embedding(positions, c.d_model));
        encoder_norm = encoder->register_module("layernorm_embedding", torch::nn::LayerNorm(ln));
        auto decoder = child(*model, "decoder");
        decoder_positions = decoder->register_module("embed_positions", torch::nn::Embedding(positions, c.d_model));
        decoder_norm = decoder->register_module("layernorm_embedding", torch::nn::LayerNorm(ln));
        break;
      }
      case Kind::kEncoder: {
        const size_t i = b - 1;
        auto layers = child(*child(*child(*this, "model"), "encoder"), "layers");
        encoder_layers.emplace_back(i, layers->register_module(std::to_string(i), zeroshard::Sharded<BartEncoderLayer>(c)));
        break;
      }
      case Kind::kDecoder: {
        const size_t i = b - 1 - static_cast<size_t>(c.encoder_layers);
        auto layers = child(*child(*child(*this, "model"), "decoder"), "layers");
        decoder_layers.emplace_back(i, layers->register_module(std::to_string(i), zeroshard::Sharded<BartDecoderLayer>(c)));
        break;
      }
      case Kind::kHead:
        lm_head = register_module("lm_head", zeroshard::Sharded<LmHead>(c.vocab_size, c.d_model));
        final_logits_bias = register_buffer("final_logits_bias", torch::zeros({1, c.vocab_size}));
        break;
    }
  }
  init_bart_parameters(*this, c, seed ? *seed : at::detail::getDefaultCPUGenerator().current_seed());
}

zeroshard::pipeline::Payload BartStageImpl::forward(const zeroshard::pipeline::Payload& in, const StageBatch& batch) {
  torch::Tensor enc, dec;
  for (const auto& [name, t] : in) (name == "enc" ? enc : dec) = t;
  const auto padding = batch.input_ids.eq(config.pad_token_id);
  auto encoder = encoder_layers.begin();
  auto decoder = decoder_layers.begin();
  for (size_t b : blocks) {
    reseed_for_block(batch.dropout, b);
    switch (kind_of(config, b)) {
      case Kind::kEmbed:
        enc = embed_sequence(shared->forward(batch.input_ids), encoder_positions, encoder_norm, config.dropout,
                             is_training());
        dec = embed_sequence(shared->forward(batch.decoder_input_ids), decoder_positions, decoder_norm,
                             config.dropout, is_training());
        break;
      case Kind::kEncoder: enc = (encoder++)->second->forward(enc, padding); break;
      case Kind::kDecoder: dec = (decoder++)->second->forward(dec, enc, padding); break;
      case Kind::kHead: return {{"logits", lm_head->forward(dec) + final_logits_bias}};
    }
  }
  return {{"enc", enc}, {"dec", dec}};
}

zeroshard::pipeline::PayloadSpec BartStageImpl::input_spec(const BartConfig& c, const StageBatch& batch,
                                                           torch::ScalarType dtype) {
  return {{"enc", {batch.input_ids.size(0), batch.input_ids.size(1), c.d_model}, dtype},
          {"dec", {batch.decoder_input_ids.size(0), batch.decoder_input_ids.size(1), c.d_model}, dtype}};
}

torch::Tensor BartStageImpl::tied_weight() const {
  if (shared) return shared->weight;
  if (lm_head) return lm_head->weight;
  return {};
}

}  // namespace bart
