// reader.cpp — CheckpointReader.
#include "reader.h"

#include "checksum.h"
#include "checkpointer_impl.h"
#include "h5.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <fstream>
#include <sstream>

namespace fs = std::filesystem;
using nlohmann::json;

namespace zeroshard::checkpoint {

c10::ScalarType dtype_named(const std::string& name) {
  for (auto t : {at::kFloat, at::kDouble, at::kLong, at::kInt, at::kByte, at::kBool, at::kBFloat16, at::kHalf}) {
    if (name == c10::toString(t)) return t;
  }
  TORCH_CHECK(false, "checkpoint: unknown dtype '", name, "'");
}


int64_t ParamEntry::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

fs::path resolve_step_dir(const fs::path& path, int64_t step) {
  if (step >= 0) {
    const fs::path p = path / ckpt::step_dir_name(step);
    TORCH_CHECK(fs::exists(p / "manifest.json"), "checkpoint: '", p.string(), "' is not a committed checkpoint");
    return p;
  }
  if (fs::exists(path / "manifest.json")) return path;
  TORCH_CHECK(fs::exists(path / "latest"), "checkpoint: '", path.string(),
              "' is neither a run directory (no 'latest') nor a step directory (no manifest.json)");
  return ckpt::latest_step_dir(path);
}

CheckpointReader::CheckpointReader(const fs::path& step_dir) : dir_(step_dir) {
  manifest_ = ckpt::read_manifest(dir_);
  for (const auto& p : manifest_.at("params")) {
    ParamEntry e{p.at("name"), p.at("shape").get<std::vector<int64_t>>(), p.at("dtype"), p.at("step"), {}};
    for (const auto& pc : p.at("pieces")) e.pieces.push_back({pc[0].get<int>(), pc[1].get<int64_t>(), pc[2].get<int64_t>()});
    params_.push_back(std::move(e));
  }
  for (const auto& r : manifest_.at("replicated")) {
    replicated_.push_back({r.at("name"), r.at("kind"), r.at("dtype"), r.at("shape").get<std::vector<int64_t>>(),
                           r.value("rank", 0)});
  }
}

CheckpointReader::~CheckpointReader() = default;

h5::File& CheckpointReader::file(int rank) {
  auto it = open_.find(rank);
  if (it == open_.end()) {
    const auto name = manifest_.at("files").at(static_cast<size_t>(rank)).at("name").get<std::string>();
    it = open_.emplace(rank, std::make_unique<h5::File>(h5::File::open_read((dir_ / name).string()))).first;
  }
  return *it->second;
}

at::Tensor CheckpointReader::read_param(const ParamEntry& p, const std::string& kind) {
  auto full = at::empty({p.numel()}, at::kFloat);
  for (const auto& pc : p.pieces) {
    file(pc.rank).read("/" + kind + "/" + p.name, h5::Type::kFloat32, 0, static_cast<uint64_t>(pc.end - pc.begin),
                       full.data_ptr<float>() + pc.begin);
  }
  return full.view(p.shape);
}

at::Tensor CheckpointReader::read_replicated(const ReplicatedEntry& r) {
  const auto dtype = dtype_named(r.dtype);
  auto t = at::empty(r.shape, at::TensorOptions().dtype(dtype));
  file(r.rank).read_all("/replicated/" + r.name, ckpt::storage_type(dtype, r.name), t.data_ptr());
  return t;
}

std::vector<std::string> CheckpointReader::verify() {
  std::vector<std::string> problems;
  const auto& files = manifest_.at("files");
  std::vector<bool> usable(files.size(), false);
  for (size_t r = 0; r < files.size(); ++r) {
    const fs::path p = dir_ / files[r].at("name").get<std::string>();
    std::error_code ec;
    if (!fs::exists(p, ec)) {
      problems.push_back(p.string() + ": missing");
      continue;
    }
    const auto size = static_cast<int64_t>(fs::file_size(p, ec));
    if (size != files[r].at("bytes").get<int64_t>()) {
      problems.push_back(p.string() + ": " + std::to_string(size) + " bytes, the manifest says " +
                         std::to_string(files[r].at("bytes").get<int64_t>()) + " (truncated?)");
      continue;
    }
    const auto digest = digest_file(p.string());
    if (to_hex(digest.xxh3) != files[r].at("xxh3").get<std::string>()) {
      problems.push_back(p.string() + ": xxh3 " + to_hex(digest.xxh3) + ", the manifest says " +
                         files[r].at("xxh3").get<std::string>() + " (corrupt)");
      continue;
    }
    usable[r] = true;
  }
  for (const auto& p : params_) {  // the pieces cover each parameter (read_manifest checked)
    for (const auto& pc : p.pieces) {
      if (pc.rank < 0 || static_cast<size_t>(pc.rank) >= files.size() || !usable[static_cast<size_t>(pc.rank)]) continue;
      for (const char* kind : {"master", "exp_avg", "exp_avg_sq"}) {
        const std::string ds = std::string("/") + kind + "/" + p.name;
        try {
          auto& f = file(pc.rank);
          if (!f.has(ds)) {
            problems.push_back(f.path() + ": no dataset " + ds);
          } else if (f.dims(ds) != std::vector<uint64_t>{static_cast<uint64_t>(pc.end - pc.begin)}) {
            problems.push_back(f.path() + ": " + ds + " does not have the " + std::to_string(pc.end - pc.begin) +
                               " elements the manifest says");
          }
        } catch (const c10::Error& e) {
          problems.push_back(e.what_without_backtrace());
        }
      }
    }
  }
  // model.h5 maps only the rank files listed, and has every parameter.
  const fs::path view = dir_ / "model.h5";
  if (fs::exists(view)) {
    try {
      auto f = h5::File::open_read(view.string());
      for (const auto& p : params_) {
        for (const auto& src : f.virtual_sources("/" + p.name)) {
          bool listed = false;
          for (const auto& e : files) listed = listed || e.at("name").get<std::string>() == src;
          if (!listed) problems.push_back(view.string() + ": /" + p.name + " maps '" + src + "', not a rank file");
        }
      }
    } catch (const c10::Error& e) {
      problems.push_back(e.what_without_backtrace());
    }
  }
  return problems;
}

}  // namespace zeroshard::checkpoint
