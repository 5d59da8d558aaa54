// packed_examples.h — BART's examples, packed from a token store's index
// (zeroshard/token_store.h; a sequence is a sentence): consecutive sentences of
// one document up to max_tokens - 2 tokens (room for bos and eos), a sentence
// longer than that cut into pieces of at most that many. The validation set
// (held_out.h: whole documents spread over the store, or spans within
// documents when they are few; bounded in tokens) is held out: an example is
// all training or all validation, and no token is in both.
//
// The packing is computed once, in one pass over the store's index, and kept in
// a file (PATH: a 128-byte header, then 16 bytes per example: its first
// sequence, the offset in it, its tokens; the training examples, then the
// held-out ones), so a run that starts again reads nothing but that header: an
// example is read from the file and the store when a batch needs it. The file
// is written beside and renamed, so ranks that build it at once each rename a
// whole one. Reading is thread-safe.
#pragma once

#include "data/held_out.h"

#include <zeroshard/token_store.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace bart {

// An example: its sentences (or pieces of one), as token ids.
using Example = std::vector<std::vector<int64_t>>;

struct PackingOptions {
  int64_t max_tokens = 128;       // per example, bos and eos included; at least 8
  ValidationOptions validation;   // what is held out (held_out.h); default: about 1% of the tokens
};

// What the validation set holds, as the packing found it.
struct ValidationSet {
  bool within_documents = false;  // spans within documents (too few documents to take whole ones)
  int64_t documents = 0;          // documents it takes tokens from
  int64_t spans = 0;              // spans, when within documents
  int64_t tokens = 0;             // its examples' tokens (bos and eos not counted)
  int64_t target_tokens = 0;      // the size asked for (0: documents were given)
};

class PackedExamples {
 public:
  // One of the two splits: examples [0, size()).
  class Split {
   public:
    int64_t size() const { return size_; }
    Example at(int64_t i) const;  // REQUIRES: 0 <= i < size()
    // The tokens of example i's target (<s>, its text, </s>), from its record alone.
    int64_t target_tokens(int64_t i) const;
    bool empty() const { return size_ == 0; }

   private:
    friend class PackedExamples;
    const PackedExamples* owner_ = nullptr;
    int64_t first_ = 0, size_ = 0;  // records [first_, first_ + size_) of the file
  };

  // Opens the packing of `store` for `options` at `path`, building it there
  // first when the file is missing or is another store's or options' packing.
  PackedExamples(std::shared_ptr<const zeroshard::TokenStore> store, const PackingOptions& options,
                 const std::string& path);
  ~PackedExamples();
  PackedExamples(const PackedExamples&) = delete;
  PackedExamples& operator=(const PackedExamples&) = delete;

  const Split& train() const { return train_; }
  const Split& validation() const { return validation_; }
  int64_t tokens() const { return store_->tokens(); }  // every example's, both splits
  const zeroshard::TokenStore& store() const { return *store_; }
  const ValidationSet& held_out() const { return held_; }
  const std::string& path() const { return path_; }
  bool built() const { return built_; }  // whether this opening computed the file

 private:
  Example read(int64_t record) const;
  int64_t record_tokens(int64_t record) const;
  std::shared_ptr<const zeroshard::TokenStore> store_;
  PackingOptions options_;
  std::string path_;
  int fd_ = -1;
  ValidationSet held_;
  bool built_ = false;
  Split train_, validation_;
};

}  // namespace bart
