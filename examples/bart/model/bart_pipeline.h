// bart_pipeline.h — BART as a sequence of blocks for pipeline stages.
//
// Linearised so that every schedule works and the tied embedding lives on the
// first and the last stage only:
//   E   the embeddings: model.shared (the tied token embedding), the encoder's
//       and the decoder's positions and embedding layer norms. It embeds the
//       source and the target (the decoder's input).
//   e   an encoder layer (model.encoder.layers.i): runs on "enc", carries "dec"
//       through untouched.
//   d   a decoder layer (model.decoder.layers.i): runs on "dec" attending to
//       "enc", the encoder's output, which it carries through (its gradient
//       collects every decoder layer's cross-attention gradient).
//   L   the head: lm_head.weight, the last stage's copy of model.shared.weight
//       (tied across the stages, see PipelineExecutor::tie), and
//       final_logits_bias; it turns "dec" into "logits".
// Between stages a microbatch is the payload {"enc" [B, S, D], "dec" [B, T, D]};
// ids, masks and labels never travel: every stage rebuilds them from the data.
//
// A stage module builds only its own blocks, with the parameter names of
// BartForConditionalGeneration (and lm_head.weight), initialised as that model
// initialises the same names (init_bart_parameters), so stages of any
// partition hold exactly the unpipelined model's values. The tied embedding
// and its copy are units of their own (Sharded<>) for ZeRO-3 ties.
#pragma once

#include "model/bart_model.h"

#include <zeroshard/pipeline_partition.h>
#include <zeroshard/pipeline_payload.h>

#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

namespace bart {

// The blocks in order: E, e × encoder_layers, d × decoder_layers, L, with
// their parameter counts (the head counts its copy of the embedding).
std::vector<zeroshard::pipeline::Block> bart_blocks(const BartConfig& c);

// What every stage of a microbatch knows without communication.
struct StageBatch {
  torch::Tensor input_ids;          // [B, S]
  torch::Tensor decoder_input_ids;  // [B, T]
  DropoutKey dropout;               // the microbatch's (bart_model.h)
};

// The embedding table as a module of its own: a unit for ZeRO-3.
struct TokenEmbeddingImpl : torch::nn::Module {
  TokenEmbeddingImpl(int64_t vocab, int64_t dim);
  torch::Tensor forward(const torch::Tensor& ids);
  torch::Tensor weight;
};
TORCH_MODULE(TokenEmbedding);

// The head's copy of the embedding: logits = dec · weightᵀ.
struct LmHeadImpl : torch::nn::Module {
  LmHeadImpl(int64_t vocab, int64_t dim);
  torch::Tensor forward(const torch::Tensor& dec);
  torch::Tensor weight;
};
TORCH_MODULE(LmHead);

struct BartStageImpl : torch::nn::Module {
  // Builds blocks `blocks` (indices into bart_blocks(c), consecutive; not
  // both E and L: one stage holding both is the whole model), initialised by
  // init_bart_parameters with `seed` (default: the default generator's seed).
  BartStageImpl(const BartConfig& c, std::vector<size_t> blocks, std::optional<uint64_t> seed = std::nullopt);
  // The stage's blocks on a microbatch: `in` is empty for the stage holding E.
  // Returns {"enc", "dec"}, or {"logits"} from the stage holding L.
  zeroshard::pipeline::Payload forward(const zeroshard::pipeline::Payload& in, const StageBatch& batch);
  // The payload entering block `block` (what the stage starting there receives).
  static zeroshard::pipeline::PayloadSpec input_spec(const BartConfig& c, const StageBatch& batch,
                                                     torch::ScalarType dtype);
  // The tied parameter held here (model.shared.weight or lm_head.weight), or undefined.
  torch::Tensor tied_weight() const;

  BartConfig config;
  std::vector<size_t> blocks;
  // Built when the stage holds the block.
  zeroshard::Sharded<TokenEmbedding> shared{nullptr};
  torch::nn::Embedding encoder_positions{nullptr}, decoder_positions{nullptr};
  torch::nn::LayerNorm encoder_norm{nullptr}, decoder_norm{nullptr};
  std::vector<std::pair<size_t, zeroshard::Sharded<BartEncoderLayer>>> encoder_layers;  // (layer index, layer)
  std::vector<std::pair<size_t, zeroshard::Sharded<BartDecoderLayer>>> decoder_layers;
  zeroshard::Sharded<LmHead> lm_head{nullptr};
  torch::Tensor final_logits_bias;
};
TORCH_MODULE(BartStage);

}  // namespace bart
