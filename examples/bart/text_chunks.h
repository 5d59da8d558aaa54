// text_chunks.h — how prepare.cpp and tokenizer_training.cpp read a corpus:
// files streamed in chunks cut where a sentence ends, a chunk's sentences as
// they are encoded, and a pipeline that hands the chunks to worker threads and
// their results back in order. Internal to the two.
#pragma once

#include "corpus.h"
#include "prepare.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace bart {

inline bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

inline bool has_text(std::string_view text) {
  return std::any_of(text.begin(), text.end(), [](char c) { return !is_space(c); });
}

// Text of one file between two sentence breaks.
struct Chunk {
  int64_t index = 0;   // in the order read
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

// Chunks flow from the reader to `workers` threads, each calling
// process(chunk, worker); the results are consumed in chunk order, one at a
// time (by whichever worker finished the next one). `mu_` guards everything below it.
template <class Result>
class Pipeline {
 public:
  using Process = std::function<Result(const Chunk&, int worker)>;
  using Consume = std::function<void(Result&&)>;
  Pipeline(int workers, Process process, Consume consume)
      : process_(std::move(process)), consume_(std::move(consume)), window_(4 * static_cast<int64_t>(workers)) {
    for (int w = 0; w < workers; ++w) threads_.emplace_back([this, w] { work(w); });
  }
  ~Pipeline() {
    try {
      close();
    } catch (...) {  // an error already on its way out
    }
  }

  // Blocks while the workers are `window` chunks behind. False once one failed.
  bool push(Chunk c) {
    std::unique_lock<std::mutex> lock(mu_);
    c.index = pushed_++;
    cv_.wait(lock, [&] { return error_ || c.index - consumed_ < window_; });
    if (error_) return false;
    tasks_.push_back(std::move(c));
    cv_.notify_all();
    return true;
  }

  // Waits for every chunk pushed, joins the workers; rethrows a worker's error.
  void close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void work(int worker) {
    for (;;) {
      Chunk c;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return closed_ || error_ || !tasks_.empty(); });
        if (error_ || tasks_.empty()) return;
        c = std::move(tasks_.front());
        tasks_.pop_front();
      }
      try {
        Result r = process_(c, worker);
        std::unique_lock<std::mutex> lock(mu_);
        done_.emplace(c.index, std::move(r));
        if (consuming_) continue;  // the worker consuming now takes this one in its turn
        consuming_ = true;
        for (auto it = done_.find(consumed_); it != done_.end(); it = done_.find(consumed_)) {
          Result next = std::move(it->second);
          done_.erase(it);
          lock.unlock();
          consume_(std::move(next));
          lock.lock();
          ++consumed_;
          cv_.notify_all();
        }
        consuming_ = false;
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
        consuming_ = false;
        cv_.notify_all();
        return;
      }
    }
  }

  const Process process_;
  const Consume consume_;
  const int64_t window_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk> tasks_;
  std::map<int64_t, Result> done_;
  int64_t pushed_ = 0, consumed_ = 0;
  bool consuming_ = false, closed_ = false;
  std::exception_ptr error_;
};

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

// Streams the text of `range` in chunks of about `bytes`, each ending where a
// sentence breaks. A range that starts inside its file starts after the first
// break from there, one that ends inside it at the last break before its end
// (either at whitespace where no sentence ends in 64 chunks), so it holds
// whole sentences of the file. Returns the bytes read that way.
template <class Result>
TextRange read_chunks(const TextRange& range, int64_t bytes, const std::string& separator, Pipeline<Result>& pipe) {
  std::ifstream in(range.file, std::ios::binary);
  TORCH_CHECK_VALUE(in, "prepare: cannot read '", range.file, "'");
  std::error_code ec;
  const auto size = static_cast<int64_t>(std::filesystem::file_size(range.file, ec));
  TORCH_CHECK_VALUE(!ec, "prepare: cannot read '", range.file, "': ", ec.message());
  const bool to_file_end = range.end >= size;
  in.seekg(range.begin);
  TextRange used{range.file, range.begin, range.begin};
  int64_t left = range.end - range.begin;
  std::string buffer;
  bool seen_text = range.begin > 0, eof = false, line_start = true, head = range.begin > 0;
  std::vector<char> block(static_cast<size_t>(bytes));
  const size_t stuck = 64 * block.size();  // no sentence ends in this much text
  auto last_space = [&] {
    const size_t k = buffer.find_last_of(" \t\n\r\f\v");
    return k == std::string::npos ? size_t{0} : k;
  };
  while (!eof) {
    const size_t want = to_file_end ? block.size() : static_cast<size_t>(std::min<int64_t>(left, bytes));
    in.read(block.data(), static_cast<std::streamsize>(want));
    const auto got = static_cast<size_t>(in.gcount());
    TORCH_CHECK(!in.bad(), "prepare: reading '", range.file, "' failed");
    left -= static_cast<int64_t>(got);
    eof = got < want || (!to_file_end && left <= 0);
    buffer.append(block.data(), got);
    if (head) {  // a sentence begins at the first break
      size_t start = next_sentence_break(buffer, 0);
      if (start == kNoBreak && !eof && buffer.size() < stuck) continue;
      if (start == kNoBreak) start = std::min(buffer.find_first_of(" \t\n\r\f\v"), buffer.size());
      line_start = start > 0 && buffer[start - 1] == '\n';
      buffer.erase(0, start);
      used.begin = used.end = used.begin + static_cast<int64_t>(start);
      head = false;
    }
    const bool file_end = eof && to_file_end;
    size_t cut = file_end ? buffer.size() : last_sentence_break(buffer, buffer.size());
    if (cut == 0 && !file_end && (eof || buffer.size() >= stuck)) {
      cut = last_space();
      if (cut == 0 && !eof) cut = buffer.size();  // one word of 64 chunks: cut anywhere
    }
    if (cut == 0 && !file_end) {
      if (eof) break;  // the range ends with no whole sentence left
      continue;
    }
    Chunk c;
    c.text = buffer.substr(0, cut);
    c.first = !seen_text;
    c.last = file_end;
    c.line_start = line_start;
    const auto parts = split_documents(c.text, separator, line_start);
    seen_text = (parts.size() == 1 && seen_text) || has_text(parts.back());  // of the document open at its end
    line_start = c.text.empty() ? line_start : c.text.back() == '\n';
    used.end += static_cast<int64_t>(cut);
    buffer.erase(0, cut);
    if (!pipe.push(std::move(c))) break;
  }
  return used;
}

}  // namespace bart
