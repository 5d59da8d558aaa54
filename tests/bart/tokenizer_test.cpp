// Byte-level BPE: GPT-2's pre-tokenization, known merges -> known ids, any
// bytes round-trip, training is deterministic and save/load keeps encodings.
#include "tokenizer/tokenizer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <random>

namespace tokenizer_test {

using bart::ByteLevelBpe;

TEST(BartTokenizer, PreTokenizesLikeGpt2) {
  // Worked out by hand from GPT-2's pattern
  //   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  EXPECT_EQ(ByteLevelBpe::pretokenize("Hello world's 123 test!!  \n  x'll ét\xC3\xA9  "),
            (std::vector<std::string>{"Hello", " world", "'s", " 123", " test", "!!", "  \n ", " x", "'ll",
                                      " \xC3\xA9t\xC3\xA9", "  "}));
  EXPECT_EQ(ByteLevelBpe::byte_symbols()[' '], "\xC4\xA0");  // 'Ġ', GPT-2's space
  EXPECT_EQ(ByteLevelBpe::byte_symbols()['a'], "a");
  EXPECT_EQ(ByteLevelBpe::byte_symbols()['\n'], "\xC4\x8A");  // 'Ċ'
}

// Unicode's letter and number classes, not a byte-range approximation: U+00B5
// (micro sign) is a letter below U+00C0, U+00BD (one half) a number, U+2019
// (right single quote) and U+1F389 (party popper) are neither.
TEST(BartTokenizer, PreTokenizesWithUnicodeClasses) {
  EXPECT_EQ(ByteLevelBpe::pretokenize("5\xC2\xB5m 1\xC2\xBD"),
            (std::vector<std::string>{"5", "\xC2\xB5m", " 1\xC2\xBD"}));
  EXPECT_EQ(ByteLevelBpe::pretokenize("don\xE2\x80\x99t end\xF0\x9F\x8E\x89."),
            (std::vector<std::string>{"don", "\xE2\x80\x99", "t", " end", "\xF0\x9F\x8E\x89."}));
}

// A hand-made vocabulary in the vocab.json/merges.txt format.
TEST(BartTokenizer, KnownMergesGiveKnownIds) {
  const auto dir = zeroshard::testing::make_temp_dir("bpe");
  nlohmann::json vocab;
  int64_t next = 0;
  for (const auto& s : ByteLevelBpe::byte_symbols()) vocab[s] = next++;
  const std::string G = "\xC4\xA0";  // Ġ
  for (const auto& t : {std::string("he"), std::string("ll"), std::string("hell"), G + "w", G + "wor"}) vocab[t] = next++;
  vocab["<mask>"] = next++;
  std::ofstream(dir + "/vocab.json") << vocab.dump();
  std::ofstream(dir + "/merges.txt") << "#version: 0.2\nh e\nl l\nhe ll\n" << G << " w\n" << G << "w o\n"
                                     << G << "wo r\n";
  auto t = ByteLevelBpe::load(dir + "/vocab.json", dir + "/merges.txt");
  // "hello": h e l l o -> he l l o -> he ll o -> hell o.
  // " world": Ġ w o r l d -> Ġw o r l d -> Ġwo r l d -> Ġwor l d.
  const auto ids = t.encode("hello world");
  const std::vector<int64_t> want{vocab["hell"].get<int64_t>(), vocab["o"].get<int64_t>(), vocab[G + "wor"].get<int64_t>(),
                                  vocab["l"].get<int64_t>(), vocab["d"].get<int64_t>()};
  EXPECT_EQ(ids, want);
  EXPECT_EQ(t.decode(ids), "hello world");
  EXPECT_EQ(t.mask_id(), next - 1);
}

TEST(BartTokenizer, AnyBytesRoundTrip) {
  const std::vector<std::string> corpus{"the quick brown fox jumps over the lazy dog. ", "the the the quick quick",
                                        "Permission is hereby granted, free of charge, to any person obtaining a copy"};
  auto t = ByteLevelBpe::train(corpus, 300);
  std::mt19937_64 rng(1);
  std::uniform_int_distribution<int> byte(0, 255), len(0, 64);
  for (int i = 0; i < 500; ++i) {
    std::string s(static_cast<size_t>(len(rng)), '\0');
    for (auto& c : s) c = static_cast<char>(byte(rng));  // NULs, invalid UTF-8, anything
    ASSERT_EQ(t.decode(t.encode(s)), s) << "sample " << i;
  }
  const std::string text = "Grüße, 世界! naïve café 🙂 \t\n";
  EXPECT_EQ(t.decode(t.encode(text)), text);
}

TEST(BartTokenizer, TrainingIsDeterministicAndSaveLoadKeepsEncodings) {
  std::vector<std::string> corpus;
  for (int i = 0; i < 50; ++i) corpus.push_back("the license grants permission to use, copy and modify the software " + std::to_string(i));
  auto a = ByteLevelBpe::train(corpus, 320), b = ByteLevelBpe::train(corpus, 320);
  EXPECT_EQ(a.vocab_size(), 320);
  EXPECT_EQ(a.id("<s>"), 0);
  EXPECT_EQ(a.pad_id(), 1);
  EXPECT_EQ(a.id("</s>"), 2);
  EXPECT_EQ(a.mask_id(), 319);
  const std::string text = "the software license grants permission";
  EXPECT_EQ(a.encode(text), b.encode(text));
  EXPECT_LT(a.encode(text).size(), text.size() / 3) << "merges learned from the corpus compress it";
  const auto dir = zeroshard::testing::make_temp_dir("bpe_save");
  a.save(dir + "/vocab.json", dir + "/merges.txt");
  auto c = ByteLevelBpe::load(dir + "/vocab.json", dir + "/merges.txt");
  EXPECT_EQ(c.encode(text), a.encode(text));
  EXPECT_EQ(c.vocab_size(), 320);
}

}  // namespace tokenizer_test
