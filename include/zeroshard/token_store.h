// zeroshard/token_store.h — a corpus of token ids on disk in Megatron-LM's indexed dataset
// layout (PREFIX.bin, PREFIX.idx), so a store written here loads in Megatron
// (megatron.core.datasets.indexed_dataset.IndexedDataset) and one Megatron's tools wrote loads
// here. A sequence is typically a sentence; a document, a run of them (an article, a file).
//
//   zeroshard::TokenStore store(prefix);                      // reads the header only
//   std::vector<int64_t> ids = store.sequence(i);
//
// TokenStore reads with pread, only what it is asked for: opening costs the same at any corpus
// size. A store is immutable; a TokenStore is safe to read from many threads. TokenStoreWriter
// streams (its memory does not grow with the corpus) and is not thread-safe; a crash at any
// instant leaves either no PREFIX.idx or a whole store.
// How it works, and the file layout: docs/bart.md ("The token store's files").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

// Megatron's token type codes (megatron.core.datasets.indexed_dataset.DType).
enum class TokenType : uint8_t { kUInt8 = 1, kInt8 = 2, kInt16 = 3, kInt32 = 4, kInt64 = 5, kUInt16 = 8 };
std::string to_string(TokenType type);
int64_t token_bytes(TokenType type);

// A store's two files: sizes and XXH3-64 checksums (seed 0; `xxhsum -H3` prints them).
struct TokenStoreDigest {
  uint64_t bin_bytes = 0, bin_xxh3 = 0, idx_bytes = 0, idx_xxh3 = 0;
};
// The narrowest type Megatron picks for a vocabulary (its optimal dtype): uint16
// below 65500 entries, else int32.
TokenType token_type_for(int64_t vocab_size);

class TokenStore {
 public:
  // Opens PREFIX.idx and PREFIX.bin. Throws (c10::Error) naming the file and what is wrong:
  // missing, not an indexed dataset, an unknown version or token type (float stores), or a
  // size its header does not account for (truncated, or written by something else).
  explicit TokenStore(const std::string& prefix);
  ~TokenStore();
  TokenStore(TokenStore&&) noexcept;
  TokenStore& operator=(TokenStore&&) noexcept;

  const std::string& prefix() const;
  TokenType type() const;
  int64_t sequences() const;
  int64_t documents() const;
  int64_t tokens() const;  // every sequence's, from the size of .bin

  // REQUIRES: 0 <= sequence < sequences(); 0 <= document < documents().
  int64_t length(int64_t sequence) const;
  int64_t document_begin(int64_t document) const;  // its first sequence
  int64_t document_end(int64_t document) const;    // one past its last

  // Tokens [offset, offset + count) of a sequence, appended to `out` as int64. Throws naming
  // the store when the sequence's pointer and length fall outside .bin (a damaged index).
  void read(int64_t sequence, int64_t offset, int64_t count, std::vector<int64_t>& out) const;
  std::vector<int64_t> sequence(int64_t i) const;

  // Checks every entry of the index (lengths not negative, each sequence in .bin, pointers
  // consecutive, document ends increasing to N), reading the whole .idx once. Throws naming
  // the first bad entry.
  void verify() const;
  // Both files' checksums: reads them whole.
  TokenStoreDigest digest() const;

 private:
  struct Files;
  std::unique_ptr<Files> m_;
};

class TokenStoreWriter {
 public:
  // Writes PREFIX.bin.partial and side files until finish(). Overwrites the .partial files of
  // an earlier, unfinished writer. REQUIRES: the directory of `prefix` exists.
  TokenStoreWriter(std::string prefix, TokenType type);
  // Without finish(): removes the partial files (an unfinished store never appears).
  ~TokenStoreWriter();
  TokenStoreWriter(const TokenStoreWriter&) = delete;
  TokenStoreWriter& operator=(const TokenStoreWriter&) = delete;

  // One sequence. Throws naming the token when one does not fit the type.
  void add(const int64_t* tokens, int64_t count);
  void add(const std::vector<int64_t>& tokens) { add(tokens.data(), static_cast<int64_t>(tokens.size())); }
  // Ends the current document (after its last add). An empty document (no add
  // since the last end) is recorded as one, as Megatron's builder does.
  void end_document();
  // Every document of `other` after ours (Megatron's IndexedDatasetBuilder.add_index): how
  // stores prepared in parts merge into one. REQUIRES: no sequence added since the last
  // end_document(); other.type() == the writer's type.
  void append(const TokenStore& other);
  // Writes the index and renames both files into place (.bin first: the .idx commits the
  // store); returns their checksums, taken as they were written. REQUIRES: the last document
  // ended.
  TokenStoreDigest finish();

  int64_t sequences() const { return sequences_; }
  int64_t documents() const { return documents_; }
  int64_t tokens() const { return tokens_; }

 private:
  void write_lengths(const int32_t* lengths, int64_t count);
  void write_document_end(int64_t end);
  std::string prefix_;
  TokenType type_;
  struct Files;
  std::unique_ptr<Files> f_;
  int64_t sequences_ = 0, documents_ = 0, tokens_ = 0, open_sequences_ = 0;
  bool finished_ = false;
  std::vector<char> buffer_;  // one sequence in the store's type
};

// Bytes [at, at + n) of the open file `fd` into `out`, whole: reads again after a short read
// or EINTR (which a PreemptionGuard's signals and network file systems cause). Throws naming
// `path`, the offset and the cause when the file ends first or a read fails. Thread-safe;
// moves no file offset. For a trainer's own data files too.
void read_file_range(int fd, void* out, int64_t n, int64_t at, const std::string& path);

}  // namespace zeroshard
