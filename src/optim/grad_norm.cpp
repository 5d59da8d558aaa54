#include "optim/grad_norm.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

namespace zeroshard::optim {
namespace {

// Elements per chunk. The chunks are fixed by n alone and their sums are added in
// order, so the result is the same bits at every thread count (at::parallel_reduce
// splits by thread count, which would change the last bits of the norm, and so the
// clipped update, with OMP_NUM_THREADS).
constexpr int64_t kChunk = int64_t{1} << 15;

template <typename T>
double chunk_sumsq(const T* p, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // four chains keep the adds pipelined
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const double a0 = static_cast<float>(p[i]), a1 = static_cast<float>(p[i + 1]);
    const double a2 = static_cast<float>(p[i + 2]), a3 = static_cast<float>(p[i + 3]);
    s0 += a0 * a0;
    s1 += a1 * a1;
    s2 += a2 * a2;
    s3 += a3 * a3;
  }
  for (; i < n; ++i) {
    const double a = static_cast<float>(p[i]);
    s0 += a * a;
  }
  return (s0 + s1) + (s2 + s3);
}

template <typename T>
double sumsq(const T* p, int64_t n) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  if (chunks <= 1) return chunk_sumsq(p, n);
  std::vector<double> partial(static_cast<size_t>(chunks));
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      partial[static_cast<size_t>(c)] = chunk_sumsq(p + c * kChunk, std::min(kChunk, n - c * kChunk));
    }
  });
  double sum = 0;
  for (double s : partial) sum += s;
  return sum;
}

}  // namespace

double sum_of_squares(const void* data, c10::ScalarType dtype, int64_t n) {
  switch (dtype) {
    case c10::ScalarType::Float: return sumsq(static_cast<const float*>(data), n);
    case c10::ScalarType::BFloat16: return sumsq(static_cast<const c10::BFloat16*>(data), n);
    case c10::ScalarType::Half: return sumsq(static_cast<const c10::Half*>(data), n);
    default:
      TORCH_CHECK_VALUE(false, "sum_of_squares: dtype ", c10::toString(dtype),
                        " is not supported; use Float, BFloat16 or Half");
  }
}

PendingSum pending_sum_of_squares(const std::vector<at::Tensor>& tensors) {
  PendingSum sum;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    if (t.device().is_cpu()) {
      sum.host += sum_of_squares(t.data_ptr(), t.scalar_type(), t.numel());
      continue;
    }
    const auto sq = at::linalg_vector_norm(t, 2, c10::nullopt, false, at::kFloat).to(at::kDouble).square();
    auto it = std::find_if(sum.device.begin(), sum.device.end(), [&](const at::Tensor& s) { return s.device() == t.device(); });
    if (it == sum.device.end()) {
      sum.device.push_back(sq);
    } else {
      *it = *it + sq;
    }
  }
  return sum;
}

double sum_of_squares(const std::vector<at::Tensor>& tensors) { return read_sums({pending_sum_of_squares(tensors)})[0]; }

void PendingSum::add(const PendingSum& other, double factor) {
  host += factor * other.host;
  for (const auto& d : other.device) device.push_back(factor == 1.0 ? d : d * factor);
}

std::vector<double> read_sums(const std::vector<PendingSum>& sums) {
  std::vector<double> out;
  std::vector<std::pair<c10::Device, std::vector<std::pair<size_t, at::Tensor>>>> by_device;  // (sum, part)
  for (size_t i = 0; i < sums.size(); ++i) {
    out.push_back(sums[i].host);
    for (const auto& d : sums[i].device) {
      auto it = std::find_if(by_device.begin(), by_device.end(), [&](const auto& e) { return e.first == d.device(); });
      if (it == by_device.end()) it = by_device.insert(by_device.end(), {d.device(), {}});
      it->second.emplace_back(i, d.reshape({}));
    }
  }
  for (const auto& [device, parts] : by_device) {
    std::vector<at::Tensor> scalars;
    for (const auto& p : parts) scalars.push_back(p.second);
    const auto host = at::stack(scalars).to(at::kCPU, at::kDouble);  // the one stop of the host for this device
    const double* v = host.data_ptr<double>();
    for (size_t k = 0; k < parts.size(); ++k) out[parts[k].first] += v[k];
  }
  return out;
}

}  // namespace zeroshard::optim
