// text_chunks.h — how prepare.cpp and tokenizer_training.cpp read a corpus:
// files streamed in chunks cut where a sentence ends, a chunk's sentences as
// they are encoded, and the chunks through worker threads, their results back
// in order. Internal to the two.
#pragma once

#include "data/corpus.h"
#include "data/json_lines.h"
#include "data/prepare.h"
#include "io/byte_stream.h"
#include "io/work_progress.h"

#include <zeroshard/prefetcher.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
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

// How a corpus's files are read (prepare.h's options, for both commands).
struct ReadRules {
  std::string who;                 // starts errors: "prepare", "train-tokenizer"
  int64_t chunk_bytes = int64_t{1} << 20;
  std::string separator;           // text files: a line that ends a document ("": documents are files)
  std::string json_key = "text";   // JSON lines: the field that holds a document's text
  bool skip_bad_lines = false;     // JSON lines: a malformed line skipped and counted, instead of fatal
};

// The rules for reading `files`, checked: a separator line is for text files
// (a JSON line is a document already), and JSON lines need a key.
inline ReadRules read_rules(std::string who, const std::vector<std::string>& files, int64_t chunk_bytes,
                            std::string separator, std::string json_key, bool skip_bad_lines) {
  const auto json = std::find_if(files.begin(), files.end(), [](const auto& f) { return is_json_lines(f); });
  TORCH_CHECK_VALUE(separator.empty() || json == files.end(), who, ": --document-separator '", separator,
                    "' is for text files, and '", json == files.end() ? "" : *json, "' is JSON lines (a document "
                    "per line already); leave the option out, or prepare the text files apart and merge");
  TORCH_CHECK_VALUE(!json_key.empty(), who, ": --json-key is empty; give the field that holds each line's text");
  ReadRules r;
  r.who = std::move(who);
  r.chunk_bytes = chunk_bytes;
  r.separator = std::move(separator);
  r.json_key = std::move(json_key);
  r.skip_bad_lines = skip_bad_lines;
  return r;
}

// Text of one file between two sentence breaks; of a JSON lines file, whole lines.
struct Chunk {
  std::string text;
  bool first = false;  // no text of its document before it: its first sentence has no leading space
  bool last = false;   // its file ends here: the document ends after it
  bool line_start = true;  // it begins a line (a separator line can only start there or after a '\n')
  bool json = false;       // JSON lines, a document each
  std::string file;
  int64_t first_line = 0;  // JSON lines: the number of its first line (from 1); 0 when not known
  int64_t first_byte = 0;  // where text[0] is in the file's content
  int64_t done_bytes = 0;  // of all the ranges' bytes on disk, read once this chunk was (progress)
};

// JSON lines that were skipped (ReadRules::skip_bad_lines).
struct BadLines {
  int64_t count = 0;
  std::string first;  // where the first was, and what was wrong with it
  void add(const BadLines& b) {
    if (count == 0) first = b.first;
    count += b.count;
  }
};

// What a worker thread keeps between chunks.
struct ChunkWorker {
  ChunkWorker(int index, const ReadRules& rules) : index(index), rules(rules), json(rules.json_key) {}
  const int index;  // 0 .. workers - 1
  const ReadRules& rules;
  JsonLineDecoder json;
  BadLines bad;  // of the chunk it is on
};

// "FILE:LINE", or where the line starts when its number is not known.
inline std::string line_name(const Chunk& c, size_t offset, int64_t line) {
  if (c.first_line > 0) return c.file + ":" + std::to_string(c.first_line + line);
  return c.file + " (the line at byte " + std::to_string(c.first_byte + static_cast<int64_t>(offset)) + ")";
}

// Calls sentence(text) for each of the chunk's sentences as it is encoded (a
// space before all but a document's first), and document_end() where one of
// its documents ends. A JSON line that is not an object with a string under
// the key throws naming its file and line, or is skipped and counted in
// w.bad (rules.skip_bad_lines).
template <class Sentence, class DocumentEnd>
void for_each_sentence(const Chunk& c, ChunkWorker& w, Sentence&& sentence, DocumentEnd&& document_end) {
  std::string spaced;  // " " + a sentence
  auto sentences_of = [&](std::string_view text, bool first) {
    each_sentence(text, [&](const std::string& s) {
      if (first) {
        sentence(s);
      } else {
        spaced.assign(1, ' ').append(s);
        sentence(spaced);
      }
      first = false;
    });
  };
  if (c.json) {
    std::string problem;
    int64_t line = 0;
    for (size_t at = 0; at < c.text.size(); ++line) {
      size_t end = c.text.find('\n', at);
      end = end == std::string::npos ? c.text.size() : end;
      // Parsed in place: the chunk keeps kJsonPadding bytes of room after its last line (take()).
      const auto text = w.json.text(std::string_view(c.text).substr(at, end - at), c.text.capacity() - at, problem);
      if (!problem.empty()) {
        TORCH_CHECK_VALUE(w.rules.skip_bad_lines, w.rules.who, ": ", line_name(c, at, line), " ", problem,
                          "; fix the line, or give --skip-bad-lines to skip such lines (they are counted)");
        if (w.bad.count++ == 0) w.bad.first = line_name(c, at, line) + " " + problem;
      } else if (!text.empty()) {
        sentences_of(text, true);
        document_end();
      }
      at = end + 1;
    }
    return;
  }
  bool first = c.first;
  const auto parts = split_documents(c.text, w.rules.separator, c.line_start);
  for (size_t k = 0; k < parts.size(); ++k) {
    if (k > 0) {
      document_end();
      first = true;
    }
    sentences_of(parts[k], first);
    first = false;
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

// Whether a range runs to its file's end: one of a plain file whose end is at
// or past the file's size; of a compressed one, whose end is the largest
// position (its length counts content, whose size is not known).
inline bool reaches_file_end(const TextRange& r, int64_t size_on_disk) {
  return compression_of(r.file) == Compression::kNone ? r.end >= size_on_disk
                                                      : r.end == std::numeric_limits<int64_t>::max();
}

// A range's bytes, as its progress counts them: on disk for one to its file's
// end, else its length (content).
inline int64_t range_bytes(const TextRange& r, int64_t size_on_disk) {
  return std::max<int64_t>(0, (reaches_file_end(r, size_on_disk) ? size_on_disk : r.end) - r.begin);
}

// The text of `range` in chunks of about `rules.chunk_bytes`, one per next().
// A range starts at a position in the file on disk (range.begin) and spans
// range.end - range.begin bytes of content from there (decompressed, for a
// compressed file; the same bytes, for a plain one); one whose end is at or
// past the file's size on disk runs to the file's end. Text ends each chunk
// where a sentence breaks: a range that starts inside its file starts after
// the first break from there, one that ends inside it at the last break before
// its end (either at whitespace where no sentence ends in 64 chunks), so it
// holds whole sentences of the file. JSON lines end each chunk at a line's end
// (a chunk holds a line however long it is), and a range holds the whole
// lines that start in it, the last one read past the range's end.
//
// The reader reads `in`, the file's stream, from where it stands: a file's
// ranges, in order, share one stream that only moves forward (a compressed
// file is decompressed once however many ranges sample it). A range that
// starts before where the stream stands starts there.
class ChunkReader {
 public:
  ChunkReader(TextRange range, const ReadRules& rules, ByteStream& in)
      : range_(std::move(range)), rules_(rules), in_(in), block_(static_cast<size_t>(rules.chunk_bytes)),
        json_(is_json_lines(range_.file)) {
    std::error_code ec;
    const auto size = static_cast<int64_t>(std::filesystem::file_size(range_.file, ec));
    TORCH_CHECK_VALUE(!ec, rules.who, ": cannot read '", range_.file, "': ", ec.message());
    const bool to_file_end = reaches_file_end(range_, size);
    // JSON lines: whether a line starts at the range's first byte is told by the byte before it,
    // read and dropped with the line it ends.
    const bool look_behind = json_ && range_.begin > 0;
    in_.skip_to(range_.begin - (look_behind ? 1 : 0));
    const int64_t start = in_.content_position() + (look_behind ? 1 : 0);
    content_end_ = to_file_end ? kToFileEnd : start + std::max<int64_t>(0, range_.end - range_.begin);
    bytes_ = range_bytes(range_, size);
    first_content_ = start;
    first_file_ = in_.file_position();
    used_ = TextRange{range_.file, in_.content_position(), in_.content_position()};
    seen_text_ = head_ = look_behind || in_.content_position() > 0;
    line_ = head_ ? 0 : 1;
  }

  // The next chunk; nullopt once the range is read.
  std::optional<Chunk> next() {
    const size_t stuck = 64 * block_.size();  // no sentence ends in this much text
    while (!done_) {
      // Past the range's end only JSON lines read on, to the end of the line that straddles it.
      if (!file_end_ && (!window_end_ || (json_ && !head_ && tail_cut() == 0))) read_block();
      if (!bom_checked_) {  // a UTF-8 byte order mark opening the file is not text (nor JSON)
        bom_checked_ = true;
        if (used_.begin == 0 && buffer_.compare(0, 3, "\xEF\xBB\xBF") == 0) {
          buffer_.erase(0, 3);
          used_.begin = used_.end = used_.begin + 3;
        }
      }
      const bool no_more = file_end_ || window_end_;
      if (head_ && !skip_head(stuck, no_more)) continue;
      if (done_) break;
      if (json_ && window_end_) {
        const size_t tail = tail_cut();
        if (tail == kNoBreak) break;  // the last line that starts in the range was taken
        if (tail == 0 && !file_end_) continue;
        done_ = true;
        return take(tail == 0 ? buffer_.size() : tail, tail == 0);  // 0: the file ends inside that line
      }
      if (file_end_) {  // the file's end: its last text, whole
        done_ = true;
        return take(buffer_.size(), true);
      }
      size_t cut = json_ ? last_line_end() : last_sentence_break(buffer_, buffer_.size());
      if (!json_ && cut == 0 && (no_more || buffer_.size() >= stuck)) {
        const size_t space = buffer_.find_last_of(" \t\n\r\f\v");
        cut = space == std::string::npos ? 0 : space;
        if (cut == 0 && !no_more) cut = buffer_.size();  // one word of 64 chunks: cut anywhere
      }
      if (no_more) done_ = true;  // at the range's end: what is left is no whole sentence
      if (cut == 0) continue;
      return take(cut, false);
    }
    return std::nullopt;
  }

  // The part of the range the chunks so far hold, in content bytes (of a
  // compressed file: decompressed).
  const TextRange& used() const { return used_; }
  // The range's bytes (on disk for one to its file's end, else of content),
  // and how many of them are read: the progress.
  int64_t bytes() const { return bytes_; }
  int64_t bytes_read() const {
    const int64_t read = content_end_ == kToFileEnd ? in_.file_position() - first_file_
                                                    : in_.content_position() - first_content_;
    return std::clamp<int64_t>(read, 0, bytes_);
  }

 private:
  static constexpr int64_t kToFileEnd = std::numeric_limits<int64_t>::max();

  // A block of the file into the buffer: up to the range's end while inside
  // it (a JSON line straddling that end is read on to its end).
  void read_block() {
    const int64_t pos = in_.content_position();
    const size_t want = window_end_ || content_end_ == kToFileEnd
                            ? block_.size()
                            : static_cast<size_t>(std::min<int64_t>(content_end_ - pos, block_.size()));
    const size_t got = want == 0 ? 0 : in_.read(block_.data(), want);
    buffer_.append(block_.data(), got);
    file_end_ = got < want;
    window_end_ = window_end_ || in_.content_position() >= content_end_;
  }

  // Past the range's end (JSON lines): where the last line that starts in the
  // range ends in the buffer (past its '\n'); 0 while that is not read yet;
  // kNoBreak when that line was taken already.
  size_t tail_cut() const {
    const int64_t last = content_end_ - 1 - used_.end;  // the range's last byte, in the buffer
    if (last < 0) return kNoBreak;
    const size_t at = buffer_.find('\n', static_cast<size_t>(last));
    return at == std::string::npos ? 0 : at + 1;
  }

  // Drops the text before the first break (a range that starts inside its
  // file; JSON lines: through the '\n' that ends the line before the range's
  // first whole line); false while more must be read to find it.
  bool skip_head(size_t stuck, bool no_more) {
    size_t start = json_ ? buffer_.find('\n') : next_sentence_break(buffer_, 0);
    if (start == kNoBreak && !no_more && (json_ || buffer_.size() < stuck)) return false;
    if (json_) {
      start = start == kNoBreak ? buffer_.size() : start + 1;
      // The first line that starts in the range starts at or past its end: the range holds none.
      if (content_end_ != kToFileEnd && used_.begin + static_cast<int64_t>(start) >= content_end_) done_ = true;
    } else if (start == kNoBreak) {
      start = std::min(buffer_.find_first_of(" \t\n\r\f\v"), buffer_.size());
    }
    line_start_ = start > 0 && buffer_[start - 1] == '\n';
    buffer_.erase(0, start);
    used_.begin = used_.end = used_.begin + static_cast<int64_t>(start);
    head_ = false;
    return true;
  }

  size_t last_line_end() const {
    const size_t at = buffer_.rfind('\n');
    return at == std::string::npos ? 0 : at + 1;
  }

  Chunk take(size_t cut, bool file_end) {
    Chunk c;
    const size_t room = json_ ? kJsonPadding : 0;  // JSON lines are parsed in place
    if (cut >= buffer_.size() / 2) {
      // Most of the buffer (a long JSON line, the file's end): it becomes the chunk, uncopied, and
      // what follows the cut starts a buffer of its own.
      std::string rest = buffer_.substr(cut);
      c.text = std::move(buffer_);
      c.text.resize(cut);
      buffer_ = std::move(rest);
      if (c.text.capacity() < cut + room) c.text.reserve(cut + room);
    } else {
      c.text.reserve(cut + room);
      c.text.assign(buffer_, 0, cut);
      buffer_.erase(0, cut);
    }
    c.first = !seen_text_;
    c.last = file_end;
    c.line_start = line_start_;
    c.json = json_;
    c.file = range_.file;
    c.first_byte = used_.end;
    c.first_line = line_;
    if (json_) {
      if (line_ > 0) line_ += std::count(c.text.begin(), c.text.end(), '\n');
    } else {
      const auto parts = split_documents(c.text, rules_.separator, line_start_);
      seen_text_ = (parts.size() == 1 && seen_text_) || has_text(parts.back());  // of the document open at its end
    }
    line_start_ = c.text.empty() ? line_start_ : c.text.back() == '\n';
    used_.end += static_cast<int64_t>(cut);
    return c;
  }

  const TextRange range_;
  const ReadRules& rules_;
  ByteStream& in_;
  std::vector<char> block_;
  const bool json_;
  int64_t content_end_ = 0;  // where the range ends in the content (kToFileEnd: at the file's end)
  int64_t bytes_ = 0, first_content_ = 0, first_file_ = 0;
  TextRange used_;
  std::string buffer_;  // content from used_.end on
  int64_t line_ = 1;    // JSON lines: the number of the buffer's first line; 0 when not known
  bool seen_text_ = false, line_start_ = true, head_ = false, bom_checked_ = false;
  bool file_end_ = false, window_end_ = false, done_ = false;
};

// The chunks of `ranges`, read in order (a ChunkReader each; a file's
// consecutive ranges share its stream, which moves forward only), through
// `workers` threads: the library's ordered, bounded worker pipeline
// (zeroshard::Prefetcher, at most 4 × workers chunks ahead).
// - process(chunk, worker) runs on the workers (`worker`: a ChunkWorker each,
//   for per-worker state; for_each_sentence takes it);
// - consume(result) runs on this thread, in chunk order;
// - range_read(k, used) runs once range k is read, in order, on a worker while
//   it reads (what it touches: only that and this thread after the return).
// The first error (reading, processing or consuming) ends it and is thrown
// here. Returns the JSON lines skipped (rules.skip_bad_lines), the first
// in chunk order named. Shows its progress (io/work_progress.h) as
// rules.who, in the ranges' bytes (range_bytes). `decompressed`, if given:
// the content the streams of compressed files went through, read or skipped
// (what their ranges cost to decompress).
template <class Result, class Process, class Consume, class RangeRead>
BadLines process_chunks(const std::vector<TextRange>& ranges, const ReadRules& rules, int workers, Process process,
                        Consume consume, RangeRead range_read, int64_t* decompressed = nullptr) {
  struct Done {
    Result result;
    BadLines bad;
    int64_t done_bytes;
  };
  using Loader = zeroshard::Prefetcher<std::optional<Chunk>, std::optional<Done>>;
  std::vector<std::unique_ptr<ChunkWorker>> state;
  for (int w = 0; w < workers; ++w) state.push_back(std::make_unique<ChunkWorker>(w, rules));
  int64_t total = 0;
  for (const auto& r : ranges) {
    std::error_code ec;
    const auto size = static_cast<int64_t>(std::filesystem::file_size(r.file, ec));
    total += ec ? 0 : range_bytes(r, size);
  }
  size_t k = 0;
  int64_t before = 0;        // the bytes of the ranges read whole
  int64_t streamed = 0;      // content of the compressed files' streams closed
  std::unique_ptr<ByteStream> stream;
  std::optional<ChunkReader> reader;
  auto close_stream = [&] {
    if (stream && compression_of(stream->path()) != Compression::kNone) streamed += stream->content_position();
    stream.reset();
  };
  auto draw = [&]() -> std::optional<Chunk> {
    for (; k < ranges.size(); ++k) {
      if (!reader) {
        if (stream && stream->path() != ranges[k].file) close_stream();
        if (!stream) stream = std::make_unique<ByteStream>(ranges[k].file, rules.who);
        reader.emplace(ranges[k], rules, *stream);
      }
      if (auto c = reader->next()) {
        c->done_bytes = before + reader->bytes_read();
        return c;
      }
      range_read(k, reader->used());
      before += reader->bytes();
      reader.reset();
    }
    close_stream();
    return std::nullopt;  // then again, for every draw the workers run ahead
  };
  auto build = [&](const std::optional<Chunk>& c) -> std::optional<Done> {
    if (!c) return std::nullopt;
    auto& w = *state[static_cast<size_t>(Loader::worker())];
    w.bad = BadLines();
    Result r = process(*c, w);
    return Done{std::move(r), std::move(w.bad), c->done_bytes};
  };
  zeroshard::PrefetchOptions options;
  options.threads = workers;
  options.ahead = 4 * workers;
  Loader loader(draw, build, options);
  WorkProgress progress(rules.who, total);
  BadLines bad;
  while (auto r = loader.next()) {
    bad.add(r->bad);
    consume(std::move(r->result));
    progress.update(r->done_bytes);
  }
  if (decompressed != nullptr) *decompressed = streamed;
  return bad;
}

}  // namespace bart
