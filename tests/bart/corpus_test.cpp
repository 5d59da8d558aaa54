// BART corpus: sentences split; a token store packed within max_tokens, every
// token kept exactly once, a deterministic held-out split; the default corpus is there.
#include "data/corpus.h"
#include "data/packed_examples.h"
#include "data/prepare.h"
#include "tokenizer/tokenizer.h"
#include "test_util.h"
#include "train/training.h"

#include <gtest/gtest.h>

#include <sys/resource.h>

#include <csignal>

#include <filesystem>
#include <algorithm>
#include <fstream>
#include <iterator>

namespace corpus_test {

TEST(BartCorpus, SplitsSentencesAndParagraphs) {
  const auto s = bart::split_sentences("Copyright (C) 2007 Free Software Foundation, Inc.  Everyone is\npermitted to copy it.\n\n"
                                       "  Preamble\n\nThe GNU GPL is free! Is it? Yes");
  EXPECT_EQ(s, (std::vector<std::string>{"Copyright (C) 2007 Free Software Foundation, Inc.",
                                         "Everyone is permitted to copy it.", "Preamble", "The GNU GPL is free!",
                                         "Is it?", "Yes"}));
}

// The licenses as a token store (a document per file, a sequence per sentence,
// as prepare writes it), packed: every token in exactly one example, in order,
// within the budget and one document; the examples of 2 documents spread over
// the store held out; the packing file read again without building, and built
// again for other options.
TEST(BartCorpus, PacksEveryTokenOnceWithinTheBudget) {
  std::vector<std::string> texts;  // the licenses, on every Debian system
  for (const auto& f : bart::corpus_files({"/usr/share/common-licenses"})) {
    std::ifstream in(f, std::ios::binary);
    texts.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GE(texts.size(), 5u);
  auto tok = bart::ByteLevelBpe::train({texts[0], texts[1]}, 600);
  const auto dir = zeroshard::testing::make_temp_dir("packed");
  std::vector<std::vector<int64_t>> flat(texts.size());  // each document's tokens, in order
  {
    zeroshard::TokenStoreWriter w(dir + "/tokens", zeroshard::TokenType::kUInt16);
    for (size_t d = 0; d < texts.size(); ++d) {
      bool first = true;
      for (const auto& s : bart::split_sentences(texts[d])) {
        const auto ids = tok.encode(first ? s : " " + s);
        first = false;
        w.add(ids);
        flat[d].insert(flat[d].end(), ids.begin(), ids.end());
      }
      w.end_document();
    }
    w.finish();
  }
  auto store = std::make_shared<const zeroshard::TokenStore>(dir + "/tokens");
  bart::PackingOptions o;
  o.max_tokens = 64;
  o.validation_docs = 2;
  bart::PackedExamples packed(store, o, dir + "/packed.bin");
  EXPECT_TRUE(packed.built());
  // Held out: documents floor((2j + 1) D / 4) for j = 0, 1, the first and third quarters' middles.
  const auto docs = static_cast<int64_t>(flat.size());
  const std::vector<int64_t> held{docs / 4, 3 * docs / 4};
  EXPECT_EQ(packed.validation_documents(), 2);
  // Document by document, in order, its examples (from the split it went to) are its tokens cut.
  int64_t t = 0, v = 0, tokens = 0;
  for (int64_t d = 0; d < docs; ++d) {
    const bool is_held = std::find(held.begin(), held.end(), d) != held.end();
    size_t at = 0;
    while (at < flat[static_cast<size_t>(d)].size()) {
      const auto& split = is_held ? packed.validation() : packed.train();
      int64_t& k = is_held ? v : t;
      ASSERT_LT(k, split.size()) << "document " << d;
      const auto ex = split.at(k++);
      int64_t n = 0;
      for (const auto& piece : ex) {
        const auto& doc = flat[static_cast<size_t>(d)];
        ASSERT_FALSE(piece.empty());
        ASSERT_LE(at + piece.size(), doc.size()) << "an example runs past document " << d;
        EXPECT_TRUE(std::equal(piece.begin(), piece.end(), doc.begin() + static_cast<std::ptrdiff_t>(at)))
            << "document " << d;
        at += piece.size();
        n += static_cast<int64_t>(piece.size());
      }
      EXPECT_GT(n, 0);
      EXPECT_LE(n, o.max_tokens - 2);
      tokens += n;
    }
  }
  EXPECT_EQ(t, packed.train().size());
  EXPECT_EQ(v, packed.validation().size());
  EXPECT_EQ(tokens, store->tokens()) << "every token in exactly one example";
  std::printf("BART examples: %zu documents, %lld tokens, %lld train + %lld validation examples\n", texts.size(),
              static_cast<long long>(tokens), static_cast<long long>(packed.train().size()),
              static_cast<long long>(packed.validation().size()));
  bart::PackedExamples again(store, o, dir + "/packed.bin");
  EXPECT_FALSE(again.built()) << "a packing already on disk is read, not computed";
  EXPECT_EQ(again.validation().at(3), packed.validation().at(3));
  o.max_tokens = 32;
  bart::PackedExamples other(store, o, dir + "/packed.bin");
  EXPECT_THROW(bart::PackedExamples(store, bart::PackingOptions{64, docs / 2 + 1}, dir + "/p2.bin"), c10::Error);
  EXPECT_TRUE(other.built()) << "another --max-tokens packs again";
  EXPECT_GT(other.train().size(), packed.train().size());
  std::filesystem::remove_all(dir);
  EXPECT_THROW(bart::corpus_files({"/nonexistent-zeroshard-dir"}), c10::Error);
}

// A tokenizer file that cannot be written whole (here: a file size limit
// below vocab.json's size, as a full disk would cut it) fails prepare, naming
// the file, and commits no dataset.
TEST(BartCorpus, PrepareRefusesToCommitATruncatedTokenizerFile) {
  const auto dir = zeroshard::testing::make_temp_dir("prepare_full");
  std::ofstream(dir + "/text.txt") << "A short text. It has two sentences.\n";
  auto tok = bart::ByteLevelBpe::train({std::string("a few words, and a few more words")}, 300);
  tok.save(dir + "/vocab.json", dir + "/merges.txt");
  bart::PrepareOptions o;
  o.data = {dir + "/text.txt"};
  o.tokenizer_dir = dir;
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  o.vocab_json = read(dir + "/vocab.json");
  o.merges_txt = read(dir + "/merges.txt");
  o.out = dir + "/dataset";
  o.workers = 1;
  const auto limit = static_cast<rlim_t>(o.vocab_json.size() - 1);
  ASSERT_GT(limit, 2000u) << "the other files must fit under the limit";
  struct rlimit before {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);  // the write fails (EFBIG) instead of killing the process
  struct rlimit capped = before;
  capped.rlim_cur = limit;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &capped), 0);
  const auto error = zeroshard::testing::error_of([&] { bart::prepare_dataset(o); });
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(error.find("prepare: writing '" + dir + "/dataset.partial/tokenizer/vocab.json' failed"),
            std::string::npos) << error;
  EXPECT_FALSE(std::filesystem::exists(o.out)) << "a dataset with a truncated vocab.json was committed";
  std::filesystem::remove_all(dir);
}

TEST(BartCorpus, SkipsBinaryFiles) {
  const auto dir = zeroshard::testing::make_temp_dir("corpus-binary");
  std::ofstream(dir + "/a.txt") << "Some text. More text.";
  std::ofstream(dir + "/a.dat", std::ios::binary) << std::string("\x02\x00\x00\x00index", 9);
  const auto files = bart::corpus_files({dir});
  ASSERT_EQ(files.size(), 1u) << "a file holding a NUL byte is not text";
  EXPECT_EQ(files[0], dir + "/a.txt");
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
