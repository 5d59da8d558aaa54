// common.cpp — checkpoint names, durable file writes, the commit, dtype storage, model identity.
#include "checkpointer_impl.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <unordered_map>

namespace zeroshard::ckpt {

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::optional<int64_t> step_of_dir_name(const std::string& name) {
  constexpr size_t kPrefix = 5;  // "step-"
  if (name.size() <= kPrefix || name.size() > kPrefix + 18 || name.compare(0, kPrefix, "step-") != 0) {
    return std::nullopt;
  }
  for (size_t i = kPrefix; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  }
  return std::stoll(name.substr(kPrefix));
}

fs::path latest_step_dir(const fs::path& run_dir) {
  std::string name = read_text(run_dir / "latest");
  name.erase(name.find_last_not_of(" \n\r\t") + 1);
  TORCH_CHECK(step_of_dir_name(name).has_value(), "checkpoint: '", (run_dir / "latest").string(), "' names '", name,
              "', which is not a step directory of this run (step- and digits); the file was edited or is corrupt. "
              "Delete it to use the newest committed checkpoint, or write the name of one into it");
  return run_dir / name;
}

std::string rank_file_name(int rank, int world) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "rank-%05d-of-%05d.h5", rank, world);
  return buf;
}

// fsync a file or directory by path.
void fsync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot open '", path.string(), "' to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "checkpoint: fsync of '", path.string(), "' failed: ", std::strerror(err));
}

// Writes `content` to `path` so that a crash leaves either the old file or the
// new one: a temporary file, fsync, rename, fsync of the directory.
void write_atomically(const fs::path& path, const std::string& content) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "checkpoint: cannot create '", tmp.string(), "': ", std::strerror(errno));
    out << content;
    out.flush();
    TORCH_CHECK(out, "checkpoint: writing '", tmp.string(), "' failed (disk full?): ", std::strerror(errno));
  }
  fsync_path(tmp, false);
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TORCH_CHECK(!ec, "checkpoint: cannot rename '", tmp.string(), "' to '", path.string(), "': ", ec.message());
  fsync_path(path.parent_path(), true);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "checkpoint: cannot read '", path.string(), "': ", std::strerror(errno));
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void commit_step_dir(const fs::path& tmp, const fs::path& final_dir, const json& manifest) {
  write_manifest(tmp, manifest);
  std::error_code ec;
  fs::path replaced;
  if (fs::exists(final_dir)) {  // the same step saved again (e.g. after a resume)
    replaced = final_dir.string() + ".replaced.tmp";
    fs::remove_all(replaced, ec);
    fs::rename(final_dir, replaced, ec);
    TORCH_CHECK(!ec, "checkpoint: cannot move the old '", final_dir.string(), "' aside: ", ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  TORCH_CHECK(!ec, "checkpoint: cannot rename '", tmp.string(), "' to '", final_dir.string(), "': ", ec.message());
  fsync_path(final_dir.parent_path(), true);
  write_atomically(final_dir.parent_path() / "latest", final_dir.filename().string() + "\n");
  if (!replaced.empty()) fs::remove_all(replaced, ec);
}

// How a tensor dtype is stored: HDF5 1.10 has no 16-bit float types, so
// bf16/fp16 are stored as their bits in uint16 with a "dtype" attribute.
checkpoint::h5::Type storage_type(c10::ScalarType t, const std::string& name) {
  switch (t) {
    case at::kFloat: return checkpoint::h5::Type::kFloat32;
    case at::kDouble: return checkpoint::h5::Type::kFloat64;
    case at::kLong: return checkpoint::h5::Type::kInt64;
    case at::kInt: return checkpoint::h5::Type::kInt32;
    case at::kByte:
    case at::kBool: return checkpoint::h5::Type::kUInt8;
    case at::kBFloat16:
    case at::kHalf: return checkpoint::h5::Type::kUInt16;
    default: break;
  }
  TORCH_CHECK_VALUE(false, "checkpoint: tensor '", name, "' has dtype ", c10::toString(t),
                    ", which checkpoints do not store (Float, Double, Long, Int, Byte, Bool, BFloat16, Half)");
}


std::vector<ModelEntry> model_entries(torch::nn::Module& model, const ShardedState& state,
                                      const std::vector<std::string>& names,
                                      const std::map<std::string, std::string>& saved_names) {
  std::unordered_map<std::string, const ParamInfo*> info;
  for (size_t i = 0; i < names.size(); ++i) info[names[i]] = &state.params[i];
  std::vector<ModelEntry> out;
  for (const auto& item : model.named_parameters()) {
    const std::string name = saved_name(saved_names, item.key());
    auto it = info.find(name);
    out.push_back({false, it != info.end() ? ParamInfo{name, it->second->shape, it->second->dtype}
                                           : ParamInfo{name, item.value().sizes().vec(), item.value().scalar_type()}});
  }
  for (const auto& item : model.named_buffers()) {
    out.push_back({true, ParamInfo{saved_name(saved_names, item.key()), item.value().sizes().vec(),
                                   item.value().scalar_type()}});
  }
  return out;
}

std::string hash_hex(const std::string& s) { return checkpoint::to_hex(checkpoint::digest_bytes(s.data(), s.size())); }

std::string saved_name(const std::map<std::string, std::string>& saved_names, const std::string& module_name) {
  const auto it = saved_names.find(module_name);
  return it == saved_names.end() ? module_name : it->second;
}

std::vector<std::string> module_names(const ShardedState& state, torch::nn::Module& model,
                                      const std::map<std::string, std::string>& saved_names) {
  std::unordered_map<const c10::TensorImpl*, std::string> by_impl;
  for (const auto& item : model.named_parameters()) {
    by_impl.emplace(item.value().unsafeGetTensorImpl(), saved_name(saved_names, item.key()));
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < state.params.size(); ++i) {
    auto it = i < state.param_tensors.size() ? by_impl.find(state.param_tensors[i].unsafeGetTensorImpl()) : by_impl.end();
    TORCH_CHECK_VALUE(it != by_impl.end(), "checkpoint: the optimizer's parameter '", state.params[i].name,
                      "' is not a parameter of the module given; pass the module the optimizer trains");
    names.push_back(it->second);
  }
  return names;
}


}  // namespace zeroshard::ckpt
