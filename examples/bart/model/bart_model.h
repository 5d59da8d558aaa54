// bart_model.h — BART (Lewis et al., 2019) in LibTorch, as fairseq and Hugging
// Face's BartForConditionalGeneration build it: learned positional embeddings
// with BART's offset of 2, a layer norm on the embeddings, post-layer-norm
// encoder and decoder layers with GELU, cross-attention, input and output
// embeddings tied to `model.shared`, and `final_logits_bias`. Parameter names
// are Hugging Face's ("model.encoder.layers.0.self_attn.q_proj.weight"), so
// zeroshard-ckpt export/import --safetensors round-trips with HF checkpoints.
//
// Encoder and decoder layers are zeroshard::Sharded<> units: fully_shard()
// shards each layer and puts the embeddings (and the tied head) in the root.
#pragma once

#include <zeroshard/fully_shard.h>

#include <torch/torch.h>

#include <string>

namespace bart {

struct BartConfig {
  int64_t vocab_size = 50265;
  int64_t d_model = 768;
  int64_t encoder_layers = 6, decoder_layers = 6;
  int64_t attention_heads = 12;
  int64_t ffn_dim = 3072;
  int64_t max_position_embeddings = 1024;
  double dropout = 0.1, attention_dropout = 0.1, activation_dropout = 0.1;
  int64_t pad_token_id = 1, bos_token_id = 0, eos_token_id = 2;
  int64_t decoder_start_token_id = 2;

  // "tiny" (tests and the demo), "base" (139.4M parameters), "large" (406.3M);
  // or the path of a JSON file with Hugging Face's config.json keys.
  static BartConfig named(const std::string& name_or_path);
  int64_t head_dim() const { return d_model / attention_heads; }
  // Hugging Face's config.json for this model (BartForConditionalGeneration:
  // GELU, post-layer-norm, unscaled embeddings, the head tied to model.shared);
  // named() reads it back.
  std::string hf_config_json() const;
};

// Dropout keyed by (seed, step, microbatch, block): with a key set, each
// block of a forward first reseeds the default generators (CPU and CUDA) from
// a hash of the key and the block's index in the pipeline order (0 the
// embeddings, 1 + i encoder layer i, 1 + encoder_layers + i decoder layer i,
// then the head), so a microbatch draws the same dropout masks whichever
// stage, rank or partition runs the block. `microbatch` counts over the
// global batch (the same on every data-parallel rank for the same examples).
struct DropoutKey {
  uint64_t seed = 0;
  int64_t step = -1;        // < 0: not set (the generators run on)
  int64_t microbatch = 0;
  bool set() const { return step >= 0; }
};
void reseed_for_block(const DropoutKey& key, size_t block);

// Multi-head attention with Hugging Face's q/k/v/out projections.
struct BartAttentionImpl : torch::nn::Module {
  BartAttentionImpl(const BartConfig& c);
  // query [B, T, D], key_value [B, S, D]; key_padding [B, S] true at padding;
  // causal: position t sees keys <= t only.
  torch::Tensor forward(const torch::Tensor& query, const torch::Tensor& key_value, const torch::Tensor& key_padding,
                        bool causal);
  torch::nn::Linear k_proj{nullptr}, v_proj{nullptr}, q_proj{nullptr}, out_proj{nullptr};
  int64_t heads, head_dim;
  double dropout;
};
TORCH_MODULE(BartAttention);

struct BartEncoderLayerImpl : torch::nn::Module {
  explicit BartEncoderLayerImpl(const BartConfig& c);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& padding);
  BartAttention self_attn{nullptr};
  torch::nn::LayerNorm self_attn_layer_norm{nullptr}, final_layer_norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  double dropout, activation_dropout;
};
TORCH_MODULE(BartEncoderLayer);

struct BartDecoderLayerImpl : torch::nn::Module {
  explicit BartDecoderLayerImpl(const BartConfig& c);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& encoder_out, const torch::Tensor& encoder_padding);
  BartAttention self_attn{nullptr}, encoder_attn{nullptr};
  torch::nn::LayerNorm self_attn_layer_norm{nullptr}, encoder_attn_layer_norm{nullptr}, final_layer_norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  double dropout, activation_dropout;
};
TORCH_MODULE(BartDecoderLayer);

struct BartEncoderImpl : torch::nn::Module {
  BartEncoderImpl(const BartConfig& c, torch::nn::Embedding shared);
  // ids [B, S] -> [B, S, D]
  torch::Tensor forward(const torch::Tensor& ids);
  torch::nn::Embedding embed_tokens{nullptr};  // model.shared, not registered here (tied)
  torch::nn::Embedding embed_positions{nullptr};
  torch::nn::LayerNorm layernorm_embedding{nullptr};
  std::vector<zeroshard::Sharded<BartEncoderLayer>> layers;
  BartConfig config;
};
TORCH_MODULE(BartEncoder);

struct BartDecoderImpl : torch::nn::Module {
  BartDecoderImpl(const BartConfig& c, torch::nn::Embedding shared);
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& encoder_out, const torch::Tensor& encoder_ids);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::Embedding embed_positions{nullptr};
  torch::nn::LayerNorm layernorm_embedding{nullptr};
  std::vector<zeroshard::Sharded<BartDecoderLayer>> layers;
  BartConfig config;
};
TORCH_MODULE(BartDecoder);

struct BartModelImpl : torch::nn::Module {
  explicit BartModelImpl(const BartConfig& c);
  torch::nn::Embedding shared{nullptr};
  BartEncoder encoder{nullptr};
  BartDecoder decoder{nullptr};
};
TORCH_MODULE(BartModel);

// The cross-entropy of logits [N, V] against labels [N], summed over the rows
// whose label is not `ignore_index`, computed in fp32 whatever the logits'
// dtype, without an fp32 copy of them all: rows go through in chunks (of
// `chunk_rows`; 0: about 2^26 logits), and when the logits need a gradient it
// is computed in the same pass (softmax minus the label's one-hot) and kept
// in the logits' dtype for backward, instead of autograd keeping the fp32
// log-softmax. Equals F::cross_entropy on the fp32 logits with reduction sum.
torch::Tensor summed_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels, int64_t ignore_index,
                                   int64_t chunk_rows = 0);

struct BartForConditionalGenerationImpl : torch::nn::Module {
  explicit BartForConditionalGenerationImpl(const BartConfig& c);
  // input_ids [B, S], decoder_input_ids [B, T] -> logits [B, T, vocab]
  // `source_padded` false: the caller knows that no source token is padding
  // (every row full), so attention to the source takes no mask and
  // scaled_dot_product_attention may use its flash kernels (a mask rules them
  // out); a padded source given false attends to its padding. true: the mask
  // from input_ids' pad_token_id.
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& decoder_input_ids,
                        bool source_padded = true);
  // Cross-entropy of the logits against `labels` (pad_token_id ignored); the
  // decoder reads labels shifted right behind decoder_start_token_id.
  torch::Tensor loss(const torch::Tensor& input_ids, const torch::Tensor& labels, bool source_padded = true);
  // Greedy decoding of a batch: input_ids [B, S] (padded with pad_token_id)
  // -> per sequence, the decoder's tokens after decoder_start_token_id, up to
  // and including eos (at most max_len). Runs exactly max_len decoder passes
  // whatever it produces, so under fully_shard every rank makes the same
  // collective calls. No gradients.
  std::vector<std::vector<int64_t>> generate(const torch::Tensor& input_ids, int64_t max_len);
  BartModel model{nullptr};
  torch::Tensor final_logits_bias;  // buffer [1, vocab]
  bool checkpoint_layers = false;   // forward keeps each layer's input only and backward recomputes the layer
  BartConfig config;
  DropoutKey dropout_key;  // set per microbatch by a trainer; unset: plain dropout
};
TORCH_MODULE(BartForConditionalGeneration);

// Hugging Face's initialisation, keyed by name: each weight normal(0, 0.02)
// from a generator seeded by (seed, its name), biases zero, layer norms at 1
// and 0, the padding row of the token embedding zero. A module holding any
// subset of BART's parameters under their names (a pipeline stage) gets
// exactly the values the whole model gets; lm_head.weight (a pipeline's copy
// of the tied embedding) gets model.shared.weight's.
void init_bart_parameters(torch::nn::Module& module, const BartConfig& c, uint64_t seed);

// The embedding of a sequence: token vectors [B, L, D] plus learned positions
// (BART's offset of 2), layer norm, dropout.
torch::Tensor embed_sequence(const torch::Tensor& token_vectors, torch::nn::Embedding positions,
                             torch::nn::LayerNorm norm, double dropout, bool training);

// labels [B, T] -> decoder inputs: decoder_start_token_id, then labels[:, :-1]
// (padding stays padding).
torch::Tensor shift_tokens_right(const torch::Tensor& labels, int64_t pad_token_id, int64_t decoder_start_token_id);

}  // namespace bart
