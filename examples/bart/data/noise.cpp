// noise.cpp — sentence permutation and text infilling.
#include "data/noise.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace bart {

std::vector<int64_t> infill(const std::vector<int64_t>& tokens, const NoiseOptions& o, std::mt19937_64& rng,
                            int64_t* masked_tokens, std::vector<int64_t>* spans_out) {
  const auto n = static_cast<int64_t>(tokens.size());
  const auto to_mask = static_cast<int64_t>(std::llround(o.mask_ratio * static_cast<double>(n)));
  // Span lengths until they cover `to_mask` tokens; the last one trimmed.
  std::poisson_distribution<int64_t> poisson(o.poisson_lambda);
  std::vector<int64_t> spans;
  int64_t covered = 0, inserts = 0;
  while (covered < to_mask) {
    int64_t len = poisson(rng);
    if (spans_out != nullptr) spans_out->push_back(len);
    if (len == 0) {
      ++inserts;
      continue;
    }
    len = std::min(len, to_mask - covered);
    spans.push_back(len);
    covered += len;
  }
  // Place the spans apart: choose which of the unmasked tokens each span
  // follows (distinct gaps, so spans never touch), in order.
  const int64_t unmasked = n - covered;
  std::vector<int64_t> gaps(static_cast<size_t>(unmasked + 1));
  std::iota(gaps.begin(), gaps.end(), 0);
  std::shuffle(gaps.begin(), gaps.end(), rng);
  const auto k = std::min<int64_t>(static_cast<int64_t>(spans.size()), unmasked + 1);
  std::vector<int64_t> chosen(gaps.begin(), gaps.begin() + k);
  std::sort(chosen.begin(), chosen.end());
  // Spans beyond the gaps available (tiny inputs) join the last chosen span.
  for (size_t s = static_cast<size_t>(k); s < spans.size(); ++s) spans[static_cast<size_t>(k) - 1] += spans[s];
  spans.resize(static_cast<size_t>(k));
  std::vector<int64_t> out;
  int64_t pos = 0, kept = 0;
  size_t next = 0;
  std::vector<int64_t> insert_at(static_cast<size_t>(inserts));
  std::uniform_int_distribution<int64_t> where(0, unmasked);
  for (auto& w : insert_at) w = where(rng);
  std::sort(insert_at.begin(), insert_at.end());
  size_t next_insert = 0;
  auto emit_gap = [&](int64_t gap) {  // before the `gap`-th unmasked token
    while (next_insert < insert_at.size() && insert_at[next_insert] == gap) {
      out.push_back(o.mask_id);
      ++next_insert;
    }
    if (next < chosen.size() && chosen[next] == gap) {
      out.push_back(o.mask_id);
      pos += spans[next];
      ++next;
    }
  };
  while (pos < n || next < chosen.size() || next_insert < insert_at.size()) {
    emit_gap(kept);
    if (pos >= n) break;
    out.push_back(tokens[static_cast<size_t>(pos)]);
    ++pos;
    ++kept;
  }
  if (masked_tokens != nullptr) *masked_tokens = covered;
  return out;
}

NoisedExample add_noise(const std::vector<std::vector<int64_t>>& sentences, const NoiseOptions& o,
                        std::mt19937_64& rng) {
  NoisedExample ex;
  ex.target.push_back(o.bos_id);
  for (const auto& s : sentences) ex.target.insert(ex.target.end(), s.begin(), s.end());
  ex.target.push_back(o.eos_id);
  std::vector<size_t> order(sentences.size());
  std::iota(order.begin(), order.end(), 0);
  if (o.permute_sentences) std::shuffle(order.begin(), order.end(), rng);
  std::vector<int64_t> permuted;
  for (size_t i : order) permuted.insert(permuted.end(), sentences[i].begin(), sentences[i].end());
  ex.source.push_back(o.bos_id);
  const auto noised = infill(permuted, o, rng, &ex.masked_tokens, &ex.spans);
  ex.source.insert(ex.source.end(), noised.begin(), noised.end());
  ex.source.push_back(o.eos_id);
  return ex;
}

}  // namespace bart
