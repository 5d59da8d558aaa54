// held_out.cpp — the validation set's documents or spans (held_out.h says which).
#include "data/held_out.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace bart {

namespace {

int64_t document_tokens(const zeroshard::TokenStore& store, int64_t d) {
  int64_t n = 0;
  for (int64_t s = store.document_begin(d); s < store.document_end(d); ++s) n += store.length(s);
  return n;
}

// Document floor((2j + 1) D / 2K), j < K: K of D spread evenly.
int64_t spread(int64_t j, int64_t k, int64_t d) {
  return static_cast<int64_t>(static_cast<__int128>(2 * j + 1) * d / (2 * k));
}

// Whole documents, spread evenly, while they fit in `target` tokens; empty
// when the corpus's documents are too few or too large for that.
std::vector<int64_t> spread_documents(const zeroshard::TokenStore& store, int64_t target) {
  const int64_t docs = store.documents(), total = store.tokens();
  if (docs == 0 || total == 0) return {};
  const int64_t average = std::max<int64_t>(1, total / docs);
  const int64_t k = (target + average - 1) / average;
  if (k < 8 || 10 * k > docs) return {};
  std::vector<int64_t> out;
  int64_t taken = 0;
  for (int64_t j = 0; j < k && taken < target; ++j) {
    const int64_t d = spread(j, k, docs);
    const int64_t n = document_tokens(store, d);
    if (n == 0 || taken + n > target) continue;  // too large for what is left: it trains
    out.push_back(d);
    taken += n;
  }
  if (2 * taken < target) return {};  // mostly documents too large to take whole
  return out;
}

}  // namespace

int64_t default_validation_tokens(int64_t corpus_tokens) {
  const int64_t floor = std::min<int64_t>(20000, corpus_tokens / 20);
  return std::min<int64_t>(1000000, std::max(corpus_tokens / 100, floor));
}

HeldOut choose_held_out(const zeroshard::TokenStore& store, const ValidationOptions& o, int64_t max_tokens) {
  TORCH_CHECK_VALUE(o.documents >= 0, "--validation-docs ", o.documents, ": must be 0 (the default) or more");
  TORCH_CHECK_VALUE(o.tokens >= 0, "--validation-tokens ", o.tokens, ": must be 0 (the default) or more");
  TORCH_CHECK_VALUE(o.documents == 0 || o.tokens == 0, "--validation-docs ", o.documents, " and --validation-tokens ",
                    o.tokens, ": give one of the two");
  HeldOut h;
  const int64_t docs = store.documents(), total = store.tokens();
  if (o.documents > 0) {
    TORCH_CHECK_VALUE(2 * o.documents <= docs, "--validation-docs ", o.documents, " holds out more than half of the "
                      "dataset's ", docs, " documents; give at most ", docs / 2, ", or leave it out (the default is "
                      "a share of the tokens, taken within documents when they are few)");
    for (int64_t j = 0; j < o.documents; ++j) h.documents.push_back(spread(j, o.documents, docs));
    return h;
  }
  h.target_tokens = o.tokens > 0 ? o.tokens : default_validation_tokens(total);
  TORCH_CHECK_VALUE(2 * h.target_tokens <= total, "--validation-tokens ", h.target_tokens, " holds out more than "
                    "half of the dataset's ", total, " tokens; give at most ", total / 2);
  h.documents = spread_documents(store, h.target_tokens);
  if (!h.documents.empty() || h.target_tokens == 0) return h;
  h.kind = HeldOut::Kind::kSpans;
  const int64_t k = std::clamp<int64_t>(h.target_tokens / (4 * max_tokens), 1, 64);
  const int64_t size = std::max<int64_t>(1, h.target_tokens / k);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t centre = spread(j, k, total);
    const int64_t begin = std::max<int64_t>(h.spans.empty() ? 0 : h.spans.back().second, centre - size / 2);
    h.spans.emplace_back(begin, std::min(total, begin + size));
  }
  return h;
}

std::string held_out_key(const ValidationOptions& o, int64_t corpus_tokens) {
  if (o.documents > 0) return "d" + std::to_string(o.documents);
  return "t" + std::to_string(o.tokens > 0 ? o.tokens : default_validation_tokens(corpus_tokens));
}

}  // namespace bart
