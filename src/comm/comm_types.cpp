#include "zeroshard/comm.h"

#include "runtime/host_name.h"
#include "zeroshard/log.h"

#include <ATen/detail/CUDAHooksInterface.h>

#include <algorithm>
#include <cstring>


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

std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text) {
  const int n = comm.size();
  if (n == 1) return {text};
  auto lengths = at::empty({n}, at::kLong);
  comm.all_gather(lengths, at::tensor({static_cast<int64_t>(text.size())}, at::kLong))->wait();
  const auto* len = lengths.data_ptr<int64_t>();
  const int64_t words = (*std::max_element(len, len + n) + 7) / 8;
  if (words == 0) return std::vector<std::string>(static_cast<size_t>(n));
  auto mine = at::zeros({words}, at::kLong);  // the communicator moves no uint8 tensors
  std::memcpy(mine.data_ptr(), text.data(), text.size());
  auto all = at::empty({n * words}, at::kLong);
  comm.all_gather(all, mine)->wait();
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) {
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<int64_t>() + r * words), static_cast<size_t>(len[r]));
  }
  return out;
}

std::vector<int> failed_ranks(Communicator& comm, bool failed) {
  auto flags = at::zeros({comm.size()}, at::kDouble);
  if (failed) flags[comm.rank()] = 1.0;
  if (comm.size() > 1) comm.all_reduce(flags, ReduceOp::kMax)->wait();
  std::vector<int> ranks;
  const double* f = flags.data_ptr<double>();
  for (int r = 0; r < comm.size(); ++r) {
    if (f[r] > 0) ranks.push_back(r);
  }
  return ranks;
}

std::string broadcast_text(Communicator& comm, const std::string& text, int root, std::chrono::milliseconds wait) {
  if (comm.size() == 1) return text;
  auto length = at::tensor({static_cast<int64_t>(comm.rank() == root ? text.size() : 0)}, at::kLong);
  comm.broadcast(length, root)->wait(wait);
  const int64_t bytes = length.item<int64_t>();
  auto words = at::zeros({(bytes + 7) / 8}, at::kLong);  // the communicator moves no uint8 tensors
  if (comm.rank() == root) std::memcpy(words.data_ptr(), text.data(), text.size());
  comm.broadcast(words, root)->wait(wait);
  return comm.rank() == root ? text : std::string(reinterpret_cast<const char*>(words.data_ptr()), bytes);
}

ProcessGroup::ProcessGroup(std::shared_ptr<Communicator> data_, std::shared_ptr<Communicator> control_)
    : data(std::move(data_)), control(std::move(control_)) {
  TORCH_CHECK_VALUE(data != nullptr && control != nullptr, "ProcessGroup: the ", data ? "control" : "data",
                    " communicator is null");
  TORCH_CHECK_VALUE(control->device().is_cpu(), "ProcessGroup: the control communicator moves ", control->device(),
                    " tensors; the control plane (flags, norms, votes) needs a CPU communicator (init_communicator)");
  TORCH_CHECK_VALUE(control->size() == data->size() && control->rank() == data->rank(),
                    "ProcessGroup: the data communicator is rank ", data->rank(), " of ", data->size(),
                    " but the control communicator is rank ", control->rank(), " of ", control->size(),
                    "; pair each device communicator with the CPU communicator it was made from");
}

std::string to_string(DeviceTransport transport) {
  switch (transport) {
    case DeviceTransport::kAuto: return "auto";
    case DeviceTransport::kNccl: return "nccl";
    case DeviceTransport::kStaged: return "staged";
  }
  return "?";
}

namespace {

// How many of `comm`'s ranks run on this host (the same host name): the ranks
// that share its GPUs. Collective.
int ranks_on_this_host(Communicator& comm) {
  const std::string host = host_name();
  const auto hosts = all_gather_text(comm, host);
  return static_cast<int>(std::count(hosts.begin(), hosts.end(), host));
}

}  // namespace

ProcessGroup device_group(std::shared_ptr<Communicator> cpu, c10::Device device, const CommOptions& options,
                          DeviceTransport transport) {
  TORCH_CHECK_VALUE(cpu != nullptr, "device_group: the CPU communicator is null; pass zeroshard::init_communicator()");
  if (device.is_cpu()) return ProcessGroup::of(std::move(cpu));
  TORCH_CHECK_VALUE(device.is_cuda(), "device_group: no collectives for ", device, " tensors; use cpu or cuda");
  const int gpus = static_cast<int>(at::detail::getCUDAHooks().getNumGPUs());
  TORCH_CHECK_VALUE(gpus > 0, "device_group: ", device, " was asked for but no CUDA device is visible (",
                    "CUDA_VISIBLE_DEVICES, or a zeroshard built against a CPU LibTorch); use cpu");
  const int local = ranks_on_this_host(*cpu);
  if (transport == DeviceTransport::kStaged) return stage_through_host(std::move(cpu), device);
  if (transport == DeviceTransport::kAuto && local > gpus) {
    log_warn("device_group: " + std::to_string(local) + " ranks on this node share " + std::to_string(gpus) +
             " GPU(s); their collectives go through host memory (stage_through_host), since NCCL refuses two "
             "ranks on one GPU. Give each rank a GPU of its own for NCCL");
    return stage_through_host(std::move(cpu), device);
  }
  return init_nccl(std::move(cpu), device, options);
}

#ifdef ZS_WITH_CUDA
bool cuda_enabled() { return true; }
#else
bool cuda_enabled() { return false; }

ProcessGroup init_nccl(std::shared_ptr<Communicator>, c10::Device device, const CommOptions&) {
  TORCH_CHECK_VALUE(false, "init_nccl: this zeroshard was built without CUDA and NCCL (against a CPU LibTorch, "
                    "or with -DZS_WITH_CUDA=OFF), so it has no NCCL communicator for ", device,
                    "; rebuild it against a CUDA LibTorch, or use stage_through_host");
}
#endif

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
