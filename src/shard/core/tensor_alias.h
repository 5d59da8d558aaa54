// tensor_alias.h — tensors over part of a flat buffer that are not autograd views.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace zeroshard::shard {

// A contiguous tensor of `shape` over flat[offset, ...), sharing flat's storage
// (StorageImpl) without being an autograd view: zero_grad()'s detach_() and
// set_data() treat it as an ordinary tensor, and it sees whatever the storage
// holds later (including after the storage was freed and re-allocated).
inline at::Tensor alias_of(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * std::max<int64_t>(shape[d + 1], 1);
  }
  auto t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, shape, strides);
  return t;
}

}  // namespace zeroshard::shard
