#include "optim/grad_norm.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

namespace zeroshard::optim {
namespace {

template <typename T>
double sumsq(const T* p, int64_t n) {
  return at::parallel_reduce(
      int64_t{0}, n, int64_t{1} << 15, 0.0,
      [p](int64_t b, int64_t e, double acc) {
        double s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // four chains keep the adds pipelined
        int64_t i = b;
        for (; i + 4 <= e; i += 4) {
          const double a0 = static_cast<float>(p[i]), a1 = static_cast<float>(p[i + 1]);
          const double a2 = static_cast<float>(p[i + 2]), a3 = static_cast<float>(p[i + 3]);
          s0 += a0 * a0;
          s1 += a1 * a1;
          s2 += a2 * a2;
          s3 += a3 * a3;
        }
        for (; i < e; ++i) {
          const double a = static_cast<float>(p[i]);
          s0 += a * a;
        }
        return acc + ((s0 + s1) + (s2 + s3));
      },
      [](double a, double b) { return a + b; });
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

}  // namespace zeroshard::optim
