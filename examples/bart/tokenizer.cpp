// tokenizer.cpp — byte-level BPE (see tokenizer.h).
#include "tokenizer.h"
#include "json_error.h"

#include "unicode_classes.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
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
std::pair<uint32_t, size_t> next_char(const std::string& s, size_t i) {
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
  std::vector<std::string> out;
  size_t i = 0;
  const size_t n = text.size();
  auto char_at = [&](size_t k) { return next_char(text, k); };
  while (i < n) {
    // 's 't 're 've 'm 'll 'd
    if (text[i] == '\'') {
      bool matched = false;
      for (const char* c : {"s", "t", "re", "ve", "m", "ll", "d"}) {
        const size_t len = std::char_traits<char>::length(c);
        if (text.compare(i + 1, len, c) == 0) {
          out.push_back(text.substr(i, len + 1));
          i += len + 1;
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
  return out;
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
  nlohmann::ordered_json v;
  for (size_t k = 0; k < tokens_.size(); ++k) v[tokens_[k]] = k;
  std::ofstream(vocab_path) << v.dump();
  std::ofstream m(merges_path);
  m << "#version: 0.2\n";
  for (const auto& [a, b] : merges_) m << a << " " << b << "\n";
}

ByteLevelBpe ByteLevelBpe::train(const std::vector<std::string>& texts, int64_t vocab_size) {
  ByteLevelBpe t;
  t.tokens_ = {"<s>", "<pad>", "</s>", "<unk>"};
  for (const auto& s : byte_symbols()) t.tokens_.push_back(s);
  const int64_t target = vocab_size - 1;  // <mask> comes last
  TORCH_CHECK_VALUE(vocab_size > static_cast<int64_t>(t.tokens_.size()) + 1, "tokenizer: vocab_size ", vocab_size,
                    " leaves no room for merges (the specials and 256 bytes take ", t.tokens_.size() + 1, ")");
  // Words: pieces with their counts, as symbol lists.
  std::map<std::string, int64_t> counts;
  for (const auto& text : texts) {
    for (const auto& piece : pretokenize(text)) ++counts[piece];
  }
  std::vector<std::vector<std::string>> words;
  std::vector<int64_t> freq;
  for (const auto& [piece, c] : counts) {
    std::vector<std::string> sym;
    for (unsigned char b : piece) sym.push_back(byte_symbols()[b]);
    words.push_back(std::move(sym));
    freq.push_back(c);
  }
  std::map<std::pair<std::string, std::string>, int64_t> pairs;  // ordered: ties break the same way every time
  for (size_t w = 0; w < words.size(); ++w) {
    for (size_t k = 0; k + 1 < words[w].size(); ++k) pairs[{words[w][k], words[w][k + 1]}] += freq[w];
  }
  while (static_cast<int64_t>(t.tokens_.size()) < target) {
    auto best = pairs.end();
    for (auto it = pairs.begin(); it != pairs.end(); ++it) {
      if (it->second > 0 && (best == pairs.end() || it->second > best->second)) best = it;
    }
    if (best == pairs.end()) break;  // nothing left to merge
    const auto [a, b] = best->first;
    t.merges_.emplace_back(a, b);
    t.tokens_.push_back(a + b);
    for (size_t w = 0; w < words.size(); ++w) {
      auto& sym = words[w];
      bool has = false;
      for (size_t k = 0; k + 1 < sym.size() && !has; ++k) has = sym[k] == a && sym[k + 1] == b;
      if (!has) continue;
      for (size_t k = 0; k + 1 < sym.size(); ++k) pairs[{sym[k], sym[k + 1]}] -= freq[w];
      merge_pair(sym, a, b);
      for (size_t k = 0; k + 1 < sym.size(); ++k) pairs[{sym[k], sym[k + 1]}] += freq[w];
    }
    pairs.erase({a, b});
  }
  t.tokens_.push_back("<mask>");
  t.index();
  return t;
}

}  // namespace bart
