// prepare.h — `bart_pretrain prepare`: a text corpus, once, into a dataset
// directory that training maps (zeroshard/token_store.h). The corpus is files
// of text, or of JSON lines (`.jsonl`, `.json`, `.ndjson`: an object per line,
// its text under one key), either compressed or not (`.gz`, `.zst`):
//
//   DATASET/tokens.bin, tokens.idx  the token store (Megatron's indexed layout):
//                                   a sequence per sentence, a document per text
//                                   file (or per run of lines between separator
//                                   lines) and per JSON line; a document without
//                                   a sentence is not recorded
//   DATASET/tokenizer/              vocab.json and merges.txt, as given
//   DATASET/manifest.json           the tokenizer's hash, the sources (path,
//                                   bytes), counts, each store file's size and xxh3
//
// Text streams through in chunks cut where a sentence ends (a blank line, or
// '.', '!', '?' before whitespace), so a chunk's sentences are the ones the
// whole file would give; chunks are split and tokenized on `workers` threads and
// written in order. Memory stays bounded (about 2 chunks per worker, or a JSON
// line where one is longer) at any corpus size. Everything is written into
// DATASET.partial, renamed to DATASET when whole: a prepare killed at any
// instant leaves no DATASET, and run again it starts over; one that fails (a
// malformed JSON line) removes DATASET.partial too.
#pragma once

#include "tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace bart {

struct PrepareOptions {
  std::vector<std::string> data;  // directories (read recursively, by sorted path) or files
  std::string tokenizer_dir;      // vocab.json and merges.txt
  std::string vocab_json, merges_txt;  // or their contents (tokenizer_dir then names them in errors)
  std::string out;                // the dataset directory; must not exist
  int workers = 0;                // tokenizing threads; 0: every core
  int64_t chunk_bytes = int64_t{1} << 20;  // text per task (more where no sentence ends within it)
  // A line that is this text (spaces, tabs and '\r' around it aside) ends a
  // document and is dropped (fortune's "%"); "": documents are files. It must
  // hold no sentence end ('.', '!', '?' before whitespace).
  std::string document_separator;
  std::string json_key = "text";  // JSON lines: the field that holds a document's text
  bool skip_bad_lines = false;    // JSON lines: a malformed line skipped and counted; else it stops prepare
  std::string partial;            // written here, then renamed to `out`; default OUT.partial (removed first)
};

struct PrepareReport {
  int64_t files = 0, text_bytes = 0, documents = 0, sequences = 0, tokens = 0;
  int64_t bad_lines = 0;          // JSON lines skipped (skip_bad_lines)
  std::string first_bad_line;     // where the first was, and what was wrong with it
  std::vector<std::string> binary_files;  // left out of the directories given (corpus_files)
  int workers = 0;
  double seconds = 0;
};

PrepareReport prepare_dataset(const PrepareOptions& options);

// Bytes [begin, end) of a file.
struct TextRange {
  std::string file;
  int64_t begin = 0, end = 0;
};

// `bart_pretrain train-tokenizer`: a byte-level BPE vocabulary learned from a
// sample of the corpus. The sample is the whole corpus when its files hold
// `sample_mb` or less on disk, else windows of `chunk_bytes` of text spread
// evenly over it, each cut to whole sentences (of JSON lines: the lines that
// start in it, however long), one pass over each file. It is read as prepare reads the corpus (chunks
// split into sentences on `workers` threads), and each sentence's GPT-2 pieces
// are counted as prepare will encode it (a space before all but a document's
// first), so the vocabulary is learned from the text it encodes. Writes
// vocab.json, merges.txt and training.json (the options, the ranges sampled,
// the counts and times) into OUT.partial, renamed to `out` when whole.
struct TokenizerTrainingOptions {
  std::vector<std::string> data;  // as PrepareOptions::data
  int64_t vocab_size = 2048;
  double sample_mb = 1000;        // MB of 10^6 bytes
  int workers = 0;                // counting threads; 0: every core
  std::string document_separator; // as PrepareOptions's
  std::string json_key = "text";  // as PrepareOptions's
  bool skip_bad_lines = false;    // as PrepareOptions's
  int64_t chunk_bytes = int64_t{1} << 20;
  std::string out;
};

struct TokenizerTrainingReport {
  int64_t corpus_bytes = 0, sample_bytes = 0, pieces = 0, vocab_size = 0, merges = 0, bad_lines = 0;
  int64_t decompressed_bytes = 0;  // text of compressed files decompressed to take the sample (read or skipped)
  std::vector<TextRange> sample;
  int workers = 0;
  double count_seconds = 0, learn_seconds = 0;
};

TokenizerTrainingReport train_tokenizer(const TokenizerTrainingOptions& options);

// `bart_pretrain merge --out DATASET PART...`: datasets prepared in parts (on
// several hosts, from parts of a corpus) into one, their documents in the
// order given: the stores' indexes concatenated and their tokens copied, the
// sources listed in order. The parts must share the tokenizer and the rules
// (the manifests say). Written as DATASET.partial, renamed when whole.
PrepareReport merge_datasets(const std::vector<std::string>& parts, const std::string& out);

// The sources prepare records for `data` (corpus_files' paths and sizes), to
// compare with a manifest's "sources".
nlohmann::json corpus_sources(const std::vector<std::string>& data);

// The corpus files of `data` in the order prepare reads them: each directory's
// regular files by sorted path, a file given by name as is; a second path to a
// file already listed (a link) and empty files left out, and a directory's
// binary files (a NUL byte in the first 8000 bytes of their content,
// decompressed, as git decides; never a JSON lines file, whose NUL is a
// malformed line) left out and listed in `binary` (if given). Throws naming a
// path that does not exist, a binary file given by name, or a compressed file
// that is not what its name says.
std::vector<std::string> corpus_files(const std::vector<std::string>& data,
                                      std::vector<std::string>* binary = nullptr);
// One line for the log naming the binary files a directory held (corpus_files'
// `binary`): how many, and the first few.
std::string binary_files_left_out(const std::string& who, const std::vector<std::string>& binary);

// Where `pos` may end a chunk of `text`: one past the whitespace that follows
// the last sentence end (a blank line, or '.', '!', '?' before whitespace)
// before `pos`, or 0 when none does. split_sentences of the two parts gives the
// sentences of the whole.
size_t last_sentence_break(const std::string& text, size_t pos);

// `text` cut at its separator lines (the lines dropped), each part the end or
// the start of a document; one part when `separator` is "" or none is found.
// `line_start`: whether text[0] begins a line.
std::vector<std::string_view> split_documents(std::string_view text, const std::string& separator, bool line_start);

// The hash the manifest records for a tokenizer: xxh3 of its two files' contents.
std::string tokenizer_hash(const std::string& vocab_json, const std::string& merges_txt);

// The prefix of the store `dataset` names: DATASET/tokens for a prepared
// dataset directory, else `dataset` itself (Megatron's PREFIX.idx/.bin).
std::string store_prefix(const std::string& dataset);

// `bart_pretrain prepare`: prepare_dataset, and a line of what it did.
int train_tokenizer_command(const TokenizerTrainingOptions& options);
int prepare_command(const PrepareOptions& options);
int merge_command(const std::vector<std::string>& parts, const std::string& out);
// `bart_pretrain inspect --dataset D [--sequences A:B] [--verify]`: the store's
// counts (and the manifest's, for a prepared dataset) as one JSON line; then
// the sequences [A, B) as JSON arrays, a line each. --verify reads the whole
// index and, for a prepared dataset, checks both files against the manifest's
// sizes and checksums; a mismatch throws naming the file.
int inspect_command(const std::string& dataset, const std::string& range, bool verify);

// DATASET/manifest.json, parsed; throws naming the dataset when it is missing
// or not a dataset's (a store without one: Megatron's, given by prefix).
nlohmann::json read_manifest(const std::string& dataset_dir);

}  // namespace bart
