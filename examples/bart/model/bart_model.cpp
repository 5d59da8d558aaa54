// bart_model.cpp — BART modules (see bart_model.h).
#include "model/bart_model.h"
#include "io/json_error.h"

#include <zeroshard/activation_checkpoint.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <type_traits>

namespace F = torch::nn::functional;

namespace bart {
namespace {

// Attention over [B, H, T, d] queries and [B, H, S, d] keys and values:
// softmax(q k^T / sqrt(d)) v, with the keys where `keep` (undefined, or bool
// broadcastable to [B, H, T, S]) is false left out, and with `causal` each
// query seeing only the keys at or before its own position (T == S).
// LibTorch 2.x: at::scaled_dot_product_attention, which picks a fused kernel
// (flash, memory-efficient or cuDNN on CUDA; flash on the CPU) and never
// materializes the [B, H, T, S] scores where one applies. 1.13 has none: the
// scores, masked, softmax, dropout, times v.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep,
               bool causal, double dropout_p) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, keep.defined() ? c10::optional<at::Tensor>(keep) : c10::nullopt,
                                          dropout_p, causal);
#else
  auto scores = at::matmul(q * (1.0 / std::sqrt(static_cast<double>(q.size(-1)))), k.transpose(-1, -2));
  const double minus_inf = -std::numeric_limits<double>::infinity();
  if (keep.defined()) scores = scores.masked_fill(keep.logical_not(), minus_inf);
  if (causal) {
    const auto future = at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, minus_inf);
  }
  auto probs = at::softmax(scores, -1);
  if (dropout_p > 0) probs = at::dropout(probs, dropout_p, /*train=*/true);
  return at::matmul(probs, v);
#endif
}

}  // namespace

BartConfig BartConfig::named(const std::string& name) {
  BartConfig c;
  if (name == "base") return c;
  if (name == "large") {
    c.d_model = 1024;
    c.encoder_layers = c.decoder_layers = 12;
    c.attention_heads = 16;
    c.ffn_dim = 4096;
    return c;
  }
  if (name == "tiny") {
    c.vocab_size = 4096;
    c.d_model = 128;
    c.encoder_layers = c.decoder_layers = 2;
    c.attention_heads = 4;
    c.ffn_dim = 512;
    c.max_position_embeddings = 256;
    return c;
  }
  std::ifstream in(name);
  TORCH_CHECK_VALUE(in, "BART config '", name, "' is neither tiny, base nor large, nor a readable JSON file");
  const nlohmann::json j = parse_json_object(std::string(std::istreambuf_iterator<char>(in), {}),
                                             "BART config '" + name + "'",
                                             "Hugging Face's config.json is one: {\"d_model\": 768, ...}");
  // A key's value, or `fallback` when the key is absent; a value of another type is named.
  const auto get = [&](const char* key, auto fallback) {
    using T = decltype(fallback);
    if (!j.contains(key)) return fallback;
    const auto& v = j.at(key);
    constexpr bool real = std::is_floating_point_v<T>;
    TORCH_CHECK_VALUE(real ? v.is_number() : v.is_number_integer(), "BART config '", name, "': \"", key, "\" is ",
                      v.dump(), ", not ", real ? "a number" : "an integer");
    return v.get<T>();
  };
  c.vocab_size = get("vocab_size", c.vocab_size);
  c.d_model = get("d_model", c.d_model);
  c.encoder_layers = get("encoder_layers", c.encoder_layers);
  c.decoder_layers = get("decoder_layers", c.decoder_layers);
  c.attention_heads = get("encoder_attention_heads", c.attention_heads);
  TORCH_CHECK_VALUE(get("decoder_attention_heads", c.attention_heads) == c.attention_heads,
                    "BART config '", name, "': encoder and decoder attention heads differ; not supported");
  c.ffn_dim = get("encoder_ffn_dim", c.ffn_dim);
  TORCH_CHECK_VALUE(get("decoder_ffn_dim", c.ffn_dim) == c.ffn_dim, "BART config '", name,
                    "': encoder and decoder FFN sizes differ; not supported");
  c.max_position_embeddings = get("max_position_embeddings", c.max_position_embeddings);
  c.dropout = get("dropout", c.dropout);
  c.attention_dropout = get("attention_dropout", c.attention_dropout);
  c.activation_dropout = get("activation_dropout", c.activation_dropout);
  c.pad_token_id = get("pad_token_id", c.pad_token_id);
  c.bos_token_id = get("bos_token_id", c.bos_token_id);
  c.eos_token_id = get("eos_token_id", c.eos_token_id);
  c.decoder_start_token_id = get("decoder_start_token_id", c.decoder_start_token_id);
  TORCH_CHECK_VALUE(c.d_model % c.attention_heads == 0, "BART config '", name, "': d_model ", c.d_model,
                    " is not a multiple of the ", c.attention_heads, " attention heads");
  return c;
}

std::string BartConfig::hf_config_json() const {
  nlohmann::json j;
  j["model_type"] = "bart";
  j["architectures"] = {"BartForConditionalGeneration"};
  j["is_encoder_decoder"] = true;
  j["vocab_size"] = vocab_size;
  j["d_model"] = d_model;
  j["encoder_layers"] = encoder_layers;
  j["decoder_layers"] = decoder_layers;
  j["encoder_attention_heads"] = j["decoder_attention_heads"] = attention_heads;
  j["encoder_ffn_dim"] = j["decoder_ffn_dim"] = ffn_dim;
  j["max_position_embeddings"] = max_position_embeddings;
  j["dropout"] = dropout;
  j["attention_dropout"] = attention_dropout;
  j["activation_dropout"] = activation_dropout;
  j["activation_function"] = "gelu";
  j["scale_embedding"] = false;
  j["tie_word_embeddings"] = true;
  j["pad_token_id"] = pad_token_id;
  j["bos_token_id"] = bos_token_id;
  j["eos_token_id"] = j["forced_eos_token_id"] = eos_token_id;
  j["decoder_start_token_id"] = decoder_start_token_id;
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
}

// BART's learned positions start at index 2 (fairseq's padding offset).
constexpr int64_t kPositionOffset = 2;

BartAttentionImpl::BartAttentionImpl(const BartConfig& c)
    : heads(c.attention_heads), head_dim(c.head_dim()), dropout(c.attention_dropout) {
  k_proj = register_module("k_proj", torch::nn::Linear(c.d_model, c.d_model));
  v_proj = register_module("v_proj", torch::nn::Linear(c.d_model, c.d_model));
  q_proj = register_module("q_proj", torch::nn::Linear(c.d_model, c.d_model));
  out_proj = register_module("out_proj", torch::nn::Linear(c.d_model, c.d_model));
}

torch::Tensor BartAttentionImpl::forward(const torch::Tensor& query, const torch::Tensor& key_value,
                                         const torch::Tensor& key_padding, bool causal) {
  const int64_t B = query.size(0), T = query.size(1), S = key_value.size(1);
  auto split = [&](const torch::Tensor& x, int64_t len) { return x.view({B, len, heads, head_dim}).transpose(1, 2); };
  // One GEMM for the projections that share an input: q, k and v in self-attention, k and v in cross-attention.
  torch::Tensor q, k, v;
  if (query.is_same(key_value)) {
    const auto qkv = torch::nn::functional::linear(query, torch::cat({q_proj->weight, k_proj->weight, v_proj->weight}),
                                                   torch::cat({q_proj->bias, k_proj->bias, v_proj->bias}))
                         .chunk(3, -1);
    q = qkv[0], k = qkv[1], v = qkv[2];
  } else {
    const auto kv = torch::nn::functional::linear(key_value, torch::cat({k_proj->weight, v_proj->weight}),
                                                  torch::cat({k_proj->bias, v_proj->bias}))
                        .chunk(2, -1);
    q = q_proj(query), k = kv[0], v = kv[1];
  }
  torch::Tensor keep;  // the keys that take part: all but padding
  if (key_padding.defined()) keep = key_padding.logical_not().view({B, 1, 1, S});
  const auto out = attention(split(q, T), split(k, S), split(v, S), keep, causal,
                             is_training() ? dropout : 0.0);
  return out_proj(out.transpose(1, 2).reshape({B, T, heads * head_dim}));
}

BartEncoderLayerImpl::BartEncoderLayerImpl(const BartConfig& c)
    : dropout(c.dropout), activation_dropout(c.activation_dropout) {
  self_attn = register_module("self_attn", BartAttention(c));
  self_attn_layer_norm = register_module("self_attn_layer_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  fc1 = register_module("fc1", torch::nn::Linear(c.d_model, c.ffn_dim));
  fc2 = register_module("fc2", torch::nn::Linear(c.ffn_dim, c.d_model));
  final_layer_norm = register_module("final_layer_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
}

torch::Tensor BartEncoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& padding) {
  auto drop = [&](const torch::Tensor& t, double p) { return F::dropout(t, F::DropoutFuncOptions().p(p).training(is_training())); };
  auto h = self_attn_layer_norm(x + drop(self_attn(x, x, padding, /*causal=*/false), dropout));
  auto f = fc2(drop(torch::gelu(fc1(h)), activation_dropout));
  return final_layer_norm(h + drop(f, dropout));
}

BartDecoderLayerImpl::BartDecoderLayerImpl(const BartConfig& c)
    : dropout(c.dropout), activation_dropout(c.activation_dropout) {
  const auto ln = torch::nn::LayerNormOptions({c.d_model});
  self_attn = register_module("self_attn", BartAttention(c));
  self_attn_layer_norm = register_module("self_attn_layer_norm", torch::nn::LayerNorm(ln));
  encoder_attn = register_module("encoder_attn", BartAttention(c));
  encoder_attn_layer_norm = register_module("encoder_attn_layer_norm", torch::nn::LayerNorm(ln));
  fc1 = register_module("fc1", torch::nn::Linear(c.d_model, c.ffn_dim));
  fc2 = register_module("fc2", torch::nn::Linear(c.ffn_dim, c.d_model));
  final_layer_norm = register_module("final_layer_norm", torch::nn::LayerNorm(ln));
}

torch::Tensor BartDecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& encoder_out,
                                            const torch::Tensor& encoder_padding) {
  auto drop = [&](const torch::Tensor& t, double p) { return F::dropout(t, F::DropoutFuncOptions().p(p).training(is_training())); };
  auto h = self_attn_layer_norm(x + drop(self_attn(x, x, torch::Tensor(), /*causal=*/true), dropout));
  h = encoder_attn_layer_norm(h + drop(encoder_attn(h, encoder_out, encoder_padding, /*causal=*/false), dropout));
  auto f = fc2(drop(torch::gelu(fc1(h)), activation_dropout));
  return final_layer_norm(h + drop(f, dropout));
}

torch::Tensor embed_sequence(const torch::Tensor& token_vectors, torch::nn::Embedding positions,
                             torch::nn::LayerNorm norm, double dropout, bool training) {
  const int64_t len = token_vectors.size(1);
  TORCH_CHECK_VALUE(len + kPositionOffset <= positions->weight.size(0), "BART: sequence length ", len,
                    " exceeds max_position_embeddings ", positions->weight.size(0) - kPositionOffset);
  const auto pos = torch::arange(kPositionOffset, len + kPositionOffset,
                                 torch::TensorOptions().dtype(torch::kLong).device(token_vectors.device()));
  auto h = norm(token_vectors + positions(pos).unsqueeze(0));
  return F::dropout(h, F::DropoutFuncOptions().p(dropout).training(training));
}

void init_bart_parameters(torch::nn::Module& module, const BartConfig& c, uint64_t seed) {
  // One parameter at a time, also those of layers built under DeferredInit.
  zeroshard::initialize_parameters(module, [&](const std::string& key, torch::Tensor& p) {
    const std::string name = key == "lm_head.weight" ? "model.shared.weight" : key;
    if (name.find("layer_norm") != std::string::npos || name.find("layernorm") != std::string::npos) {
      (name.compare(name.size() - 5, 5, ".bias") == 0 ? p.zero_() : p.fill_(1.0));
    } else if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
      p.zero_();
    } else {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(XXH64(name.data(), name.size(), seed));
      p.copy_(torch::empty(p.sizes(), torch::kFloat).normal_(0.0, 0.02, gen));
      if (name == "model.shared.weight") p[c.pad_token_id].zero_();
    }
  });
}

BartEncoderImpl::BartEncoderImpl(const BartConfig& c, torch::nn::Embedding shared) : embed_tokens(shared), config(c) {
  embed_positions = register_module("embed_positions",
                                    torch::nn::Embedding(c.max_position_embeddings + kPositionOffset, c.d_model));
  auto list = register_module("layers", torch::nn::ModuleList());  // names layers.0, layers.1, ...
  for (int64_t i = 0; i < c.encoder_layers; ++i) {
    layers.push_back(zeroshard::Sharded<BartEncoderLayer>(c));
    list->push_back(layers.back());
  }
  layernorm_embedding = register_module("layernorm_embedding", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
}

torch::Tensor BartEncoderImpl::forward(const torch::Tensor& ids) {
  const auto padding = ids.eq(config.pad_token_id);
  auto h = embed_sequence(embed_tokens(ids), embed_positions, layernorm_embedding, config.dropout, is_training());
  for (auto& l : layers) h = l->forward(h, padding);
  return h;
}

BartDecoderImpl::BartDecoderImpl(const BartConfig& c, torch::nn::Embedding shared) : embed_tokens(shared), config(c) {
  embed_positions = register_module("embed_positions",
                                    torch::nn::Embedding(c.max_position_embeddings + kPositionOffset, c.d_model));
  auto list = register_module("layers", torch::nn::ModuleList());  // names layers.0, layers.1, ...
  for (int64_t i = 0; i < c.decoder_layers; ++i) {
    layers.push_back(zeroshard::Sharded<BartDecoderLayer>(c));
    list->push_back(layers.back());
  }
  layernorm_embedding = register_module("layernorm_embedding", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
}

torch::Tensor BartDecoderImpl::forward(const torch::Tensor& ids, const torch::Tensor& encoder_out,
                                       const torch::Tensor& encoder_ids) {
  const auto encoder_padding = encoder_ids.eq(config.pad_token_id);
  auto h = embed_sequence(embed_tokens(ids), embed_positions, layernorm_embedding, config.dropout, is_training());
  for (auto& l : layers) h = l->forward(h, encoder_out, encoder_padding);
  return h;
}

BartModelImpl::BartModelImpl(const BartConfig& c) {
  shared = register_module("shared", torch::nn::Embedding(torch::nn::EmbeddingOptions(c.vocab_size, c.d_model)));
  encoder = register_module("encoder", BartEncoder(c, shared));
  decoder = register_module("decoder", BartDecoder(c, shared));
}

BartForConditionalGenerationImpl::BartForConditionalGenerationImpl(const BartConfig& c) : config(c) {
  model = register_module("model", BartModel(c));
  final_logits_bias = register_buffer("final_logits_bias", torch::zeros({1, c.vocab_size}));
  // Hugging Face's initialisation, keyed by name from the default generator's
  // seed (torch::manual_seed), so pipeline stages built alone get the same values.
  init_bart_parameters(*this, c, at::detail::getDefaultCPUGenerator().current_seed());
}

void reseed_for_block(const DropoutKey& key, size_t block) {
  if (!key.set()) return;
  const uint64_t words[3] = {static_cast<uint64_t>(key.step), static_cast<uint64_t>(key.microbatch), block};
  torch::manual_seed(XXH64(words, sizeof(words), key.seed));
}

torch::Tensor BartForConditionalGenerationImpl::forward(const torch::Tensor& input_ids,
                                                        const torch::Tensor& decoder_input_ids, bool source_padded) {
  // In the pipeline's block order (bart_pipeline.h): both embeddings, the
  // encoder layers, the decoder layers, the head.
  auto& enc = *model->encoder;
  auto& dec = *model->decoder;
  reseed_for_block(dropout_key, 0);
  auto encoded = embed_sequence(model->shared(input_ids), enc.embed_positions, enc.layernorm_embedding,
                                config.dropout, is_training());
  auto decoded = embed_sequence(model->shared(decoder_input_ids), dec.embed_positions, dec.layernorm_embedding,
                                config.dropout, is_training());
  const auto padding = source_padded ? input_ids.eq(config.pad_token_id) : torch::Tensor();
  size_t block = 1;
  // The recomputation restores the generators, so it draws the same dropout masks.
  for (auto& l : enc.layers) {
    reseed_for_block(dropout_key, block++);
    encoded = checkpoint_layers ? zeroshard::activation_checkpoint(
                                      [l = l.ptr(), padding](const torch::Tensor& x) { return l->forward(x, padding); }, encoded)
                                : l->forward(encoded, padding);
  }
  for (auto& l : dec.layers) {
    reseed_for_block(dropout_key, block++);
    decoded = checkpoint_layers
                  ? zeroshard::activation_checkpoint(
                        [l = l.ptr(), padding](const zeroshard::TensorList& in) {
                          return zeroshard::TensorList{l->forward(in[0], in[1], padding)};
                        },
                        {decoded, encoded})[0]
                  : l->forward(decoded, encoded, padding);
  }
  // The output projection is the shared embedding (tied).
  return torch::matmul(decoded, model->shared->weight.t()) + final_logits_bias;
}

namespace {

// Rows [begin, end): their summed loss (fp32, 0-dim), and into `grad` (when defined) its gradient.
torch::Tensor cross_entropy_rows(const torch::Tensor& logits, const torch::Tensor& labels, int64_t ignore_index,
                                 int64_t begin, int64_t end, const torch::Tensor& grad) {
  const auto x = logits.slice(0, begin, end).to(torch::kFloat);
  const auto y = labels.slice(0, begin, end);
  const auto valid = y.ne(ignore_index);
  const auto label = y.masked_fill(valid.logical_not(), 0).unsqueeze(1);
  const auto lse = x.logsumexp(1);
  const auto loss = (lse - x.gather(1, label).squeeze(1)).masked_fill(valid.logical_not(), 0).sum();
  if (grad.defined()) {
    auto g = (x - lse.unsqueeze(1)).exp_();  // softmax
    const auto v = valid.to(torch::kFloat).unsqueeze(1);
    g.scatter_add_(1, label, -v);  // minus the label's one-hot
    g.mul_(v);
    grad.slice(0, begin, end).copy_(g);
  }
  return loss;
}

// Rows per chunk: `chunk_rows`, or (0) about 2^26 logits.
int64_t rows_per_chunk(int64_t columns, int64_t chunk_rows) {
  return chunk_rows > 0 ? chunk_rows : std::max<int64_t>(1, (int64_t{1} << 26) / std::max<int64_t>(1, columns));
}

// Every row, a chunk at a time.
torch::Tensor cross_entropy_chunks(const torch::Tensor& logits, const torch::Tensor& labels, int64_t ignore_index,
                                   int64_t chunk_rows, const torch::Tensor& grad) {
  const int64_t n = logits.size(0);
  const int64_t chunk = rows_per_chunk(logits.size(1), chunk_rows);
  auto total = torch::zeros({}, logits.options().dtype(torch::kFloat));
  for (int64_t b = 0; b < n; b += chunk) total += cross_entropy_rows(logits, labels, ignore_index, b, std::min(n, b + chunk), grad);
  return total;
}

class SummedCrossEntropy : public torch::autograd::Function<SummedCrossEntropy> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& labels, int64_t ignore_index, int64_t chunk_rows) {
    auto grad = torch::empty_like(logits);
    auto total = cross_entropy_chunks(logits, labels, ignore_index, chunk_rows, grad);
    ctx->save_for_backward({grad});
    ctx->saved_data["chunk_rows"] = chunk_rows;
    return total;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto grad = ctx->get_saved_variables()[0];
    const auto& factor = grad_out[0];  // fp32, 0-dim, on the logits' device: no read of it here
    if (grad.scalar_type() == torch::kFloat) return {grad * factor, torch::Tensor(), torch::Tensor(), torch::Tensor()};
    // 16-bit logits: each element is the fp32 product, rounded once. The factor
    // rounded to bf16 (what LibTorch 1.13's CPU kernels do with a 0-dim fp32
    // operand) would scale the whole gradient by one error of up to 0.39%.
    auto out = torch::empty_like(grad);
    const int64_t n = grad.size(0), chunk = rows_per_chunk(grad.size(1), ctx->saved_data["chunk_rows"].toInt());
    for (int64_t b = 0; b < n; b += chunk) {
      const int64_t e = std::min(n, b + chunk);
      out.slice(0, b, e).copy_(grad.slice(0, b, e).to(torch::kFloat).mul_(factor));
    }
    return {out, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor summed_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels, int64_t ignore_index,
                                   int64_t chunk_rows) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && labels.dim() == 1 && labels.size(0) == logits.size(0),
                    "summed_cross_entropy: logits [N, V] and labels [N], got ", logits.sizes(), " and ", labels.sizes());
  if (torch::GradMode::is_enabled() && logits.requires_grad()) {
    return SummedCrossEntropy::apply(logits, labels, ignore_index, chunk_rows);
  }
  return cross_entropy_chunks(logits, labels, ignore_index, chunk_rows, torch::Tensor());
}

torch::Tensor BartForConditionalGenerationImpl::loss(const torch::Tensor& input_ids, const torch::Tensor& labels,
                                                     bool source_padded) {
  const auto logits =
      forward(input_ids, shift_tokens_right(labels, config.pad_token_id, config.decoder_start_token_id), source_padded);
  // The trainer's loss (summed_cross_entropy: fp32 chunks), over the targets that are not padding; the count
  // stays on the device.
  const auto flat = labels.reshape(-1);
  return summed_cross_entropy(logits.reshape({-1, config.vocab_size}), flat, config.pad_token_id) /
         flat.ne(config.pad_token_id).sum().clamp_min(1).to(torch::kFloat);
}

std::vector<std::vector<int64_t>> BartForConditionalGenerationImpl::generate(const torch::Tensor& input_ids,
                                                                            int64_t max_len) {
  TORCH_CHECK_VALUE(input_ids.dim() == 2 && input_ids.size(0) >= 1, "BART generate: input_ids must be [B, S], got ",
                    input_ids.sizes());
  torch::NoGradGuard no_grad;
  const int64_t b = input_ids.size(0);
  const auto encoded = model->encoder->forward(input_ids);
  auto ids = torch::full({b, 1}, config.decoder_start_token_id, input_ids.options());
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(b));
  std::vector<char> done(static_cast<size_t>(b), 0);
  for (int64_t i = 0; i < max_len; ++i) {
    const auto decoded = model->decoder->forward(ids, encoded, input_ids);
    const auto last = decoded.select(1, decoded.size(1) - 1);
    const auto next = (torch::matmul(last, model->shared->weight.t()) + final_logits_bias).argmax(-1).to(torch::kCPU);
    const auto* n = next.data_ptr<int64_t>();
    for (int64_t r = 0; r < b; ++r) {  // after eos a sequence's passes run on (causal: they change nothing before)
      if (done[static_cast<size_t>(r)]) continue;
      out[static_cast<size_t>(r)].push_back(n[r]);
      done[static_cast<size_t>(r)] = n[r] == config.eos_token_id;
    }
    ids = torch::cat({ids, next.to(ids.device()).unsqueeze(1)}, 1);
  }
  return out;
}

torch::Tensor shift_tokens_right(const torch::Tensor& labels, int64_t pad_token_id, int64_t decoder_start_token_id) {
  auto out = torch::full_like(labels, pad_token_id);
  out.slice(1, 1).copy_(labels.slice(1, 0, labels.size(1) - 1));
  out.select(1, 0).fill_(decoder_start_token_id);
  return out;
}

}  // namespace bart
