// bench_util.h — pieces the training benchmarks share.
#pragma once

#include <zeroshard/comm.h>
#include <zeroshard/metrics.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#ifdef ZS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <vector>

namespace zeroshard::bench {

// Peak resident set size of this process, MiB.
inline double peak_rss_mib() { return static_cast<double>(peak_rss_bytes()) / (1 << 20); }

// Waits until the device has run everything queued on its current stream
// (nothing to wait for on the CPU): before a clock is read.
inline void sync_device(c10::Device device) {
  if (!device.is_cpu()) c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
}

// Peak memory of this rank where its tensors live, MiB: the resident set on the
// CPU, the caching allocator's peak allocation on a CUDA device.
inline double peak_memory_mib(c10::Device device) {
#ifdef ZS_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 20);  // [0]: every pool (StatType AGGREGATE)
  }
#endif
  return peak_rss_mib();
}

// Plain data parallelism: averages every parameter's gradient over the ranks
// with one all_reduce of the flattened gradients.
inline void average_gradients(Communicator& comm, const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) grads.push_back(p.grad().reshape(-1));
  auto flat = torch::cat(grads);
  comm.all_reduce(flat, ReduceOp::kAvg)->wait();
  int64_t off = 0;
  for (const auto& p : params) {
    p.grad().copy_(flat.slice(0, off, off + p.numel()).view_as(p));
    off += p.numel();
  }
}

}  // namespace zeroshard::bench
