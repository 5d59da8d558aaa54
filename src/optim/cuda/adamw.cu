// adamw.cu — the fused AdamW kernel (adamw_cuda.h). Compiled with -fmad=false:
// no multiply-add contraction, so the device computes the CPU kernel's bits.
#include "optim/cuda/adamw_cuda.h"

#include <algorithm>
#include <mutex>

namespace zeroshard::optim::cuda {
namespace {

using kernel::Half16;

constexpr int kThreads = 256;
// Enough resident blocks to saturate memory, few enough that each thread loops.
constexpr int kBlocksPerSm = 8;

struct Table {
  int32_t n_segments = 0;
  Segment segments[kMaxSegments];
  Coeffs coeffs[kMaxCoeffSets];
};

template <Half16 GK, Half16 CK, bool kDeviceStep>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(Arrays a, Table t, Hyper hyper, const float* step, DeviceScalars scalars) {
  if (scalars.found_inf != nullptr && *scalars.found_inf > 0) return;
  const float scale = scalars.grad_scale != nullptr ? *scalars.grad_scale : 1.0f;
  __shared__ Coeffs from_step;
  if constexpr (kDeviceStep) {
    if (threadIdx.x == 0) from_step = kernel::coeffs_of_step(hyper, static_cast<double>(*step), 1.0);
    __syncthreads();
  }
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int s = 0; s < t.n_segments; ++s) {
    const Segment seg = t.segments[s];
    Coeffs c = kDeviceStep ? from_step : t.coeffs[seg.coeffs];
    c.grad_scale = c.grad_scale * scale;
    kernel::update_segment<GK, CK>(c, a, seg, thread, threads);
  }
}

int sm_count() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  static std::mutex mu;
  static int counts[256] = {};
  std::lock_guard<std::mutex> lock(mu);
  int& n = counts[device & 255];
  if (n == 0 && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) n = 1;
  return std::max(n, 1);
}

template <bool kDeviceStep>
cudaError_t launch(const Arrays& a, const Table& t, int64_t elements, const Hyper& hyper, const float* step,
                   const DeviceScalars& scalars, cudaStream_t stream) {
  if (elements == 0) return cudaSuccess;
  const int64_t quads = (elements + 3) / 4;
  const int blocks = static_cast<int>(
      std::min<int64_t>((quads + kThreads - 1) / kThreads, static_cast<int64_t>(sm_count()) * kBlocksPerSm));
  auto run = [&](auto kernel) {
    kernel<<<blocks, kThreads, 0, stream>>>(a, t, hyper, step, scalars);
    return cudaGetLastError();
  };
  // 3 gradient kinds x 3 copy kinds.
#define ZS_ADAMW_COPY(GK)                                                                        \
  switch (a.copy_kind) {                                                                         \
    case Half16::kBF16: return run(adamw_kernel<GK, Half16::kBF16, kDeviceStep>);                \
    case Half16::kF16: return run(adamw_kernel<GK, Half16::kF16, kDeviceStep>);                  \
    default: return run(adamw_kernel<GK, Half16::kNone, kDeviceStep>);                           \
  }
  switch (a.grad_kind) {
    case Half16::kBF16: ZS_ADAMW_COPY(Half16::kBF16)
    case Half16::kF16: ZS_ADAMW_COPY(Half16::kF16)
    default: ZS_ADAMW_COPY(Half16::kNone)
  }
#undef ZS_ADAMW_COPY
}

}  // namespace

cudaError_t adamw(const Arrays& arrays, const Segment* segments, int n_segments, const Coeffs* coeffs,
                  int n_coeffs, const DeviceScalars& scalars, cudaStream_t stream) {
  if (n_segments < 0 || n_segments > kMaxSegments || n_coeffs < 0 || n_coeffs > kMaxCoeffSets) {
    return cudaErrorInvalidValue;
  }
  Table t;
  t.n_segments = n_segments;
  int64_t elements = 0;
  for (int s = 0; s < n_segments; ++s) {
    if (segments[s].coeffs < 0 || segments[s].coeffs >= n_coeffs) return cudaErrorInvalidValue;
    t.segments[s] = segments[s];
    elements = std::max(elements, segments[s].size);  // threads are shared by segments in turn
  }
  std::copy(coeffs, coeffs + n_coeffs, t.coeffs);
  return launch<false>(arrays, t, elements, Hyper{}, nullptr, scalars, stream);
}

cudaError_t adamw_device_step(const Arrays& arrays, int64_t n, const Hyper& hyper, const float* step,
                              const DeviceScalars& scalars, cudaStream_t stream) {
  if (step == nullptr) return cudaErrorInvalidValue;
  Table t;
  t.n_segments = 1;
  t.segments[0] = Segment{0, n, 0};
  return launch<true>(arrays, t, n, hyper, step, scalars, stream);
}

}  // namespace zeroshard::optim::cuda
