// BART corpus: sentences split; a token store packed within max_tokens, every
// token kept exactly once, a deterministic held-out split; the default corpus is there.
#include "data/corpus.h"
#include "data/packed_examples.h"
#include "data/prepare.h"
#include "io/work_progress.h"
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

// A store whose every token is its position in the corpus (int32): documents
// of `doc_tokens` tokens each, in sentences of `sentence` tokens.
std::shared_ptr<const zeroshard::TokenStore> positions_store(const std::string& dir,
                                                             const std::vector<int64_t>& doc_tokens, int64_t sentence) {
  zeroshard::TokenStoreWriter w(dir + "/tokens", zeroshard::TokenType::kInt32);
  int64_t at = 0;
  for (const int64_t n : doc_tokens) {
    for (int64_t s = 0; s < n; s += sentence) {
      std::vector<int64_t> ids;
      for (int64_t k = 0; k < std::min(sentence, n - s); ++k) ids.push_back(at++);
      w.add(ids);
    }
    w.end_document();
  }
  w.finish();
  return std::make_shared<const zeroshard::TokenStore>(dir + "/tokens");
}

// The validation set of a store of positions: every position in exactly one
// example of one split; the held-out positions as runs [begin, end).
std::vector<std::pair<int64_t, int64_t>> held_runs(const bart::PackedExamples& p) {
  const int64_t total = p.tokens();
  std::vector<int8_t> seen(static_cast<size_t>(total), -1);
  for (int split = 0; split < 2; ++split) {
    const auto& examples = split == 0 ? p.train() : p.validation();
    for (int64_t i = 0; i < examples.size(); ++i) {
      for (const auto& piece : examples.at(i)) {
        for (const int64_t t : piece) {
          EXPECT_EQ(seen[static_cast<size_t>(t)], -1) << "token " << t << " is in two examples";
          seen[static_cast<size_t>(t)] = static_cast<int8_t>(split);
        }
      }
    }
  }
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t t = 0; t < total; ++t) {
    EXPECT_NE(seen[static_cast<size_t>(t)], -1) << "token " << t << " is in no example";
    if (seen[static_cast<size_t>(t)] != 1) continue;
    if (!runs.empty() && runs.back().second == t) {
      ++runs.back().second;
    } else {
      runs.emplace_back(t, t + 1);
    }
  }
  return runs;
}

// The validation set is bounded in tokens whatever the corpus's shape: one
// long document (a single text file), two, and 10^5 tiny ones. With few
// documents it is spans within them, spread over the corpus; with many, whole
// documents spread over the store. Never trained on, never over its size.
TEST(BartCorpus, HoldsOutABoundedShareOfAnyCorpus) {
  EXPECT_EQ(bart::default_validation_tokens(500000), 20000);     // 4%: the floor
  EXPECT_EQ(bart::default_validation_tokens(100000), 5000);      // 5% caps the floor
  EXPECT_EQ(bart::default_validation_tokens(10000000), 100000);  // 1%
  EXPECT_EQ(bart::default_validation_tokens(int64_t{1} << 40), 1000000);
  const auto dir = zeroshard::testing::make_temp_dir("held-out");
  struct Case {
    const char* name;
    std::vector<int64_t> docs;
    int64_t sentence;
  };
  const std::vector<Case> cases = {{"one file", {500000}, 23},
                                   {"two files", {310000, 190000}, 37},
                                   {"1e5 tiny documents", std::vector<int64_t>(100000, 10), 4}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::filesystem::remove_all(dir + "/c");
    std::filesystem::create_directories(dir + "/c");
    const auto store = positions_store(dir + "/c", c.docs, c.sentence);
    const int64_t total = store->tokens(), target = bart::default_validation_tokens(total);
    bart::PackingOptions o;
    o.max_tokens = 64;
    bart::PackedExamples p(store, o, dir + "/c/packed.bin");
    const auto runs = held_runs(p);
    const auto& h = p.held_out();
    int64_t held = 0;
    for (const auto& r : runs) held += r.second - r.first;
    EXPECT_EQ(held, h.tokens);
    EXPECT_EQ(h.target_tokens, target);
    ASSERT_FALSE(runs.empty());
    // Spread: held-out text in the corpus's first and last tenths.
    EXPECT_LT(runs.front().first, total / 10);
    EXPECT_GT(runs.back().second, total - total / 10);
    if (c.docs.size() > 2) {  // whole documents: exactly the size, every run a document's tokens
      EXPECT_FALSE(h.within_documents);
      EXPECT_EQ(held, target);
      EXPECT_EQ(h.documents, target / 10);
      for (const auto& r : runs) EXPECT_EQ(r.first % 10, 0) << "a held-out run starts inside a document";
    } else {  // spans within the documents: whole sentences up to the size, short by less than one a span; 64 at most
      EXPECT_TRUE(h.within_documents);
      EXPECT_EQ(h.documents, static_cast<int64_t>(c.docs.size()));
      EXPECT_EQ(h.spans, std::min<int64_t>(64, target / (4 * o.max_tokens)));
      EXPECT_EQ(static_cast<int64_t>(runs.size()), h.spans);
      EXPECT_GE(held, target - h.spans * (c.sentence + 1));
      EXPECT_LE(held, target);
    }
    EXPECT_LE(held, total / 20) << "more than 5% of the corpus held out";
    std::printf("BART validation, %s: %lld of %lld tokens (%.2f%%) in %zu runs\n", c.name,
                static_cast<long long>(held), static_cast<long long>(total), 100.0 * held / total, runs.size());
  }
  // Asked for: a size, within bounds; documents and a size at once, or more than half, refused.
  const auto store = positions_store(dir + "/c", std::vector<int64_t>(100000, 10), 4);
  bart::PackingOptions o;
  o.validation.tokens = 3000;
  bart::PackedExamples p(store, o, dir + "/c/packed-3000.bin");
  EXPECT_EQ(p.held_out().tokens, 3000);
  o.validation.tokens = 500001;
  EXPECT_THROW(bart::PackedExamples(store, o, dir + "/c/p.bin"), c10::Error);
  o.validation = {5, 100};
  EXPECT_THROW(bart::PackedExamples(store, o, dir + "/c/p.bin"), c10::Error);
  std::filesystem::remove_all(dir);
}

// A small corpus (900 tokens in two files of 30-token sentences, the review's case): its 5% share
// (45 tokens) is held in whole sentences and never exceeded. Before, every sentence touching the
// span was held out: 60 tokens, 6.67%. A corpus of one sentence holds out that sentence (its
// span's centre): the run then says its validation set took all of its text.
TEST(BartCorpus, ASmallCorpusHoldsOutNoMoreThanItsShare) {
  const auto dir = zeroshard::testing::make_temp_dir("held-out-small");
  for (const auto& [docs, sentence, want] : std::vector<std::tuple<std::vector<int64_t>, int64_t, int64_t>>{
           {{510, 390}, 30, 30}, {{36}, 36, 36}}) {
    std::filesystem::remove_all(dir + "/c");
    std::filesystem::create_directories(dir + "/c");
    const auto store = positions_store(dir + "/c", docs, sentence);
    bart::PackingOptions o;
    o.max_tokens = 64;
    bart::PackedExamples p(store, o, dir + "/c/packed.bin");
    const auto runs = held_runs(p);
    int64_t held = 0;
    for (const auto& r : runs) held += r.second - r.first;
    EXPECT_EQ(held, want) << store->tokens() << " tokens";
    EXPECT_EQ(p.held_out().tokens, want);
    if (store->tokens() > sentence) {
      EXPECT_LE(held, store->tokens() / 20);
    }
  }
  std::filesystem::remove_all(dir);
}

// The progress line of prepare, merge and train-tokenizer: bytes, share, rate and time left, in closed form.
TEST(BartCorpus, ProgressLineSaysWhereLongWorkStands) {
  EXPECT_EQ(bart::WorkProgress::line(500000000, 1000000000, 10), "500.0 MB of 1.00 GB (50%), 50.0 MB/s, 10s left");
  EXPECT_EQ(bart::WorkProgress::line(int64_t{3} * 1000000000, int64_t{10} * 1000000000, 100),
            "3.00 GB of 10.00 GB (30%), 30.0 MB/s, 3m53s left");
  EXPECT_EQ(bart::WorkProgress::line(0, 2000000, 1), "0.0 MB of 2.0 MB (0%), 0.0 MB/s, ? left");
}

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
  o.validation.documents = 2;  // --validation-docs 2: the documents rule as given
  bart::PackedExamples packed(store, o, dir + "/packed.bin");
  EXPECT_TRUE(packed.built());
  // Held out: documents floor((2j + 1) D / 4) for j = 0, 1, the first and third quarters' middles.
  const auto docs = static_cast<int64_t>(flat.size());
  const std::vector<int64_t> held{docs / 4, 3 * docs / 4};
  EXPECT_EQ(packed.held_out().documents, 2);
  EXPECT_FALSE(packed.held_out().within_documents);
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
  EXPECT_THROW(bart::PackedExamples(store, bart::PackingOptions{64, {docs / 2 + 1, 0}}, dir + "/p2.bin"), c10::Error);
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
