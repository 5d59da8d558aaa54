// noise.h — BART's denoising objective (Lewis et al., 2019, section 2.2):
// sentence permutation, then text infilling.
//
// Text infilling: span lengths are drawn from Poisson(λ) until they cover
// mask_ratio of the tokens (the last span trimmed to land exactly); each span
// is replaced by ONE mask token, so the model must also predict how many
// tokens are missing; a zero-length span inserts a mask token. Spans never
// overlap or touch, so each stays one mask. Deterministic given the RNG.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace bart {

struct NoiseOptions {
  double mask_ratio = 0.3;      // fraction of tokens inside masked spans
  double poisson_lambda = 3.0;  // mean span length
  bool permute_sentences = true;
  int64_t mask_id = 50264, bos_id = 0, eos_id = 2;
};

struct NoisedExample {
  std::vector<int64_t> source;  // bos, the noised tokens, eos: the encoder's input
  std::vector<int64_t> target;  // bos, the original tokens, eos: what the decoder must produce
  int64_t masked_tokens = 0;    // original tokens replaced by masks
  std::vector<int64_t> spans;   // every span length drawn (zeros are insertions)
};

// `sentences`: one document's sentences as token ids (no bos/eos).
NoisedExample add_noise(const std::vector<std::vector<int64_t>>& sentences, const NoiseOptions& options,
                        std::mt19937_64& rng);

// Text infilling alone, on a flat token sequence (no bos/eos).
std::vector<int64_t> infill(const std::vector<int64_t>& tokens, const NoiseOptions& options, std::mt19937_64& rng,
                            int64_t* masked_tokens = nullptr, std::vector<int64_t>* spans = nullptr);

}  // namespace bart
