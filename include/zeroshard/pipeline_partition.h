// zeroshard/pipeline_partition.h — which blocks of a model each pipeline stage holds.
//
// A model to pipeline is a sequence of blocks (an embedding, a transformer layer, a head, ...),
// each named and marked with a symbol. A partition gives each stage a contiguous, non-empty run
// of blocks; together the stages hold every block exactly once, in order. Every way of making
// one is checked the same: a block in no stage or in two is an error naming it.
//
//   auto p = partition_by_layout(blocks, "E t*3 | t*4 | t*3 L");   // by hand
//   auto b = partition_balanced(blocks, 4);                         // by parameter count
//
// Layout strings: stages separated by '|', each a list of symbols, a symbol optionally repeated
// as `sym*count` ("E t*3 | t*4 | t*3 L": three stages of 4 blocks each).
// Thread-safety: values and pure functions. How it works: docs/pipeline.md ("Partitions").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard::pipeline {

struct Block {
  std::string name;    // "decoder.layers.3"
  std::string symbol;  // for layout strings: letters, e.g. "E", "t", "L"
  int64_t params = 0;  // for balanced partitions
};

struct Partition {
  std::vector<std::vector<size_t>> stages;  // block indices of each stage, ascending and contiguous
  size_t stage_of(size_t block) const;      // REQUIRES: the block is in some stage
};

// REQUIRES (checked, the error names the block or stage and the fix):
// a layout whose symbols, read in order, are the blocks' symbols exactly.
Partition partition_by_layout(const std::vector<Block>& blocks, const std::string& layout);
// `stages` stages whose block counts differ by at most one (earlier stages take the extra ones).
// REQUIRES: 1 <= stages <= blocks.size().
Partition partition_uniform(const std::vector<Block>& blocks, int stages);
// `stages` contiguous stages with the smallest possible largest parameter count.
// REQUIRES: 1 <= stages <= blocks.size().
Partition partition_balanced(const std::vector<Block>& blocks, int stages);

// Throws unless every stage is non-empty and contiguous, and the stages in
// order hold every block once: names the first block that is missing, repeated
// or out of order.
void check_partition(const std::vector<Block>& blocks, const Partition& partition);

// The layout string of a partition ("E t*3 | t*4 | t*3 L"); partition_by_layout reads it back.
std::string to_layout(const std::vector<Block>& blocks, const Partition& partition);

}  // namespace zeroshard::pipeline
