// byte_stream.h — a corpus file's bytes as they stream in: read as they are,
// or decompressed on the way (gzip by zlib for `.gz`, zstd by libzstd for
// `.zst`), with errors that name the file. Memory is a fixed few hundred KB
// whatever the file's size. One reader; not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace bart {

enum class Compression { kNone, kGzip, kZstd };

// By the file's name: ".gz" gzip, ".zst" zstd, else none.
Compression compression_of(const std::string& path);
const char* to_string(Compression c);

// `path` without its compression suffix ("a.jsonl.zst" -> "a.jsonl").
std::string without_compression(const std::string& path);

// Whether `name` ends with `suffix` (a file's kind, by its name).
inline bool name_ends_with(std::string_view name, std::string_view suffix) {
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

class ByteStream {
 public:
  // Opens `path`, decompressing as compression_of(path) says. `who` starts the
  // errors ("prepare"). Throws naming the file when it cannot be opened.
  ByteStream(const std::string& path, std::string who);
  ~ByteStream();
  ByteStream(const ByteStream&) = delete;
  ByteStream& operator=(const ByteStream&) = delete;

  // Up to `n` bytes of the (decompressed) content into `out`; fewer only at
  // the end, 0 there. Throws naming the file on a read error, on data that is
  // not of its compression, and on a compressed stream cut short.
  size_t read(char* out, size_t n);

  // Bytes of the file consumed so far (for a compressed file, of the
  // compressed bytes: where it stands in the file on disk).
  int64_t file_position() const;
  // Bytes of content delivered or skipped so far.
  int64_t content_position() const;

  // Moves on to file position `pos` (>= file_position()): a seek for a plain
  // file; a compressed one decompresses and drops content until its
  // compressed position reaches `pos` (or the end).
  void skip_to(int64_t pos);

  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bart
