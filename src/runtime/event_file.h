// event_file.h — TensorBoard's event files: TFRecord records (a length, its masked
// CRC32C, the bytes, their masked CRC32C) of protobuf `Event` messages, encoded with
// libprotobuf's wire format over the fields TensorBoard documents (event.proto,
// summary.proto; the numbers are in event_file.cpp). Each record is written whole and
// flushed, so a crash at any instant leaves a file TensorBoard reads to its last whole
// record.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard::runtime {

class EventFile {
 public:
  // Creates a new events.out.tfevents.<unix seconds>.<microseconds>.<host>.<pid> in `dir` (made
  // if missing), and writes its first records: the file version, and a SessionLog START at `resume_step`
  // (the step the run goes on from; 0 for a new run), on which TensorBoard drops what the
  // directory's earlier files hold from that step on: the steps a resumed run takes again
  // replace theirs (one curve, no step twice). Throws naming the path when it cannot be written.
  EventFile(const std::string& dir, int64_t resume_step);
  ~EventFile();
  EventFile(const EventFile&) = delete;
  EventFile& operator=(const EventFile&) = delete;

  // One Event at `step` and `wall_time` (Unix seconds) holding a scalar (a float, as
  // TensorBoard's scalars are) per (tag, value).
  void scalars(int64_t step, double wall_time, const std::vector<std::pair<std::string, double>>& values);
  // One Event with a text summary (TensorBoard's text plugin: markdown) under `tag`.
  void text(int64_t step, double wall_time, const std::string& tag, const std::string& markdown);

  const std::string& path() const { return path_; }

  // TFRecord's masked CRC32C of `n` bytes (exposed for the tests).
  static uint32_t masked_crc32c(const void* data, size_t n);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  void record(const std::string& event);
};

}  // namespace zeroshard::runtime
