// BART corpus: sentences split, packed within max_tokens, every token kept
// exactly once, a deterministic held-out split; the default corpus is there.
#include "corpus.h"
#include "test_util.h"
#include "training.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

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

TEST(BartCorpus, SkipsBinaryFiles) {
  const auto dir = zeroshard::testing::make_temp_dir("corpus-binary");
  std::ofstream(dir + "/a.txt") << "Some text. More text.";
  std::ofstream(dir + "/a.dat", std::ios::binary) << std::string("\x02\x00\x00\x00index", 9);
  const auto texts = bart::read_texts(dir);
  ASSERT_EQ(texts.size(), 1u) << "a file holding a NUL byte is not text";
  EXPECT_EQ(texts[0], "Some text. More text.");
  std::filesystem::remove_all(dir);
}

// The alignment the denoising check scores with, against sequences whose
// longest common subsequence is known.
TEST(BartCorpus, AlignedInMarksALongestCommonSubsequence) {
  using V = std::vector<int64_t>;
  using C = std::vector<char>;
  EXPECT_EQ(bart::aligned_in({1, 2, 3, 4, 5}, {1, 2, 3, 4, 5}), C(5, 1));
  EXPECT_EQ(bart::aligned_in({1, 2, 3, 4, 5}, {1, 9, 3, 5}), (C{1, 0, 1, 0, 1}));  // a substitution and a drop
  EXPECT_EQ(bart::aligned_in({1, 2, 3}, {7, 1, 2, 8, 3, 9}), C(3, 1));           // insertions cost nothing
  EXPECT_EQ(bart::aligned_in({1, 2, 3}, {}), C(3, 0));
  EXPECT_EQ(bart::aligned_in({}, V{1}), C{});
  const auto shifted = bart::aligned_in({5, 6, 7, 8}, {6, 7, 8, 5});  // one token moved: 3 of 4 stay aligned
  EXPECT_EQ(std::count(shifted.begin(), shifted.end(), 1), 3);
}

}  // namespace corpus_test
