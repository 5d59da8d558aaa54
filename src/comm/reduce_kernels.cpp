#include "comm/reduce_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace zeroshard::comm {
namespace {

// Elements per block: the float32 accumulator stays in L1.
constexpr int64_t kBlock = 2048;

template <typename Acc>
bool is_nan(Acc v) {
  if constexpr (std::is_floating_point_v<Acc>) {
    return std::isnan(v);
  } else {
    return false;
  }
}

// The accumulator back to the element type. Integers wrap around (two's complement,
// through the unsigned type, where the conversion is defined) as torch's integer
// sums do, instead of overflowing a signed type mid-sum.
template <typename T, typename Acc>
T narrow(Acc v) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<std::make_unsigned_t<T>>(v));
  } else {
    return static_cast<T>(v);
  }
}

template <typename T, typename Acc, typename Combine>
void reduce_typed(T* out, const std::vector<const void*>& srcs, int64_t numel, Combine combine,
                  int64_t average_over) {
  Acc acc[kBlock];
  const size_t k = srcs.size();
  const bool average = average_over > 0;
  const Acc scale = average ? static_cast<Acc>(average_over) : Acc(1);
  for (int64_t base = 0; base < numel; base += kBlock) {
    const int64_t n = std::min(kBlock, numel - base);
    const T* s0 = static_cast<const T*>(srcs[0]) + base;
    for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<Acc>(s0[i]);
    for (size_t j = 1; j < k; ++j) {
      const T* s = static_cast<const T*>(srcs[j]) + base;
      for (int64_t i = 0; i < n; ++i) acc[i] = combine(acc[i], static_cast<Acc>(s[i]));
    }
    T* o = out + base;
    if (average) {
      for (int64_t i = 0; i < n; ++i) o[i] = narrow<T>(acc[i] / scale);
    } else {
      for (int64_t i = 0; i < n; ++i) o[i] = narrow<T>(acc[i]);
    }
  }
}

template <typename T, typename Acc>
void reduce_op(void* out, const std::vector<const void*>& srcs, int64_t numel, ReduceOp op, int64_t divisor) {
  T* o = static_cast<T*>(out);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      reduce_typed<T, Acc>(o, srcs, numel, [](Acc a, Acc b) { return a + b; },
                           op == ReduceOp::kAvg ? (divisor > 0 ? divisor : static_cast<int64_t>(srcs.size())) : 0);
      return;
    // A NaN on any rank wins, as in torch.maximum / torch.minimum (a comparison alone
    // would keep it only where the first rank holds it).
    case ReduceOp::kMax:
      reduce_typed<T, Acc>(
          o, srcs, numel, [](Acc a, Acc b) { return is_nan(a) ? a : (is_nan(b) || b > a) ? b : a; }, 0);
      return;
    case ReduceOp::kMin:
      reduce_typed<T, Acc>(
          o, srcs, numel, [](Acc a, Acc b) { return is_nan(a) ? a : (is_nan(b) || b < a) ? b : a; }, 0);
      return;
  }
}

}  // namespace

bool is_supported_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
    case c10::kBFloat16:
    case c10::kHalf:
    case c10::kDouble:
    case c10::kInt:
    case c10::kLong:
      return true;
    default:
      return false;
  }
}

void reduce_buffers(void* out, const std::vector<const void*>& srcs, int64_t numel,
                    c10::ScalarType dtype, ReduceOp op, int64_t divisor) {
  TORCH_INTERNAL_ASSERT(!srcs.empty());
  switch (dtype) {
    case c10::kFloat: return reduce_op<float, float>(out, srcs, numel, op, divisor);
    case c10::kBFloat16: return reduce_op<c10::BFloat16, float>(out, srcs, numel, op, divisor);
    case c10::kHalf: return reduce_op<c10::Half, float>(out, srcs, numel, op, divisor);
    case c10::kDouble: return reduce_op<double, double>(out, srcs, numel, op, divisor);
    // Integers accumulate in a wider type: a sum that overflows only mid-way (a + b - c)
    // comes out exact, and an average divides the exact sum.
    case c10::kInt: return reduce_op<int32_t, int64_t>(out, srcs, numel, op, divisor);
    case c10::kLong: return reduce_op<int64_t, __int128>(out, srcs, numel, op, divisor);
    default:
      TORCH_CHECK(false, "reduce: dtype ", dtype, " is not supported");
  }
}

}  // namespace zeroshard::comm
