// zeroshard-ckpt: inspect, verify, consolidate, export and import zeroshard
// checkpoints. See docs/checkpoint-format.md and docs/checkpoints.md. Part of the
// checkpoint library (it compiles in the library's unity unit); tools/main.cpp
// is the program.
#include "tools/zeroshard_ckpt.h"
#include "zeroshard/log.h"

#include "checksum.h"
#include "h5.h"
#include "checkpointer_impl.h"
#include "reader.h"
#include "durable.h"

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <c10/util/BFloat16.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
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
  TORCH_CHECK_VALUE(in, "cannot read the name map '", path, "'");
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

// The safetensors dtypes the tool writes and reads, by the format's names.
const std::vector<std::pair<std::string, at::ScalarType>> kSafetensorsTypes{
    {"F32", at::kFloat}, {"BF16", at::kBFloat16}, {"F16", at::kHalf}, {"F64", at::kDouble},
    {"I64", at::kLong},  {"I32", at::kInt},       {"BOOL", at::kBool}, {"U8", at::kByte}};

const char* safetensors_dtype(at::ScalarType t) {
  for (const auto& [name, type] : kSafetensorsTypes) {
    if (type == t) return name.c_str();
  }
  return "U8";
}

int export_safetensors(const std::string& path, int64_t step, const std::string& out, const std::string& dtype,
                       const std::string& map_path, bool buffers) {
  zeroshard::SafetensorsExport opts;
  opts.step = step;
  opts.dtype = dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  opts.buffers = buffers;
  opts.names = read_name_map(map_path);
  const auto written = zeroshard::export_safetensors(path, out, opts);
  std::cout << "wrote " << out << ": " << written.size() << " tensors, " << fs::file_size(out) / 1e6 << " MB\n";
  return 0;
}

std::vector<SafetensorsEntry> read_safetensors_header(const std::string& path, uint64_t* data_start) {
  namespace zc = zeroshard::ckpt;
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  TORCH_CHECK(!ec, "import: cannot read '", path, "': ", ec.message());
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "import: cannot open '", path, "'");
  uint64_t len = 0;  // little-endian u64, as on every supported machine
  in.read(reinterpret_cast<char*>(&len), 8);
  // The format caps its header at 100 MB.
  TORCH_CHECK(in && size >= 8 && len <= size - 8 && len <= 100'000'000, "import: '", path,
              "' is not a safetensors file: its header length (", len, " bytes) does not fit the file's ", size,
              " bytes");
  std::string text(len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(len));
  TORCH_CHECK(in, "import: '", path, "': reading the ", len, "-byte header failed");
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "import: '", path, "': the header is not JSON (", e.what(), ")");
  }
  TORCH_CHECK(header.is_object(), "import: '", path, "': the header is not a JSON object");
  *data_start = 8 + len;
  const uint64_t data_bytes = size - *data_start;
  const std::map<std::string, at::ScalarType> types(kSafetensorsTypes.begin(), kSafetensorsTypes.end());
  std::vector<SafetensorsEntry> out;
  for (auto item = header.begin(); item != header.end(); ++item) {
    if (item.key() == "__metadata__") continue;
    const std::string& name = item.key();
    const json& e = item.value();
    const std::string where = "import: '" + path + "', tensor '" + name + "'";
    // The name becomes a dataset path in the rank file.
    TORCH_CHECK(!name.empty() && name.find('/') == std::string::npos && name.find('\0') == std::string::npos,
                where, ": a tensor name must be non-empty and hold no '/'");
    TORCH_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"), where,
                ": want an object with dtype, shape and data_offsets, got ", e.dump().substr(0, 200));
    const json& dt = e.at("dtype");
    TORCH_CHECK(dt.is_string() && types.count(dt.get<std::string>()), where, ": dtype ", dt.dump(),
                " is not one of F32, BF16, F16, F64, I64, I32, BOOL, U8");
    SafetensorsEntry t{name, types.at(dt.get<std::string>()), {}, 0, 0};
    const json& shape = e.at("shape");
    TORCH_CHECK(shape.is_array() && shape.size() <= 16, where, ": shape ", shape.dump().substr(0, 200),
                " is not a list of at most 16 sizes");
    // The element count, kept below the data's size so that no product overflows.
    uint64_t numel = 1;
    for (const auto& d : shape) {
      TORCH_CHECK(d.is_number_unsigned(), where, ": shape ", shape.dump(), " holds ", d.dump(),
                  ", not a size >= 0");
      const uint64_t v = d.get<uint64_t>();
      TORCH_CHECK(v == 0 || numel <= data_bytes / v, where, ": shape ", shape.dump(), " holds more elements than the ",
                  data_bytes, " data bytes of the file");
      numel *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    const uint64_t nbytes = numel * c10::elementSize(t.dtype);
    const json& off = e.at("data_offsets");
    TORCH_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                where, ": data_offsets ", off.dump().substr(0, 200), " is not [begin, end]");
    t.begin = off[0].get<uint64_t>();
    t.end = off[1].get<uint64_t>();
    TORCH_CHECK(t.begin <= t.end && t.end <= data_bytes, where, ": data_offsets [", t.begin, ", ", t.end,
                ") lie outside the file's ", data_bytes, " data bytes (a truncated file?)");
    TORCH_CHECK(t.end - t.begin == nbytes, where, ": data_offsets [", t.begin, ", ", t.end, ") hold ",
                t.end - t.begin, " bytes; ", dt.get<std::string>(), " ", shape.dump(), " needs ", nbytes);
    out.push_back(std::move(t));
  }
  return out;
}

int import_safetensors(const std::string& in_path, const std::string& run_dir, const std::string& map_path,
                       int64_t step) {
  namespace zc = zeroshard::ckpt;
  const auto names = read_name_map(map_path);  // theirs -> ours here: the file's names are looked up
  uint64_t data_start = 0;
  const auto entries = read_safetensors_header(in_path, &data_start);  // every entry checked before reading
  std::ifstream in(in_path, std::ios::binary);
  TORCH_CHECK(in, "import: cannot open '", in_path, "'");
  // The checkpoint an untrained run of one rank at ZeRO-2 would save: every floating tensor a
  // parameter (fp32 master, zero moments, never stepped), the rest buffers. Written by the
  // library's own rank-file writer and manifest builder.
  zc::Snapshot snap;
  snap.progress.step = step;
  int64_t largest = 0;
  std::set<std::string> seen;
  for (const auto& e : entries) {
    const std::string ours = names.count(e.name) ? names.at(e.name) : e.name;
    TORCH_CHECK(seen.insert(ours).second, "import: '", in_path, "': two tensors map to the name '", ours, "'");
    auto t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    in.seekg(static_cast<std::streamoff>(data_start + e.begin));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    TORCH_CHECK(in, "import: reading '", e.name, "' from '", in_path, "' failed");
    if (at::isFloatingType(e.dtype)) {
      snap.owned.push_back({snap.params.size(), 0, t.to(at::kFloat).contiguous().reshape(-1), {}, {}, {}});
      largest = std::max(largest, t.numel());
      snap.params.push_back({ours, e.shape, e.dtype});
      snap.names.push_back(ours);
      snap.steps.push_back(0);
    } else {
      snap.replicated.push_back({ours, "buffer", t});
    }
  }
  const auto zeros = at::zeros({largest});  // every parameter's moments: views of one buffer
  for (auto& o : snap.owned) o.exp_avg = o.exp_avg_sq = zeros.narrow(0, 0, o.master.numel());
  const fs::path final_dir = fs::path(run_dir) / zc::step_dir_name(step);
  const fs::path tmp = final_dir.string() + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  TORCH_CHECK(!ec, "import: cannot create '", tmp.string(), "': ", ec.message());
  auto contents = zc::merge_records({zc::rank_record(snap).dump()}, 0);
  const std::string file = zc::rank_file_name(0, 1);
  zc::write_rank_file(tmp / file, snap, contents.skip);  // fsynced
  const auto digest = digest_file((tmp / file).string());
  json m = zc::build_manifest(snap, std::move(contents), {{static_cast<int64_t>(digest.bytes), digest.xxh3}});
  m["model_hash"] = "";  // imported: the loader matches parameters by name and shape instead
  m["imported_from"] = fs::path(in_path).filename().string();
  m["lineage"] = zc::fresh_lineage(zc::new_line_id());  // a history of its own
  zc::commit_step_dir(tmp, final_dir, m);
  std::cout << "imported " << snap.params.size() << " parameters and " << snap.replicated.size() << " buffers from "
            << in_path << " into " << final_dir.string() << "; the run loads it as its latest checkpoint\n";
  return 0;
}

// A checkpoint in a durable tier (s3://bucket/prefix, or .../step-N): the step the
// path or --step names (else the store's newest committed one) copied into a
// temporary run directory, where the other commands read it as a local one.
struct StoreCopy {
  fs::path run_dir;
  int64_t step = -1;
  StoreCopy() = default;
  StoreCopy(const StoreCopy&) = delete;
  ~StoreCopy() {
    std::error_code ec;
    if (!run_dir.empty()) fs::remove_all(run_dir, ec);
  }
};

// The commit a store path means: step `step` (-1: the newest) of line `line` ("": of the history
// the store's `latest` names; a step no other line holds is taken from whichever line has it).
zeroshard::ckpt::Commit store_commit(zeroshard::ckpt::DurableTier& store, int64_t step, const std::string& line) {
  namespace zc = zeroshard::ckpt;
  const auto all = store.commits();
  TORCH_CHECK(!all.empty(), store.client().location().uri(), " holds no committed checkpoint (no step-N/commit-*.json)");
  zc::json history;
  if (line.empty()) {
    if (auto l = store.latest()) history = store.lineage(*l);
  }
  std::vector<zc::Commit> want, at_step;
  for (const auto& c : all) {
    if (step >= 0 && c.step != step) continue;
    at_step.push_back(c);
    if (line.empty() ? history.is_null() || zc::in_history(history, c.step, c.line) : c.line == line) want.push_back(c);
  }
  if (want.empty() && line.empty() && step >= 0 && at_step.size() == 1) want = at_step;
  std::string lines;
  for (const auto& c : at_step) lines += (lines.empty() ? "" : ", ") + c.line;
  TORCH_CHECK(!want.empty(), store.client().location().uri(), " holds no commit of ", step >= 0 ? "step " + std::to_string(step) : std::string("any step"),
              line.empty() ? " in the history its latest names" : " on line " + line,
              lines.empty() ? std::string() : "; lines there: " + lines + " (choose one with --line)");
  return want.front();
}

// verify false: the files as the store holds them (for `verify`, which reports what is wrong).
std::unique_ptr<StoreCopy> copy_from_store(const std::string& uri, int64_t step, const std::string& line, bool verify) {
  auto where = zeroshard::ckpt::s3::parse_uri(uri);
  const auto slash = where.prefix.rfind('/');
  const std::string last = slash == std::string::npos ? where.prefix : where.prefix.substr(slash + 1);
  if (auto named = zeroshard::ckpt::step_of_dir_name(last)) {  // .../step-N
    TORCH_CHECK(step < 0 || step == *named, uri, " names step ", *named, " and --step says ", step);
    step = *named;
    where.prefix = slash == std::string::npos ? "" : where.prefix.substr(0, slash);
  }
  zeroshard::ckpt::DurableTier store(where, zeroshard::ckpt::s3::process_environment(), 0, 1, {});
  const auto commit = store_commit(store, step, line);
  auto copy = std::make_unique<StoreCopy>();
  char tmpl[] = "/tmp/zeroshard-ckpt-XXXXXX";
  TORCH_CHECK(::mkdtemp(tmpl) != nullptr, "cannot make a temporary directory: ", std::strerror(errno));
  copy->run_dir = tmpl;
  copy->step = commit.step;
  store.fetch(commit, copy->run_dir, verify);
  return copy;
}

// `zeroshard-ckpt import ... s3://...`: the imported step, committed in the store as a
// one-rank job's save would be.
void commit_to_store(const std::string& uri, const fs::path& run_dir, int64_t step) {
  zeroshard::ckpt::DurableTier store(zeroshard::ckpt::s3::parse_uri(uri), zeroshard::ckpt::s3::process_environment(), 0,
                                     1, {});
  store.check_access();
  store.start_upload(run_dir / zeroshard::ckpt::step_dir_name(step), step, std::random_device{}());
  store.wait(std::chrono::hours(24));
  const auto status = store.status();
  TORCH_CHECK(status.durable_step == step, "the upload of the imported step to ", uri, " failed: ", status.last_error);
}

}  // namespace zeroshard_ckpt

namespace zeroshard {

std::vector<std::pair<std::string, std::vector<int64_t>>> export_safetensors(const std::string& checkpoint,
                                                                             const std::string& out,
                                                                             const SafetensorsExport& options) {
  TORCH_CHECK_VALUE(options.dtype == at::kFloat || options.dtype == at::kBFloat16, "export_safetensors: dtype ",
                    c10::toString(options.dtype), "; parameters export as Float or BFloat16");
  CheckpointReader r(resolve_step_dir(checkpoint, options.step));
  struct Item {
    std::string name;
    std::function<at::Tensor()> load;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  std::vector<Item> items;
  auto mapped = [&](const std::string& n) { return options.names.count(n) ? options.names.at(n) : n; };
  const auto want = options.dtype;
  for (const auto& e : r.params()) {
    items.push_back({mapped(e.name), [&r, e, want] { return r.read_param(e).to(want); }, want, e.shape});
  }
  for (const auto& e : r.replicated()) {
    if (e.kind == "buffer" && !options.buffers) continue;
    const auto dt = dtype_named(e.dtype);
    const auto to = at::isFloatingType(dt) ? want : dt;
    items.push_back({mapped(e.name), [&r, e, to] { return r.read_replicated(e).to(to); }, to, e.shape});
  }
  json header;
  int64_t offset = 0;
  std::vector<std::pair<std::string, std::vector<int64_t>>> written;
  for (const auto& it : items) {
    int64_t n = 1;
    for (auto d : it.shape) n *= d;
    const int64_t nbytes = n * static_cast<int64_t>(c10::elementSize(it.dtype));
    TORCH_CHECK_VALUE(!header.contains(it.name), "export_safetensors: two tensors map to the name '", it.name,
                      "'; fix the name map");
    header[it.name] = {{"dtype", zeroshard_ckpt::safetensors_dtype(it.dtype)},
                       {"shape", it.shape},
                       {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    written.emplace_back(it.name, it.shape);
  }
  header["__metadata__"] = {{"format", "pt"}, {"zeroshard_step", std::to_string(r.manifest().at("step").get<int64_t>())}};
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h += ' ';
  // Written beside and renamed: a crash never leaves half a file under `out`.
  const std::string tmp = out + ".tmp";
  {
    std::ofstream o(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(o, "export_safetensors: cannot create '", tmp, "'");
    const uint64_t len = h.size();
    o.write(reinterpret_cast<const char*>(&len), 8);  // little-endian on every supported machine
    o.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const auto& it : items) {  // streamed: one tensor in memory at a time
      const auto t = it.load().contiguous();
      o.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    }
    o.flush();
    TORCH_CHECK(o, "export_safetensors: writing '", tmp, "' failed (disk full?)");
  }
  fs::rename(tmp, out);
  return written;
}

}  // namespace zeroshard

int zeroshard_ckpt_main(int argc, char** argv) {
  using namespace zeroshard_ckpt;
  CLI::App app{"zeroshard-ckpt: inspect, verify, consolidate, export and import zeroshard checkpoints"};
  app.require_subcommand(1);
  std::string path, out, dtype = "float32", name_map;
  int64_t step = -1;
  std::string line;
  static const char* kLineHelp = "s3:// only: the line of checkpoints the step is of (default: the history the store's latest names)";
  bool params = false, moments = false, safetensors = false, buffers = false;

  auto* ins = app.add_subcommand("inspect", "steps, world size, sizes and (--params) every parameter");
  ins->add_option("path", path, "run directory, step directory, or s3://BUCKET/PREFIX[/step-N] (a durable tier)")->required();
  ins->add_option("--step", step, "a step of the run directory (default: latest)");
  ins->add_option("--line", line, kLineHelp);
  ins->add_flag("--params", params, "list every parameter");

  auto* ver = app.add_subcommand("verify", "checksums, sizes, datasets and model.h5 against the manifest; exit 1 when bad");
  ver->add_option("path", path, "run directory, step directory, or s3://BUCKET/PREFIX[/step-N] (a durable tier)")->required();
  ver->add_option("--step", step, "a step of the run directory (default: latest)");
  ver->add_option("--line", line, kLineHelp);

  auto* con = app.add_subcommand("consolidate", "one HDF5 file with every full parameter (streamed)");
  con->add_option("path", path, "run directory, step directory, or s3://BUCKET/PREFIX[/step-N] (a durable tier)")->required();
  con->add_option("out", out, "the HDF5 file to write")->required();
  con->add_option("--step", step, "a step of the run directory (default: latest)");
  con->add_option("--line", line, kLineHelp);
  con->add_flag("--moments", moments, "also the AdamW moments, under optimizer/");

  auto* exp = app.add_subcommand("export", "full weights in another format");
  exp->add_option("path", path, "run directory, step directory, or s3://BUCKET/PREFIX[/step-N] (a durable tier)")->required();
  exp->add_option("out", out, "the file to write")->required();
  exp->add_flag("--safetensors", safetensors, "the safetensors format (required: the only one so far)")->required();
  exp->add_option("--step", step, "a step of the run directory (default: latest)");
  exp->add_option("--line", line, kLineHelp);
  exp->add_option("--dtype", dtype, "float32 or bfloat16 (round to nearest even)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  exp->add_option("--name-map", name_map, "rename tensors: JSON {\"ours\": \"theirs\"} or lines 'ours theirs'");
  exp->add_flag("--buffers", buffers, "also export buffers");

  std::string in;
  auto* imp = app.add_subcommand("import", "start a run from a safetensors file: writes a step checkpoint it loads");
  imp->add_option("in", in, "the safetensors file")->required();
  imp->add_option("run_dir", out, "the run directory to create or extend, or s3://BUCKET/PREFIX (committed in a durable tier)")->required();
  imp->add_flag("--safetensors", safetensors, "the input is safetensors (required)")->required();
  imp->add_option("--name-map", name_map, "rename tensors: JSON {\"theirs\": \"ours\"} or lines 'theirs ours'");
  int64_t import_step = 0;
  imp->add_option("--step", import_step, "the step the checkpoint is saved as (default: 0)");

  CLI11_PARSE(app, argc, argv);
  try {
    // A durable tier's checkpoint: read from a local copy; an import: written locally, then committed there.
    std::unique_ptr<StoreCopy> copy;
    if (zeroshard::ckpt::s3::is_uri(path)) {
      copy = copy_from_store(path, step, line, /*verify=*/!*ver);
      path = copy->run_dir.string();
      step = copy->step;
    }
    if (*imp && zeroshard::ckpt::s3::is_uri(out)) {
      StoreCopy staged;
      char tmpl[] = "/tmp/zeroshard-ckpt-XXXXXX";
      TORCH_CHECK(::mkdtemp(tmpl) != nullptr, "cannot make a temporary directory: ", std::strerror(errno));
      staged.run_dir = tmpl;
      const int rc = import_safetensors(in, staged.run_dir.string(), name_map, import_step);
      if (rc == 0) commit_to_store(out, staged.run_dir, import_step);
      return rc;
    }
    if (*ins) return inspect(path, step, params);
    if (*ver) return verify(path, step);
    if (*con) return consolidate(path, step, out, moments);
    if (*exp) return export_safetensors(path, step, out, dtype, name_map, buffers);
    if (*imp) return import_safetensors(in, out, name_map, import_step);
  } catch (const c10::Error& e) {
    std::cerr << "zeroshard-ckpt: " << e.what_without_backtrace() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "zeroshard-ckpt: " << zeroshard::error_message(e) << "\n";
    return 2;
  }
  return 0;
}
