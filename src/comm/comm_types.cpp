#include "zeroshard/comm.h"

namespace zeroshard {

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

std::string to_string(OpKind kind) {
  switch (kind) {
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kBarrier: return "barrier";
  }
  return "?";
}

OpStats CommStats::total() const {
  OpStats t;
  for (const auto& [kind, s] : by_kind) {
    t.calls += s.calls;
    t.bytes_sent += s.bytes_sent;
    t.bytes_received += s.bytes_received;
    t.control_bytes += s.control_bytes;
    t.seconds += s.seconds;
  }
  return t;
}

}  // namespace zeroshard
