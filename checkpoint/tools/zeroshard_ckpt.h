// zeroshard_ckpt.h — the commands of zeroshard-ckpt that other code calls in
// process: the program's entry point and the safetensors import (which the
// fuzz tests drive directly). Errors are c10::Error naming the file and what
// is wrong with it.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

int zeroshard_ckpt_main(int argc, char** argv);

namespace zeroshard_ckpt {

// One tensor of a safetensors file: its bytes are [begin, end) of the data
// that follows the header.
struct SafetensorsEntry {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

// The header of the safetensors file at `path`, every entry checked against
// the file before anything is allocated: a known dtype, sizes whose product
// fits the file, offsets inside the data and exactly as long as dtype and
// shape say. Sets *data_start to the data's offset in the file.
std::vector<SafetensorsEntry> read_safetensors_header(const std::string& path, uint64_t* data_start);

// `zeroshard-ckpt import`: the step checkpoint an untrained run of one rank
// would save, from a safetensors file (floating tensors become parameters
// with zero moments, the others buffers), committed in `run_dir` as `step`.
// `map_path`: a name map (their name -> ours), or "".
int import_safetensors(const std::string& in_path, const std::string& run_dir, const std::string& map_path,
                       int64_t step);

}  // namespace zeroshard_ckpt
