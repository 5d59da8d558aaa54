// load_candidates.cpp — which committed checkpoint to load: the steps every
// rank can see, each verified (manifest, files present here, in the durable
// tier or on another rank), the newest that passes on every rank.
#include "checkpointer_impl.h"

#include "zeroshard/log.h"

#include <algorithm>
#include <functional>
#include <iterator>
#include <map>

namespace zeroshard {

using namespace ckpt;

namespace {

// "LINE (newest step S), ..." for an error.
std::string lines_of(const std::vector<Commit>& all) {
  std::string out;
  std::set<std::string> seen;
  for (const auto& c : all) {
    if (!seen.insert(c.line).second) continue;
    out += (out.empty() ? "" : ", ") + (c.line.empty() ? "\"\"" : c.line) + " (newest step " + std::to_string(c.step) + ")";
  }
  return out.empty() ? "none" : out;
}

// The lineage of the checkpoint `latest` names in `root`, or null (none, or unreadable).
json local_history(const fs::path& root) {
  try {
    if (fs::exists(root / "latest")) return lineage_of(read_manifest(latest_step_dir(root)));
  } catch (const std::exception& e) {
    log_warn("checkpoint: " + error_message(e) + "; this run's history of checkpoints (lineage.h) is not known from it");
  }
  return json();
}

}  // namespace

json Checkpointer::Impl::latest_history(const std::vector<ckpt::Commit>& all) {
  const auto latest = durable->latest();
  if (!latest) return json();
  try {
    return durable->lineage(*latest);
  } catch (const c10::Error& e) {  // its commit gone (a step taken away by hand) or damaged: its line's newest
    auto it = std::find_if(all.begin(), all.end(), [&](const Commit& c) {
      return c.line == latest->line && c.step != latest->step;
    });
    log_warn("checkpoint: the commit " + options.durable_uri + "/latest names cannot be read (" + error_message(e) +
             "); this run follows " + (it == all.end() ? std::string("every line") : "line " + it->line));
    return it == all.end() ? json() : durable->lineage(*it);
  }
}

json Checkpointer::Impl::store_view(const fs::path& root) {
  // This run's history: the disk's latest checkpoint's, else the store's latest commit's (or the
  // newest commit of the line the options name).
  json history = options.durable_line.empty() ? local_history(root) : json();
  json view{{"history", nullptr}, {"commits", json::array()}, {"others", json::array()}};
  if (!durable) {
    view["history"] = history;
    return view;
  }
  try {
    const auto all = durable->commits();
    if (!options.durable_line.empty()) {
      auto it = std::find_if(all.begin(), all.end(), [&](const Commit& c) { return c.line == options.durable_line; });
      TORCH_CHECK(it != all.end(), "checkpoint: CheckpointOptions::durable_line '", options.durable_line,
                  "' has no commit in ", options.durable_uri, "; its lines: ", lines_of(all));
      history = durable->lineage(*it);
    } else if (history.is_null()) {
      history = latest_history(all);
    }
    std::set<int64_t> taken;
    for (const auto& c : all) {
      const bool ours = history.is_null() || in_history(history, c.step, c.line);
      if (ours && taken.insert(c.step).second) {
        view["commits"].push_back({c.step, c.line});
      } else if (!ours) {
        view["others"].push_back({c.step, c.line});
      }
    }
  } catch (const c10::Error& e) {
    if (!options.durable_line.empty()) throw;
    log_warn("checkpoint: cannot list the durable tier (" + error_message(e) + "); loading from '" + dir + "' alone");
  }
  view["history"] = history;
  return view;
}

std::vector<fs::path> Checkpointer::Impl::agree_on_candidates(std::optional<int64_t> step) {
  const fs::path root(dir);
  durable_steps.clear();
  std::string text = "{}";
  if (comm->rank() == 0) {
    try {
      text = store_view(root).dump();
    } catch (const std::exception& e) {
      text = json{{"error", error_message(e)}}.dump();
    }
  }
  const json view = json::parse(broadcast_text(*comm, text, 0));
  TORCH_CHECK(!view.contains("error"), view.value("error", ""));
  const json history = view.at("history");
  for (const auto& c : view.at("commits")) durable_steps.emplace(c.at(0).get<int64_t>(), c.at(1).get<std::string>());
  // A step of this run's history on this disk: its manifest's line is in the history (a step whose
  // manifest cannot be read is tried, and refused naming why).
  auto ours = [&](const fs::path& step_dir) {
    if (history.is_null()) return true;
    try {
      const json m = read_manifest(step_dir);
      return in_history(history, m.at("step").get<int64_t>(), line_of(m));
    } catch (const std::exception&) {
      return true;
    }
  };
  if (step) {
    const bool here = fs::exists(root / step_dir_name(*step) / "manifest.json");
    std::string lines;
    for (const auto& c : view.at("others")) {
      if (c.at(0).get<int64_t>() == *step) lines += (lines.empty() ? "" : ", ") + c.at(1).get<std::string>();
    }
    TORCH_CHECK(here || durable_steps.count(*step) || lines.empty(), "checkpoint: step ", *step, " in ",
                options.durable_uri, " is of another line of checkpoints (", lines, "), not of this run's history ",
                history.dump(), "; set CheckpointOptions::durable_line to that line to follow it");
    return {root / step_dir_name(*step)};
  }
  // This rank's view: what `latest` names and the committed steps, newest first.
  json mine{{"latest", nullptr}, {"committed", json::array()}};
  if (fs::exists(root / "latest")) {
    try {
      const fs::path latest = latest_step_dir(root);
      if (ours(latest)) mine["latest"] = *step_of_dir_name(latest.filename().string());
    } catch (const std::exception& e) {
      log_warn(error_message(e) + "; loading the newest committed checkpoint instead");
    }
  }
  for (const auto& c : committed()) {
    if (ours(c)) mine["committed"].push_back(*step_of_dir_name(c.filename().string()));
  }
  // Every disk's view, so that every rank tries the same steps in the same order: first
  // the oldest step a `latest` names (a crash between two disks' commits leaves one disk
  // a step ahead), then the steps every disk holds, newest first.
  std::vector<json> views;
  if (disks.shared()) {
    views.push_back(mine);
  } else {
    for (const auto& t : all_gather_text(*comm, mine.dump())) views.push_back(json::parse(t));
  }
  std::optional<int64_t> latest;
  std::set<int64_t> everywhere;
  std::string holders;  // which ranks hold which steps, for the error below
  for (size_t r = 0; r < views.size(); ++r) {
    const auto& v = views[r];
    if (!v.at("latest").is_null()) latest = std::min(latest.value_or(std::numeric_limits<int64_t>::max()), v.at("latest").get<int64_t>());
    std::set<int64_t> held;
    for (const auto& s : v.at("committed")) held.insert(s.get<int64_t>());
    if (r == 0) {
      everywhere = held;
    } else {
      std::set<int64_t> both;
      std::set_intersection(everywhere.begin(), everywhere.end(), held.begin(), held.end(),
                            std::inserter(both, both.end()));
      everywhere = std::move(both);
    }
    if (disks.shared() || disks.leads(static_cast<int>(r))) {
      holders += std::string(holders.empty() ? "" : "; ") + "host " + disks.hosts[r] + " (rank " + std::to_string(r) +
                 ") " + (held.empty() ? std::string("none") : "steps " + v.at("committed").dump());
    }
  }
  // The durable tier's steps too: a disk that lacks one copies it from the store (fetch_from_durable).
  std::set<int64_t> loadable = everywhere;
  for (const auto& [s, line] : durable_steps) loadable.insert(s);
  // Newer steps of other lines are not this run's: said once, with how to follow one.
  if (comm->rank() == 0 && !view.at("others").empty()) {
    const auto newest = view.at("others").at(0);
    if (loadable.empty() || newest.at(0).get<int64_t>() > *loadable.rbegin()) {
      log_warn("checkpoint: " + options.durable_uri + " holds step " + std::to_string(newest.at(0).get<int64_t>()) +
               " of line " + newest.at(1).get<std::string>() + ", not of this run's history " + history.dump() +
               " (a timeline left by a rollback, or another job on this store): not loaded; set "
               "CheckpointOptions::durable_line to follow that line");
    }
  }
  std::vector<fs::path> out;
  if (latest) out.push_back(root / step_dir_name(*latest));
  for (auto it = loadable.rbegin(); it != loadable.rend(); ++it) {
    if (!latest || *it != *latest) out.push_back(root / step_dir_name(*it));
  }
  bool any = false;
  for (const auto& v : views) any = any || !v.at("committed").empty();
  // Some disks hold checkpoints and others none (a host replaced by a fresh one): starting
  // from scratch would silently throw the run away.
  TORCH_CHECK(!any || !loadable.empty(), "checkpoint: the hosts' run directories '", dir,
              "' hold no committed step in common (", holders,
              "). Bring every host's step directories together (a shared filesystem, or copy them onto each host: "
              "docs/checkpoints.md), or empty the directory on every host to start afresh");
  return out;
}

bool Checkpointer::Impl::here(const fs::path& step_dir, const json& file) {
  std::error_code ec;
  return fs::exists(step_dir / file.at("name").get<std::string>(), ec);
}

std::vector<char> Checkpointer::Impl::files_anywhere(const fs::path& step_dir, const json* m) const {
  std::string mine;  // '1' for each of the manifest's files this rank's directory holds
  if (m) {
    for (const auto& f : m->at("files")) mine += here(step_dir, f) ? '1' : '0';
  }
  std::vector<char> out(mine.size(), 0);
  for (const auto& theirs : all_gather_text(*comm, mine)) {
    for (size_t j = 0; j < out.size() && j < theirs.size(); ++j) out[j] = static_cast<char>(out[j] || theirs[j] == '1');
  }
  return out;
}

std::string Checkpointer::Impl::verify_share(const fs::path& step_dir, const json& m,
                                             const std::vector<char>& anywhere) const {
  const auto& files = m.at("files");
  // Each rank checks a share of the files its directory holds. Without a shared
  // filesystem a file may be on another host's disk only; one on none is missing.
  const auto group = disks.members(comm->rank());
  const size_t at = static_cast<size_t>(std::find(group.begin(), group.end(), comm->rank()) - group.begin());
  const bool in_store = fetchable(step_dir, m);  // a file no disk holds is copied from there when read
  for (size_t j = 0; j < anywhere.size() && !in_store; ++j) {
    if (!anywhere[j]) {
      return "'" + (step_dir / files[j].at("name").get<std::string>()).string() + "' is missing on every host";
    }
  }
  for (size_t j = at; j < files.size(); j += group.size()) {
    const fs::path p = step_dir / files[j].at("name").get<std::string>();
    std::error_code ec;
    if (!fs::exists(p, ec)) {
      if (!disks.shared() || in_store) continue;  // on another host's disk, or copied from the store when read
      const auto host = files[j].value("host", std::string());
      const auto& mine = disks.hosts[static_cast<size_t>(comm->rank())];
      return "'" + p.string() + "' is missing" +
             (host.empty() || host == mine ? std::string()
                                           : " (host " + host + " wrote it; without a shared filesystem, bring every "
                                             "host's files together: docs/checkpoints.md)");
    }
    const auto size = fs::file_size(p, ec);
    const auto want = files[j].at("bytes").get<int64_t>();
    if (ec || static_cast<int64_t>(size) != want) {
      return "'" + p.string() + "' has " + std::to_string(size) + " bytes, the manifest says " + std::to_string(want) +
             " (truncated?)";
    }
    const auto digest = checkpoint::digest_file(p.string());
    if (checkpoint::to_hex(digest.xxh3) != files[j].at("xxh3").get<std::string>()) {
      return "'" + p.string() + "' fails its checksum (xxh3 " + checkpoint::to_hex(digest.xxh3) +
             ", the manifest says " + files[j].at("xxh3").get<std::string>() + "): the file is corrupt";
    }
  }
  return "";
}

void Checkpointer::Impl::check_same_model(const json& m, const std::vector<ModelEntry>& mine,
                                          const fs::path& cand) const {
  // Whether some rank's model holds each of the checkpoint's tensors, and which ranks found a difference.
  std::unordered_map<std::string, std::pair<int64_t, const json*>> listed;  // name -> (index, entry)
  int64_t n = 0;
  for (const char* list : {"params", "replicated"}) {
    for (const auto& e : m.at(list)) listed.emplace(e.at("name").get<std::string>(), std::make_pair(n++, &e));
  }
  const bool imported = m.at("model_hash").get<std::string>().empty();  // zeroshard-ckpt import: matched by name
  auto held = torch::zeros({n + comm->size()}, torch::kDouble);
  std::string first;
  for (const auto& [buffer, info] : mine) {
    const std::string what = std::string(buffer ? "buffer '" : "parameter '") + info.name + "'";
    auto it = listed.find(info.name);
    if (it == listed.end()) {
      if (!imported && first.empty()) first = what + " is not in the checkpoint";
      continue;
    }
    const json& e = *it->second.second;
    held[it->second.first] = 1.0;
    const bool saved_buffer = e.value("kind", "parameter") == "buffer";
    const auto shape = e.at("shape").get<std::vector<int64_t>>();
    if (!first.empty()) continue;
    // An import (safetensors) knows no buffers and stores what it was given: names and shapes must match.
    if (!imported && saved_buffer != buffer) {
      first = what + " is a " + (saved_buffer ? "buffer" : "parameter") + " in the checkpoint";
    } else if (shape != info.shape) {
      first = what + " has shape " + c10::str(c10::IntArrayRef(info.shape)) + " here and " + e.at("shape").dump() +
              " in the checkpoint";
    } else if (!imported && e.at("dtype").get<std::string>() != c10::toString(info.dtype)) {
      first = what + " is " + c10::toString(info.dtype) + " here and " + e.at("dtype").get<std::string>() +
              " in the checkpoint";
    }
  }
  if (!first.empty()) held[n + comm->rank()] = 1.0;
  if (comm->size() > 1) comm->all_reduce(held, ReduceOp::kMax)->wait();
  std::string differ;
  for (int r = 0; r < comm->size(); ++r) {
    if (held[n + r].item<double>() > 0) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  }
  if (first.empty() && !differ.empty()) first = "rank(s) " + differ + " found a difference (their errors say which)";
  if (first.empty() && !imported) {
    for (const auto& [name, at] : listed) {
      if (held[at.first].item<double>() == 0) {
        first = "'" + name + "' is in the checkpoint but in no rank's model";
        break;
      }
    }
  }
  TORCH_CHECK(first.empty(), "checkpoint: '", cand.string(), "' was saved from a different model (", first,
              "); load it into the model it was saved from");
}

std::string Checkpointer::Impl::fetch_from_durable(const fs::path& cand) {
  const auto step = step_of_dir_name(cand.filename().string());
  std::string why;
  if (step && durable_steps.count(*step) && disks.leads(comm->rank()) && !fs::exists(cand / "manifest.json")) {
    try {  // the manifest now; each file a rank reads follows when it is read (PieceReader)
      durable->fetch_manifest({*step, durable_steps.at(*step)}, dir);
      log_warn("checkpoint: " + cand.filename().string() + " is not on this disk (host " +
               disks.hosts[static_cast<size_t>(comm->rank())] + "): its manifest copied from the durable tier " +
               options.durable_uri + ", the files its ranks read follow");
    } catch (const std::exception& e) {
      why = "copying its manifest from the durable tier " + options.durable_uri + " failed: " + error_message(e);
    }
  }
  // Nobody reads the step before every disk holds its manifest.
  if (!failed_ranks(*comm, !why.empty()).empty() && why.empty()) {
    why = "another host could not copy it from the durable tier (its log says why)";
  }
  return why;
}

bool Checkpointer::Impl::fetchable(const fs::path& cand, const json& m) const {
  const auto step = step_of_dir_name(cand.filename().string());
  return durable && step && durable_steps.count(*step) > 0 && durable_steps.at(*step) == line_of(m);
}

std::string Checkpointer::Impl::check_candidate(const fs::path& cand, json& m) const {
  std::string why;
  try {
    if (!fs::exists(cand / "manifest.json")) {
      why = "'" + cand.string() + "' has no manifest.json (never committed)" +
            (disks.shared() ? "" : " on host " + disks.hosts[static_cast<size_t>(comm->rank())]);
    } else {
      m = read_manifest(cand);
    }
  } catch (const std::exception& e) {
    why = "'" + (cand / "manifest.json").string() + "' cannot be used: " + error_message(e);
  }
  std::vector<char> anywhere;  // without a shared filesystem: the files some host's disk holds
  if (!disks.shared()) anywhere = files_anywhere(cand, why.empty() ? &m : nullptr);
  try {
    if (why.empty()) why = verify_share(cand, m, anywhere);
  } catch (const std::exception& e) {
    why = "'" + cand.string() + "' cannot be verified: " + error_message(e);
  }
  return why;
}


}  // namespace zeroshard
