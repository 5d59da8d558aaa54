// byte_stream.cpp — plain reads, zlib's inflate (gzip members, one after
// another as `cat a.gz b.gz` makes them) and libzstd's streaming decompression.
#include "io/byte_stream.h"

#include <c10/util/Exception.h>
#include <zlib.h>
#include <zstd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

namespace bart {

Compression compression_of(const std::string& path) {
  if (name_ends_with(path, ".gz")) return Compression::kGzip;
  if (name_ends_with(path, ".zst")) return Compression::kZstd;
  return Compression::kNone;
}

const char* to_string(Compression c) {
  switch (c) {
    case Compression::kGzip: return "gzip";
    case Compression::kZstd: return "zstd";
    case Compression::kNone: break;
  }
  return "none";
}

std::string without_compression(const std::string& path) {
  switch (compression_of(path)) {
    case Compression::kGzip: return path.substr(0, path.size() - 3);
    case Compression::kZstd: return path.substr(0, path.size() - 4);
    case Compression::kNone: break;
  }
  return path;
}

struct ByteStream::Impl {
  std::string path, who;
  Compression compression = Compression::kNone;
  std::FILE* file = nullptr;
  int64_t file_pos = 0, content_pos = 0;
  // Compressed input read from the file and not yet consumed: in[in_at, in_end).
  std::vector<char> in;
  size_t in_at = 0, in_end = 0;
  bool file_end = false;
  z_stream z{};
  bool z_open = false, member_open = false;  // gzip: inflate set up; inside a member
  int64_t members = 0;                        // gzip: members read whole
  ZSTD_DCtx* zstd = nullptr;
  size_t zstd_hint = 0;  // ZSTD_decompressStream's last answer: 0 at a frame's end

  [[noreturn]] void fail(const std::string& what) const {
    TORCH_CHECK_VALUE(false, who, ": '", path, "' ", what);
    std::abort();
  }

  // More compressed input; false at the file's end.
  bool fill() {
    if (in_at < in_end) return true;
    if (file_end) return false;
    const size_t got = std::fread(in.data(), 1, in.size(), file);
    if (got < in.size()) {
      if (std::ferror(file)) fail(std::string("cannot be read: ") + std::strerror(errno));
      file_end = true;
    }
    in_at = 0;
    in_end = got;
    return got > 0;
  }

  size_t read_plain(char* out, size_t n) {
    const size_t got = std::fread(out, 1, n, file);
    if (got < n && std::ferror(file)) fail(std::string("cannot be read: ") + std::strerror(errno));
    file_pos += static_cast<int64_t>(got);
    return got;
  }

  size_t read_gzip(char* out, size_t n) {
    z.next_out = reinterpret_cast<Bytef*>(out);
    z.avail_out = static_cast<uInt>(n);
    while (z.avail_out > 0) {
      const bool more = fill();
      if (!more && !member_open) break;  // the end, between members
      if (!member_open && members > 0) {
        // Zero bytes after a member (a tape's or a block device's padding): gzip ignores them, so do we.
        while (in_at < in_end && in[in_at] == 0) {
          ++in_at;
          ++file_pos;
        }
        if (in_at == in_end) continue;  // more padding, or the end
      }
      if (!member_open) {
        if (inflateReset(&z) != Z_OK) fail("cannot be decompressed: inflateReset failed");
        member_open = true;
      }
      z.next_in = reinterpret_cast<Bytef*>(in.data() + in_at);
      z.avail_in = static_cast<uInt>(in_end - in_at);
      const uInt room = z.avail_out;
      const int rc = inflate(&z, Z_NO_FLUSH);
      const size_t used = (in_end - in_at) - z.avail_in;
      in_at += used;
      file_pos += static_cast<int64_t>(used);
      if (rc == Z_STREAM_END) {
        member_open = false;  // another member may follow
        ++members;
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        fail(std::string("is not gzip data as its name says (zlib: ") + (z.msg ? z.msg : zError(rc)) + ")");
      } else if (!more && z.avail_out == room) {
        fail("ends inside its gzip stream (cut short?); compress it again");
      }
    }
    return n - z.avail_out;
  }

  size_t read_zstd(char* out, size_t n) {
    ZSTD_outBuffer o{out, n, 0};
    while (o.pos < o.size) {
      const bool more = fill();
      if (!more && zstd_hint == 0) break;  // the end, between frames
      ZSTD_inBuffer i{in.data() + in_at, in_end - in_at, 0};
      const size_t before = o.pos;
      const size_t rc = ZSTD_decompressStream(zstd, &o, &i);
      if (ZSTD_isError(rc)) {
        fail(std::string("is not zstd data as its name says (zstd: ") + ZSTD_getErrorName(rc) + ")");
      }
      in_at += i.pos;
      file_pos += static_cast<int64_t>(i.pos);
      zstd_hint = rc;
      if (!more && o.pos == before) fail("ends inside its zstd frame (cut short?); compress it again");
    }
    return o.pos;
  }
};

ByteStream::ByteStream(const std::string& path, std::string who) : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.path = path;
  s.who = std::move(who);
  s.compression = compression_of(path);
  s.file = std::fopen(path.c_str(), "rb");
  if (s.file == nullptr) s.fail(std::string("cannot be opened: ") + std::strerror(errno));
  if (s.compression == Compression::kGzip) {
    s.in.resize(size_t{1} << 17);
    if (inflateInit2(&s.z, 15 + 16) != Z_OK) s.fail("cannot be decompressed: inflateInit2 failed");  // gzip only
    s.z_open = true;
  } else if (s.compression == Compression::kZstd) {
    s.in.resize(ZSTD_DStreamInSize());
    s.zstd = ZSTD_createDCtx();
    if (s.zstd == nullptr) s.fail("cannot be decompressed: ZSTD_createDCtx failed");
    // Frames made with long-distance matching (zstd --long, up to 2 GiB windows): the CLI needs --long=N
    // to read them; a corpus reader takes them as they come (the window's memory only when a frame asks).
    ZSTD_DCtx_setParameter(s.zstd, ZSTD_d_windowLogMax, 31);  // ZSTD_WINDOWLOG_MAX_64 (static-linking-only)
  }
}

ByteStream::~ByteStream() {
  auto& s = *impl_;
  if (s.z_open) inflateEnd(&s.z);
  if (s.zstd != nullptr) ZSTD_freeDCtx(s.zstd);
  if (s.file != nullptr) std::fclose(s.file);
}

size_t ByteStream::read(char* out, size_t n) {
  auto& s = *impl_;
  size_t got = 0;
  switch (s.compression) {
    case Compression::kNone: got = s.read_plain(out, n); break;
    case Compression::kGzip: got = s.read_gzip(out, n); break;
    case Compression::kZstd: got = s.read_zstd(out, n); break;
  }
  s.content_pos += static_cast<int64_t>(got);
  return got;
}

int64_t ByteStream::file_position() const { return impl_->file_pos; }
int64_t ByteStream::content_position() const { return impl_->content_pos; }
const std::string& ByteStream::path() const { return impl_->path; }

void ByteStream::skip_to(int64_t pos) {
  auto& s = *impl_;
  if (pos <= s.file_pos) return;
  if (s.compression == Compression::kNone) {
    if (std::fseek(s.file, static_cast<long>(pos), SEEK_SET) != 0) {
      s.fail(std::string("cannot be read: ") + std::strerror(errno));
    }
    s.content_pos += pos - s.file_pos;
    s.file_pos = pos;
    return;
  }
  std::vector<char> drop(size_t{1} << 16);
  while (s.file_pos < pos && read(drop.data(), drop.size()) > 0) {
  }
}

}  // namespace bart
