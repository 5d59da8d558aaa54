// tokenizer.h — byte-level BPE in the GPT-2/BART format (vocab.json +
// merges.txt), so a real BART vocabulary loads, and training of a vocabulary
// from the pieces of a corpus (prepare.h's train_tokenizer samples and counts them).
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
#include <deque>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace bart {

// How often each piece (ByteLevelBpe::pretokenize's unit) occurs in a text.
// The pieces' bytes are kept in blocks owned here, so counting takes no
// allocation per piece.
class PieceCounts {
 public:
  void add(std::string_view piece, int64_t n = 1);
  void add(const PieceCounts& other);
  // The GPT-2 pieces of `text`, each counted once.
  void add_text(std::string_view text);
  const std::unordered_map<std::string_view, int64_t>& counts() const { return counts_; }
  size_t size() const { return counts_.size(); }

 private:
  std::unordered_map<std::string_view, int64_t> counts_;
  std::deque<std::string> blocks_;  // the keys' bytes; a block never grows past its capacity
};

class ByteLevelBpe {
 public:
  // BART's special tokens: <s>=0, <pad>=1, </s>=2, <unk>=3 (in trained vocabularies; a
  // loaded vocabulary keeps its own ids), and <mask> last.
  static ByteLevelBpe load(const std::string& vocab_json_path, const std::string& merges_txt_path);
  // The same from the two files' contents (the names are the files' in errors).
  static ByteLevelBpe parse(const std::string& vocab_json, const std::string& merges_txt,
                            const std::string& vocab_name, const std::string& merges_name);
  // Learns merges from the pieces until the vocabulary has `vocab_size`
  // entries (specials, the 256 bytes, merges, <mask>), or no pair is left. The
  // most frequent pair of symbols is merged first; a tie goes to the pair whose
  // first (then second) symbol is the smaller, a byte's symbol being its
  // character's code point and a merged one coming after every byte, in the
  // order learned. Those are Hugging Face's BpeTrainer's rules, so both learn
  // the same merges from the same pieces (tests/bart/check_tokenizer_training.py).
  // Pair counts are kept up to date as words merge (only the words holding the
  // merged pair are visited) and the next pair comes from a priority queue.
  static ByteLevelBpe train(const PieceCounts& pieces, int64_t vocab_size);
  // The same from the pieces of `texts`.
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
  int64_t merges() const { return static_cast<int64_t>(merges_.size()); }
  // The id of a token in the byte alphabet ("Ġworld"), or of a special token; -1 if absent.
  int64_t id(const std::string& token) const;
  const std::string& token(int64_t id) const { return tokens_.at(static_cast<size_t>(id)); }
  int64_t mask_id() const { return id("<mask>"); }
  int64_t pad_id() const { return id("<pad>"); }

  // GPT-2's pre-tokenization of `text` into pieces (byte substrings).
  static std::vector<std::string> pretokenize(const std::string& text);
  // The same, appended to `pieces` as views into `text`.
  static void pretokenize(std::string_view text, std::vector<std::string_view>& pieces);
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

// The tokenizer files of a directory (vocab.json, whose presence marks one),
// and the tokenizer they hold.
std::string tokenizer_files_in(const std::string& dir);
ByteLevelBpe load_tokenizer(const std::string& dir);

}  // namespace bart
