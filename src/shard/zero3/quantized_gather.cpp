#include "shard/zero3/quantized_gather.h"

#include <c10/util/Exception.h>

namespace zeroshard::shard {

QuantizedGather::QuantizedGather(int64_t shard_numel) : numel_(shard_numel) {
  TORCH_INTERNAL_ASSERT(shard_numel > 0 && shard_numel % 64 == 0, "a shard of ", shard_numel,
                        " values cannot be cut into blocks of 64");
  block_ = shard_numel % 256 == 0 ? 256 : shard_numel % 128 == 0 ? 128 : 64;
  blocks_ = shard_numel / block_;
}

void QuantizedGather::quantize(const at::Tensor& values, at::Tensor& packed) const {
  TORCH_INTERNAL_ASSERT(values.numel() == numel_ && packed.numel() == packed_bytes() &&
                        packed.scalar_type() == at::kByte);
  const auto x = values.to(at::kFloat).view({blocks_, block_});
  auto scale = x.abs().amax(1).div_(127.0);
  scale.masked_fill_(scale == 0, 1.0);  // an all-zero block: q = 0 whatever s is
  auto q = packed.narrow(0, 0, numel_).view(at::kChar).view({blocks_, block_});
  q.copy_(x.div(scale.unsqueeze(1)).round_().clamp_(-127, 127));
  packed.narrow(0, numel_, 4 * blocks_).copy_(scale.view(at::kByte));
}

void QuantizedGather::dequantize(const at::Tensor& gathered_packed, at::Tensor& out) const {
  const int64_t world = gathered_packed.numel() / packed_bytes();
  TORCH_INTERNAL_ASSERT(gathered_packed.numel() == world * packed_bytes() && out.numel() == world * numel_);
  const auto rows = gathered_packed.view({world, packed_bytes()});
  const auto q = rows.narrow(1, 0, numel_).view(at::kChar).view({world, blocks_, block_});
  const auto scale = rows.narrow(1, numel_, 4 * blocks_).contiguous().view(at::kFloat).view({world, blocks_, 1});
  auto dst = out.view({world, blocks_, block_});
  if (out.scalar_type() == at::kFloat) {
    dst.copy_(q);  // widened in place, then scaled: no buffer of the unit's size besides `out`
    dst.mul_(scale);
  } else {
    dst.copy_(q.to(at::kFloat).mul_(scale));
  }
}

}  // namespace zeroshard::shard
