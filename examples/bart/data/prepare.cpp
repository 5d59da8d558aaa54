// prepare.cpp — a corpus into a token store: read (this thread), split and
// tokenize (workers), write in order (whichever worker finishes the next chunk).
#include "data/prepare.h"

#include "io/byte_stream.h"
#include "io/text_file.h"
#include "io/work_progress.h"

#include "data/text_chunks.h"

#include <zeroshard/log.h>
#include <zeroshard/metrics.h>
#include <zeroshard/token_store.h>

#include <c10/util/Exception.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
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

bool is_binary(const fs::path& file) {
  ByteStream in(file.string(), "prepare");
  char head[8000];
  const size_t got = in.read(head, sizeof(head));
  return std::find(head, head + got, '\0') != head + got;
}

// A `.json` file that holds one JSON document (an array, or an object printed over several
// lines, as package.json is) rather than JSON lines: by its first bytes.
bool is_json_document(const fs::path& file) {
  if (!name_ends_with(without_compression(file.string()), ".json")) return false;
  ByteStream in(file.string(), "prepare");
  char head[8000];
  const size_t got = in.read(head, sizeof(head));
  size_t i = got >= 3 && std::string_view(head, 3) == "\xEF\xBB\xBF" ? 3 : 0;
  while (i < got && std::isspace(static_cast<unsigned char>(head[i]))) ++i;
  if (i == got || (head[i] != '[' && head[i] != '{')) return false;
  if (head[i] == '[') return true;
  size_t j = i + 1;  // "{" alone on its line
  while (j < got && (head[j] == ' ' || head[j] == '\t' || head[j] == '\r')) ++j;
  return j < got && head[j] == '\n';
}

std::string read_file(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  TORCH_CHECK_VALUE(in, "prepare: cannot read '", file.string(), "'");
  return {std::istreambuf_iterator<char>(in), {}};
}

// A chunk's ids, in the narrowest type the vocabulary fits (16 bits for
// BART's; a long document's ids are the most of what preparing it holds).
struct Tokenized {
  std::vector<uint16_t> narrow;  // a vocabulary of at most 65,536 entries
  std::vector<int32_t> wide;     // else
  std::vector<int64_t> lengths;  // per sentence
  std::vector<size_t> ends;      // a document ends after this many of the sentences
};

Tokenized tokenize(const Chunk& c, ChunkWorker& w, const ByteLevelBpe& tokenizer, ByteLevelBpe::Cache& cache) {
  Tokenized out;
  const bool narrow = tokenizer.vocab_size() <= 65536;
  for_each_sentence(
      c, w,
      [&](const std::string& s) {
        const auto ids = tokenizer.encode(s, cache);
        if (narrow) {
          out.narrow.insert(out.narrow.end(), ids.begin(), ids.end());
        } else {
          out.wide.insert(out.wide.end(), ids.begin(), ids.end());
        }
        out.lengths.push_back(static_cast<int64_t>(ids.size()));
      },
      [&] { out.ends.push_back(out.lengths.size()); });
  return out;
}

// Writes tokenized chunks, in order, into the store. A document with no
// sentence (a file of whitespace, two separators in a row) is not recorded.
class StoreWriting {
 public:
  explicit StoreWriting(zeroshard::TokenStoreWriter& writer) : writer_(writer) {}
  void operator()(Tokenized&& t) {
    if (t.narrow.empty()) {
      write(t, t.wide.data());
    } else {
      write(t, t.narrow.data());
    }
  }

 private:
  template <class Id>
  void write(const Tokenized& t, const Id* p) {
    size_t next_end = 0;
    for (size_t k = 0; k <= t.lengths.size(); ++k) {
      for (; next_end < t.ends.size() && t.ends[next_end] == k; ++next_end) {
        if (open_ > 0) writer_.end_document();
        open_ = 0;
      }
      if (k == t.lengths.size()) break;
      sentence_.assign(p, p + t.lengths[k]);
      writer_.add(sentence_);
      p += t.lengths[k];
      ++open_;
    }
  }

  zeroshard::TokenStoreWriter& writer_;
  std::vector<int64_t> sentence_;  // one sentence's ids, as the writer takes them
  int64_t open_ = 0;  // sentences of the document being written
};

// The tokenizer's files and the manifest (with the store's sizes and checksums)
// into `partial`, then `partial` renamed to `out`: the dataset appears whole, or not at all.
void commit_dataset(const fs::path& partial, const std::string& out, const std::string& vocab,
                    const std::string& merges, const zeroshard::TokenStoreDigest& digest, json manifest) {
  fs::create_directories(partial / "tokenizer");
  write_text_file(partial / "tokenizer" / "vocab.json", vocab, "prepare");
  write_text_file(partial / "tokenizer" / "merges.txt", merges, "prepare");
  manifest["files"] = {{"tokens.bin", {{"bytes", digest.bin_bytes}, {"xxh3", hex(digest.bin_xxh3)}}},
                       {"tokens.idx", {{"bytes", digest.idx_bytes}, {"xxh3", hex(digest.idx_xxh3)}}}};
  write_text_file(partial / "manifest.json", manifest.dump(1) + "\n", "prepare");
  fs::rename(partial, out);
}

// A dataset being written: removed first (an earlier run that was stopped
// starts over) and again when it is left without being renamed (an error).
struct PartialDir {
  explicit PartialDir(fs::path p) : path(std::move(p)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~PartialDir() {
    std::error_code ec;
    fs::remove_all(path, ec);  // nothing there once it was renamed
  }
  PartialDir(const PartialDir&) = delete;
  PartialDir& operator=(const PartialDir&) = delete;
  const fs::path path;
};

// What a document is, for the manifest (datasets merge only when they agree).
std::string documents_are(const std::vector<std::string>& files, const ReadRules& rules) {
  const auto json_files = std::count_if(files.begin(), files.end(), [](const auto& f) { return is_json_lines(f); });
  const std::string text = rules.separator.empty() ? "files" : "files, cut at lines '" + rules.separator + "'";
  const std::string lines = "JSON lines (the text of field \"" + rules.json_key + "\")";
  if (json_files == 0) return text;
  if (json_files == static_cast<int64_t>(files.size())) return lines;
  return "text " + text + "; " + lines;
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

std::vector<std::string> corpus_files(const std::vector<std::string>& data, std::vector<std::string>* binary) {
  std::vector<std::string> out, left_out;
  std::set<fs::path> seen;
  for (const auto& d : data) {
    std::error_code ec;
    TORCH_CHECK_VALUE(fs::exists(d, ec), "prepare: --data '", d, "' does not exist; give directories or files of text");
    std::vector<fs::path> files;
    const bool listed = fs::is_directory(d, ec);
    if (listed) {
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
      if (fs::file_size(f, ec) == 0 || ec) continue;
      TORCH_CHECK_VALUE(!is_json_document(f), "prepare: '", f.string(), "' is one JSON document (",
                        "an array, or an object over several lines), not JSON lines (one object per line, a document "
                        "each); give its documents as JSON lines (e.g. `jq -c '.[]'` of an array), or move it out of "
                        "--data");
      // A JSON lines file is read whatever it holds: a NUL makes its line malformed (named, or skipped).
      if (!is_json_lines(f.string()) && is_binary(f)) {
        TORCH_CHECK_VALUE(listed, "prepare: --data '", f.string(), "' has a NUL byte in its first 8000 bytes: a binary "
                          "file, not text; give text files (a directory's binary files are left out and counted)");
        left_out.push_back(f.string());
        continue;
      }
      out.push_back(f.string());
    }
  }
  TORCH_CHECK_VALUE(!out.empty(), "prepare: no text file under --data",
                    left_out.empty() ? std::string() : "; " + binary_files_left_out("prepare", left_out));
  if (binary != nullptr) *binary = std::move(left_out);
  return out;
}

std::string binary_files_left_out(const std::string& who, const std::vector<std::string>& binary) {
  std::string names;
  for (size_t i = 0; i < std::min<size_t>(binary.size(), 3); ++i) names += (i ? ", '" : "'") + binary[i] + "'";
  return who + ": left out " + std::to_string(binary.size()) + " binary file(s) (a NUL byte in the first 8000 "
         "bytes): " + names + (binary.size() > 3 ? ", ..." : "");
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
  PrepareReport r;
  const auto files = corpus_files(o.data, &r.binary_files);
  const ReadRules rules = read_rules("prepare", files, o.chunk_bytes, o.document_separator, o.json_key,
                                     o.skip_bad_lines);

  r.workers = o.workers > 0 ? o.workers : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  r.files = static_cast<int64_t>(files.size());
  const PartialDir partial(o.partial.empty() ? o.out + ".partial" : o.partial);
  const auto type = zeroshard::token_type_for(tokenizer.vocab_size());
  json sources = json::array();
  zeroshard::TokenStoreDigest digest;
  {
    zeroshard::TokenStoreWriter writer((partial.path / "tokens").string(), type);
    std::vector<ByteLevelBpe::Cache> caches(static_cast<size_t>(r.workers));
    std::vector<TextRange> whole;
    for (const auto& f : files) whole.push_back(TextRange{f, 0, std::numeric_limits<int64_t>::max()});
    const auto bad = process_chunks<Tokenized>(
        whole, rules, r.workers,
        [&](const Chunk& c, ChunkWorker& w) { return tokenize(c, w, tokenizer, caches[static_cast<size_t>(w.index)]); },
        StoreWriting(writer), [&](size_t, const TextRange& used) {
          r.text_bytes += used.end - used.begin;
          sources.push_back({{"path", used.file}, {"bytes", fs::file_size(used.file)}});
        });
    r.bad_lines = bad.count;
    r.first_bad_line = bad.first;
    digest = writer.finish();
    r.documents = writer.documents();
    r.sequences = writer.sequences();
    r.tokens = writer.tokens();
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  json manifest = {
      {"format", "zeroshard token store"},
      {"version", 1},
      {"store", "tokens"},
      {"token_type", zeroshard::to_string(type)},
      {"tokenizer", {{"xxh3", tokenizer_hash(vocab, merges)}, {"vocab_size", tokenizer.vocab_size()}}},
      {"sequences_are", "sentences (split after '.', '!' or '?' before whitespace, and at blank lines)"},
      {"documents_are", documents_are(files, rules)},
      {"documents", r.documents},
      {"sequences", r.sequences},
      {"tokens", r.tokens},
      {"text_bytes", r.text_bytes},
      {"sources", sources},
      {"prepare", {{"workers", r.workers}, {"seconds", r.seconds}}},
  };
  if (r.bad_lines > 0) manifest["skipped_lines"] = {{"count", r.bad_lines}, {"first", r.first_bad_line}};
  if (!r.binary_files.empty()) manifest["binary_files_left_out"] = r.binary_files;
  commit_dataset(partial.path, o.out, vocab, merges, digest, manifest);
  return r;
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
  const PartialDir partial(out + ".partial");
  json manifest = manifests.front();
  manifest["sources"] = json::array();
  PrepareReport r;
  zeroshard::TokenStoreDigest digest;
  {
    zeroshard::TokenStoreWriter writer((partial.path / "tokens").string(),
                                       zeroshard::TokenStore(store_prefix(parts.front())).type());
    int64_t total = 0, done = 0;  // the parts' tokens.bin bytes
    for (const auto& p : parts) total += static_cast<int64_t>(fs::file_size(store_prefix(p) + ".bin"));
    WorkProgress progress("merge", total);
    for (size_t i = 0; i < parts.size(); ++i) {
      writer.append(zeroshard::TokenStore(store_prefix(parts[i])));
      done += static_cast<int64_t>(fs::file_size(store_prefix(parts[i]) + ".bin"));
      progress.update(done, std::to_string(i + 1) + " of " + std::to_string(parts.size()) + " datasets");
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
  commit_dataset(partial.path, out, vocab, merges, digest, manifest);
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
                "in %.1f s (%.2f MB/s on %d workers; peak memory %.0f MB) into ", static_cast<long long>(r.files),
                r.text_bytes / 1e6, static_cast<long long>(r.documents), static_cast<long long>(r.sequences),
                static_cast<long long>(r.tokens), r.seconds, r.text_bytes / 1e6 / std::max(r.seconds, 1e-9), r.workers,
                zeroshard::peak_rss_bytes() / 1e6);
  zeroshard::log_info(msg + o.out);
  if (r.bad_lines > 0) {
    zeroshard::log_warn("prepare: skipped " + std::to_string(r.bad_lines) + " malformed JSON line(s) "
                        "(--skip-bad-lines); the first: " + r.first_bad_line);
  }
  if (!r.binary_files.empty()) zeroshard::log_warn(binary_files_left_out("prepare", r.binary_files));
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
