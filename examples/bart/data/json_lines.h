// json_lines.h — the text of a JSON lines corpus (`.jsonl`, `.json`,
// `.ndjson`, compressed or not): one JSON object per line, a document each,
// its text the string under one key (Megatron-LM's preprocess_data.py reads
// the same shape). Lines are read by simdjson's On-Demand parser: the whole
// line is checked as UTF-8 and its structure walked, but only the text's value
// is parsed, so what Python's json accepts in other fields (NaN, integers past
// 64 bits, 1e400, lone surrogate escapes) passes, as in Megatron's reader. One
// decoder per thread; a decoder is not thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace bart {

// The bytes past a line's end that the parser may read (simdjson's padding):
// a buffer of JSON lines keeps this much room after its last line.
constexpr size_t kJsonPadding = 64;

// Whether `path` holds JSON lines, by its name (a compression suffix aside).
bool is_json_lines(const std::string& path);

class JsonLineDecoder {
 public:
  explicit JsonLineDecoder(std::string key);
  ~JsonLineDecoder();
  JsonLineDecoder(const JsonLineDecoder&) = delete;
  JsonLineDecoder& operator=(const JsonLineDecoder&) = delete;

  // The text under the key of `line` (one line, its '\n' excluded), valid
  // until the next call; or, when the line is not a JSON object holding a
  // string under the key, "" with `problem` saying what is wrong. A blank line
  // gives "" with no problem. `readable`: the bytes that may be read from
  // line.data() on (the line and what follows it in memory); with
  // kJsonPadding past the line's end the line is parsed where it is, else it
  // is copied first (a long line would cost its size once more).
  std::string_view text(std::string_view line, size_t readable, std::string& problem);
  std::string_view text(std::string_view line, std::string& problem) { return text(line, line.size(), problem); }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bart
