// manifest.cpp — the manifest: every rank's record merged into one list of
// parameters and pieces, and written with its checksum (manifest_read.cpp reads
// it back and verifies it); and the topology (pipeline stages x data-parallel
// groups) it records.
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

namespace {

using StageEntry = std::pair<int, const json*>;

// For each name, the lowest stage holding it and its entry there. A name held
// by several stages (a tied parameter, a shared buffer) is written by the
// lowest of them; all must agree on its shape and dtype.
std::unordered_map<std::string, StageEntry> first_holders(const std::vector<json>& recs, const std::vector<int>& order) {
  std::unordered_map<std::string, StageEntry> first;
  for (int r : order) {
    const json& rec = recs[static_cast<size_t>(r)];
    const int stage = rec.at("pp_stage").get<int>();
    for (const char* list : {"params", "replicated"}) {
      for (const auto& e : rec.at(list)) {
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
  return first;
}

// The records merged into the manifest's contents, one rank's record at a time
// (ranks by stage, then data-parallel rank).
struct Merge {
  Merge(const std::unordered_map<std::string, StageEntry>& f, int rank, bool keep)
      : first(f), my_rank(rank), keep_alternates(keep) {}
  const std::unordered_map<std::string, StageEntry>& first;
  const int my_rank;
  const bool keep_alternates;
  Contents out;
  std::unordered_map<std::string, size_t> param_at, replicated_at;
  // Without a shared filesystem, the other complete sets of a parameter's pieces: another
  // stage's (a tied parameter), a disk's copy of a replicated group's, or another replica's
  // shards (hybrid sharding; its ranks' pieces together). Keyed by (stage, the copying rank,
  // -2 - the replica, or -1).
  std::map<std::string, std::map<std::pair<int, int>, json>> alternates;

  void add_params(int r, const json& rec, int stage) {
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
  }

  void add_replicated(int r, const json& rec, int stage) {
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
  }

  void finish(const json& my_record) {
    for (auto& [name, covers] : alternates) {
      json& p = out.params.at(param_at.at(name));
      for (auto& [where, cover] : covers) p["alternates"].push_back(std::move(cover));
    }
    // A name another stage writes as a trained parameter: this rank's copy is not written either.
    for (const auto& e : my_record.at("replicated")) {
      if (param_at.count(e.at("name").get<std::string>())) out.skip.insert(e.at("name").get<std::string>());
    }
  }
};

}  // namespace

Contents merge_records(const std::vector<std::string>& texts, int my_rank, bool keep_alternates) {
  std::vector<json> recs;
  for (const auto& t : texts) recs.push_back(json::parse(t));
  auto key = [&](size_t r) {
    return std::make_pair(recs[r].at("pp_stage").get<int>(), recs[r].at("dp_rank").get<int>());
  };
  std::vector<int> order(recs.size());  // ranks by (stage, dp rank)
  for (size_t r = 0; r < order.size(); ++r) order[r] = static_cast<int>(r);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return key(a) < key(b); });
  const auto first = first_holders(recs, order);
  Merge merge(first, my_rank, keep_alternates);
  for (int r : order) {
    const json& rec = recs[static_cast<size_t>(r)];
    merge.add_params(r, rec, key(r).first);
    merge.add_replicated(r, rec, key(r).first);
    for (const auto& g : rec.at("groups")) merge.out.groups.push_back(g);
  }
  merge.finish(recs[static_cast<size_t>(my_rank)]);
  for (size_t r = 0; r < recs.size(); ++r) merge.out.places.push_back({key(r).first, key(r).second});
  return std::move(merge.out);
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

}  // namespace zeroshard::ckpt
