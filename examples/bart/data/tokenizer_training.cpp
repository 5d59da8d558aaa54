// tokenizer_training.cpp — `bart_pretrain train-tokenizer`: a sample of the
// corpus read as prepare reads it, its pieces counted on worker threads, a
// vocabulary learned from the counts (prepare.h says what and how).
#include "data/prepare.h"
#include "data/text_chunks.h"
#include "io/text_file.h"

#include <zeroshard/log.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

namespace bart {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// The ranges of the corpus a tokenizer trains on: every file whole when they
// hold `sample_bytes` or less on disk; else windows of `window` bytes of
// content, at positions spread evenly over the files' bytes on disk end to end,
// so that the sample holds about `sample_bytes` of text (ChunkReader reads a
// range's length in content bytes: a compressed file's windows are as long in
// text as a plain file's). A plain file's overlapping windows are joined.
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
    for (const auto& f : files) out.push_back({f, 0, std::numeric_limits<int64_t>::max()});
    return out;
  }
  const int64_t windows = std::max<int64_t>(1, (sample_bytes + window - 1) / window);
  for (int64_t k = 0; k < windows; ++k) {
    const auto at = static_cast<int64_t>(static_cast<__int128>(k) * total / windows);
    const size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), at) - starts.begin() - 1);
    const bool plain = compression_of(files[i]) == Compression::kNone;
    const int64_t begin = at - starts[i], end = plain ? std::min(begin + window, sizes[i]) : begin + window;
    if (plain && !out.empty() && out.back().file == files[i] && begin <= out.back().end) {
      out.back().end = std::max(out.back().end, end);
    } else {
      out.push_back({files[i], begin, end});
    }
  }
  return out;
}

}  // namespace

TokenizerTrainingReport train_tokenizer(const TokenizerTrainingOptions& o) {
  TORCH_CHECK_VALUE(!o.out.empty(), "train-tokenizer: give the directory to write with --out");
  TORCH_CHECK_VALUE(o.sample_mb > 0, "train-tokenizer: --sample-mb ", o.sample_mb, " must be above 0");
  TORCH_CHECK_VALUE(o.chunk_bytes >= 4096, "train-tokenizer: chunk_bytes ", o.chunk_bytes, " is below 4096");
  TORCH_CHECK_VALUE(o.vocab_size >= 262, "train-tokenizer: --vocab-size ", o.vocab_size,
                    " must be at least 262 (4 specials, 256 bytes, a merge, <mask>)");
  auto t0 = Clock::now();
  TokenizerTrainingReport r;
  r.workers = o.workers > 0 ? o.workers : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::string> binary;
  const auto files = corpus_files(o.data, &binary);
  if (!binary.empty()) zeroshard::log_warn(binary_files_left_out("train-tokenizer", binary));
  const ReadRules rules = read_rules("train-tokenizer", files, o.chunk_bytes, o.document_separator, o.json_key,
                                     o.skip_bad_lines);
  for (const auto& f : files) r.corpus_bytes += static_cast<int64_t>(fs::file_size(f));
  const auto ranges = sample_ranges(files, static_cast<int64_t>(o.sample_mb * 1e6), o.chunk_bytes);
  std::vector<PieceCounts> counts(static_cast<size_t>(r.workers));
  {
    const auto bad = process_chunks<bool>(
        ranges, rules, r.workers,
        [&](const Chunk& c, ChunkWorker& w) {
          auto& mine = counts[static_cast<size_t>(w.index)];
          for_each_sentence(c, w, [&](const std::string& s) { mine.add_text(s); }, [] {});
          return true;
        },
        [](bool&&) {},
        [&](size_t, const TextRange& used) {
          if (used.end > used.begin) r.sample.push_back(used);
          r.sample_bytes += used.end - used.begin;
        },
        &r.decompressed_bytes);
    r.bad_lines = bad.count;
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
      {"decompressed_bytes", r.decompressed_bytes},
      {"document_separator", o.document_separator},
      {"json_key", o.json_key},
      {"skipped_lines", r.bad_lines},
      {"pieces", r.pieces},
      {"workers", r.workers},
      {"seconds", {{"count", r.count_seconds}, {"learn", r.learn_seconds}}},
      {"sample", sample},
  };
  write_text_file(partial / "training.json", training.dump(1) + "\n", "train-tokenizer");
  fs::remove_all(o.out);
  fs::rename(partial, o.out);
  return r;
}

int train_tokenizer_command(const TokenizerTrainingOptions& o) {
  const auto r = train_tokenizer(o);
  char msg[360];
  // The sample is text (decompressed); the corpus is counted as its files are on disk (compressed ones as they are).
  char decompressed[64] = "";
  if (r.decompressed_bytes > 0) {
    std::snprintf(decompressed, sizeof(decompressed), "; %.1f MB of text decompressed", r.decompressed_bytes / 1e6);
  }
  std::snprintf(msg, sizeof(msg), "tokenizer: %lld entries (%lld merges) from %.1f MB of text sampled in %zu ranges "
                "of %.1f MB of corpus files on disk (%lld distinct pieces%s): counted in %.1f s on %d workers, learned "
                "in %.1f s, into ",
                static_cast<long long>(r.vocab_size), static_cast<long long>(r.merges), r.sample_bytes / 1e6,
                r.sample.size(), r.corpus_bytes / 1e6, static_cast<long long>(r.pieces), decompressed, r.count_seconds,
                r.workers, r.learn_seconds);
  zeroshard::log_info(msg + o.out);
  return 0;
}

}  // namespace bart
