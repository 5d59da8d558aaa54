// BART corpus: sentences split, packed within max_tokens, every token kept
// exactly once, a deterministic held-out split; the default corpus is there.
#include "corpus.h"

#include <gtest/gtest.h>

namespace corpus_test {

TEST(BartCorpus, SplitsSentencesAndParagraphs) {
  const auto s = bart::split_sentences("Copyright (C) 2007 Free Software Foundation, Inc.  Everyone is\npermitted to copy it.\n\n"
                                       "  Preamble\n\nThe GNU GPL is free! Is it? Yes");
  EXPECT_EQ(s, (std::vector<std::string>{"Copyright (C) 2007 Free Software Foundation, Inc.",
                                         "Everyone is permitted to copy it.", "Preamble", "The GNU GPL is free!",
                                         "Is it?", "Yes"}));
}

TEST(BartCorpus, PacksEveryTokenOnceWithinTheBudget) {
  const auto texts = bart::read_texts("/usr/share/common-licenses");  // on every Debian system
  ASSERT_GE(texts.size(), 5u);
  auto tok = bart::ByteLevelBpe::train({texts[0], texts[1]}, 600);
  bart::CorpusOptions o;
  o.max_tokens = 64;
  const auto corpus = bart::build_corpus(texts, tok, o);
  int64_t tokens = 0;
  for (const auto* split : {&corpus.train, &corpus.validation}) {
    for (const auto& ex : *split) {
      int64_t n = 0;
      for (const auto& s : ex) n += static_cast<int64_t>(s.size());
      EXPECT_LE(n, o.max_tokens - 2);
      EXPECT_GT(n, 0);
      tokens += n;
    }
  }
  EXPECT_EQ(tokens, corpus.tokens) << "every token in exactly one example";
  const double held = static_cast<double>(corpus.validation.size()) / (corpus.train.size() + corpus.validation.size());
  std::printf("BART corpus: %zu texts, %lld tokens, %zu train + %zu validation examples\n", texts.size(),
              static_cast<long long>(corpus.tokens), corpus.train.size(), corpus.validation.size());
  EXPECT_NEAR(held, 1.0 / o.validation_every, 0.01);
  const auto again = bart::build_corpus(texts, tok, o);
  EXPECT_EQ(again.validation, corpus.validation);
  EXPECT_THROW(bart::read_texts("/nonexistent-zeroshard-dir"), c10::Error);
}

}  // namespace corpus_test
