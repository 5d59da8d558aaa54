// text_chunks.h — how prepare.cpp and tokenizer_training.cpp read a corpus:
// files streamed in chunks cut where a sentence ends, a chunk's sentences as
// they are encoded, and the chunks through worker threads, their results back
// in order. Internal to the two.
#pragma once

#include "data/corpus.h"
#include "data/prepare.h"

#include <zeroshard/prefetcher.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace bart {

inline bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

inline bool has_text(std::string_view text) {
  return std::any_of(text.begin(), text.end(), [](char c) { return !is_space(c); });
}

// Text of one file between two sentence breaks.
struct Chunk {
  std::string text;
  bool first = false;  // no text of its document before it: its first sentence has no leading space
  bool last = false;   // its file ends here: the document ends after it
  bool line_start = true;  // it begins a line (a separator line can only start there or after a '\n')
};

// Calls sentence(text) for each of the chunk's sentences as it is encoded (a
// space before all but a document's first), and document_end() where one of
// its documents ends.
template <class Sentence, class DocumentEnd>
void for_each_sentence(const Chunk& c, const std::string& separator, Sentence&& sentence, DocumentEnd&& document_end) {
  bool first = c.first;
  const auto parts = split_documents(c.text, separator, c.line_start);
  for (size_t k = 0; k < parts.size(); ++k) {
    if (k > 0) {
      document_end();
      first = true;
    }
    for (const auto& s : split_sentences(std::string(parts[k]))) {
      sentence(first ? s : " " + s);
      first = false;
    }
  }
  if (c.last) document_end();
}

constexpr size_t kNoBreak = std::string::npos;

// Where a cut at text[j] would fall if a sentence breaks there (j itself, or
// past a blank line), or 0.
inline size_t break_at(const std::string& text, size_t j) {
  const char c = text[j];
  if (!is_space(c)) return 0;
  const char before = text[j - 1];
  if (before == '.' || before == '!' || before == '?') return j;
  if (c == '\n') {  // a blank line: '\n', spaces, tabs or returns, '\n'
    size_t k = j;
    while (k-- > 0 && (text[k] == ' ' || text[k] == '\t' || text[k] == '\r')) {
    }
    if (k < j && text[k] == '\n') return j + 1;
  }
  return 0;
}

// The first cut where a sentence breaks after `pos`, or kNoBreak.
inline size_t next_sentence_break(const std::string& text, size_t pos) {
  for (size_t j = std::max<size_t>(pos, 1); j < text.size(); ++j) {
    if (const size_t cut = break_at(text, j)) return cut;
  }
  return kNoBreak;
}

// The text of `range` in chunks of about `bytes`, each ending where a
// sentence breaks, one per next(). A range that starts inside its file starts
// after the first break from there, one that ends inside it at the last break
// before its end (either at whitespace where no sentence ends in 64 chunks),
// so it holds whole sentences of the file.
class ChunkReader {
 public:
  ChunkReader(TextRange range, int64_t bytes, std::string separator)
      : range_(std::move(range)), separator_(std::move(separator)), in_(range_.file, std::ios::binary),
        block_(static_cast<size_t>(bytes)) {
    TORCH_CHECK_VALUE(in_, "prepare: cannot read '", range_.file, "'");
    std::error_code ec;
    const auto size = static_cast<int64_t>(std::filesystem::file_size(range_.file, ec));
    TORCH_CHECK_VALUE(!ec, "prepare: cannot read '", range_.file, "': ", ec.message());
    to_file_end_ = range_.end >= size;
    in_.seekg(range_.begin);
    used_ = TextRange{range_.file, range_.begin, range_.begin};
    left_ = range_.end - range_.begin;
    seen_text_ = head_ = range_.begin > 0;
  }

  // The next chunk; nullopt once the range is read.
  std::optional<Chunk> next() {
    const size_t stuck = 64 * block_.size();  // no sentence ends in this much text
    while (!eof_) {
      const size_t want = to_file_end_ ? block_.size() : static_cast<size_t>(std::min<int64_t>(left_, block_.size()));
      in_.read(block_.data(), static_cast<std::streamsize>(want));
      const auto got = static_cast<size_t>(in_.gcount());
      TORCH_CHECK(!in_.bad(), "prepare: reading '", range_.file, "' failed");
      left_ -= static_cast<int64_t>(got);
      eof_ = got < want || (!to_file_end_ && left_ <= 0);
      buffer_.append(block_.data(), got);
      if (head_) {  // a sentence begins at the first break
        size_t start = next_sentence_break(buffer_, 0);
        if (start == kNoBreak && !eof_ && buffer_.size() < stuck) continue;
        if (start == kNoBreak) start = std::min(buffer_.find_first_of(" \t\n\r\f\v"), buffer_.size());
        line_start_ = start > 0 && buffer_[start - 1] == '\n';
        buffer_.erase(0, start);
        used_.begin = used_.end = used_.begin + static_cast<int64_t>(start);
        head_ = false;
      }
      const bool file_end = eof_ && to_file_end_;
      size_t cut = file_end ? buffer_.size() : last_sentence_break(buffer_, buffer_.size());
      if (cut == 0 && !file_end && (eof_ || buffer_.size() >= stuck)) {
        const size_t space = buffer_.find_last_of(" \t\n\r\f\v");
        cut = space == std::string::npos ? 0 : space;
        if (cut == 0 && !eof_) cut = buffer_.size();  // one word of 64 chunks: cut anywhere
      }
      if (cut == 0 && !file_end) continue;  // at the range's end: no whole sentence left
      Chunk c;
      c.text = buffer_.substr(0, cut);
      c.first = !seen_text_;
      c.last = file_end;
      c.line_start = line_start_;
      const auto parts = split_documents(c.text, separator_, line_start_);
      seen_text_ = (parts.size() == 1 && seen_text_) || has_text(parts.back());  // of the document open at its end
      line_start_ = c.text.empty() ? line_start_ : c.text.back() == '\n';
      used_.end += static_cast<int64_t>(cut);
      buffer_.erase(0, cut);
      return c;
    }
    return std::nullopt;
  }

  // The part of the range the chunks so far hold.
  const TextRange& used() const { return used_; }

 private:
  const TextRange range_;
  const std::string separator_;
  std::ifstream in_;
  std::vector<char> block_;
  bool to_file_end_ = false;
  TextRange used_;
  int64_t left_ = 0;
  std::string buffer_;
  bool seen_text_ = false, eof_ = false, line_start_ = true, head_ = false;
};

// The chunks of `ranges`, read in order (a ChunkReader each), through
// `workers` threads: the library's ordered, bounded worker pipeline
// (zeroshard::Prefetcher, at most 4 × workers chunks ahead).
// - process(chunk, worker) runs on the workers (`worker`: 0 .. workers - 1, for per-worker state);
// - consume(result) runs on this thread, in chunk order;
// - range_read(k, used) runs once range k is read, in order, on a worker while
//   it reads (what it touches: only that and this thread after the return).
// The first error (reading, processing or consuming) ends it and is thrown here.
template <class Result, class Process, class Consume, class RangeRead>
void process_chunks(const std::vector<TextRange>& ranges, int64_t bytes, const std::string& separator, int workers,
                    Process process, Consume consume, RangeRead range_read) {
  using Loader = zeroshard::Prefetcher<std::optional<Chunk>, std::optional<Result>>;
  size_t k = 0;
  std::optional<ChunkReader> reader;
  auto draw = [&]() -> std::optional<Chunk> {
    for (; k < ranges.size(); ++k) {
      if (!reader) reader.emplace(ranges[k], bytes, separator);
      if (auto c = reader->next()) return c;
      range_read(k, reader->used());
      reader.reset();
    }
    return std::nullopt;  // then again, for every draw the workers run ahead
  };
  auto build = [&](const std::optional<Chunk>& c) -> std::optional<Result> {
    if (!c) return std::nullopt;
    return process(*c, Loader::worker());
  };
  zeroshard::PrefetchOptions options;
  options.threads = workers;
  options.ahead = 4 * workers;
  Loader loader(draw, build, options);
  while (auto r = loader.next()) consume(std::move(*r));
}

}  // namespace bart
