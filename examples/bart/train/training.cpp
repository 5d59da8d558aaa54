// training.cpp — noised batches, the summed loss, validation, a denoising sample.
#include "train/training.h"

#include <algorithm>
#include <cctype>
#include <random>

namespace bart {

namespace F = torch::nn::functional;

NoisedExample noised_example(const Example& example, int64_t index, const NoiseOptions& noise, uint64_t seed,
                             int64_t epoch) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), static_cast<uint32_t>(epoch),
                    static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32)};
  std::mt19937_64 rng(seq);
  return add_noise(example, noise, rng);
}

namespace {

// Noised examples padded to the longest, on `device`.
Batch pad_batch(const std::vector<NoisedExample>& noised, int64_t pad_id, torch::Device device) {
  size_t src_len = 0, tgt_len = 0;
  for (const auto& n : noised) {
    src_len = std::max(src_len, n.source.size());
    tgt_len = std::max(tgt_len, n.target.size());
  }
  const auto b = static_cast<int64_t>(noised.size());
  Batch out;
  out.input_ids = torch::full({b, static_cast<int64_t>(src_len)}, pad_id, torch::kLong);
  out.labels = torch::full({b, static_cast<int64_t>(tgt_len)}, pad_id, torch::kLong);
  auto in = out.input_ids.accessor<int64_t, 2>();
  auto lab = out.labels.accessor<int64_t, 2>();
  for (int64_t r = 0; r < b; ++r) {
    const auto& n = noised[static_cast<size_t>(r)];
    for (size_t j = 0; j < n.source.size(); ++j) in[r][static_cast<int64_t>(j)] = n.source[j];
    for (size_t j = 0; j < n.target.size(); ++j) lab[r][static_cast<int64_t>(j)] = n.target[j];
    out.target_tokens += static_cast<int64_t>(n.target.size());
  }
  out.source_padded = std::any_of(noised.begin(), noised.end(), [&](const NoisedExample& n) { return n.source.size() < src_len; });
  out.input_ids = out.input_ids.to(device);
  out.labels = out.labels.to(device);
  return out;
}

void check_batch(const std::vector<int64_t>& indices, const std::vector<int64_t>& epochs) {
  TORCH_CHECK_VALUE(!indices.empty(), "BART data: an empty batch");
  TORCH_CHECK_VALUE(epochs.size() == indices.size(), "BART data: ", epochs.size(), " epochs for ", indices.size(),
                    " examples");
}

}  // namespace

Batch make_batch(const PackedExamples::Split& examples, const std::vector<int64_t>& indices,
                 const std::vector<int64_t>& epochs, const NoiseOptions& noise, uint64_t seed, int64_t pad_id,
                 torch::Device device) {
  check_batch(indices, epochs);
  std::vector<NoisedExample> noised;
  for (size_t k = 0; k < indices.size(); ++k) {
    noised.push_back(noised_example(examples.at(indices[k]), indices[k], noise, seed, epochs[k]));
  }
  return pad_batch(noised, pad_id, device);
}

Batch make_batch(const TrainingData& data, const std::vector<int64_t>& positions, const std::vector<int64_t>& epochs,
                 const NoiseOptions& noise, uint64_t seed, int64_t pad_id, torch::Device device) {
  check_batch(positions, epochs);
  std::vector<NoisedExample> noised;
  for (size_t k = 0; k < positions.size(); ++k) {
    const auto d = data.draw(epochs[k], positions[k], seed);
    noised.push_back(noised_example(data.example(d), d.index, noise, seed + static_cast<uint64_t>(d.source), d.epoch));
  }
  return pad_batch(noised, pad_id, device);
}

torch::Tensor summed_loss(BartForConditionalGeneration& model, const Batch& batch) {
  const auto& c = model->config;
  const auto logits = model->forward(batch.input_ids, shift_tokens_right(batch.labels, c.pad_token_id, c.decoder_start_token_id),
                                     batch.source_padded);
  return summed_cross_entropy(logits.reshape({-1, c.vocab_size}), batch.labels.reshape(-1), c.pad_token_id);
}

std::vector<ValidationBatch> validation_batches(const PackedExamples::Split& validation, const NoiseOptions& noise,
                                               int64_t batch_size, int64_t pad_id, int rank, int ranks,
                                               torch::Device device, int64_t limit) {
  TORCH_CHECK_VALUE(!validation.empty(), "BART validation: the validation set holds no text (a store with "
                                         "empty documents, or a tiny one: give --validation-tokens)");
  const int64_t all = validation.size(), n = validation_examples(all, limit);
  const auto example = [&](int64_t j) { return n == all ? j : j * all / n; };  // spread evenly over the set
  const int64_t per_rank = (n + ranks - 1) / ranks;
  const int64_t batches = (per_rank + batch_size - 1) / batch_size;
  std::vector<ValidationBatch> out;
  for (int64_t b = 0; b < batches; ++b) {
    std::vector<int64_t> idx;
    for (int64_t k = b * batch_size; k < std::min(per_rank, (b + 1) * batch_size); ++k) {
      const int64_t i = k * ranks + rank;
      if (i < n) idx.push_back(example(i));
    }
    const bool padding = idx.empty();  // this rank ran out: a pass that counts for nothing
    if (padding) idx.push_back(0);
    out.push_back({make_batch(validation, idx, std::vector<int64_t>(idx.size(), 0), noise, /*seed=*/0, pad_id, device),
                   padding});
  }
  return out;
}

Validation validate(BartForConditionalGeneration& model, const PackedExamples::Split& validation,
                    const NoiseOptions& noise, int64_t batch_size, int64_t pad_id, zeroshard::Communicator& comm,
                    torch::Device device, int64_t limit) {
  torch::NoGradGuard no_grad;
  model->eval();
  double sum = 0;
  int64_t tokens = 0;
  for (const auto& [batch, padding] :
       validation_batches(validation, noise, batch_size, pad_id, comm.rank(), comm.size(), device, limit)) {
    const double l = summed_loss(model, batch).item<double>();
    if (!padding) {
      sum += l;
      tokens += batch.target_tokens;
    }
  }
  model->train();
  auto t = torch::tensor({sum, static_cast<double>(tokens)}, torch::kDouble);
  comm.all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
  Validation v;
  v.tokens = static_cast<int64_t>(t[1].item<double>());
  v.loss = t[0].item<double>() / static_cast<double>(std::max<int64_t>(v.tokens, 1));
  v.examples = validation_examples(validation.size(), limit);
  return v;
}

Validation validate(PipelinedBart& pipe, const PackedExamples::Split& validation, const NoiseOptions& noise,
                    int64_t batch_size, int64_t pad_id, torch::Device device, int64_t limit) {
  const auto& grid = pipe.grid();
  auto batches = validation_batches(validation, noise, batch_size, pad_id, grid.dp_rank(), grid.dp(), device, limit);
  int64_t local = 0;
  for (const auto& b : batches) local += b.padding ? 0 : b.batch.target_tokens;
  // Every stage of a data-parallel index holds the same batches: the world's sum counts them pp times.
  auto t = torch::tensor({static_cast<double>(local)}, torch::kDouble);
  grid.world().control->all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
  Validation v;
  v.tokens = static_cast<int64_t>(t.item<double>()) / grid.pp();
  std::vector<Microbatch> micro;
  std::vector<double> weights;
  for (auto& b : batches) {
    micro.push_back(pipeline_microbatch(b.batch, pipe.config(), DropoutKey{}));
    weights.push_back(b.padding ? 0.0 : 1.0 / static_cast<double>(std::max<int64_t>(v.tokens, 1)));
  }
  v.loss = pipe.evaluate(std::move(micro), weights);
  v.examples = validation_examples(validation.size(), limit);
  return v;
}

Microbatch pipeline_microbatch(const Batch& b, const BartConfig& c, DropoutKey dropout) {
  Microbatch m;
  m.batch.input_ids = b.input_ids;
  m.batch.decoder_input_ids = shift_tokens_right(b.labels, c.pad_token_id, c.decoder_start_token_id);
  m.batch.dropout = dropout;
  m.labels = b.labels;
  return m;
}

std::vector<char> aligned_in(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<int32_t>> len(n + 1, std::vector<int32_t>(m + 1, 0));  // LCS of a[i:], b[j:]
  for (size_t i = n; i-- > 0;) {
    for (size_t j = m; j-- > 0;) {
      len[i][j] = a[i] == b[j] ? len[i + 1][j + 1] + 1 : std::max(len[i + 1][j], len[i][j + 1]);
    }
  }
  std::vector<char> out(n, 0);
  for (size_t i = 0, j = 0; i < n && j < m;) {
    if (a[i] == b[j] && len[i][j] == len[i + 1][j + 1] + 1) {
      out[i] = 1;
      ++i;
      ++j;
    } else if (len[i + 1][j] >= len[i][j + 1]) {
      ++i;
    } else {
      ++j;
    }
  }
  return out;
}

namespace {

// Whether decoded text is a whole sentence: it starts at a word (a space, a capital, a digit or
// a quote; a long sentence's later pieces start inside one, corpus.h) and ends one (. ! or ?,
// perhaps inside quotes).
bool whole_sentence(const std::string& text) {
  const size_t last = text.find_last_not_of(" \"')");
  if (text.empty() || last == std::string::npos) return false;
  const auto first = static_cast<unsigned char>(text[0]);
  const bool starts = text[0] == ' ' || text[0] == '"' || text[0] == '\'' || std::isupper(first) || std::isdigit(first);
  const char end = text[last];
  return starts && (end == '.' || end == '!' || end == '?');
}

}  // namespace

DenoisingAccuracy denoising_accuracy(BartForConditionalGeneration& model, const PackedExamples::Split& validation,
                                     int64_t count, int64_t max_len, const NoiseOptions& noise,
                                     const ByteLevelBpe& tokenizer, torch::Device device, int64_t batch) {
  std::vector<Example> sentences;
  for (int64_t i = 0; i < validation.size() && static_cast<int64_t>(sentences.size()) < count; ++i) {
    for (const auto& s : validation.at(i)) {
      if (static_cast<int64_t>(sentences.size()) < count && s.size() >= 12 && static_cast<int64_t>(s.size()) <= max_len) {
        sentences.push_back({s});
      }
    }
  }
  NoiseOptions one = noise;
  one.permute_sentences = false;
  const int64_t pad = model->config.pad_token_id;
  DenoisingAccuracy acc;
  bool sample_whole = false;  // the sample is the first whole sentence, else the first sentence
  model->eval();
  for (size_t from = 0; from < sentences.size(); from += static_cast<size_t>(batch)) {
    const size_t to = std::min(sentences.size(), from + static_cast<size_t>(batch));
    std::vector<NoisedExample> noised;
    size_t src_len = 0, tgt_len = 0;
    for (size_t i = from; i < to; ++i) {
      noised.push_back(noised_example(sentences[i], static_cast<int64_t>(i), one, /*seed=*/0, /*epoch=*/0));
      src_len = std::max(src_len, noised.back().source.size());
      tgt_len = std::max(tgt_len, noised.back().target.size());
    }
    auto input = torch::full({static_cast<int64_t>(noised.size()), static_cast<int64_t>(src_len)}, pad, torch::kLong);
    for (size_t r = 0; r < noised.size(); ++r) {
      const auto& src = noised[r].source;
      input[static_cast<int64_t>(r)].slice(0, 0, static_cast<int64_t>(src.size())).copy_(torch::tensor(src, torch::kLong));
    }
    const auto decoded = model->generate(input.to(device), static_cast<int64_t>(tgt_len) + 8);
    for (size_t r = 0; r < noised.size(); ++r) {
      const auto& n = noised[r];
      // Without bos and eos: the original, what the input kept of it, and the reconstruction.
      const std::vector<int64_t> original(n.target.begin() + 1, n.target.end() - 1);
      std::vector<int64_t> kept;
      for (size_t j = 1; j + 1 < n.source.size(); ++j) {
        if (n.source[j] != noise.mask_id) kept.push_back(n.source[j]);
      }
      std::vector<int64_t> out = decoded[r];  // bos, the text, eos when it stopped in time
      if (!out.empty() && out.back() == model->config.eos_token_id) out.pop_back();
      if (!out.empty() && out.front() == n.target.front()) out.erase(out.begin());
      const auto unmasked = aligned_in(original, kept), right = aligned_in(original, out);
      for (size_t j = 0; j < original.size(); ++j) {
        (unmasked[j] ? acc.unmasked : acc.masked) += 1;
        (unmasked[j] ? acc.unmasked_right : acc.masked_right) += right[j];
      }
      acc.exact += out == original;
      ++acc.sentences;
      const bool whole = !sample_whole && whole_sentence(tokenizer.decode(n.target));
      if (from + r == 0 || whole) {
        sample_whole = whole;
        acc.sample.original = tokenizer.decode(n.target);
        acc.sample.masked = tokenizer.decode(std::vector<int64_t>(n.source.begin() + 1, n.source.end() - 1),
                                             /*keep_special=*/true);  // shows where spans went
        acc.sample.reconstruction = tokenizer.decode(decoded[r]);
      }
    }
  }
  model->train();
  return acc;
}

}  // namespace bart
