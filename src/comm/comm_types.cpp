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

std::shared_ptr<Communicator> Communicator::dup() {
  std::vector<int> all(static_cast<size_t>(size()));
  for (int r = 0; r < size(); ++r) all[static_cast<size_t>(r)] = r;
  return split(all);
}

ProcessGroup ProcessGroup::of(std::shared_ptr<Communicator> comm) {
  TORCH_CHECK_VALUE(comm != nullptr, "ProcessGroup::of: the communicator is null");
  TORCH_CHECK_VALUE(comm->device().is_cpu(), "ProcessGroup::of: the communicator moves ", comm->device(),
                    " tensors; its control plane needs a CPU communicator of the same ranks: "
                    "ProcessGroup{device_comm, cpu_comm}");
  return {comm, comm};
}

OpStats& OpStats::operator+=(const OpStats& other) {
  calls += other.calls;
  bytes_sent += other.bytes_sent;
  bytes_received += other.bytes_received;
  control_bytes += other.control_bytes;
  seconds += other.seconds;
  return *this;
}

OpStats CommStats::total() const {
  OpStats t;
  for (const auto& [kind, s] : by_kind) t += s;
  return t;
}

CommStats& CommStats::operator+=(const CommStats& other) {
  for (const auto& [kind, s] : other.by_kind) by_kind[kind] += s;
  return *this;
}

}  // namespace zeroshard
