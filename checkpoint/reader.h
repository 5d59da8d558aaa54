// reader.h — reading a committed checkpoint directory without a model: what
// zeroshard-ckpt (inspect, verify, consolidate, export) is built on.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace zeroshard::checkpoint {

namespace h5 {
class File;
}

// A run directory (with `latest`) or a step directory (with manifest.json),
// and optionally a step: the step directory they name. Throws naming the path.
std::filesystem::path resolve_step_dir(const std::filesystem::path& path, int64_t step = -1);

struct PieceRef {
  int rank;
  int64_t begin, end;  // elements of the flattened parameter
};
struct ParamEntry {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;  // the model's (masters are fp32)
  int64_t step = 0;
  std::vector<PieceRef> pieces;
  int64_t numel() const;
};
struct ReplicatedEntry {
  std::string name, kind, dtype;
  std::vector<int64_t> shape;
  int rank = 0;  // the rank file holding it
};

class CheckpointReader {
 public:
  explicit CheckpointReader(const std::filesystem::path& step_dir);
  ~CheckpointReader();
  const nlohmann::json& manifest() const { return manifest_; }
  const std::filesystem::path& dir() const { return dir_; }
  const std::vector<ParamEntry>& params() const { return params_; }
  const std::vector<ReplicatedEntry>& replicated() const { return replicated_; }

  // The full tensor (fp32, the parameter's shape), assembled from the rank
  // files; kind: "master", "exp_avg" or "exp_avg_sq". A rank file is checked
  // against its manifest entry (size, xxh3) before it is first opened.
  at::Tensor read_param(const ParamEntry& p, const std::string& kind = "master");
  // A replicated tensor in its own dtype.
  at::Tensor read_replicated(const ReplicatedEntry& r);

  // Every problem found ("" none): files missing, of the wrong size or
  // checksum; datasets missing or of the wrong size; model.h5 sources that are
  // not the rank files. (A manifest that fails its checksum or whose pieces do
  // not cover a parameter exactly once is refused by the constructor.)
  std::vector<std::string> verify();

 private:
  std::filesystem::path dir_;
  nlohmann::json manifest_;
  std::vector<ParamEntry> params_;
  std::vector<ReplicatedEntry> replicated_;
  std::map<int, std::unique_ptr<h5::File>> open_;
  std::set<int> verified_;  // rank files whose size and xxh3 match the manifest (checked before HDF5 opens one)
  h5::File& file(int rank);
};

// c10's name of a dtype ("Float", "BFloat16", ...) -> the ScalarType.
c10::ScalarType dtype_named(const std::string& name);

}  // namespace zeroshard::checkpoint
