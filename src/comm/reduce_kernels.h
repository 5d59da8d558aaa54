// reduce_kernels.h — elementwise reductions of several buffers, in a fixed order.
//
// out[i] = op(...op(op(src[0][i], src[1][i]), src[2][i])..., src[k-1][i]),
// accumulated in float32 for bfloat16/float16 (rounded once at the end), in
// int64 / 128 bits for int32 / int64 (the sum wraps around in the element type
// only when stored, as torch's integer sums do; an integer average truncates
// toward zero), in the element type otherwise. kAvg divides the sum by
// `divisor`, or srcs.size() when it is 0 (a ring's last hop divides by the ranks). kMax and kMin return NaN where any rank holds one.
// `out` may alias any src (each block is read before it is written).
// Pure functions; thread-safe.
#pragma once

#include "zeroshard/comm.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace zeroshard::comm {

void reduce_buffers(void* out, const std::vector<const void*>& srcs, int64_t numel,
                    c10::ScalarType dtype, ReduceOp op, int64_t divisor = 0);

// The dtypes the communicator moves and reduces, and a readable check.
bool is_supported_dtype(c10::ScalarType dtype);

}  // namespace zeroshard::comm
