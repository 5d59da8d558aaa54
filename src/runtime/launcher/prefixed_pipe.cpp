#include "runtime/launcher/prefixed_pipe.h"

#include <unistd.h>

#include <cerrno>

namespace zeroshard::launcher {

void PrefixedPipe::close() {
  boost::system::error_code ec;
  stream_.close(ec);
}

void PrefixedPipe::read() {
  auto self = shared_from_this();
  stream_.async_read_some(boost::asio::buffer(chunk_), [self](boost::system::error_code ec, size_t n) {
    if (n > 0) self->consume(self->chunk_.data(), n);
    if (ec) {
      if (!self->partial_.empty()) self->emit(self->partial_ + "\n");
      self->partial_.clear();
      self->open_ = false;
      return;
    }
    self->read();
  });
}

void PrefixedPipe::consume(const char* data, size_t n) {
  size_t start = 0;
  for (size_t i = 0; i < n; ++i) {
    if (data[i] != '\n') continue;
    partial_.append(data + start, i + 1 - start);
    emit(partial_);
    partial_.clear();
    start = i + 1;
  }
  partial_.append(data + start, n - start);
}

void PrefixedPipe::emit(const std::string& line) {
  const std::string s = prefix_ + line;
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t w = ::write(out_fd_, s.data() + off, s.size() - off);
    if (w <= 0) {
      if (w < 0 && errno == EINTR) continue;
      return;  // our own output is gone; keep draining the child
    }
    off += static_cast<size_t>(w);
  }
}

}  // namespace zeroshard::launcher
