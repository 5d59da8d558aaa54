// corpus.h — text files to BART training examples: sentences, tokenized and
// packed into examples of at most max_tokens (with bos/eos), a held-out split.
#pragma once

#include "tokenizer.h"

#include <cstdint>
#include <string>
#include <vector>

namespace bart {

// The contents of every regular file under `dir` (recursively, by sorted
// path; links to a file already read and binary files, those holding a NUL
// byte, are skipped). Throws naming the directory
// when it holds no readable file.
std::vector<std::string> read_texts(const std::string& dir);

// Sentences: text split after '.', '!' or '?' followed by whitespace, and at
// blank lines; whitespace collapsed to single spaces; empty pieces dropped.
std::vector<std::string> split_sentences(const std::string& text);

struct CorpusOptions {
  int64_t max_tokens = 128;      // per example, bos and eos included
  int64_t validation_every = 20; // every n-th example (the last of each n) is held out
};

// An example: consecutive sentences of one text, as token ids.
using Example = std::vector<std::vector<int64_t>>;
struct Corpus {
  std::vector<Example> train, validation;
  int64_t tokens = 0;  // all sentences' tokens
};

// Sentences are encoded with a leading space after the first of a text (as
// running text tokenizes) and packed greedily; a sentence longer than an
// example is cut into pieces. Deterministic.
Corpus build_corpus(const std::vector<std::string>& texts, const ByteLevelBpe& tokenizer, const CorpusOptions& options);

}  // namespace bart
