// corpus.cpp — sentence splitting.
#include "data/corpus.h"

#include <cctype>

namespace bart {

std::vector<std::string> split_sentences(const std::string& text) {
  std::vector<std::string> out;
  each_sentence(text, [&](const std::string& s) { out.push_back(s); });
  return out;
}

void each_sentence(std::string_view text, const std::function<void(const std::string&)>& sentence) {
  std::string cur;
  bool pending_space = false;
  auto flush = [&] {
    if (!cur.empty()) sentence(cur);
    cur.clear();
    pending_space = false;
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool space = c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
    if (space) {
      if (c == '\n') {  // a blank line ends a paragraph
        size_t j = i + 1;
        while (j < text.size() && (text[j] == ' ' || text[j] == '\t' || text[j] == '\r')) ++j;
        if (j < text.size() && text[j] == '\n') {
          flush();
          i = j;
          continue;
        }
      }
      pending_space = !cur.empty();
      continue;
    }
    if (pending_space) cur += ' ';
    pending_space = false;
    cur += c;
    const bool end = c == '.' || c == '!' || c == '?';
    if (end && (i + 1 == text.size() || std::isspace(static_cast<unsigned char>(text[i + 1])))) flush();
  }
  flush();
}

}  // namespace bart
