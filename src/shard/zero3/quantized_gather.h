// quantized_gather.h — a unit's shard block-quantized to int8 for its all-gather
// (FullyShardOptions::gather_dtype = Char; ZeRO++'s quantized weights, qwZ).
//
// The shard's n values are cut into blocks of `block` values; each block is
// sent as int8 q = round(x / s), s = max|x| / 127 over the block (symmetric;
// an all-zero block has s = 1), followed by the blocks' fp32 scales:
//
//   packed (uint8, packed_bytes()):  [ q of block 0 | q of block 1 | ... | s_0 s_1 ... ]
//
// Every rank's packed shard has the same size, so one all-gather of uint8
// moves them all; dequantize() writes x' = q * s into the gathered buffer.
// |x - x'| <= s / 2 = max|x| / 254 over its block. About 1.02 bytes per value
// instead of 4 (fp32) or 2 (bf16).
#pragma once

#include <ATen/ATen.h>

namespace zeroshard::shard {

class QuantizedGather {
 public:
  // `shard_numel`: values per rank, a multiple of 64 (FlatLayout's alignment).
  // The block is 256 values, or 128 or 64 where the shard needs it.
  explicit QuantizedGather(int64_t shard_numel);

  int64_t block() const { return block_; }
  int64_t packed_bytes() const { return blocks_ * (block_ + 4); }

  // `values` (n floating-point values) into `packed` (uint8, packed_bytes()).
  void quantize(const at::Tensor& values, at::Tensor& packed) const;
  // `gathered_packed` (uint8, world * packed_bytes()) into `out` (world * n, any floating dtype).
  void dequantize(const at::Tensor& gathered_packed, at::Tensor& out) const;

 private:
  int64_t numel_, block_, blocks_;
};

}  // namespace zeroshard::shard
