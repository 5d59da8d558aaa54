// BART's noise: 30% of tokens masked in Poisson(3) spans, one mask per span,
// sentence permutation keeps the sentences, all deterministic given the seed.
#include "data/noise.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>

namespace noise_test {

constexpr int64_t kMask = 9999;

std::vector<std::vector<int64_t>> document(std::mt19937_64& rng, int sentences) {
  std::uniform_int_distribution<int64_t> len(5, 30), tok(10, 5000);
  std::vector<std::vector<int64_t>> doc(static_cast<size_t>(sentences));
  for (auto& s : doc) {
    s.resize(static_cast<size_t>(len(rng)));
    for (auto& t : s) t = tok(rng);
  }
  return doc;
}

TEST(BartNoise, ThirtyPercentMaskedInSpansOfMeanThree) {
  bart::NoiseOptions o;
  o.mask_id = kMask;
  std::mt19937_64 rng(1);
  int64_t tokens = 0, masked = 0, mask_tokens = 0, span_count = 0, span_sum = 0, zero_spans = 0;
  for (int i = 0; i < 2000; ++i) {
    const auto doc = document(rng, 6);
    const auto ex = bart::add_noise(doc, o, rng);
    const int64_t n = static_cast<int64_t>(ex.target.size()) - 2;
    tokens += n;
    masked += ex.masked_tokens;
    mask_tokens += std::count(ex.source.begin(), ex.source.end(), kMask);
    for (auto s : ex.spans) {
      ++span_count;
      span_sum += s;
      zero_spans += s == 0;
    }
    // What is left: every unmasked token once, in (permuted) order, plus one mask per span.
    EXPECT_EQ(static_cast<int64_t>(ex.source.size()) - 2, n - ex.masked_tokens + std::count(ex.source.begin(), ex.source.end(), kMask));
  }
  const double fraction = static_cast<double>(masked) / static_cast<double>(tokens);
  const double mean_span = static_cast<double>(span_sum) / static_cast<double>(span_count);
  std::printf("BART noise over 2000 documents: %.3f of tokens masked, mean drawn span %.2f, %.3f of spans empty "
              "(Poisson(3): %.3f), %.2f mask tokens per document\n",
              fraction, mean_span, static_cast<double>(zero_spans) / span_count, std::exp(-3.0),
              static_cast<double>(mask_tokens) / 2000);
  EXPECT_NEAR(fraction, 0.30, 0.02);
  // The last span of each document is trimmed to land on 30%, so drawn spans
  // are a Poisson(3) sample: mean 3 (within sampling error), e^-3 of them empty.
  EXPECT_NEAR(mean_span, 3.0, 0.15);
  EXPECT_NEAR(static_cast<double>(zero_spans) / span_count, std::exp(-3.0), 0.015);
}

TEST(BartNoise, SentencePermutationKeepsTheSentences) {
  bart::NoiseOptions o;
  o.mask_id = kMask;
  o.mask_ratio = 0;  // permutation alone
  std::mt19937_64 rng(2);
  const auto doc = document(rng, 8);
  const auto ex = bart::add_noise(doc, o, rng);
  std::vector<int64_t> a(ex.source.begin() + 1, ex.source.end() - 1), b(ex.target.begin() + 1, ex.target.end() - 1);
  EXPECT_NE(a, b) << "sentences were reordered";
  // Each sentence appears contiguously in the source.
  std::multiset<std::vector<int64_t>> found, want(doc.begin(), doc.end());
  size_t pos = 0;
  while (pos < a.size()) {
    bool matched = false;
    for (const auto& s : doc) {
      if (pos + s.size() <= a.size() && std::equal(s.begin(), s.end(), a.begin() + static_cast<std::ptrdiff_t>(pos))) {
        found.insert(s);
        pos += s.size();
        matched = true;
        break;
      }
    }
    ASSERT_TRUE(matched) << "source position " << pos << " starts no sentence";
  }
  EXPECT_EQ(found, want);
  EXPECT_EQ(ex.target.front(), o.bos_id);
  EXPECT_EQ(ex.target.back(), o.eos_id);
}

TEST(BartNoise, DeterministicGivenTheSeed) {
  bart::NoiseOptions o;
  std::mt19937_64 r0(3), r1(3), r2(4);
  std::mt19937_64 d(5);
  const auto doc = document(d, 5);
  const auto a = bart::add_noise(doc, o, r0), b = bart::add_noise(doc, o, r1), c = bart::add_noise(doc, o, r2);
  EXPECT_EQ(a.source, b.source);
  EXPECT_NE(a.source, c.source);
}

}  // namespace noise_test
