// manifest_read.cpp — a manifest read back and verified: its checksum, its
// schema (every field the readers use has the type and range they assume) and
// its pieces (each parameter covered exactly once).
#include "checkpointer_impl.h"
#include "reader.h"

#include <algorithm>
#include <map>
#include <set>

namespace zeroshard::ckpt {

namespace {

// "" when every parameter's pieces cover its elements exactly once, each from a
// rank that wrote a file, and every replicated tensor is in one; else what is wrong.
std::string pieces_problem(const json& m) {
  const int64_t files = static_cast<int64_t>(m.at("files").size());
  // No tensor holds more elements than its files have bytes for: a reader allocates a
  // tensor before it reads it, and an edited shape must not make that allocation huge.
  int64_t all_bytes = 0;
  for (const auto& f : m.at("files")) all_bytes += f.at("bytes").get<int64_t>();
  for (const char* list : {"params", "replicated"}) {
    for (const auto& e : m.at(list)) {
      int64_t numel = 1;
      for (int64_t d : e.at("shape").get<std::vector<int64_t>>()) numel *= d;
      const int64_t element = std::string(list) == "params" ? 4 : 1;  // fp32 masters; at least a byte
      if (numel > all_bytes / element) {
        return "'" + e.at("name").get<std::string>() + "' has " + std::to_string(numel) + " elements, more than the " +
               std::to_string(all_bytes) + " bytes of the rank files can hold";
      }
    }
  }
  auto outside = [&](const json& e) -> std::string {  // a copy in a file that was not written
    for (const auto& c : e.value("copies", json::array())) {
      if (c.get<int64_t>() < 0 || c.get<int64_t>() >= files) {
        return "a copy of '" + e.at("name").get<std::string>() + "' is on rank " + c.dump() + ", but " +
               std::to_string(files) + " rank files were written";
      }
    }
    return "";
  };
  // "" when `cover`'s pieces cover the parameter's elements exactly once, each in a written file.
  auto cover_problem = [&](const std::string& name, int64_t numel, const json& cover) -> std::string {
    std::vector<std::array<int64_t, 3>> pieces;  // begin, end, rank
    for (const auto& pc : cover) pieces.push_back({pc.at(1).get<int64_t>(), pc.at(2).get<int64_t>(), pc.at(0).get<int64_t>()});
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
    return "";
  };
  for (const auto& p : m.at("params")) {
    const std::string name = p.at("name").get<std::string>();
    int64_t numel = 1;
    for (int64_t d : p.at("shape").get<std::vector<int64_t>>()) numel *= d;
    if (auto why = cover_problem(name, numel, p.at("pieces")); !why.empty()) return why;
    for (const auto& alt : p.value("alternates", json::array())) {
      if (auto why = cover_problem(name, numel, alt); !why.empty()) return "an alternate set: " + why;
    }
  }
  for (const auto& r : m.at("replicated")) {
    const int64_t rank = r.value("rank", 0);
    if (rank < 0 || rank >= files) {
      return "'" + r.at("name").get<std::string>() + "' is on rank " + std::to_string(rank) + ", but " +
             std::to_string(files) + " rank files were written";
    }
    if (auto why = outside(r); !why.empty()) return why;
  }
  return "";
}

// What a manifest's fields must be, each a predicate on a JSON value.
namespace schema {

constexpr int64_t kMax = int64_t{1} << 53;
bool integer(const json& j, int64_t lo, int64_t hi) {
  return j.is_number_integer() && j.get<int64_t>() >= lo && j.get<int64_t>() <= hi;
}
bool any_int(const json& j) { return integer(j, -kMax, kMax); }
bool count(const json& j) { return integer(j, 0, kMax); }
bool text(const json& j) { return j.is_string(); }
bool number(const json& j) { return j.is_number(); }
bool boolean(const json& j) { return j.is_boolean(); }
bool object(const json& j) { return j.is_object(); }
bool array(const json& j) { return j.is_array(); }
bool triples(const json& j) {  // pieces: [rank, begin, end]
  if (!j.is_array()) return false;
  for (const auto& pc : j) {
    if (!pc.is_array() || pc.size() != 3 || !any_int(pc[0]) || !any_int(pc[1]) || !any_int(pc[2])) return false;
  }
  return true;
}
bool ranks(const json& j) { return j.is_array() && std::all_of(j.begin(), j.end(), any_int); }
bool list_of_triples(const json& j) { return j.is_array() && std::all_of(j.begin(), j.end(), triples); }
// Tensor names become HDF5 dataset paths, file names paths in the step directory.
bool tensor_name(const json& j) {
  return j.is_string() && !j.get<std::string>().empty() && j.get<std::string>().find('/') == std::string::npos;
}
bool file_name(const json& j) {
  if (!j.is_string()) return false;
  const auto n = j.get<std::string>();
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos;
}
bool dtype(const json& j) {
  if (!j.is_string()) return false;
  try {
    checkpoint::dtype_named(j.get<std::string>());  // the names the readers accept
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}
bool shape(const json& j) {
  if (!j.is_array() || j.size() > 16) return false;
  int64_t numel = 1;
  for (const auto& d : j) {
    if (!count(d) || (d.get<int64_t>() != 0 && numel > kMax / d.get<int64_t>())) return false;
    numel *= d.get<int64_t>();
  }
  return true;
}
bool world_size(const json& j) { return integer(j, 1, 1 << 20); }
bool zero_stage(const json& j) { return integer(j, 0, 3); }
bool topology(const json& j) {
  return j.is_object() && (!j.contains("pp_stages") || integer(j.at("pp_stages"), 1, 1 << 20)) &&
         (!j.contains("dp_size") || integer(j.at("dp_size"), 1, 1 << 20));
}
bool index(const json& j) {
  return j.is_object() && j.contains("bytes") && count(j.at("bytes")) && j.contains("xxh3") && text(j.at("xxh3"));
}

// The first problem found: each check() adds its field's, if it has one and none came before.
struct Problems {
  std::string first;
  void check(const std::string& where, const json& obj, const char* key, bool (*ok)(const json&),
             bool required = true) {
    if (!first.empty()) return;
    if (!obj.contains(key)) {
      if (required) first = where + "'" + key + "' is missing";
    } else if (!ok(obj.at(key))) {
      first = where + "'" + key + "' is " + obj.at(key).dump().substr(0, 80);
    }
  }
};

void top_level(Problems& p, const json& m) {
  p.check("", m, "step", any_int);
  p.check("", m, "epoch", any_int);
  p.check("", m, "extra", object);
  p.check("", m, "world_size", world_size);
  p.check("", m, m.contains("zero_stage") ? "zero_stage" : "stage", zero_stage);
  p.check("", m, "model_hash", text);
  p.check("", m, "loss_scale", number);
  p.check("", m, "loss_scale_clean_steps", any_int);
  p.check("", m, "gradients", boolean, false);
  p.check("", m, "save_seconds", number, false);
  p.check("", m, "topology", topology, false);
  for (const char* list : {"files", "params", "replicated"}) p.check("", m, list, array);
}

std::string files(Problems& p, const json& m) {
  if (m.at("files").size() != m.at("world_size").get<size_t>()) {
    return std::to_string(m.at("files").size()) + " files are listed for a world of " + m.at("world_size").dump();
  }
  for (const auto& f : m.at("files")) {
    if (!f.is_object()) return "a file entry is " + f.dump().substr(0, 80);
    const std::string where = "file " + f.value("name", json()).dump() + ": ";
    p.check(where, f, "name", file_name);
    p.check(where, f, "bytes", count);
    p.check(where, f, "xxh3", text);
    p.check(where, f, "pp_stage", count, false);
    p.check(where, f, "dp_rank", count, false);
    p.check(where, f, "host", text, false);
    p.check(where, f, "index", index, false);
  }
  if (m.contains("model_view")) {
    const json& v = m.at("model_view");
    if (!v.is_object()) return "'model_view' is " + v.dump().substr(0, 80);
    p.check("model_view: ", v, "name", file_name);
    p.check("model_view: ", v, "bytes", count);
    p.check("model_view: ", v, "xxh3", text);
  }
  return p.first;
}

std::string entries(Problems& p, const json& m) {
  std::set<std::string> names;
  for (const std::string list : {"params", "replicated"}) {
    for (const auto& e : m.at(list)) {
      if (!e.is_object()) return "an entry of '" + list + "' is " + e.dump().substr(0, 80);
      const std::string where = list + " entry " + e.value("name", json()).dump().substr(0, 80) + ": ";
      p.check(where, e, "name", tensor_name);
      p.check(where, e, "shape", shape);
      p.check(where, e, "dtype", dtype);
      if (list == "params") {
        p.check(where, e, "step", any_int);
        p.check(where, e, "had_grad", boolean, false);
        p.check(where, e, "alternates", list_of_triples, false);
        p.check(where, e, "pieces", triples);
      } else {
        p.check(where, e, "kind", text);
        p.check(where, e, "rank", any_int, false);
        p.check(where, e, "copies", ranks, false);
      }
      if (!p.first.empty()) return p.first;
      if (!names.insert(e.at("name").get<std::string>()).second) {
        return "'" + e.at("name").get<std::string>() + "' is listed twice";
      }
    }
  }
  return p.first;
}

}  // namespace schema

// "" when every field the readers use has the type and range they assume; else
// the first that does not. (An edited manifest whose checksum was fixed up, or a
// legacy one without manifest.xxh3, must not reach them with a string where a
// size is expected, a file name that leads out of the step directory, or a
// shape whose element count overflows.)
std::string schema_problem(const json& m) {
  schema::Problems p;
  schema::top_level(p, m);
  if (!p.first.empty()) return p.first;
  if (auto bad = schema::files(p, m); !bad.empty()) return bad;
  return schema::entries(p, m);
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
  TORCH_CHECK(m.is_object() && m.contains("format") && m.at("format") == kFormat && m.contains("format_version") &&
                  m.at("format_version") == kFormatVersion,
              "checkpoint: '", path.string(), "' is not a zeroshard checkpoint manifest of format version ",
              kFormatVersion);
  std::string bad = schema_problem(m);
  if (bad.empty()) bad = pieces_problem(m);
  TORCH_CHECK(bad.empty(), "checkpoint: '", path.string(), "': ", bad, ": the manifest is corrupt or was edited");
  try {
    (void)lineage_of(m);  // its line of checkpoints (lineage.h), checked here, before any reader relies on it
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "checkpoint: '", path.string(), "': ", e.what_without_backtrace());
  }
  return m;
}

int zero_stage_of(const json& manifest) {
  return manifest.contains("zero_stage") ? manifest.at("zero_stage").get<int>() : manifest.at("stage").get<int>();
}

}  // namespace zeroshard::ckpt
