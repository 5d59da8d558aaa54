// common.cpp — checkpoint names, durable file writes, dtype storage, model identity.
#include "checkpointer_impl.h"

#include <xxhash.h>

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

void write_manifest(const fs::path& step_dir, const json& manifest) {
  const std::string text = manifest.dump(1);
  write_atomically(step_dir / "manifest.xxh3", hash_hex(text) + "\n");
  write_atomically(step_dir / "manifest.json", text);
}

namespace {

// "" when every parameter's pieces cover its elements exactly once, each from a
// rank that wrote a file; else what is wrong.
std::string pieces_problem(const json& m) {
  const int64_t files = static_cast<int64_t>(m.at("files").size());
  for (const auto& p : m.at("params")) {
    const std::string name = p.at("name").get<std::string>();
    int64_t numel = 1;
    for (int64_t d : p.at("shape").get<std::vector<int64_t>>()) numel *= d;
    std::vector<std::array<int64_t, 3>> pieces;  // begin, end, rank
    for (const auto& pc : p.at("pieces")) pieces.push_back({pc.at(1).get<int64_t>(), pc.at(2).get<int64_t>(), pc.at(0).get<int64_t>()});
    std::sort(pieces.begin(), pieces.end());
    int64_t next = 0;
    for (const auto& [begin, end, rank] : pieces) {
      if (rank < 0 || rank >= files) {
        return "a piece of '" + name + "' is on rank " + std::to_string(rank) + ", but " + std::to_string(files) +
               " rank files were written";
      }
      if (begin != next || end < begin) {
        return "the pieces of '" + name + "' do not cover its " + std::to_string(numel) +
               " elements exactly once (element " + std::to_string(next) + " is followed by a piece [" +
               std::to_string(begin) + ", " + std::to_string(end) + "))";
      }
      next = end;
    }
    if (next != numel) {
      return "the pieces of '" + name + "' do not cover its " + std::to_string(numel) + " elements exactly once (they end at " +
             std::to_string(next) + ")";
    }
  }
  return "";
}

}  // namespace

json read_manifest(const fs::path& step_dir) {
  const fs::path path = step_dir / "manifest.json";
  const std::string text = read_text(path);
  const fs::path sum = step_dir / "manifest.xxh3";
  if (fs::exists(sum)) {
    std::string want = read_text(sum);
    want.erase(want.find_last_not_of(" \n\r\t") + 1);
    TORCH_CHECK(hash_hex(text) == want, "checkpoint: '", path.string(), "' fails its checksum (xxh3 ", hash_hex(text),
                ", manifest.xxh3 says ", want, "): the manifest is corrupt or was edited");
  }
  json m;
  try {
    m = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "checkpoint: '", path.string(), "' is not valid JSON (torn or edited): ", e.what());
  }
  TORCH_CHECK(m.is_object() && m.value("format", "") == kFormat && m.value("format_version", 0) == kFormatVersion,
              "checkpoint: '", path.string(), "' is not a zeroshard checkpoint manifest of format version ",
              kFormatVersion);
  std::string bad;
  try {
    bad = pieces_problem(m);
  } catch (const json::exception& e) {
    bad = std::string("a parameter entry is malformed: ") + e.what();
  }
  TORCH_CHECK(bad.empty(), "checkpoint: '", path.string(), "': ", bad, ": the manifest is corrupt or was edited");
  return m;
}

int zero_stage_of(const json& manifest) {
  return manifest.contains("zero_stage") ? manifest.at("zero_stage").get<int>() : manifest.at("stage").get<int>();
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


// Model identity: every parameter's and buffer's name, shape and dtype, in
// module order. Shapes of the optimizer's parameters come from its state: a
// resharded fully_shard parameter holds no elements.
std::string model_description(torch::nn::Module& model, const ShardedState& state,
                              const std::vector<std::string>& names) {
  std::unordered_map<std::string, const ParamInfo*> info;
  for (size_t i = 0; i < names.size(); ++i) info[names[i]] = &state.params[i];
  std::string d;
  for (const auto& item : model.named_parameters()) {
    auto it = info.find(item.key());
    const ParamInfo p = it != info.end() ? ParamInfo{item.key(), it->second->shape, it->second->dtype}
                                         : ParamInfo{item.key(), item.value().sizes().vec(), item.value().scalar_type()};
    d += "param " + p.describe() + "\n";
  }
  for (const auto& item : model.named_buffers()) {
    d += "buffer " + ParamInfo{item.key(), item.value().sizes().vec(), item.value().scalar_type()}.describe() + "\n";
  }
  return d;
}

std::string hash_hex(const std::string& s) { return checkpoint::to_hex(XXH3_64bits(s.data(), s.size())); }

// Names of the state's parameters as the module calls them.
std::vector<std::string> module_names(const ShardedState& state, torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::string> by_impl;
  for (const auto& item : model.named_parameters()) by_impl.emplace(item.value().unsafeGetTensorImpl(), item.key());
  std::vector<std::string> names;
  for (size_t i = 0; i < state.params.size(); ++i) {
    auto it = i < state.param_tensors.size() ? by_impl.find(state.param_tensors[i].unsafeGetTensorImpl()) : by_impl.end();
    TORCH_CHECK_VALUE(it != by_impl.end(), "checkpoint: the optimizer's parameter '", state.params[i].name,
                      "' is not a parameter of the module given; pass the module the optimizer trains");
    names.push_back(it->second);
  }
  return names;
}

std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace zeroshard::ckpt
