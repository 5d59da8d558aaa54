// tokenizer.h — byte-level BPE in the GPT-2/BART format (vocab.json +
// merges.txt), so a real BART vocabulary loads, and training of a small
// vocabulary from a corpus.
//
// Text is split GPT-2's way (contractions, letter runs, digit runs, other
// symbols, each with an optional leading space; whitespace runs), each piece's
// UTF-8 bytes are mapped to GPT-2's printable byte alphabet (space -> 'Ġ'),
// and the lowest-ranked merges are applied until none is left. Any byte
// sequence round-trips through encode/decode.
//
// Letters and numbers are Unicode's \p{L} and \p{N} (unicode_classes.h, the
// classes Hugging Face tokenizers uses), so any valid UTF-8 text splits exactly
// as GPT-2's regex does in Hugging Face's ByteLevel pre-tokenizer
// (tests/bart/check_hf.py tokenizer compares the ids).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace bart {

class ByteLevelBpe {
 public:
  // BART's special tokens: <s>=0, <pad>=1, </s>=2, <unk>=3 (in trained vocabularies; a
  // loaded vocabulary keeps its own ids), and <mask> last.
  static ByteLevelBpe load(const std::string& vocab_json_path, const std::string& merges_txt_path);
  // The same from the two files' contents (the names are the files' in errors).
  static ByteLevelBpe parse(const std::string& vocab_json, const std::string& merges_txt,
                            const std::string& vocab_name, const std::string& merges_name);
  // Learns merges from `texts` until the vocabulary has `vocab_size` entries
  // (specials, the 256 bytes, merges, <mask>). Deterministic.
  static ByteLevelBpe train(const std::vector<std::string>& texts, int64_t vocab_size);
  void save(const std::string& vocab_json_path, const std::string& merges_txt_path) const;

  // Pieces already encoded, kept by a caller that encodes much text (a corpus)
  // with the same tokenizer: one per thread. Holds at most `limit` pieces, then
  // starts over, so its memory is bounded at any corpus size.
  struct Cache {
    std::unordered_map<std::string, std::vector<int64_t>> pieces;
    size_t limit = size_t{1} << 18;
  };
  // Thread-safe: a tokenizer is immutable once loaded, and encoding writes only `cache`.
  std::vector<int64_t> encode(const std::string& text, Cache& cache) const;
  std::vector<int64_t> encode(const std::string& text) const;
  // Special tokens are left out unless keep_special.
  std::string decode(const std::vector<int64_t>& ids, bool keep_special = false) const;

  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  // The id of a token in the byte alphabet ("Ġworld"), or of a special token; -1 if absent.
  int64_t id(const std::string& token) const;
  const std::string& token(int64_t id) const { return tokens_.at(static_cast<size_t>(id)); }
  int64_t mask_id() const { return id("<mask>"); }
  int64_t pad_id() const { return id("<pad>"); }

  // GPT-2's pre-tokenization of `text` into pieces (byte substrings).
  static std::vector<std::string> pretokenize(const std::string& text);
  // The byte alphabet: byte -> its printable character (UTF-8), and back.
  static const std::vector<std::string>& byte_symbols();

 private:
  std::vector<std::string> tokens_;                   // id -> token
  std::unordered_map<std::string, int64_t> ids_;      // token -> id
  std::vector<std::pair<std::string, std::string>> merges_;
  std::unordered_map<std::string, int64_t> rank_;     // "a b" -> merge rank
  std::unordered_map<std::string, int64_t> byte_of_;  // symbol -> byte
  void index();
  std::vector<std::string> bpe(const std::string& piece) const;
};

}  // namespace bart
