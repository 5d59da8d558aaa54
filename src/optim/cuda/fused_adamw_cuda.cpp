#include "optim/cuda/fused_adamw_cuda.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace zeroshard::optim {
namespace {

kernel::Half16 kind_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return kernel::Half16::kNone;
    case at::kBFloat16: return kernel::Half16::kBF16;
    case at::kHalf: return kernel::Half16::kF16;
    default:
      TORCH_CHECK_VALUE(false, "fused_adamw_cuda: ", what, " dtype ", t.scalar_type(),
                        " is not supported; use Float, BFloat16 or Half");
  }
}

void check_array(const at::Tensor& t, const at::Tensor& master, const char* what) {
  TORCH_CHECK_VALUE(t.device() == master.device(), "fused_adamw_cuda: ", what, " is on ", t.device(),
                    " but the master is on ", master.device(), "; keep every array on one device");
  TORCH_CHECK_VALUE(t.is_contiguous() && t.numel() == master.numel(), "fused_adamw_cuda: ", what, " has ",
                    t.numel(), " elements", t.is_contiguous() ? "" : " (not contiguous)", ", the master ",
                    master.numel(), "; pass contiguous arrays of one length");
}

cuda::Arrays arrays_of(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, const at::Tensor& copy) {
  TORCH_CHECK_VALUE(master.is_cuda() && master.scalar_type() == at::kFloat && master.is_contiguous(),
                    "fused_adamw_cuda: the master must be a contiguous fp32 CUDA tensor, got ",
                    master.scalar_type(), " on ", master.device());
  check_array(grad, master, "the gradient");
  check_array(exp_avg, master, "exp_avg");
  check_array(exp_avg_sq, master, "exp_avg_sq");
  TORCH_CHECK_VALUE(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat,
                    "fused_adamw_cuda: the moments must be fp32");
  cuda::Arrays a;
  a.param = master.data_ptr<float>();
  a.grad = grad.data_ptr();
  a.grad_kind = kind_of(grad, "gradient");
  a.exp_avg = exp_avg.data_ptr<float>();
  a.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  if (copy.defined()) {
    check_array(copy, master, "the parameter copy");
    a.copy_kind = kind_of(copy, "parameter copy");
    TORCH_CHECK_VALUE(a.copy_kind != kernel::Half16::kNone,
                      "fused_adamw_cuda: the parameter copy must be BFloat16 or Half");
    a.copy = copy.data_ptr();
  }
  return a;
}

}  // namespace

void fused_adamw_cuda(const std::vector<AdamWPiece>& pieces, const at::Tensor& master, const at::Tensor& grad,
                      const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const at::Tensor& copy,
                      const cuda::DeviceScalars& scalars) {
  const cuda::Arrays a = arrays_of(master, grad, exp_avg, exp_avg_sq, copy);
  const c10::cuda::CUDAGuard guard(master.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(master.device().index()).stream();
  std::vector<cuda::Segment> segments;
  std::vector<cuda::Coeffs> coeffs;
  auto flush = [&] {
    if (segments.empty()) return;
    C10_CUDA_CHECK(cuda::adamw(a, segments.data(), static_cast<int>(segments.size()), coeffs.data(),
                               static_cast<int>(coeffs.size()), scalars, stream));
    segments.clear();
    coeffs.clear();
  };
  for (const auto& piece : pieces) {
    TORCH_CHECK_VALUE(piece.begin >= 0 && piece.size >= 0 && piece.begin + piece.size <= master.numel(),
                      "fused_adamw_cuda: piece [", piece.begin, ", ", piece.begin + piece.size,
                      ") is outside the ", master.numel(), " elements");
    if (piece.size == 0) continue;
    int set = -1;  // pieces of one parameter group share their coefficients
    for (size_t k = 0; k < coeffs.size(); ++k) {
      if (std::memcmp(&coeffs[k], &piece.coeffs, sizeof(cuda::Coeffs)) == 0) set = static_cast<int>(k);
    }
    if (set < 0 && coeffs.size() == cuda::kMaxCoeffSets) flush();
    if (set < 0) {
      set = static_cast<int>(coeffs.size());
      coeffs.push_back(piece.coeffs);
    }
    segments.push_back(cuda::Segment{piece.begin, piece.size, set});
    if (segments.size() == cuda::kMaxSegments) flush();
  }
  flush();
}

void fused_adamw_cuda_step(const kernel::Hyper& hyper, const at::Tensor& step, const at::Tensor& master,
                           const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                           const at::Tensor& copy, const cuda::DeviceScalars& scalars) {
  const cuda::Arrays a = arrays_of(master, grad, exp_avg, exp_avg_sq, copy);
  TORCH_CHECK_VALUE(step.device() == master.device() && step.scalar_type() == at::kFloat && step.numel() == 1,
                    "fused_adamw_cuda_step: the step must be one fp32 element on ", master.device(), ", got ",
                    step.numel(), " ", step.scalar_type(), " on ", step.device());
  const c10::cuda::CUDAGuard guard(master.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(master.device().index()).stream();
  C10_CUDA_CHECK(cuda::adamw_device_step(a, master.numel(), hyper, step.data_ptr<float>(), scalars, stream));
}

}  // namespace zeroshard::optim
