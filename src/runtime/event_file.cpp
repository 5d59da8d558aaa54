// event_file.cpp — TensorBoard event files: TFRecord framing (Boost.CRC's CRC32C) of
// Event messages encoded with libprotobuf's wire format (WireFormatLite).
#include "runtime/event_file.h"

#include "runtime/host_name.h"

#include <boost/crc.hpp>
#include <c10/util/Exception.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>

namespace zeroshard::runtime {

namespace {

using google::protobuf::internal::WireFormatLite;
using Out = google::protobuf::io::CodedOutputStream;

// The schema: the fields of TensorBoard's protos that these files use (tensorboard/compat/proto).
namespace event {  // message Event
constexpr int kWallTime = 1;     // double
constexpr int kStep = 2;         // int64
constexpr int kFileVersion = 3;  // string, in the oneof `what`
constexpr int kSummary = 5;      // Summary, in `what`
constexpr int kSessionLog = 7;   // SessionLog, in `what`
}  // namespace event
namespace session_log {         // message SessionLog
constexpr int kStatus = 1;      // enum SessionStatus
constexpr int kStart = 1;       // SessionStatus START
}  // namespace session_log
namespace summary {             // message Summary
constexpr int kValue = 1;       // repeated Summary.Value
}  // namespace summary
namespace value {               // message Summary.Value
constexpr int kTag = 1;         // string
constexpr int kSimpleValue = 2; // float, in the oneof `value`
constexpr int kTensor = 8;      // TensorProto, in `value`
constexpr int kMetadata = 9;    // SummaryMetadata
}  // namespace value
namespace metadata {            // message SummaryMetadata
constexpr int kPluginData = 1;  // SummaryMetadata.PluginData
constexpr int kPluginName = 1;  // PluginData.plugin_name: string
}  // namespace metadata
namespace tensor {              // message TensorProto
constexpr int kDtype = 1;       // enum DataType
constexpr int kShape = 2;       // TensorShapeProto (empty: a scalar)
constexpr int kStringVal = 8;   // repeated bytes
constexpr int kDtString = 7;    // DataType DT_STRING
}  // namespace tensor

// A message's bytes, written by `fill`.
std::string message(const std::function<void(Out&)>& fill) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    Out out(&stream);
    fill(out);
  }
  return bytes;
}

std::string event_at(int64_t step, double wall_time, const std::function<void(Out&)>& what) {
  return message([&](Out& out) {
    WireFormatLite::WriteDouble(event::kWallTime, wall_time, &out);
    WireFormatLite::WriteInt64(event::kStep, step, &out);
    what(out);
  });
}

}  // namespace

uint32_t EventFile::masked_crc32c(const void* data, size_t n) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;  // CRC-32C (Castagnoli)
  crc.process_bytes(data, n);
  const uint32_t c = crc.checksum();
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

EventFile::EventFile(const std::string& dir, int64_t resume_step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec, "TensorBoard: cannot make the directory '", dir, "': ", ec.message());
  // TensorBoard reads a directory's event files in name order, and a resumed run's file must
  // come after the earlier ones: the time to the microsecond, in fixed widths (a launcher may
  // start a run again within the second), then the host and process as TensorFlow names them.
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::system_clock::now().time_since_epoch()).count();
  char when[32];
  std::snprintf(when, sizeof(when), "%010lld.%06lld", static_cast<long long>(us / 1000000),
                static_cast<long long>(us % 1000000));
  const std::string stem = dir + "/events.out.tfevents." + when + "." + host_name() + "." + std::to_string(::getpid());
  path_ = stem;
  for (int n = 1; std::filesystem::exists(path_); ++n) path_ = stem + "." + std::to_string(n);
  file_ = std::fopen(path_.c_str(), "wb");
  TORCH_CHECK(file_ != nullptr, "TensorBoard: cannot create '", path_, "': ", std::strerror(errno));
  const double now = static_cast<double>(us) / 1e6;
  record(event_at(0, now, [](Out& out) { WireFormatLite::WriteString(event::kFileVersion, "brain.Event:2", &out); }));
  // TensorBoard drops what earlier files hold at this step and after.
  const std::string start = message([](Out& out) { WireFormatLite::WriteEnum(session_log::kStatus, session_log::kStart, &out); });
  record(event_at(resume_step, now, [&](Out& out) { WireFormatLite::WriteBytes(event::kSessionLog, start, &out); }));
}

EventFile::~EventFile() {
  if (file_ != nullptr) std::fclose(file_);
}

void EventFile::record(const std::string& event) {
  // length (uint64, little-endian), its masked CRC32C, the bytes, theirs: one write, then flushed.
  std::string r(12 + event.size() + 4, '\0');
  const uint64_t length = event.size();
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "TFRecord is little-endian; so is this host's layout");
  std::memcpy(r.data(), &length, 8);
  const uint32_t length_crc = masked_crc32c(&length, 8);
  std::memcpy(r.data() + 8, &length_crc, 4);
  std::memcpy(r.data() + 12, event.data(), event.size());
  const uint32_t data_crc = masked_crc32c(event.data(), event.size());
  std::memcpy(r.data() + 12 + event.size(), &data_crc, 4);
  const bool ok = std::fwrite(r.data(), 1, r.size(), file_) == r.size() && std::fflush(file_) == 0;
  TORCH_CHECK(ok, "TensorBoard: cannot write '", path_, "': ", std::strerror(errno));
}

void EventFile::scalars(int64_t step, double wall_time, const std::vector<std::pair<std::string, double>>& values) {
  if (values.empty()) return;
  const std::string s = message([&](Out& out) {
    for (const auto& [tag, v] : values) {
      WireFormatLite::WriteBytes(summary::kValue, message([&](Out& o) {
                                   WireFormatLite::WriteString(value::kTag, tag, &o);
                                   WireFormatLite::WriteFloat(value::kSimpleValue, static_cast<float>(v), &o);
                                 }),
                                 &out);
    }
  });
  record(event_at(step, wall_time, [&](Out& out) { WireFormatLite::WriteBytes(event::kSummary, s, &out); }));
}

void EventFile::text(int64_t step, double wall_time, const std::string& tag, const std::string& markdown) {
  const std::string plugin = message([](Out& o) { WireFormatLite::WriteString(metadata::kPluginName, "text", &o); });
  const std::string meta = message([&](Out& o) { WireFormatLite::WriteBytes(metadata::kPluginData, plugin, &o); });
  const std::string t = message([&](Out& o) {
    WireFormatLite::WriteEnum(tensor::kDtype, tensor::kDtString, &o);
    WireFormatLite::WriteBytes(tensor::kShape, "", &o);
    WireFormatLite::WriteBytes(tensor::kStringVal, markdown, &o);
  });
  const std::string v = message([&](Out& o) {
    WireFormatLite::WriteString(value::kTag, tag, &o);
    WireFormatLite::WriteBytes(value::kMetadata, meta, &o);
    WireFormatLite::WriteBytes(value::kTensor, t, &o);
  });
  const std::string s = message([&](Out& o) { WireFormatLite::WriteBytes(summary::kValue, v, &o); });
  record(event_at(step, wall_time, [&](Out& out) { WireFormatLite::WriteBytes(event::kSummary, s, &out); }));
}

}  // namespace zeroshard::runtime
