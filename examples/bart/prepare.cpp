// prepare.cpp — a corpus into a token store: read (this thread), split and
// tokenize (workers), write in order (whichever worker finishes the next chunk).
#include "prepare.h"

#include "corpus.h"
#include "run.h"

#include <zeroshard/log.h>
#include <zeroshard/token_store.h>

#include <c10/util/Exception.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <string_view>
#include <thread>
#include <tuple>

namespace bart {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

std::string hex(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof(s), "%016llx", static_cast<unsigned long long>(v));
  return s;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

bool is_binary(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  char head[8000];
  in.read(head, sizeof(head));
  return std::find(head, head + in.gcount(), '\0') != head + in.gcount();
}

std::string read_file(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  TORCH_CHECK_VALUE(in, "prepare: cannot read '", file.string(), "'");
  return {std::istreambuf_iterator<char>(in), {}};
}

bool has_text(std::string_view text) {
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

struct Tokenized {
  std::vector<int64_t> tokens;
  std::vector<int64_t> lengths;  // per sentence
  std::vector<size_t> ends;      // a document ends after this many of the sentences
};

Tokenized tokenize(const Chunk& c, const std::string& separator, const ByteLevelBpe& tokenizer,
                   ByteLevelBpe::Cache& cache) {
  Tokenized out;
  for_each_sentence(
      c, separator,
      [&](const std::string& s) {
        const auto ids = tokenizer.encode(s, cache);
        out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
        out.lengths.push_back(static_cast<int64_t>(ids.size()));
      },
      [&] { out.ends.push_back(out.lengths.size()); });
  return out;
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

// Writes tokenized chunks, in order, into the store. A document with no
// sentence (a file of whitespace, two separators in a row) is not recorded.
class StoreWriting {
 public:
  explicit StoreWriting(zeroshard::TokenStoreWriter& writer) : writer_(writer) {}
  void operator()(Tokenized&& t) {
    const int64_t* p = t.tokens.data();
    size_t next_end = 0;
    for (size_t k = 0; k <= t.lengths.size(); ++k) {
      for (; next_end < t.ends.size() && t.ends[next_end] == k; ++next_end) {
        if (open_ > 0) writer_.end_document();
        open_ = 0;
      }
      if (k == t.lengths.size()) break;
      writer_.add(p, t.lengths[k]);
      p += t.lengths[k];
      ++open_;
    }
  }

 private:
  zeroshard::TokenStoreWriter& writer_;
  int64_t open_ = 0;  // sentences of the document being written
};

constexpr size_t kNoBreak = std::string::npos;

// Where a cut at text[j] would fall if a sentence breaks there (j itself, or
// past a blank line), or 0.
size_t break_at(const std::string& text, size_t j) {
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
size_t next_sentence_break(const std::string& text, size_t pos) {
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
  const auto size = static_cast<int64_t>(fs::file_size(range.file, ec));
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

// The ranges of the corpus a tokenizer trains on: every file whole when they
// hold `sample_bytes` or less; else windows of `window` bytes spread evenly
// over the files end to end (overlapping ones joined), about `sample_bytes`
// in all.
std::vector<TextRange> sample_ranges(const std::vector<std::string>& files, int64_t sample_bytes, int64_t window) {
  std::vector<int64_t> sizes, starts;  // starts: of each file, end to end
  int64_t total = 0;
  for (const auto& f : files) {
    sizes.push_back(static_cast<int64_t>(fs::file_size(f)));
    starts.push_back(total);
    total += sizes.back();
  }
  std::vector<TextRange> out;
  if (total <= sample_bytes) {
    for (size_t i = 0; i < files.size(); ++i) out.push_back({files[i], 0, sizes[i]});
    return out;
  }
  const int64_t windows = std::max<int64_t>(1, (sample_bytes + window - 1) / window);
  for (int64_t k = 0; k < windows; ++k) {
    const auto at = static_cast<int64_t>(static_cast<__int128>(k) * total / windows);
    const size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), at) - starts.begin() - 1);
    const int64_t begin = at - starts[i], end = std::min(begin + window, sizes[i]);
    if (!out.empty() && out.back().file == files[i] && begin <= out.back().end) {
      out.back().end = std::max(out.back().end, end);
    } else {
      out.push_back({files[i], begin, end});
    }
  }
  return out;
}

// The tokenizer's files and the manifest (with the store's sizes and checksums)
// into `partial`, then `partial` renamed to `out`: the dataset appears whole, or not at all.
void commit_dataset(const fs::path& partial, const std::string& out, const std::string& vocab,
                    const std::string& merges, const zeroshard::TokenStoreDigest& digest, json manifest) {
  fs::create_directories(partial / "tokenizer");
  for (auto [name, text] : {std::pair{"vocab.json", &vocab}, std::pair{"merges.txt", &merges}}) {
    std::ofstream(partial / "tokenizer" / name, std::ios::binary) << *text;
  }
  manifest["files"] = {{"tokens.bin", {{"bytes", digest.bin_bytes}, {"xxh3", hex(digest.bin_xxh3)}}},
                       {"tokens.idx", {{"bytes", digest.idx_bytes}, {"xxh3", hex(digest.idx_xxh3)}}}};
  {
    std::ofstream f(partial / "manifest.json");
    f << manifest.dump(1) << '\n';
    f.close();
    TORCH_CHECK(f.good(), "prepare: writing '", (partial / "manifest.json").string(), "' failed");
  }
  fs::rename(partial, out);
}

}  // namespace

std::vector<std::string_view> split_documents(std::string_view text, const std::string& separator, bool line_start) {
  std::vector<std::string_view> parts;
  if (separator.empty()) return {text};
  size_t begin = 0;  // of the current part
  for (size_t line = 0; line <= text.size();) {
    size_t end = text.find('\n', line);
    end = end == std::string_view::npos ? text.size() : end;
    if (line > 0 || line_start) {
      std::string_view l = text.substr(line, end - line);
      while (!l.empty() && (l.front() == ' ' || l.front() == '\t')) l.remove_prefix(1);
      while (!l.empty() && (l.back() == ' ' || l.back() == '\t' || l.back() == '\r')) l.remove_suffix(1);
      if (l == separator) {
        parts.push_back(text.substr(begin, line - begin));
        begin = std::min(end + 1, text.size());
      }
    }
    if (end == text.size()) break;
    line = end + 1;
  }
  parts.push_back(text.substr(begin));
  return parts;
}

size_t last_sentence_break(const std::string& text, size_t pos) {
  for (size_t j = std::min(pos, text.size()); j-- > 1;) {
    if (const size_t cut = break_at(text, j)) return cut;
  }
  return 0;
}

std::vector<std::string> corpus_files(const std::vector<std::string>& data) {
  std::vector<std::string> out;
  std::set<fs::path> seen;
  for (const auto& d : data) {
    std::error_code ec;
    TORCH_CHECK_VALUE(fs::exists(d, ec), "prepare: --data '", d, "' does not exist; give directories or files of text");
    std::vector<fs::path> files;
    if (fs::is_directory(d, ec)) {
      for (auto it = fs::recursive_directory_iterator(d, ec); !ec && it != fs::recursive_directory_iterator();
           it.increment(ec)) {
        if (it->is_regular_file(ec)) files.push_back(it->path());
      }
      TORCH_CHECK_VALUE(!ec, "prepare: cannot list '", d, "': ", ec.message());
      std::sort(files.begin(), files.end());
    } else {
      files.push_back(d);
    }
    for (const auto& f : files) {
      const auto real = fs::canonical(f, ec);
      if (ec || !seen.insert(real).second) continue;  // a link to a file already listed
      if (fs::file_size(f, ec) == 0 || ec || is_binary(f)) continue;
      out.push_back(f.string());
    }
  }
  TORCH_CHECK_VALUE(!out.empty(), "prepare: no text file under --data (binary files, those with a NUL byte in "
                    "their first 8000 bytes, are left out)");
  return out;
}

json corpus_sources(const std::vector<std::string>& data) {
  json sources = json::array();
  for (const auto& f : corpus_files(data)) sources.push_back({{"path", f}, {"bytes", fs::file_size(f)}});
  return sources;
}

std::string tokenizer_hash(const std::string& vocab_json, const std::string& merges_txt) {
  XXH3_state_t* s = XXH3_createState();
  XXH3_64bits_reset(s);
  XXH3_64bits_update(s, vocab_json.data(), vocab_json.size());
  XXH3_64bits_update(s, "\0", 1);
  XXH3_64bits_update(s, merges_txt.data(), merges_txt.size());
  const auto h = XXH3_64bits_digest(s);
  XXH3_freeState(s);
  return hex(h);
}

json read_manifest(const std::string& dataset_dir) {
  const auto path = fs::path(dataset_dir) / "manifest.json";
  TORCH_CHECK_VALUE(fs::exists(path), "dataset '", dataset_dir, "' has no manifest.json: prepare it with "
                    "`bart_pretrain prepare --data DIR --tokenizer T --out ", dataset_dir, "`");
  json m = json::parse(read_file(path), nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK_VALUE(m.is_object() && m.value("format", "") == "zeroshard token store", "dataset '", dataset_dir,
                    "': '", path.string(), "' is not a dataset manifest; prepare the dataset again");
  return m;
}

PrepareReport prepare_dataset(const PrepareOptions& o) {
  const auto t0 = Clock::now();
  TORCH_CHECK_VALUE(!o.out.empty(), "prepare: give the dataset directory to write with --out");
  TORCH_CHECK_VALUE(!fs::exists(o.out), "prepare: --out '", o.out, "' exists; remove it or give another directory");
  TORCH_CHECK_VALUE(o.chunk_bytes >= 4096, "prepare: chunk_bytes ", o.chunk_bytes, " is below 4096");
  const bool given = !o.vocab_json.empty();
  TORCH_CHECK_VALUE(given || fs::exists(tokenizer_files_in(o.tokenizer_dir)), "prepare: --tokenizer '",
                    o.tokenizer_dir, "' has no vocab.json; give a directory with vocab.json and merges.txt "
                    "(bart_pretrain train-tokenizer makes one)");
  const std::string vocab = given ? o.vocab_json : read_file(fs::path(o.tokenizer_dir) / "vocab.json");
  const std::string merges = given ? o.merges_txt : read_file(fs::path(o.tokenizer_dir) / "merges.txt");
  const auto tokenizer = ByteLevelBpe::parse(vocab, merges, (fs::path(o.tokenizer_dir) / "vocab.json").string(),
                                             (fs::path(o.tokenizer_dir) / "merges.txt").string());
  const auto files = corpus_files(o.data);

  PrepareReport r;
  r.workers = o.workers > 0 ? o.workers : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  r.files = static_cast<int64_t>(files.size());
  const fs::path partial = o.partial.empty() ? o.out + ".partial" : o.partial;
  fs::remove_all(partial);  // an earlier prepare that was stopped: start over
  fs::create_directories(partial);
  const auto type = zeroshard::token_type_for(tokenizer.vocab_size());
  json sources = json::array();
  zeroshard::TokenStoreDigest digest;
  {
    zeroshard::TokenStoreWriter writer((partial / "tokens").string(), type);
    std::vector<ByteLevelBpe::Cache> caches(static_cast<size_t>(r.workers));
    Pipeline<Tokenized> pipe(
        r.workers,
        [&](const Chunk& c, int w) { return tokenize(c, o.document_separator, tokenizer, caches[static_cast<size_t>(w)]); },
        StoreWriting(writer));
    auto last_log = Clock::now();
    for (const auto& f : files) {
      const auto used = read_chunks(TextRange{f, 0, std::numeric_limits<int64_t>::max()}, o.chunk_bytes,
                                    o.document_separator, pipe);
      r.text_bytes += used.end - used.begin;
      sources.push_back({{"path", f}, {"bytes", used.end - used.begin}});
      if (std::chrono::duration<double>(Clock::now() - last_log).count() > 10) {
        last_log = Clock::now();
        const double s = std::chrono::duration<double>(last_log - t0).count();
        char msg[160];
        std::snprintf(msg, sizeof(msg), "prepare: %.1f MB of text read, %.1f MB/s", r.text_bytes / 1e6,
                      r.text_bytes / 1e6 / s);
        zeroshard::log_info(msg);
      }
    }
    pipe.close();
    digest = writer.finish();
    r.documents = writer.documents();
    r.sequences = writer.sequences();
    r.tokens = writer.tokens();
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const json manifest = {
      {"format", "zeroshard token store"},
      {"version", 1},
      {"store", "tokens"},
      {"token_type", zeroshard::to_string(type)},
      {"tokenizer", {{"xxh3", tokenizer_hash(vocab, merges)}, {"vocab_size", tokenizer.vocab_size()}}},
      {"sequences_are", "sentences (split after '.', '!' or '?' before whitespace, and at blank lines)"},
      {"documents_are", o.document_separator.empty() ? "files"
                                                     : "files, cut at lines '" + o.document_separator + "'"},
      {"documents", r.documents},
      {"sequences", r.sequences},
      {"tokens", r.tokens},
      {"text_bytes", r.text_bytes},
      {"sources", sources},
      {"prepare", {{"workers", r.workers}, {"seconds", r.seconds}}},
  };
  commit_dataset(partial, o.out, vocab, merges, digest, manifest);
  return r;
}

TokenizerTrainingReport train_tokenizer(const TokenizerTrainingOptions& o) {
  TORCH_CHECK_VALUE(!o.out.empty(), "train-tokenizer: give the directory to write with --out");
  TORCH_CHECK_VALUE(o.sample_mb > 0, "train-tokenizer: --sample-mb ", o.sample_mb, " must be above 0");
  TORCH_CHECK_VALUE(o.chunk_bytes >= 4096, "train-tokenizer: chunk_bytes ", o.chunk_bytes, " is below 4096");
  TORCH_CHECK_VALUE(o.vocab_size >= 262, "train-tokenizer: --vocab-size ", o.vocab_size,
                    " must be at least 262 (4 specials, 256 bytes, a merge, <mask>)");
  auto t0 = Clock::now();
  TokenizerTrainingReport r;
  r.workers = o.workers > 0 ? o.workers : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const auto files = corpus_files(o.data);
  for (const auto& f : files) r.corpus_bytes += static_cast<int64_t>(fs::file_size(f));
  const auto ranges = sample_ranges(files, static_cast<int64_t>(o.sample_mb * 1e6), o.chunk_bytes);
  std::vector<PieceCounts> counts(static_cast<size_t>(r.workers));
  {
    Pipeline<bool> pipe(
        r.workers,
        [&](const Chunk& c, int w) {
          auto& mine = counts[static_cast<size_t>(w)];
          for_each_sentence(c, o.document_separator, [&](const std::string& s) { mine.add_text(s); }, [] {});
          return true;
        },
        [](bool&&) {});
    for (const auto& range : ranges) {
      const auto used = read_chunks(range, o.chunk_bytes, o.document_separator, pipe);
      if (used.end > used.begin) r.sample.push_back(used);
      r.sample_bytes += used.end - used.begin;
    }
    pipe.close();
  }
  for (size_t w = 1; w < counts.size(); ++w) {
    counts[0].add(counts[w]);
    counts[w] = PieceCounts();
  }
  r.pieces = static_cast<int64_t>(counts[0].size());
  TORCH_CHECK_VALUE(r.pieces > 0, "train-tokenizer: the sample of --data holds no text");
  r.count_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  const auto tokenizer = ByteLevelBpe::train(counts[0], o.vocab_size);
  r.learn_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.vocab_size = tokenizer.vocab_size();
  r.merges = tokenizer.merges();

  const fs::path partial = o.out + ".partial";
  fs::remove_all(partial);
  fs::create_directories(partial);
  tokenizer.save((partial / "vocab.json").string(), (partial / "merges.txt").string());
  json sample = json::array();
  for (const auto& t : r.sample) sample.push_back({{"path", t.file}, {"begin", t.begin}, {"end", t.end}});
  const json training = {
      {"vocab_size", r.vocab_size},
      {"merges", r.merges},
      {"sample_mb", o.sample_mb},
      {"corpus_bytes", r.corpus_bytes},
      {"sample_bytes", r.sample_bytes},
      {"document_separator", o.document_separator},
      {"pieces", r.pieces},
      {"workers", r.workers},
      {"seconds", {{"count", r.count_seconds}, {"learn", r.learn_seconds}}},
      {"sample", sample},
  };
  {
    std::ofstream f(partial / "training.json");
    f << training.dump(1) << '\n';
    f.close();
    TORCH_CHECK(f.good(), "train-tokenizer: writing '", (partial / "training.json").string(), "' failed");
  }
  fs::remove_all(o.out);
  fs::rename(partial, o.out);
  return r;
}

int train_tokenizer_command(const TokenizerTrainingOptions& o) {
  const auto r = train_tokenizer(o);
  char msg[320];
  std::snprintf(msg, sizeof(msg), "tokenizer: %lld entries (%lld merges) from %.1f MB of %.1f MB of text (%zu ranges, "
                "%lld distinct pieces): counted in %.1f s on %d workers, learned in %.1f s, into ",
                static_cast<long long>(r.vocab_size), static_cast<long long>(r.merges), r.sample_bytes / 1e6,
                r.corpus_bytes / 1e6, r.sample.size(), static_cast<long long>(r.pieces), r.count_seconds, r.workers,
                r.learn_seconds);
  zeroshard::log_info(msg + o.out);
  return 0;
}

PrepareReport merge_datasets(const std::vector<std::string>& parts, const std::string& out) {
  const auto t0 = Clock::now();
  TORCH_CHECK_VALUE(!parts.empty(), "merge: give the prepared datasets to merge");
  TORCH_CHECK_VALUE(!fs::exists(out), "merge: --out '", out, "' exists; remove it or give another directory");
  std::vector<json> manifests;
  for (const auto& p : parts) {
    manifests.push_back(read_manifest(p));
    const auto& m = manifests.back();
    for (const char* key : {"tokenizer", "token_type", "sequences_are", "documents_are"}) {
      TORCH_CHECK_VALUE(m.at(key) == manifests.front().at(key), "merge: '", p, "' was prepared with another ", key,
                        " than '", parts.front(), "' (", m.at(key).dump(), " against ",
                        manifests.front().at(key).dump(), "); prepare every part the same way");
    }
  }
  const std::string vocab = read_file(fs::path(parts.front()) / "tokenizer" / "vocab.json");
  const std::string merges = read_file(fs::path(parts.front()) / "tokenizer" / "merges.txt");
  TORCH_CHECK_VALUE(tokenizer_hash(vocab, merges) == manifests.front().at("tokenizer").at("xxh3").get<std::string>(),
                    "merge: '", parts.front(), "/tokenizer' is not the tokenizer its manifest names; prepare it again");
  const fs::path partial = out + ".partial";
  fs::remove_all(partial);
  fs::create_directories(partial);
  json manifest = manifests.front();
  manifest["sources"] = json::array();
  PrepareReport r;
  zeroshard::TokenStoreDigest digest;
  {
    zeroshard::TokenStoreWriter writer((partial / "tokens").string(),
                                       zeroshard::TokenStore(store_prefix(parts.front())).type());
    for (size_t i = 0; i < parts.size(); ++i) {
      writer.append(zeroshard::TokenStore(store_prefix(parts[i])));
      for (const auto& src : manifests[i].at("sources")) manifest["sources"].push_back(src);
      r.text_bytes += manifests[i].value("text_bytes", int64_t{0});
      r.files += static_cast<int64_t>(manifests[i].at("sources").size());
    }
    digest = writer.finish();
    r.documents = writer.documents();
    r.sequences = writer.sequences();
    r.tokens = writer.tokens();
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  manifest["documents"] = r.documents;
  manifest["sequences"] = r.sequences;
  manifest["tokens"] = r.tokens;
  manifest["text_bytes"] = r.text_bytes;
  manifest["prepare"] = {{"merged", parts}, {"seconds", r.seconds}};
  commit_dataset(partial, out, vocab, merges, digest, manifest);
  return r;
}

std::string store_prefix(const std::string& dataset) {
  const auto own = fs::path(dataset) / "tokens";
  return fs::is_directory(dataset) && fs::exists(own.string() + ".idx") ? own.string() : dataset;
}

int prepare_command(const PrepareOptions& o) {
  const auto r = prepare_dataset(o);
  char msg[320];
  std::snprintf(msg, sizeof(msg), "prepare: %lld files, %.1f MB of text -> %lld documents, %lld sentences, %lld tokens "
                "in %.1f s (%.2f MB/s on %d workers) into ", static_cast<long long>(r.files), r.text_bytes / 1e6,
                static_cast<long long>(r.documents), static_cast<long long>(r.sequences),
                static_cast<long long>(r.tokens), r.seconds, r.text_bytes / 1e6 / std::max(r.seconds, 1e-9), r.workers);
  zeroshard::log_info(msg + o.out);
  return 0;
}

int merge_command(const std::vector<std::string>& parts, const std::string& out) {
  const auto r = merge_datasets(parts, out);
  char msg[200];
  std::snprintf(msg, sizeof(msg), "merge: %zu datasets -> %lld documents, %lld sentences, %lld tokens in %.1f s into ",
                parts.size(), static_cast<long long>(r.documents), static_cast<long long>(r.sequences),
                static_cast<long long>(r.tokens), r.seconds);
  zeroshard::log_info(msg + out);
  return 0;
}

int inspect_command(const std::string& dataset, const std::string& range, bool verify) {
  const bool prepared = fs::exists(fs::path(dataset) / "manifest.json");
  const json manifest = prepared ? read_manifest(dataset) : json(nullptr);
  const zeroshard::TokenStore store(store_prefix(dataset));
  json out = {{"prefix", store.prefix()}, {"token_type", zeroshard::to_string(store.type())},
              {"documents", store.documents()}, {"sequences", store.sequences()}, {"tokens", store.tokens()}};
  if (verify) {
    store.verify();
    const auto d = store.digest();
    out["bin_xxh3"] = hex(d.bin_xxh3);
    out["idx_xxh3"] = hex(d.idx_xxh3);
    if (prepared) {
      for (auto [name, bytes, h] : {std::tuple{"tokens.bin", d.bin_bytes, d.bin_xxh3},
                                    std::tuple{"tokens.idx", d.idx_bytes, d.idx_xxh3}}) {
        const auto& want = manifest.at("files").at(name);
        TORCH_CHECK_VALUE(want.at("bytes").get<uint64_t>() == bytes && want.at("xxh3").get<std::string>() == hex(h),
                          "dataset '", dataset, "': ", name, " is ", bytes, " bytes with xxh3 ", hex(h),
                          "; its manifest says ", want.at("bytes").get<uint64_t>(), " bytes with xxh3 ",
                          want.at("xxh3").get<std::string>(), ": the file is damaged; prepare the dataset again");
      }
    }
    out["verified"] = true;
  }
  if (prepared) out["manifest"] = manifest;
  std::cout << out.dump() << '\n';
  if (!range.empty()) {
    const auto colon = range.find(':');
    TORCH_CHECK_VALUE(colon != std::string::npos, "inspect: --sequences '", range, "' is not FIRST:END");
    const int64_t first = std::stoll(range.substr(0, colon));
    const int64_t end = std::min<int64_t>(store.sequences(), std::stoll(range.substr(colon + 1)));
    for (int64_t i = first; i < end; ++i) std::cout << json(store.sequence(i)).dump() << '\n';
  }
  std::cout.flush();
  TORCH_CHECK(std::cout.good(), "inspect: writing failed");
  return 0;
}

}  // namespace bart
