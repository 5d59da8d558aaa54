// zeroshard-ckpt: inspect, verify, consolidate, export and import zeroshard
// checkpoints. See docs/checkpoint-format.md and docs/checkpoints.md. Part of the
// checkpoint library (it compiles in the library's unity unit); tools/main.cpp
// is the program.
#include "checksum.h"
#include "h5.h"
#include "checkpointer_impl.h"
#include "reader.h"

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <c10/util/BFloat16.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

namespace fs = std::filesystem;
using nlohmann::json;
using namespace zeroshard::checkpoint;

namespace zeroshard_ckpt {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

// A name map: a JSON object {"ours": "theirs"} or lines "ours theirs".
std::map<std::string, std::string> read_name_map(const std::string& path) {
  std::map<std::string, std::string> m;
  if (path.empty()) return m;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read the name map '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  if (text.find_first_not_of(" \n\t") != std::string::npos && text[text.find_first_not_of(" \n\t")] == '{') {
    const auto j = json::parse(text);
    for (auto it = j.begin(); it != j.end(); ++it) m[it.key()] = it.value().get<std::string>();
  } else {
    std::istringstream lines(text);
    std::string a, b;
    while (lines >> a >> b) m[a] = b;
  }
  return m;
}

int inspect(const std::string& path, int64_t step, bool params) {
  const fs::path p(path);
  if (step < 0 && fs::exists(p / "latest")) {
    std::vector<std::string> steps;
    for (const auto& e : fs::directory_iterator(p)) {
      const auto n = e.path().filename().string();
      if (zeroshard::ckpt::step_of_dir_name(n) && fs::exists(e.path() / "manifest.json")) steps.push_back(n);
    }
    std::sort(steps.begin(), steps.end());
    std::cout << "run directory " << path << ": " << steps.size() << " committed checkpoint(s)";
    for (const auto& s : steps) std::cout << " " << s;
    std::cout << "\n";
  }
  const auto dir = resolve_step_dir(p, step);
  CheckpointReader r(dir);
  const auto& m = r.manifest();
  int64_t elements = 0, bytes = 0;
  for (const auto& e : r.params()) elements += e.numel();
  for (const auto& f : m.at("files")) bytes += f.at("bytes").get<int64_t>();
  std::printf("%s: step %lld, epoch %lld, saved by %d ranks at ZeRO stage %d; %zu parameters (%lld elements), %zu "
              "replicated tensors; %.1f MB in %zu files; saving took %.2f s\n",
              dir.string().c_str(), static_cast<long long>(m.at("step").get<int64_t>()),
              static_cast<long long>(m.at("epoch").get<int64_t>()), m.at("world_size").get<int>(),
              zeroshard::ckpt::zero_stage_of(m), r.params().size(), static_cast<long long>(elements), r.replicated().size(),
              bytes / 1e6, m.at("files").size(), m.value("save_seconds", 0.0));
  if (params) {
    for (const auto& e : r.params()) {
      std::printf("  %-50s %-16s %-9s step %lld\n", e.name.c_str(), shape_str(e.shape).c_str(), e.dtype.c_str(),
                  static_cast<long long>(e.step));
    }
    for (const auto& e : r.replicated()) {
      std::printf("  %-50s %-16s %-9s %s (replicated)\n", e.name.c_str(), shape_str(e.shape).c_str(), e.dtype.c_str(),
                  e.kind.c_str());
    }
  }
  return 0;
}

int verify(const std::string& path, int64_t step) {
  const auto dir = resolve_step_dir(path, step);
  std::unique_ptr<CheckpointReader> reader;
  try {
    reader = std::make_unique<CheckpointReader>(dir);
  } catch (const c10::Error& e) {  // the manifest itself is bad
    std::cout << "BAD " << e.what_without_backtrace() << "\n";
    return 1;
  }
  auto& r = *reader;
  const auto problems = r.verify();
  for (const auto& p : problems) std::cout << "BAD " << p << "\n";
  if (problems.empty()) {
    std::cout << "OK " << dir.string() << ": " << r.manifest().at("files").size() << " files match the manifest ("
              << r.params().size() << " parameters)\n";
  }
  return problems.empty() ? 0 : 1;
}

int consolidate(const std::string& path, int64_t step, const std::string& out, bool moments) {
  CheckpointReader r(resolve_step_dir(path, step));
  auto f = h5::File::create(out);
  f.set_attribute("/", "step", r.manifest().at("step").get<int64_t>());
  for (const auto& e : r.params()) {  // one tensor at a time: memory bounded by the largest
    // A scalar is stored as one element. (Not push_back onto the empty vector: GCC 12 reports a
    // false -Wfree-nonheap-object there.)
    const std::vector<uint64_t> dims =
        e.shape.empty() ? std::vector<uint64_t>{1} : std::vector<uint64_t>(e.shape.begin(), e.shape.end());
    for (const std::string kind : {"master", "exp_avg", "exp_avg_sq"}) {
      if (kind != "master" && !moments) continue;
      const auto t = r.read_param(e, kind);
      f.write(kind == "master" ? "/" + e.name : "/optimizer/" + kind + "/" + e.name, h5::Type::kFloat32, dims,
              t.data_ptr());
    }
  }
  for (const auto& e : r.replicated()) {
    const auto t = r.read_replicated(e).contiguous();
    // A scalar is stored as one element. (Not push_back onto the empty vector: GCC 12 reports a
    // false -Wfree-nonheap-object there.)
    const std::vector<uint64_t> dims =
        e.shape.empty() ? std::vector<uint64_t>{1} : std::vector<uint64_t>(e.shape.begin(), e.shape.end());
    f.write("/" + e.name, zeroshard::ckpt::storage_type(dtype_named(e.dtype), e.name), dims, t.data_ptr());
    f.set_attribute("/" + e.name, "dtype", e.dtype);
  }
  f.close();
  std::cout << "wrote " << out << ": " << r.params().size() + r.replicated().size() << " tensors\n";
  return 0;
}

const char* safetensors_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kDouble: return "F64";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kBool: return "BOOL";
    default: return "U8";
  }
}

int export_safetensors(const std::string& path, int64_t step, const std::string& out, const std::string& dtype,
                       const std::string& map_path, bool buffers) {
  CheckpointReader r(resolve_step_dir(path, step));
  const auto names = read_name_map(map_path);
  const auto want = dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  struct Item {
    std::string name;
    std::function<at::Tensor()> load;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  std::vector<Item> items;
  auto mapped = [&](const std::string& n) { return names.count(n) ? names.at(n) : n; };
  for (const auto& e : r.params()) {
    items.push_back({mapped(e.name), [&r, e, want] { return r.read_param(e).to(want); }, want, e.shape});
  }
  for (const auto& e : r.replicated()) {
    if (e.kind == "buffer" && !buffers) continue;
    const auto dt = dtype_named(e.dtype);
    const auto to = at::isFloatingType(dt) ? want : dt;
    items.push_back({mapped(e.name), [&r, e, to] { return r.read_replicated(e).to(to); }, to, e.shape});
  }
  json header;
  int64_t offset = 0;
  for (const auto& it : items) {
    int64_t n = 1;
    for (auto d : it.shape) n *= d;
    const int64_t nbytes = n * static_cast<int64_t>(c10::elementSize(it.dtype));
    if (header.contains(it.name)) throw std::runtime_error("two tensors map to the name '" + it.name + "'");
    header[it.name] = {{"dtype", safetensors_dtype(it.dtype)}, {"shape", it.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  header["__metadata__"] = {{"format", "pt"}, {"zeroshard_step", std::to_string(r.manifest().at("step").get<int64_t>())}};
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h += ' ';
  std::ofstream o(out, std::ios::binary | std::ios::trunc);
  if (!o) throw std::runtime_error("cannot create '" + out + "'");
  const uint64_t len = h.size();
  o.write(reinterpret_cast<const char*>(&len), 8);  // little-endian on every supported machine
  o.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& it : items) {  // streamed: one tensor in memory at a time
    const auto t = it.load().contiguous();
    o.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  }
  o.flush();
  if (!o) throw std::runtime_error("writing '" + out + "' failed (disk full?)");
  std::cout << "wrote " << out << ": " << items.size() << " tensors, " << (8 + h.size() + offset) / 1e6 << " MB\n";
  return 0;
}

int import_safetensors(const std::string& in_path, const std::string& run_dir, const std::string& map_path,
                       int64_t step) {
  const auto names = read_name_map(map_path);  // theirs -> ours here: the file's names are looked up
  std::ifstream in(in_path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read '" + in_path + "'");
  uint64_t len = 0;
  in.read(reinterpret_cast<char*>(&len), 8);
  if (!in || len > (uint64_t{1} << 30)) throw std::runtime_error("'" + in_path + "' is not a safetensors file");
  std::string h(len, '\0');
  in.read(h.data(), static_cast<std::streamsize>(len));
  const auto header = json::parse(h);
  const auto data_start = static_cast<std::streamoff>(8 + len);
  const fs::path final_dir = fs::path(run_dir) / zeroshard::ckpt::step_dir_name(step);
  const fs::path tmp = final_dir.string() + ".tmp";
  fs::create_directories(tmp);
  const std::string file = zeroshard::ckpt::rank_file_name(0, 1);
  auto f = h5::File::create((tmp / file).string());
  f.set_attribute("/", "format", std::string(zeroshard::ckpt::kFormat));
  f.set_attribute("/", "format_version", int64_t{zeroshard::ckpt::kFormatVersion});
  f.set_attribute("/", "rank", int64_t{0});
  f.set_attribute("/", "world_size", int64_t{1});
  f.set_attribute("/", "step", step);
  json m;
  m["format"] = zeroshard::ckpt::kFormat;
  m["format_version"] = zeroshard::ckpt::kFormatVersion;
  m["step"] = step;
  m["epoch"] = 0;
  m["extra"] = json::object();
  m["world_size"] = 1;
  m["zero_stage"] = 2;
  m["model_hash"] = "";  // imported: parameters are matched by name and shape instead
  m["imported_from"] = fs::path(in_path).filename().string();
  m["loss_scale"] = 1.0;
  m["loss_scale_clean_steps"] = 0;
  m["params"] = json::array();
  m["replicated"] = json::array();
  m["groups"] = json::array();
  const std::map<std::string, at::ScalarType> types{{"F32", at::kFloat}, {"BF16", at::kBFloat16}, {"F16", at::kHalf},
                                                    {"F64", at::kDouble}, {"I64", at::kLong}, {"I32", at::kInt},
                                                    {"BOOL", at::kBool}, {"U8", at::kByte}};
  for (auto item = header.begin(); item != header.end(); ++item) {
    const std::string theirs = item.key();
    const json& e = item.value();
    if (theirs == "__metadata__") continue;
    const std::string ours = names.count(theirs) ? names.at(theirs) : theirs;
    const auto dt = types.at(e.at("dtype").get<std::string>());
    const auto shape = e.at("shape").get<std::vector<int64_t>>();
    const auto off = e.at("data_offsets").get<std::vector<int64_t>>();
    auto t = at::empty(shape, at::TensorOptions().dtype(dt));
    if (off[1] - off[0] != static_cast<int64_t>(t.nbytes())) throw std::runtime_error("'" + theirs + "': size mismatch");
    in.seekg(data_start + off[0]);
    in.read(static_cast<char*>(t.data_ptr()), off[1] - off[0]);
    if (!in) throw std::runtime_error("'" + in_path + "' is truncated at '" + theirs + "'");
    if (at::isFloatingType(dt)) {  // a parameter: fp32 master, zero moments, never stepped
      auto master = t.to(at::kFloat).contiguous().reshape(-1);
      auto zero = at::zeros_like(master);
      const std::vector<uint64_t> dims{static_cast<uint64_t>(master.numel())};
      for (const auto& [kind, v] : {std::pair<std::string, at::Tensor>{"master", master}, {"exp_avg", zero}, {"exp_avg_sq", zero}}) {
        f.write("/" + kind + "/" + ours, h5::Type::kFloat32, dims, v.data_ptr());
        f.set_attribute("/" + kind + "/" + ours, "begin", int64_t{0});
      }
      m["params"].push_back({{"name", ours}, {"shape", shape}, {"dtype", c10::toString(dt)}, {"step", 0},
                             {"pieces", json::array({json::array({0, 0, master.numel()})})}});
    } else {
      std::vector<uint64_t> dims(shape.begin(), shape.end());
      if (dims.empty()) dims.push_back(1);
      f.write("/replicated/" + ours, zeroshard::ckpt::storage_type(dt, ours), dims, t.data_ptr());
      f.set_attribute("/replicated/" + ours, "dtype", std::string(c10::toString(dt)));
      m["replicated"].push_back({{"name", ours}, {"kind", "buffer"}, {"shape", shape}, {"dtype", c10::toString(dt)}});
    }
  }
  f.close();
  const auto digest = digest_file((tmp / file).string());
  m["files"] = json::array({{{"name", file}, {"bytes", digest.bytes}, {"xxh3", to_hex(digest.xxh3)}}});
  zeroshard::ckpt::commit_step_dir(tmp, final_dir, m);
  std::cout << "imported " << m["params"].size() << " parameters from " << in_path << " into " << final_dir.string()
            << "; the run loads it as its latest checkpoint\n";
  return 0;
}

}  // namespace zeroshard_ckpt

int zeroshard_ckpt_main(int argc, char** argv) {
  using namespace zeroshard_ckpt;
  CLI::App app{"zeroshard-ckpt: inspect, verify, consolidate, export and import zeroshard checkpoints"};
  app.require_subcommand(1);
  std::string path, out, dtype = "float32", name_map;
  int64_t step = -1;
  bool params = false, moments = false, safetensors = false, buffers = false;

  auto* ins = app.add_subcommand("inspect", "steps, world size, sizes and (--params) every parameter");
  ins->add_option("path", path, "run directory or step directory")->required();
  ins->add_option("--step", step, "a step of the run directory (default: latest)");
  ins->add_flag("--params", params, "list every parameter");

  auto* ver = app.add_subcommand("verify", "checksums, sizes, datasets and model.h5 against the manifest; exit 1 when bad");
  ver->add_option("path", path, "run directory or step directory")->required();
  ver->add_option("--step", step, "a step of the run directory (default: latest)");

  auto* con = app.add_subcommand("consolidate", "one HDF5 file with every full parameter (streamed)");
  con->add_option("path", path, "run directory or step directory")->required();
  con->add_option("out", out, "the HDF5 file to write")->required();
  con->add_option("--step", step, "a step of the run directory (default: latest)");
  con->add_flag("--moments", moments, "also the AdamW moments, under optimizer/");

  auto* exp = app.add_subcommand("export", "full weights in another format");
  exp->add_option("path", path, "run directory or step directory")->required();
  exp->add_option("out", out, "the file to write")->required();
  exp->add_flag("--safetensors", safetensors, "the safetensors format (required: the only one so far)")->required();
  exp->add_option("--step", step, "a step of the run directory (default: latest)");
  exp->add_option("--dtype", dtype, "float32 or bfloat16 (round to nearest even)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  exp->add_option("--name-map", name_map, "rename tensors: JSON {\"ours\": \"theirs\"} or lines 'ours theirs'");
  exp->add_flag("--buffers", buffers, "also export buffers");

  std::string in;
  auto* imp = app.add_subcommand("import", "start a run from a safetensors file: writes a step checkpoint it loads");
  imp->add_option("in", in, "the safetensors file")->required();
  imp->add_option("run_dir", out, "the run directory to create or extend")->required();
  imp->add_flag("--safetensors", safetensors, "the input is safetensors (required)")->required();
  imp->add_option("--name-map", name_map, "rename tensors: JSON {\"theirs\": \"ours\"} or lines 'theirs ours'");
  int64_t import_step = 0;
  imp->add_option("--step", import_step, "the step the checkpoint is saved as (default: 0)");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*ins) return inspect(path, step, params);
    if (*ver) return verify(path, step);
    if (*con) return consolidate(path, step, out, moments);
    if (*exp) return export_safetensors(path, step, out, dtype, name_map, buffers);
    if (*imp) return import_safetensors(in, out, name_map, import_step);
  } catch (const c10::Error& e) {
    std::cerr << "zeroshard-ckpt: " << e.what_without_backtrace() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "zeroshard-ckpt: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
