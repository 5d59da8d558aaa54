// held_out.h — which part of a token store is BART's validation set: pure
// choices from the store's index (its documents' sizes), computed once per
// packing (packed_examples.h) and never trained on.
//
// By default the set is bounded in tokens: about 1% of the corpus's tokens,
// at least min(20,000, 5%) and at most 1,000,000 (ValidationOptions::tokens
// gives another size), so it is a small share of any corpus.
// - Whole documents, spread evenly over the store, when the corpus has many
//   small ones (the size needs at least 8 documents, and at most a tenth of
//   them): document floor((2j + 1) D / 2K) for j < K, each taken while it fits
//   in what is left of the size.
// - Otherwise (a corpus of one long file, or a few large ones) spans of
//   consecutive tokens within documents, spread evenly over the corpus's
//   tokens end to end: K = clamp(size / (4 max_tokens), 1, 64) spans of
//   size / K tokens, span j centred on token (2j + 1) T / 2K. The packer holds
//   out the whole pieces of sentences that overlap a span while they fit in
//   its size (and the piece at its centre in any case), so the set holds at
//   most its size, short of it by less than a sentence per span.
// ValidationOptions::documents keeps the earlier rule: that many whole
// documents, spread as above, whatever their size.
#pragma once

#include <zeroshard/token_store.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace bart {

struct ValidationOptions {
  int64_t documents = 0;  // > 0: this many whole documents (--validation-docs); at most half the store's
  int64_t tokens = 0;     // > 0: about this many tokens (--validation-tokens); 0: default_validation_tokens
};

// 1% of `corpus_tokens`, at least min(20,000, 5%) and at most 1,000,000.
int64_t default_validation_tokens(int64_t corpus_tokens);

struct HeldOut {
  enum class Kind { kDocuments, kSpans };
  Kind kind = Kind::kDocuments;
  int64_t target_tokens = 0;  // the size asked for (0 with ValidationOptions::documents)
  std::vector<int64_t> documents;                   // kDocuments: ascending
  std::vector<std::pair<int64_t, int64_t>> spans;  // kSpans: token ranges [begin, end) of the corpus end to end,
                                                   // ascending and disjoint
};

// REQUIRES: max_tokens >= 8. Throws naming the option when it asks for more
// than the store can give (documents above half of them; tokens above half).
HeldOut choose_held_out(const zeroshard::TokenStore& store, const ValidationOptions& options, int64_t max_tokens);

// A short name of the choice, for file names: "d100" (documents given),
// "t20000" (a size in tokens).
std::string held_out_key(const ValidationOptions& options, int64_t corpus_tokens);

}  // namespace bart
