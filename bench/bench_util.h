// bench_util.h — pieces the training benchmarks share.
#pragma once

#include <zeroshard/comm.h>
#include <zeroshard/metrics.h>

#include <torch/torch.h>

#include <vector>

namespace zeroshard::bench {

// Peak resident set size of this process, MiB.
inline double peak_rss_mib() { return static_cast<double>(peak_rss_bytes()) / (1 << 20); }

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
