// tokenizer.cpp — byte-level BPE (see tokenizer.h).
#include "tokenizer/tokenizer.h"
#include "io/json_error.h"

#include "tokenizer/unicode_classes.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>

namespace bart {
namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// One UTF-8 character at `i`: its code point and byte length (an invalid
// byte is a character of its own, code point 0xFFFD).
std::pair<uint32_t, size_t> next_char(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  auto cont = [&](size_t k) { return i + k < s.size() && (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80; };
  if (b < 0x80) return {b, 1};
  if ((b & 0xE0) == 0xC0 && cont(1)) return {((b & 0x1Fu) << 6) | (s[i + 1] & 0x3F), 2};
  if ((b & 0xF0) == 0xE0 && cont(1) && cont(2)) {
    return {((b & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3F), 3};
  }
  if ((b & 0xF8) == 0xF0 && cont(1) && cont(2) && cont(3)) {
    return {((b & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3F), 4};
  }
  return {0xFFFD, 1};
}

bool is_space(uint32_t c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}
// Whether c lies in one of the sorted, disjoint ranges.
template <size_t N>
bool in_ranges(const unicode::CodeRange (&ranges)[N], uint32_t c) {
  const auto* after = std::upper_bound(std::begin(ranges), std::end(ranges), c,
                                       [](uint32_t x, const unicode::CodeRange& r) { return x < r.first; });
  return after != std::begin(ranges) && c <= (after - 1)->last;
}
// GPT-2's \p{L} and \p{N}: Unicode's letters (Lu Ll Lt Lm Lo) and numbers (Nd Nl
// No), from the tables. Not "every code point from U+00C0 up": marks (U+0301),
// symbols and emoji, punctuation (U+2019 ’, U+2014 —), the zero-width space are
// neither, and ª µ º ² ½ ٣ ９ Ⅻ ① are letters or numbers.
bool is_letter(uint32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  return in_ranges(unicode::kLetters, c);
}
bool is_number(uint32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  return in_ranges(unicode::kNumbers, c);
}

// Replaces every occurrence of the adjacent pair (a, b), left to right, by a+b.
void merge_pair(std::vector<std::string>& sym, const std::string& a, const std::string& b) {
  std::vector<std::string> merged;
  for (size_t k = 0; k < sym.size(); ++k) {
    if (k + 1 < sym.size() && sym[k] == a && sym[k + 1] == b) {
      merged.push_back(a + b);
      ++k;
    } else {
      merged.push_back(sym[k]);
    }
  }
  sym = std::move(merged);
}

}  // namespace

const std::vector<std::string>& ByteLevelBpe::byte_symbols() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    uint32_t extra = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = utf8(printable ? b : 256 + extra++);
    }
    return t;
  }();
  return table;
}

std::vector<std::string> ByteLevelBpe::pretokenize(const std::string& text) {
  std::vector<std::string_view> views;
  pretokenize(text, views);
  return {views.begin(), views.end()};
}

void ByteLevelBpe::pretokenize(std::string_view text, std::vector<std::string_view>& out) {
  size_t i = 0;
  const size_t n = text.size();
  auto char_at = [&](size_t k) { return next_char(text, k); };
  while (i < n) {
    // 's 't 're 've 'm 'll 'd
    if (text[i] == '\'') {
      bool matched = false;
      for (std::string_view c : {"s", "t", "re", "ve", "m", "ll", "d"}) {
        if (text.substr(i + 1, c.size()) == c) {
          out.push_back(text.substr(i, c.size() + 1));
          i += c.size() + 1;
          matched = true;
          break;
        }
      }
      if (matched) continue;
    }
    const auto [c0, l0] = char_at(i);
    // " ?" followed by a run of one class
    size_t start = i, j = i;
    uint32_t c = c0;
    size_t l = l0;
    if (c0 == ' ' && i + 1 < n) {
      const auto [c1, l1] = char_at(i + 1);
      if (!is_space(c1)) {
        j = i + 1;
        c = c1;
        l = l1;
      }
    }
    if (!is_space(c)) {
      auto cls = [](uint32_t x) { return is_letter(x) ? 0 : is_number(x) ? 1 : 2; };
      const int k = cls(c);
      j += l;
      while (j < n) {
        const auto [cj, lj] = char_at(j);
        if (is_space(cj) || cls(cj) != k) break;
        j += lj;
      }
      out.push_back(text.substr(start, j - start));
      i = j;
      continue;
    }
    // Whitespace: the run, leaving its last character to a following non-space piece.
    j = i;
    size_t last = i;
    while (j < n) {
      const auto [cj, lj] = char_at(j);
      if (!is_space(cj)) break;
      last = j;
      j += lj;
    }
    if (j < n && last > i) j = last;  // \s+(?!\S)
    out.push_back(text.substr(i, j - i));
    i = j;
  }
}

void ByteLevelBpe::index() {
  ids_.clear();
  for (size_t k = 0; k < tokens_.size(); ++k) ids_[tokens_[k]] = static_cast<int64_t>(k);
  rank_.clear();
  for (size_t k = 0; k < merges_.size(); ++k) rank_[merges_[k].first + " " + merges_[k].second] = static_cast<int64_t>(k);
  byte_of_.clear();
  for (int b = 0; b < 256; ++b) byte_of_[byte_symbols()[static_cast<size_t>(b)]] = b;
}

int64_t ByteLevelBpe::id(const std::string& token) const {
  auto it = ids_.find(token);
  return it == ids_.end() ? -1 : it->second;
}

std::vector<std::string> ByteLevelBpe::bpe(const std::string& piece) const {
  std::vector<std::string> sym;
  for (unsigned char b : piece) sym.push_back(byte_symbols()[b]);
  while (sym.size() > 1) {
    int64_t best = -1;
    size_t at = 0;
    for (size_t k = 0; k + 1 < sym.size(); ++k) {
      auto it = rank_.find(sym[k] + " " + sym[k + 1]);
      if (it != rank_.end() && (best < 0 || it->second < best)) {
        best = it->second;
        at = k;
      }
    }
    if (best < 0) break;
    const std::string a = sym[at], b = sym[at + 1];
    merge_pair(sym, a, b);
  }
  return sym;
}

std::vector<int64_t> ByteLevelBpe::encode(const std::string& text) const {
  Cache cache;
  return encode(text, cache);
}

std::vector<int64_t> ByteLevelBpe::encode(const std::string& text, Cache& cache) const {
  std::vector<int64_t> out;
  for (const auto& piece : pretokenize(text)) {
    auto hit = cache.pieces.find(piece);
    if (hit == cache.pieces.end()) {
      if (cache.pieces.size() >= cache.limit) cache.pieces.clear();
      std::vector<int64_t> ids;
      for (const auto& s : bpe(piece)) {
        const int64_t k = id(s);
        if (k >= 0) {
          ids.push_back(k);
        } else {  // a vocabulary without this merge result: its bytes
          for (size_t p = 0; p < s.size();) {
            for (size_t len = 1; len <= 4 && p + len <= s.size(); ++len) {
              const int64_t kb = id(s.substr(p, len));
              if (kb >= 0 && byte_of_.count(s.substr(p, len))) {
                ids.push_back(kb);
                p += len;
                goto next_symbol;
              }
            }
            TORCH_CHECK(false, "tokenizer: the vocabulary has no entry for a byte of '", piece, "'");
          next_symbol:;
          }
        }
      }
      hit = cache.pieces.emplace(piece, std::move(ids)).first;
    }
    out.insert(out.end(), hit->second.begin(), hit->second.end());
  }
  return out;
}

std::string ByteLevelBpe::decode(const std::vector<int64_t>& ids, bool keep_special) const {
  std::string out;
  for (int64_t k : ids) {
    const std::string& t = token(k);
    if (t.size() > 2 && t.front() == '<' && t.back() == '>' && !byte_of_.count(t)) {
      if (keep_special) out += t;
      continue;
    }
    for (size_t p = 0; p < t.size();) {
      const size_t len = next_char(t, p).second;
      auto it = byte_of_.find(t.substr(p, len));
      TORCH_CHECK(it != byte_of_.end(), "tokenizer: token ", k, " is not in the byte alphabet");
      out += static_cast<char>(it->second);
      p += len;
    }
  }
  return out;
}

ByteLevelBpe ByteLevelBpe::load(const std::string& vocab_path, const std::string& merges_path) {
  std::ifstream v(vocab_path);
  TORCH_CHECK_VALUE(v, "tokenizer: cannot read the vocabulary '", vocab_path, "'");
  std::ifstream m(merges_path);
  TORCH_CHECK_VALUE(m, "tokenizer: cannot read the merges '", merges_path, "'");
  return parse(std::string(std::istreambuf_iterator<char>(v), {}), std::string(std::istreambuf_iterator<char>(m), {}),
               vocab_path, merges_path);
}

ByteLevelBpe ByteLevelBpe::parse(const std::string& vocab_json, const std::string& merges_txt,
                                 const std::string& vocab_name, const std::string& merges_name) {
  ByteLevelBpe t;
  const nlohmann::json vocab = parse_json_object(vocab_json, "tokenizer: '" + vocab_name + "'",
                                                 "of token -> id; a vocab.json is one: {\"<s>\": 0, ...}");
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    TORCH_CHECK_VALUE(it.value().is_number_integer() && it.value().get<int64_t>() >= 0, "tokenizer: '", vocab_name,
                      "': the id of ", nlohmann::json(it.key()).dump(), " is ", it.value().dump(),
                      ", not an integer of 0 or more");
    max_id = std::max(max_id, it.value().get<int64_t>());
  }
  t.tokens_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) t.tokens_[static_cast<size_t>(it.value().get<int64_t>())] = it.key();
  std::istringstream m(merges_txt);
  std::string line;
  for (int64_t n = 1; std::getline(m, line); ++n) {
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t sp = line.find(' ');
    TORCH_CHECK_VALUE(sp != std::string::npos, "tokenizer: '", merges_name, "' line ", n,
                      " is not a merge 'a b': ", line);
    t.merges_.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  t.index();
  return t;
}

void ByteLevelBpe::save(const std::string& vocab_path, const std::string& merges_path) const {
  // Written by hand, in id order: nlohmann's ordered_json looks each key up in a list (50k entries: seconds).
  std::ofstream v(vocab_path);
  v << '{';
  bool first = true;
  for (size_t k = 0; k < tokens_.size(); ++k) {
    if (tokens_[k].empty()) continue;  // an id a loaded vocabulary skipped
    v << (first ? "" : ",") << nlohmann::json(tokens_[k]).dump() << ':' << k;
    first = false;
  }
  v << '}';
  v.close();
  TORCH_CHECK(v.good(), "tokenizer: writing '", vocab_path, "' failed");
  std::ofstream m(merges_path);
  m << "#version: 0.2\n";
  for (const auto& [a, b] : merges_) m << a << " " << b << "\n";
  m.close();
  TORCH_CHECK(m.good(), "tokenizer: writing '", merges_path, "' failed");
}

void PieceCounts::add(std::string_view piece, int64_t n) {
  auto it = counts_.find(piece);
  if (it != counts_.end()) {
    it->second += n;
    return;
  }
  if (blocks_.empty() || blocks_.back().capacity() - blocks_.back().size() < piece.size()) {
    blocks_.emplace_back();
    blocks_.back().reserve(std::max<size_t>(size_t{1} << 20, piece.size()));
  }
  auto& block = blocks_.back();
  const size_t at = block.size();
  block.append(piece);  // within the capacity: the block's bytes do not move
  counts_.emplace(std::string_view(block.data() + at, piece.size()), n);
}

void PieceCounts::add(const PieceCounts& other) {
  for (const auto& [piece, n] : other.counts_) add(piece, n);
}

void PieceCounts::add_text(std::string_view text) {
  thread_local std::vector<std::string_view> pieces;
  pieces.clear();
  ByteLevelBpe::pretokenize(text, pieces);
  for (auto p : pieces) add(p);
}

ByteLevelBpe ByteLevelBpe::train(const std::vector<std::string>& texts, int64_t vocab_size) {
  PieceCounts pieces;
  for (const auto& text : texts) pieces.add_text(text);
  return train(pieces, vocab_size);
}

namespace {

// A pair of symbols (token ids) as one key: first << 32 | second.
uint64_t pair_key(int32_t a, int32_t b) { return static_cast<uint64_t>(a) << 32 | static_cast<uint32_t>(b); }
int32_t first_of(uint64_t pair) { return static_cast<int32_t>(pair >> 32); }
int32_t second_of(uint64_t pair) { return static_cast<int32_t>(pair & 0xFFFFFFFFu); }

struct Candidate {
  int64_t count;
  uint64_t pair;
};

// The state of learning merges: every piece as a word of symbols, the pairs'
// counts, which words hold each pair, and a queue of candidate pairs (counts
// updated lazily: a candidate whose count fell is queued again at its count).
class BpeTrainer {
  // A symbol's place in ties: a byte's character's code point; merged symbols after all of them, as learned.
  uint64_t rank(int32_t id) const {
    return id < first_merged_ ? order_[static_cast<size_t>(id - first_byte_)]
                              : uint64_t{0x110000} + static_cast<uint64_t>(id);
  }
  // The queue's top is the most frequent pair, then the one whose symbols rank first.
  auto after() const {
    return [this](const Candidate& x, const Candidate& y) {
      if (x.count != y.count) return x.count < y.count;
      const int32_t xa = first_of(x.pair), ya = first_of(y.pair);
      if (xa != ya) return rank(xa) > rank(ya);
      return rank(second_of(x.pair)) > rank(second_of(y.pair));
    };
  }

 public:
  BpeTrainer(const PieceCounts& pieces, int32_t first_byte, int32_t first_merged, std::vector<uint32_t> order)
      : first_byte_(first_byte), first_merged_(first_merged), order_(std::move(order)) {
    load_words(pieces);
    count_pairs();
  }

  // The most frequent pair (ties: the one whose symbols rank first); none when no pair is left.
  std::optional<uint64_t> pop_best() {
    while (!queue_.empty()) {
      std::pop_heap(queue_.begin(), queue_.end(), after());
      const Candidate top = queue_.back();
      queue_.pop_back();
      const auto it = count_.find(top.pair);
      const int64_t now = it == count_.end() ? 0 : it->second;
      if (now != top.count) {  // the count fell since it was queued: queue it again at its count
        if (now > 0) push(now, top.pair);
        continue;
      }
      if (now < 1) return std::nullopt;
      return top.pair;
    }
    return std::nullopt;
  }

  // Replaces every occurrence of `pair` by the symbol `id`, left to right (as
  // GPT-2 applies a merge), and queues the pairs the new symbol forms.
  void merge(uint64_t pair, int32_t id) {
    const int32_t a = first_of(pair), b = second_of(pair);
    ++step_;
    fresh_.clear();
    const std::vector<uint32_t> holders = std::move(where_[pair]);
    where_.erase(pair);
    count_.erase(pair);
    for (uint32_t w : holders) {
      if (visited_[w] == step_) continue;
      visited_[w] = step_;
      int32_t* s = symbols_.data() + begin_[w];
      const uint32_t len = length_[w];
      bool holds = false;
      for (uint32_t k = 0; k + 1 < len && !holds; ++k) holds = s[k] == a && s[k + 1] == b;
      if (!holds) continue;
      const int64_t f = freq_[w];
      for (uint32_t k = 0; k + 1 < len; ++k) take(pair_key(s[k], s[k + 1]), pair, f);
      uint32_t out = 0;
      for (uint32_t k = 0; k < len; ++k) {
        if (k + 1 < len && s[k] == a && s[k + 1] == b) {
          s[out++] = id;
          ++k;
        } else {
          s[out++] = s[k];
        }
      }
      length_[w] = out;
      for (uint32_t k = 0; k + 1 < out; ++k) {
        const uint64_t p = pair_key(s[k], s[k + 1]);
        count_[p] += f;
        if (s[k] == id || s[k + 1] == id) {
          note(p, w);
          fresh_.push_back(p);
        }
      }
    }
    std::sort(fresh_.begin(), fresh_.end());
    fresh_.erase(std::unique(fresh_.begin(), fresh_.end()), fresh_.end());
    for (uint64_t p : fresh_) push(count_.at(p), p);
  }

 private:
  // Words: every piece's symbols, end to end (a word shrinks in place as it merges).
  void load_words(const PieceCounts& pieces) {
    const size_t words = pieces.size();
    begin_.resize(words + 1);
    length_.resize(words);
    freq_.resize(words);
    visited_.assign(words, 0);
    size_t w = 0;
    for (const auto& [piece, n] : pieces.counts()) {
      begin_[w] = symbols_.size();
      for (unsigned char b : piece) symbols_.push_back(first_byte_ + b);
      length_[w] = static_cast<uint32_t>(piece.size());
      freq_[w] = n;
      ++w;
    }
    begin_[w] = symbols_.size();
  }

  void count_pairs() {
    for (uint32_t w = 0; w < length_.size(); ++w) {
      const int32_t* s = symbols_.data() + begin_[w];
      for (uint32_t k = 0; k + 1 < length_[w]; ++k) {
        const uint64_t p = pair_key(s[k], s[k + 1]);
        count_[p] += freq_[w];
        note(p, w);
      }
    }
    queue_.reserve(count_.size());
    for (const auto& [p, n] : count_) queue_.push_back({n, p});
    std::make_heap(queue_.begin(), queue_.end(), after());
  }

  void push(int64_t n, uint64_t pair) {
    queue_.push_back({n, pair});
    std::push_heap(queue_.begin(), queue_.end(), after());
  }
  void note(uint64_t pair, uint32_t w) {
    auto& ws = where_[pair];
    if (ws.empty() || ws.back() != w) ws.push_back(w);
  }
  // A word of frequency f loses an occurrence of `p` (not the pair being merged, whose count is gone).
  void take(uint64_t p, uint64_t merging, int64_t f) {
    if (p == merging) return;
    auto c = count_.find(p);
    if ((c->second -= f) == 0) count_.erase(c);
  }

  const int32_t first_byte_, first_merged_;
  const std::vector<uint32_t> order_;
  std::vector<int32_t> symbols_;
  std::vector<size_t> begin_;
  std::vector<uint32_t> length_;
  std::vector<int64_t> freq_;
  std::unordered_map<uint64_t, int64_t> count_;                // pair -> occurrences, weighted by the words' counts
  std::unordered_map<uint64_t, std::vector<uint32_t>> where_;  // pair -> words that held it (some may no longer)
  std::vector<Candidate> queue_;
  std::vector<uint32_t> visited_;  // the merge that last visited each word (1-based)
  std::vector<uint64_t> fresh_;    // pairs holding the new symbol
  uint32_t step_ = 0;
};

}  // namespace

ByteLevelBpe ByteLevelBpe::train(const PieceCounts& pieces, int64_t vocab_size) {
  ByteLevelBpe t;
  t.tokens_ = {"<s>", "<pad>", "</s>", "<unk>"};
  const int32_t first_byte = static_cast<int32_t>(t.tokens_.size());
  std::vector<uint32_t> order;
  for (const auto& s : byte_symbols()) {
    t.tokens_.push_back(s);
    order.push_back(next_char(s, 0).first);
  }
  const int32_t first_merged = static_cast<int32_t>(t.tokens_.size());
  const int64_t target = vocab_size - 1;  // <mask> comes last
  TORCH_CHECK_VALUE(vocab_size > static_cast<int64_t>(t.tokens_.size()) + 1, "tokenizer: vocab_size ", vocab_size,
                    " leaves no room for merges (the specials and 256 bytes take ", t.tokens_.size() + 1, ")");
  BpeTrainer trainer(pieces, first_byte, first_merged, std::move(order));
  std::unordered_map<std::string, int32_t> merged_id;
  int64_t entries = static_cast<int64_t>(t.tokens_.size());
  while (entries < target) {
    const auto pair = trainer.pop_best();
    if (!pair) break;
    const std::string& left = t.tokens_[static_cast<size_t>(first_of(*pair))];
    const std::string& right = t.tokens_[static_cast<size_t>(second_of(*pair))];
    t.merges_.emplace_back(left, right);
    const std::string joined = left + right;
    // Two merges can spell the same token ("a bc", "ab c"): it keeps its first id.
    auto [known, fresh] = merged_id.emplace(joined, static_cast<int32_t>(t.tokens_.size()));
    if (fresh) {
      t.tokens_.push_back(joined);
      ++entries;
    }
    trainer.merge(*pair, known->second);
  }
  t.tokens_.push_back("<mask>");
  t.index();
  return t;
}

std::string tokenizer_files_in(const std::string& dir) {
  return (std::filesystem::path(dir) / "vocab.json").string();
}

ByteLevelBpe load_tokenizer(const std::string& dir) {
  const std::filesystem::path d(dir);
  return ByteLevelBpe::load((d / "vocab.json").string(), (d / "merges.txt").string());
}

}  // namespace bart
