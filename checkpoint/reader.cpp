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

namespace {

// "" when the file at `path` has the size and xxh3 its manifest entry (`e`: bytes, xxh3)
// records, else what differs. HDF5 is handed no file that fails this: its parser is not
// built for damaged input.
std::string digest_problem(const fs::path& path, const json& e) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return path.string() + ": missing";
  const auto size = static_cast<int64_t>(fs::file_size(path, ec));
  if (size != e.at("bytes").get<int64_t>()) {
    return path.string() + ": " + std::to_string(size) + " bytes, the manifest says " +
           std::to_string(e.at("bytes").get<int64_t>()) + " (truncated?)";
  }
  const auto digest = digest_file(path.string());
  if (to_hex(digest.xxh3) != e.at("xxh3").get<std::string>()) {
    return path.string() + ": xxh3 " + to_hex(digest.xxh3) + ", the manifest says " + e.at("xxh3").get<std::string>() +
           " (corrupt)";
  }
  return "";
}

}  // namespace

h5::File& CheckpointReader::file(int rank) {
  auto it = open_.find(rank);
  if (it == open_.end()) {
    TORCH_CHECK(rank >= 0 && static_cast<size_t>(rank) < manifest_.at("files").size(), "checkpoint ", dir_.string(),
                ": no rank file ", rank);
    const json& e = manifest_.at("files").at(static_cast<size_t>(rank));
    const fs::path path = dir_ / e.at("name").get<std::string>();
    if (!verified_.count(rank)) {
      const std::string bad = digest_problem(path, e);
      TORCH_CHECK(bad.empty(), "checkpoint: ", bad, ": not read (zeroshard-ckpt verify lists every problem)");
      verified_.insert(rank);
    }
    it = open_.emplace(rank, std::make_unique<h5::File>(h5::File::open_read(path.string()))).first;
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
  file(r.rank).read_all("/replicated/" + r.name, ckpt::storage_type(dtype, r.name), static_cast<uint64_t>(t.numel()),
                        t.data_ptr());
  return t;
}

std::vector<std::string> CheckpointReader::verify() {
  std::vector<std::string> problems;
  const auto& files = manifest_.at("files");
  std::vector<bool> usable(files.size(), false);
  for (size_t r = 0; r < files.size(); ++r) {
    const std::string bad = digest_problem(dir_ / files[r].at("name").get<std::string>(), files[r]);
    if (bad.empty()) {
      usable[r] = true;
      verified_.insert(static_cast<int>(r));
    } else {
      problems.push_back(bad);
    }
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
  // Checkpoints from before the manifest recorded model.h5's checksum are opened unverified.
  const std::string view_bad = manifest_.contains("model_view") && fs::exists(view)
                                   ? digest_problem(view, manifest_.at("model_view")) : std::string();
  if (!view_bad.empty()) problems.push_back(view_bad);
  if (fs::exists(view) && view_bad.empty()) {
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
