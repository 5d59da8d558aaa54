// prefixed_pipe.h — one rank's output stream as zeroshard-run prints it: read
// from the rank's pipe and written line by line, each line prefixed
// ("[rank3]: "), so that the ranks' lines never interleave mid-line.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>

#include <array>
#include <cstddef>
#include <memory>
#include <string>

namespace zeroshard::launcher {

class PrefixedPipe : public std::enable_shared_from_this<PrefixedPipe> {
 public:
  // Reads `fd` (owned from now on) and writes to `out_fd`.
  PrefixedPipe(boost::asio::io_context& io, int fd, int out_fd, std::string prefix)
      : stream_(io, fd), out_fd_(out_fd), prefix_(std::move(prefix)) {}

  void start() { read(); }
  // False once the stream ended (the rank and whatever it started closed it).
  bool open() const { return open_; }
  void close();

 private:
  void read();
  void consume(const char* data, size_t n);
  void emit(const std::string& line);

  boost::asio::posix::stream_descriptor stream_;
  const int out_fd_;
  const std::string prefix_;
  std::array<char, 64 * 1024> chunk_;
  std::string partial_;
  bool open_ = true;
};

}  // namespace zeroshard::launcher
