// corpus.cpp — reading and sentence splitting.
#include "corpus.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace bart {

std::vector<std::string> read_texts(const std::string& dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec)) files.push_back(it->path());
  }
  TORCH_CHECK_VALUE(!ec || !files.empty(), "corpus: cannot read '", dir, "': ", ec.message(), "; pass a directory of text with --data");
  std::sort(files.begin(), files.end());
  std::set<fs::path> seen;
  std::vector<std::string> texts;
  for (const auto& f : files) {
    const auto real = fs::canonical(f, ec);
    if (ec || !seen.insert(real).second) continue;  // a link to a file already read
    std::ifstream in(f, std::ios::binary);
    std::ostringstream os;
    os << in.rdbuf();
    // Binary files (a NUL byte: fortune's .dat indexes, images) are not text.
    if (in && !os.str().empty() && os.str().find('\0') == std::string::npos) texts.push_back(os.str());
  }
  TORCH_CHECK_VALUE(!texts.empty(), "corpus: '", dir, "' holds no readable text file; pass a directory of text with --data");
  return texts;
}

std::vector<std::string> split_sentences(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  bool pending_space = false;
  auto flush = [&] {
    if (!cur.empty()) out.push_back(cur);
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
  return out;
}

}  // namespace bart
