// manifest.cpp — the manifest: every rank's record merged into one list of
// parameters and pieces, written with its checksum, read back and verified;
// and the topology (pipeline stages x data-parallel groups) it records.
#include "checkpointer_impl.h"
#include "reader.h"

#include <algorithm>
#include <array>
#include <map>
#include <unordered_map>

namespace zeroshard::ckpt {

std::vector<char> agree_on_places(Communicator& world, const Place& mine, const std::vector<char>& flags,
                                  std::vector<std::pair<int, int>>* places) {
  std::vector<int64_t> row{mine.pp_stage, mine.pp_stages, mine.dp_rank, mine.dp_size};
  for (char f : flags) row.push_back(f ? 1 : 0);
  const int n = world.size();
  const auto width = static_cast<int64_t>(row.size());
  auto all = at::empty({n * width}, at::kLong);
  world.all_gather(all, at::tensor(row, at::kLong))->wait();
  const int64_t* a = all.data_ptr<int64_t>();
  std::vector<char> any(flags.size(), 0);
  std::map<std::pair<int64_t, int64_t>, int> seen;  // (stage, dp rank) -> world rank
  std::string bad;
  for (int r = 0; r < n && bad.empty(); ++r) {
    const int64_t* q = a + r * width;
    const int64_t stage = q[0], stages = q[1], dp_rank = q[2], dp_size = q[3];
    for (size_t k = 0; k < flags.size(); ++k) any[k] = static_cast<char>(any[k] || q[4 + k] != 0);
    if (stages != a[1]) {
      bad = "rank " + std::to_string(r) + " says " + std::to_string(stages) + " pipeline stages, rank 0 says " +
            std::to_string(a[1]);
    } else if (stages * dp_size != n) {
      bad = "rank " + std::to_string(r) + "'s optimizer shards over " + std::to_string(dp_size) + " rank(s) and there " +
            (stages == 1 ? std::string("is 1 pipeline stage") : "are " + std::to_string(stages) + " pipeline stages") +
            ", but the Checkpointer's communicator has " + std::to_string(n) +
            " ranks; pass the communicator of every rank of every stage (pipeline stages x the optimizer's group), "
            "and set CheckpointOptions::pp_stages and pp_stage";
    } else if (!seen.emplace(std::make_pair(stage, dp_rank), r).second) {
      bad = "ranks " + std::to_string(seen.at({stage, dp_rank})) + " and " + std::to_string(r) +
            " both say they are rank " + std::to_string(dp_rank) + " of pipeline stage " + std::to_string(stage) +
            "; set CheckpointOptions::pp_stage to each rank's own stage";
    }
  }
  TORCH_CHECK_VALUE(bad.empty(), "checkpoint: the ranks do not form one grid of pipeline stages and data-parallel "
                    "groups: ", bad);
  if (places) {
    places->clear();
    for (int r = 0; r < n; ++r) places->emplace_back(static_cast<int>(a[r * width]), static_cast<int>(a[r * width + 2]));
  }
  return any;
}

json rank_record(const Snapshot& snap) {
  json rec;
  rec["pp_stage"] = snap.place.pp_stage;
  rec["dp_rank"] = snap.place.dp_rank;
  if (snap.replica > 0) rec["replica"] = snap.replica;
  std::vector<json> pieces(snap.params.size(), json::array());
  std::vector<char> copied(snap.params.size(), 0);
  for (const auto& o : snap.owned) {
    pieces[o.param].push_back({o.begin, o.begin + o.master.numel()});
    copied[o.param] = static_cast<char>(copied[o.param] || o.copy);
  }
  rec["params"] = json::array();
  for (size_t i = 0; i < snap.params.size(); ++i) {
    json p{{"name", snap.names[i]}, {"shape", snap.params[i].shape}, {"dtype", c10::toString(snap.params[i].dtype)},
           {"step", snap.steps[i]}, {"pieces", std::move(pieces[i])}};
    if (snap.gradients) p["had_grad"] = snap.had_grad[i] != 0;
    if (copied[i]) p["copy"] = true;
    rec["params"].push_back(std::move(p));
  }
  rec["replicated"] = json::array();
  rec["groups"] = json::array();
  if (snap.writes_replicated) {  // what the group shares
    for (const auto& r : snap.replicated) {
      rec["replicated"].push_back({{"name", r.name}, {"kind", r.kind}, {"shape", r.value.sizes().vec()},
                                   {"dtype", c10::toString(r.value.scalar_type())}});
    }
  }
  if (snap.place.dp_rank != 0) return rec;  // the group's first rank lists its layouts
  for (const auto& g : snap.groups) {
    json j;
    j["pp_stage"] = snap.place.pp_stage;
    j["params"] = json::array();
    for (size_t k = 0; k < g.params.size(); ++k) j["params"].push_back(snap.names[g.params[k]]);
    j["offsets"] = g.layout.offsets;
    j["padded_numel"] = g.layout.padded_numel;
    j["dtype"] = c10::toString(g.layout.dtype);
    rec["groups"].push_back(std::move(j));
  }
  return rec;
}

Contents merge_records(const std::vector<std::string>& texts, int my_rank, bool keep_alternates) {
  std::vector<json> recs;
  for (const auto& t : texts) recs.push_back(json::parse(t));
  std::vector<int> order(recs.size());  // ranks by (stage, dp rank)
  for (size_t r = 0; r < order.size(); ++r) order[r] = static_cast<int>(r);
  auto key = [&](int r) {
    return std::make_pair(recs[static_cast<size_t>(r)].at("pp_stage").get<int>(),
                          recs[static_cast<size_t>(r)].at("dp_rank").get<int>());
  };
  std::sort(order.begin(), order.end(), [&](int a, int b) { return key(a) < key(b); });
  // A name held by several stages (a tied parameter, a shared buffer) is
  // written by the lowest of them; all must agree on its shape and dtype.
  std::unordered_map<std::string, std::pair<int, const json*>> first;  // name -> (stage, entry)
  for (int r : order) {
    const int stage = key(r).first;
    for (const char* list : {"params", "replicated"}) {
      for (const auto& e : recs[static_cast<size_t>(r)].at(list)) {
        const auto name = e.at("name").get<std::string>();
        auto [it, fresh] = first.emplace(name, std::make_pair(stage, &e));
        const json& f = *it->second.second;
        TORCH_CHECK_VALUE(fresh || (f.at("shape") == e.at("shape") && f.at("dtype") == e.at("dtype")),
                          "checkpoint: pipeline stages ", it->second.first, " and ", stage, " both hold '", name,
                          "', as ", f.at("dtype").get<std::string>(), " ", f.at("shape").dump(), " and ",
                          e.at("dtype").get<std::string>(), " ", e.at("shape").dump(),
                          "; a tensor held by several stages must be the same tensor in each");
      }
    }
  }
  Contents out;
  std::unordered_map<std::string, size_t> param_at, replicated_at;
  // Without a shared filesystem, the other complete sets of a parameter's pieces: another
  // stage's (a tied parameter), a disk's copy of a replicated group's, or another replica's
  // shards (hybrid sharding; its ranks' pieces together). Keyed by (stage, the copying rank,
  // -2 - the replica, or -1).
  std::map<std::string, std::map<std::pair<int, int>, json>> alternates;
  for (int r : order) {
    const json& rec = recs[static_cast<size_t>(r)];
    const int stage = key(r).first;
    for (const auto& e : rec.at("params")) {
      const auto name = e.at("name").get<std::string>();
      const bool copy = e.value("copy", false);
      if (first.at(name).first != stage || copy) {
        if (!keep_alternates) {
          if (r == my_rank) out.skip.insert(name);
          continue;
        }
        const int replica = rec.value("replica", 0);
        json& cover = alternates[name][{stage, !copy ? -1 : replica > 0 ? -2 - replica : r}];
        for (const auto& pc : e.at("pieces")) cover.push_back({r, pc.at(0), pc.at(1)});
        continue;
      }
      auto [it, fresh] = param_at.emplace(name, out.params.size());
      if (fresh) {
        json p = e;
        p["pieces"] = json::array();
        out.params.push_back(std::move(p));
      }
      json& p = out.params[it->second];
      for (const auto& pc : e.at("pieces")) p["pieces"].push_back({r, pc.at(0), pc.at(1)});
      if (e.contains("had_grad")) p["had_grad"] = p.at("had_grad").get<bool>() || e.at("had_grad").get<bool>();
    }
    for (const auto& e : rec.at("replicated")) {
      const auto name = e.at("name").get<std::string>();
      const bool lower = first.at(name).first != stage;  // a lower stage holds it too
      if (param_at.count(name) || (lower && !keep_alternates)) {
        if (r == my_rank) out.skip.insert(name);
        continue;
      }
      auto [it, fresh] = replicated_at.emplace(name, out.replicated.size());
      if (fresh) {  // the lowest stage's group's first rank (ranks go by stage, then dp rank)
        json q = e;
        q["rank"] = r;
        out.replicated.push_back(std::move(q));
      } else {      // the first rank of a stage on another disk, or of a higher stage: a copy there
        out.replicated[it->second]["copies"].push_back(r);
      }
    }
    for (const auto& g : rec.at("groups")) out.groups.push_back(g);
  }
  for (auto& [name, covers] : alternates) {
    json& p = out.params.at(param_at.at(name));
    for (auto& [where, cover] : covers) p["alternates"].push_back(std::move(cover));
  }
  // A name another stage writes as a trained parameter: this rank's copy is not written either.
  for (const auto& e : recs[static_cast<size_t>(my_rank)].at("replicated")) {
    if (param_at.count(e.at("name").get<std::string>())) out.skip.insert(e.at("name").get<std::string>());
  }
  for (size_t r = 0; r < recs.size(); ++r) out.places.push_back({key(static_cast<int>(r)).first, key(static_cast<int>(r)).second});
  return out;
}

json build_manifest(const Snapshot& snap, Contents contents, const std::vector<std::pair<int64_t, uint64_t>>& digests) {
  json m;
  m["format"] = kFormat;
  m["format_version"] = kFormatVersion;
  m["step"] = snap.progress.step;
  m["epoch"] = snap.progress.epoch;
  m["extra"] = json::parse(snap.progress.extra_json);
  m["world_size"] = snap.world;
  m["zero_stage"] = snap.zero_stage;
  m["topology"] = {{"pp_stages", snap.place.pp_stages}, {"dp_size", snap.place.dp_size}};
  m["gradients"] = snap.gradients;
  m["loss_scale"] = snap.loss_scale;
  m["loss_scale_clean_steps"] = snap.loss_scale_clean_steps;
  m["params"] = std::move(contents.params);
  m["replicated"] = std::move(contents.replicated);
  m["groups"] = std::move(contents.groups);  // the saving run's flat layouts (buckets or units), for tools
  m["files"] = json::array();
  for (int r = 0; r < snap.world; ++r) {
    const auto& [bytes, xxh3] = digests[static_cast<size_t>(r)];
    const auto& [stage, dp_rank] = contents.places[static_cast<size_t>(r)];
    m["files"].push_back({{"name", rank_file_name(r, snap.world)}, {"bytes", bytes}, {"xxh3", checkpoint::to_hex(xxh3)},
                          {"pp_stage", stage}, {"dp_rank", dp_rank}});
  }
  m["model_hash"] = hash_hex(manifest_model_description(m));
  return m;
}

std::string manifest_model_description(const json& m) {
  std::vector<std::string> lines;
  for (const auto& p : m.at("params")) {
    lines.push_back("param " + p.at("name").get<std::string>() + " " + p.at("shape").dump() + " " +
                    p.at("dtype").get<std::string>());
  }
  for (const auto& r : m.at("replicated")) {
    lines.push_back((r.at("kind").get<std::string>() == "buffer" ? "buffer " : "param ") +
                    r.at("name").get<std::string>() + " " + r.at("shape").dump() + " " + r.at("dtype").get<std::string>());
  }
  std::sort(lines.begin(), lines.end());
  std::string d;
  for (const auto& l : lines) d += l + "\n";
  return d;
}

void write_manifest(const fs::path& step_dir, const json& manifest) {
  const std::string text = manifest.dump(1);
  write_atomically(step_dir / "manifest.xxh3", hash_hex(text) + "\n");
  write_atomically(step_dir / "manifest.json", text);
}

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

// "" when every field the readers use has the type and range they assume; else
// the first that does not. (An edited manifest whose checksum was fixed up, or a
// legacy one without manifest.xxh3, must not reach them with a string where a
// size is expected, a file name that leads out of the step directory, or a
// shape whose element count overflows.)
std::string schema_problem(const json& m) {
  auto integer = [](const json& j, int64_t lo, int64_t hi) {
    return j.is_number_integer() && j.get<int64_t>() >= lo && j.get<int64_t>() <= hi;
  };
  constexpr int64_t kMax = int64_t{1} << 53;
  auto field = [&](const json& obj, const char* key, auto ok, bool required = true) -> std::string {
    if (!obj.contains(key)) return required ? std::string("'") + key + "' is missing" : std::string();
    return ok(obj.at(key)) ? std::string() : std::string("'") + key + "' is " + obj.at(key).dump().substr(0, 80);
  };
  auto any_int = [&](const json& j) { return integer(j, -kMax, kMax); };
  auto count = [&](const json& j) { return integer(j, 0, kMax); };
  auto text = [](const json& j) { return j.is_string(); };
  auto triples = [&](const json& j) {  // pieces: [rank, begin, end]
    if (!j.is_array()) return false;
    for (const auto& pc : j) {
      if (!pc.is_array() || pc.size() != 3 || !any_int(pc[0]) || !any_int(pc[1]) || !any_int(pc[2])) return false;
    }
    return true;
  };
  auto ranks = [&](const json& j) {
    return j.is_array() && std::all_of(j.begin(), j.end(), [&](const json& c) { return any_int(c); });
  };
  // Tensor names become HDF5 dataset paths, file names paths in the step directory.
  auto tensor_name = [](const json& j) {
    return j.is_string() && !j.get<std::string>().empty() && j.get<std::string>().find('/') == std::string::npos;
  };
  auto file_name = [](const json& j) {
    if (!j.is_string()) return false;
    const auto n = j.get<std::string>();
    return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos;
  };
  auto dtype = [](const json& j) {
    if (!j.is_string()) return false;
    try {
      checkpoint::dtype_named(j.get<std::string>());  // the names the readers accept
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  };
  auto shape = [&](const json& j) {
    if (!j.is_array() || j.size() > 16) return false;
    int64_t numel = 1;
    for (const auto& d : j) {
      if (!count(d) || (d.get<int64_t>() != 0 && numel > kMax / d.get<int64_t>())) return false;
      numel *= d.get<int64_t>();
    }
    return true;
  };
  std::string bad;
  auto first = [&](const std::string& where, std::initializer_list<std::string> problems) {
    for (const auto& p : problems) {
      if (bad.empty() && !p.empty()) bad = where + p;
    }
  };
  first("", {field(m, "step", any_int), field(m, "epoch", any_int), field(m, "extra", [](const json& j) { return j.is_object(); }),
             field(m, "world_size", [&](const json& j) { return integer(j, 1, 1 << 20); }),
             field(m, m.contains("zero_stage") ? "zero_stage" : "stage", [&](const json& j) { return integer(j, 0, 3); }),
             field(m, "model_hash", text), field(m, "loss_scale", [](const json& j) { return j.is_number(); }),
             field(m, "loss_scale_clean_steps", any_int), field(m, "gradients", [](const json& j) { return j.is_boolean(); }, false),
             field(m, "save_seconds", [](const json& j) { return j.is_number(); }, false),
             field(m, "topology", [&](const json& j) {
               return j.is_object() && (!j.contains("pp_stages") || integer(j.at("pp_stages"), 1, 1 << 20)) &&
                      (!j.contains("dp_size") || integer(j.at("dp_size"), 1, 1 << 20));
             }, false)});
  for (const char* list : {"files", "params", "replicated"}) {
    first("", {field(m, list, [](const json& j) { return j.is_array(); })});
  }
  if (!bad.empty()) return bad;
  if (m.at("files").size() != m.at("world_size").get<size_t>()) {
    return std::to_string(m.at("files").size()) + " files are listed for a world of " + m.at("world_size").dump();
  }
  for (const auto& f : m.at("files")) {
    if (!f.is_object()) return "a file entry is " + f.dump().substr(0, 80);
    first("file " + f.value("name", json()).dump() + ": ",
          {field(f, "name", file_name), field(f, "bytes", count), field(f, "xxh3", text),
           field(f, "pp_stage", count, false), field(f, "dp_rank", count, false), field(f, "host", text, false),
           field(f, "index", [&](const json& j) {
             return j.is_object() && j.contains("bytes") && count(j.at("bytes")) && j.contains("xxh3") &&
                    text(j.at("xxh3"));
           }, false)});
  }
  if (m.contains("model_view")) {
    const json& v = m.at("model_view");
    if (!v.is_object()) return "'model_view' is " + v.dump().substr(0, 80);
    first("model_view: ", {field(v, "name", file_name), field(v, "bytes", count), field(v, "xxh3", text)});
  }
  std::set<std::string> names;
  for (const char* list : {"params", "replicated"}) {
    for (const auto& e : m.at(list)) {
      if (!e.is_object()) return std::string("an entry of '") + list + "' is " + e.dump().substr(0, 80);
      const std::string where = std::string(list) + " entry " + e.value("name", json()).dump().substr(0, 80) + ": ";
      first(where, {field(e, "name", tensor_name), field(e, "shape", shape), field(e, "dtype", dtype)});
      if (std::string(list) == "params") {
        first(where, {field(e, "step", any_int), field(e, "had_grad", [](const json& j) { return j.is_boolean(); }, false),
                      field(e, "alternates", [&](const json& j) {
                        return j.is_array() && std::all_of(j.begin(), j.end(), [&](const json& c) { return triples(c); });
                      }, false),
                      field(e, "pieces", triples)});
      } else {
        first(where, {field(e, "kind", text), field(e, "rank", any_int, false),
                      field(e, "copies", ranks, false)});
      }
      if (!bad.empty()) return bad;
      if (!names.insert(e.at("name").get<std::string>()).second) {
        return "'" + e.at("name").get<std::string>() + "' is listed twice";
      }
    }
  }
  return bad;
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
  return m;
}

int zero_stage_of(const json& manifest) {
  return manifest.contains("zero_stage") ? manifest.at("zero_stage").get<int>() : manifest.at("stage").get<int>();
}


}  // namespace zeroshard::ckpt
