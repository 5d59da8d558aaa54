// load.cpp — reading this rank's pieces of a verified checkpoint (resharding)
// and applying them on every rank or none (load_candidates.cpp: which one).
#include "checkpointer_impl.h"

#include "compat/torch_compat.h"
#include "reader.h"
#include "zeroshard/log.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <unordered_map>

namespace zeroshard {

using namespace ckpt;

namespace {

// What a rank reads from one verified checkpoint (step directory `cand`, its
// manifest `m`): pieces of parameters' masters, moments and gradients from
// whichever saved files hold them, and parameters saved in full. Each file
// opens once. Without a shared filesystem only the files on this host's disk
// can be read; a read that needs another throws, naming the file and the fix.
class PieceReader {
 public:
  using Ranged = std::function<std::unique_ptr<checkpoint::h5::Readable>(const json& file)>;
  // `on_disk(file)`: whether one of the manifest's files is in this rank's directory.
  // `fetch(file)` and `ranged(file)` (optional: the step is in a durable tier): a file
  // this directory lacks, when it is first read: copied into it whole, verified, when
  // it is one of this disk's ranks' own (the local tier again), else read where it is,
  // dataset by dataset (when the save left an index of it).
  PieceReader(const fs::path& cand, const json& m, const Disks& disks, int rank,
              std::function<bool(const json& file)> on_disk, std::function<void(const json& file)> fetch = {},
              Ranged ranged = {})
      : cand_(cand), m_(m), disks_(disks), rank_(rank), on_disk_(std::move(on_disk)), fetch_(std::move(fetch)),
        ranged_(std::move(ranged)) {
    for (const auto& p : m.at("params")) saved_[p.at("name").get<std::string>()] = &p;
    for (const auto& r : m.at("replicated")) replicated_[r.at("name").get<std::string>()] = &r;
  }

  bool saved(const std::string& name) const { return saved_.count(name) > 0; }
  const json& saved_entry(const std::string& name) const { return *saved_.at(name); }
  bool replicated(const std::string& name) const { return replicated_.count(name) > 0; }
  // Whether rank r's file is on this host's disk.
  bool local(int r) const { return disks_.shared() || on_disk_(file_entry(r)); }
  // How dear reading rank r's file is: 0 on this disk, 1 a file this disk's ranks copy
  // from the durable tier for themselves (at the topology that saved it, their own), 2
  // another file there, 3 none at all.
  int cost(int r) const {
    if (local(r)) return 0;
    if (!fetch_) return 3;
    const auto mine = disks_.members(rank_);
    return std::find(mine.begin(), mine.end(), r) != mine.end() ? 1 : 2;
  }
  const json& file_entry(int r) const { return m_.at("files").at(static_cast<size_t>(r)); }

  const checkpoint::h5::Readable& file(int r) {
    auto it = open_.find(r);
    if (it == open_.end()) {
      const json& f = file_entry(r);
      const fs::path path = cand_ / f.at("name").get<std::string>();
      std::unique_ptr<checkpoint::h5::Readable> opened;
      std::error_code ec;
      if (fetch_ && !fs::exists(path, ec)) {
        const auto mine = disks_.members(rank_);
        if (ranged_ && f.contains("index") && std::find(mine.begin(), mine.end(), r) == mine.end()) {
          opened = ranged_(f);
        } else {
          fetch_(f);
        }
      }
      if (!opened) opened = std::make_unique<checkpoint::h5::File>(checkpoint::h5::File::open_read(path.string()));
      it = open_.emplace(r, std::move(opened)).first;
    }
    return *it->second;
  }

  // A parameter saved in full (untrained at save time, e.g. frozen at stage 2), in its saved dtype.
  at::Tensor read_replicated(const std::string& name, const std::vector<int64_t>& shape) {
    const json& entry = *replicated_.at(name);
    const auto dtype = checkpoint::dtype_named(entry.at("dtype").get<std::string>());
    auto t = torch::empty(shape, torch::TensorOptions().dtype(dtype));
    std::vector<int> holders{entry.value("rank", 0)};  // the file saved with it, then copies on other disks
    for (const auto& c : entry.value("copies", json::array())) holders.push_back(c.get<int>());
    const auto it = std::min_element(holders.begin(), holders.end(), [&](int a, int b) { return cost(a) < cost(b); });
    if (cost(*it) == 3) not_here(holders.front(), name);
    const auto& in = file(*it);
    in.read_all("/replicated/" + name, storage_type(dtype, name), static_cast<uint64_t>(t.numel()), t.data_ptr());
    in.complete();  // callers convert it at once
    return t;
  }

  // Every read asked of the files so far has landed (h5::Readable::complete).
  void complete() {
    for (auto& [r, f] : open_) f->complete();
  }

  // Elements [a, e) of a saved parameter's `kind` ("master", "exp_avg", "exp_avg_sq", "grad"),
  // from the pieces of whichever ranks saved them; landed in `out` by complete().
  void read_master(const std::string& name, const char* kind, int64_t a, int64_t e, float* out) {
    const json& p = *saved_.at(name);
    auto overlaps = [&](const json& pc) { return std::max(a, pc[1].get<int64_t>()) < std::min(e, pc[2].get<int64_t>()); };
    // The saved pieces, or (without a shared filesystem) the first alternate set whose
    // pieces over [a, e) are cheapest to read: all on this disk, else in files this disk
    // copies from the durable tier anyway (cost()).
    const json* cover = &p.at("pieces");
    auto worst = [&](const json& c) {
      int w = 0;
      for (const auto& pc : c) {
        if (overlaps(pc)) w = std::max(w, cost(pc[0].get<int>()));
      }
      return w;
    };
    if (worst(*cover) > 0 && p.contains("alternates")) {
      for (const auto& alt : p.at("alternates")) {
        if (worst(alt) < worst(*cover)) cover = &alt;
      }
    }
    for (const auto& pc : *cover) {
      if (!overlaps(pc)) continue;
      const int r = pc[0].get<int>();
      const int64_t pb = pc[1].get<int64_t>(), pe = pc[2].get<int64_t>();
      const int64_t lo = std::max(a, pb), hi = std::min(e, pe);
      if (cost(r) == 3) not_here(r, name);
      file(r).read(std::string("/") + kind + "/" + name, checkpoint::h5::Type::kFloat32,
                   static_cast<uint64_t>(lo - pb), static_cast<uint64_t>(hi - lo), out + (lo - a));
    }
  }

 private:
  [[noreturn]] void not_here(int r, const std::string& name) const {
    const auto& f = file_entry(r);
    TORCH_CHECK(false, "'", (cand_ / f.at("name").get<std::string>()).string(), "' (written by rank ", r,
                f.contains("host") ? " on host " + f.at("host").get<std::string>() : std::string(),
                ") is not on this host's disk (host ", disks_.hosts[static_cast<size_t>(rank_)], ", rank ", rank_,
                "), and this load reads '", name, "' from it: the checkpoint was saved by ",
                m_.at("world_size").get<int>(), " ranks (", m_.value("topology", json::object()).value("pp_stages", 1),
                " pipeline stage(s), ZeRO stage ", zero_stage_of(m_), ") and the ranks now place its pieces elsewhere. "
                "Bring every host's ", cand_.filename().string(), " files together on each host (a shared filesystem, or "
                "copy them: docs/checkpoints.md), or resume with the topology that saved it");
  }

  const fs::path& cand_;
  const json& m_;
  const Disks& disks_;
  const int rank_;
  const std::function<bool(const json& file)> on_disk_;
  const std::function<void(const json& file)> fetch_;
  const Ranged ranged_;
  std::unordered_map<std::string, const json*> saved_, replicated_;
  std::map<int, std::unique_ptr<checkpoint::h5::Readable>> open_;
};

// What a load changes, read but not applied yet: every rank applies it, or none does.
// Its tensors are in host memory, where the reads land (PieceReader::complete).
struct Staged {
  std::vector<std::pair<at::Tensor, at::Tensor>> tensors;     // (live tensor, value read)
  std::vector<std::pair<c10::Device, at::Tensor>> generators;  // (device, state read)
  std::vector<int64_t> steps;                                  // AdamW's step count, per parameter
  std::vector<at::Tensor> grad_shards;                         // an accumulation in progress, per bucket
  std::vector<char> had_grad;
};

// The optimizer's shards of this rank (master and moments, in the current layout), from
// the pieces that cover them; a parameter saved in full (untrained then) has no moments.
void stage_shards(PieceReader& in, const ShardedState& state, const std::vector<std::string>& names, Staged& out) {
  out.steps.assign(state.params.size(), 0);
  for (size_t i = 0; i < names.size(); ++i) {
    if (in.saved(names[i])) {
      out.steps[i] = in.saved_entry(names[i]).at("step").get<int64_t>();
    } else {
      TORCH_CHECK(in.replicated(names[i]), "parameter '", names[i], "' is not in the checkpoint");
    }
  }
  std::unordered_map<std::string, at::Tensor> full_replicated;  // read once per parameter
  for (const auto& b : state.buckets) {
    // Reads land in host copies of the shards; they reach the live state, one copy each, only
    // when every rank has read everything. What no parameter covers (the padding) keeps its
    // value: copied from the live shard, the rest is read over.
    const int shard = b.layout.shard_of_rank(state.shard_rank);
    const auto segments = shard_segments(b.layout, shard);
    auto host = [&](const at::Tensor& live) {
      auto copy = at::empty(live.sizes(), live.options().device(at::kCPU));
      int64_t at = 0;
      auto keep = [&](int64_t end) {
        if (end > at) copy.slice(0, at, end).copy_(live.slice(0, at, end));
      };
      for (const auto& seg : segments) {
        const Range local = seg.local(b.layout, shard);
        keep(local.begin);
        at = std::max(at, local.end);
      }
      keep(live.size(0));
      return copy;
    };
    const at::Tensor master = host(b.master), exp_avg = host(b.exp_avg), exp_avg_sq = host(b.exp_avg_sq);
    for (const auto& seg : segments) {
      const size_t pi = b.params[seg.param];
      const std::string& name = names[pi];
      const Range local = seg.local(b.layout, shard);
      const int64_t a = seg.param_offset, e = seg.param_offset + local.size();
      if (in.saved(name)) {
        in.read_master(name, "master", a, e, master.data_ptr<float>() + local.begin);
        in.read_master(name, "exp_avg", a, e, exp_avg.data_ptr<float>() + local.begin);
        in.read_master(name, "exp_avg_sq", a, e, exp_avg_sq.data_ptr<float>() + local.begin);
      } else {
        auto& full = full_replicated[name];
        if (!full.defined()) full = in.read_replicated(name, state.params[pi].shape).to(at::kFloat).reshape(-1);
        master.slice(0, local.begin, local.end).copy_(full.slice(0, a, e));
        exp_avg.slice(0, local.begin, local.end).zero_();
        exp_avg_sq.slice(0, local.begin, local.end).zero_();
      }
    }
    out.tensors.push_back({b.master, master});
    out.tensors.push_back({b.exp_avg, exp_avg});
    out.tensors.push_back({b.exp_avg_sq, exp_avg_sq});
  }
}

// The module's parameters the optimizer does not hold, and its buffers, in full.
// `imported` (zeroshard-ckpt import): what the checkpoint lacks keeps its value.
void stage_module_rest(PieceReader& in, torch::nn::Module& model, const std::vector<std::string>& names,
                       const std::map<std::string, std::string>& saved_names, bool imported, Staged& out) {
  std::unordered_map<std::string, bool> in_state;
  for (const auto& n : names) in_state[n] = true;
  auto restore_full = [&](const std::string& name, const at::Tensor& target) {
    if (imported && !in.replicated(name) && !in.saved(name)) {
      log_info("checkpoint: '" + name + "' is not in the imported checkpoint; it keeps its value");
      return;
    }
    if (in.replicated(name)) {
      out.tensors.push_back({target.detach(), in.read_replicated(name, target.sizes().vec())});
    } else {
      TORCH_CHECK(in.saved(name), "'", name, "' is not in the checkpoint");
      auto full = torch::empty({target.numel()}, at::kFloat);
      in.read_master(name, "master", 0, target.numel(), full.data_ptr<float>());
      out.tensors.push_back({target.detach(), full.view(target.sizes())});
    }
  };
  for (const auto& item : model.named_parameters()) {
    const std::string name = saved_name(saved_names, item.key());
    if (!in_state.count(name)) restore_full(name, item.value());
  }
  for (const auto& item : model.named_buffers()) restore_full(saved_name(saved_names, item.key()), item.value());
}

// The random generators' states, when this rank sits where the saver did (the same place in
// the same topology: each rank resumes its own stream): the CPU's, and the training
// device's when it is a GPU.
void stage_generators(PieceReader& in, const json& m, const Place& place, int rank, int world, c10::Device device,
                      const std::string& dir, Staged& out) {
  const auto& saved_file = in.file_entry(std::min(rank, static_cast<int>(m.at("files").size()) - 1));
  const bool same_place = m.at("world_size").get<int>() == world &&
                          m.value("topology", json::object()).value("pp_stages", 1) == place.pp_stages &&
                          saved_file.value("pp_stage", 0) == place.pp_stage &&
                          saved_file.value("dp_rank", rank) == place.dp_rank;
  if (!same_place || !in.local(rank)) return;
  std::vector<std::pair<std::string, c10::Device>> generators{{"/rng/cpu", c10::kCPU}};
  if (device.is_cuda()) generators.emplace_back("/rng/cuda", device);
  for (const auto& [ds, dev] : generators) {
    if (!in.file(rank).has(ds)) continue;
    const auto dims = in.file(rank).dims(ds);
    // A generator's state is a few KiB (the CPU's mt19937: 5,056 bytes).
    TORCH_CHECK(dims.size() == 1 && dims[0] <= (1u << 20), "checkpoint ", dir, ": ", ds, " of rank ", rank,
                " is not a generator state (", dims.size(), "-D, ", dims.empty() ? 0 : dims[0],
                " elements; want 1-D, at most 1 MiB): a file edited or written by another program?");
    auto rng = torch::empty({static_cast<int64_t>(dims[0])}, torch::kUInt8);
    in.file(rank).read_all(ds, checkpoint::h5::Type::kUInt8, static_cast<uint64_t>(rng.numel()), rng.data_ptr());
    out.generators.emplace_back(dev, rng);
  }
}

// An accumulation in progress when it was saved: the reduced gradients so far, in this layout.
void stage_gradients(PieceReader& in, const ShardedState& state, const std::vector<std::string>& names, Staged& out) {
  for (const auto& b : state.buckets) {
    auto g = at::zeros({b.shard.size()}, at::kFloat);
    const int shard = b.layout.shard_of_rank(state.shard_rank);
    for (const auto& seg : shard_segments(b.layout, shard)) {
      const std::string& name = names[b.params[seg.param]];
      if (!in.saved(name)) continue;  // untrained when saved: no gradient
      const Range local = seg.local(b.layout, shard);
      in.read_master(name, "grad", seg.param_offset, seg.param_offset + local.size(), g.data_ptr<float>() + local.begin);
    }
    out.grad_shards.push_back(g);
  }
  for (const auto& n : names) {
    out.had_grad.push_back(in.saved(n) && in.saved_entry(n).value("had_grad", false) ? 1 : 0);
  }
}

// Everything a load changes on this rank, read into `staged` (not applied).
void stage_all(PieceReader& in, const json& m, const ShardedState& state, torch::nn::Module& model,
               const std::vector<std::string>& names, const std::map<std::string, std::string>& saved_names,
               const Place& place, Communicator& comm, const std::string& dir, Staged& staged) {
  stage_shards(in, state, names, staged);
  const bool imported = m.at("model_hash").get<std::string>().empty();  // zeroshard-ckpt import: no hash
  stage_module_rest(in, model, names, saved_names, imported, staged);
  const c10::Device device = state.buckets.empty() ? c10::Device(c10::kCPU) : state.buckets.front().master.device();
  stage_generators(in, m, place, comm.rank(), comm.size(), device, dir, staged);
  if (m.value("gradients", false)) stage_gradients(in, state, names, staged);
  in.complete();
}

TrainingProgress progress_of(const json& m) {
  TrainingProgress progress;
  progress.step = m.at("step").get<int64_t>();
  progress.epoch = m.at("epoch").get<int64_t>();
  progress.extra_json = m.at("extra").dump();
  progress.save_seconds = m.value("save_seconds", 0.0);
  return progress;
}

}  // namespace

std::optional<TrainingProgress> Checkpointer::Impl::load(
    ShardedState state, torch::nn::Module& model, std::optional<int64_t> step,
    const Restore& restore) {
  wait_pending();
  torch::NoGradGuard no_grad;
  const Place place = place_of(state);
  agree_on_places(*comm, place, {});
  const auto names = module_names(state, model, options.saved_names);
  const std::vector<fs::path> candidates = agree_on_candidates(step);
  if (candidates.empty()) return std::nullopt;
  const auto mine = model_entries(model, state, names, options.saved_names);
  std::string skipped;  // why each candidate was passed over, for the error when every one is
  auto skip = [&](const fs::path& cand, const std::string& why) {
    TORCH_CHECK(!step, "checkpoint: step ", step.value_or(0), " in '", dir, "' cannot be loaded: ", why);
    log_warn("checkpoint: not loading " + cand.string() + ": " + why + "; trying the previous committed checkpoint");
    skipped += "; " + cand.filename().string() + ": " + why;
  };
  for (const auto& cand : candidates) {
    // 0. what a disk lacks, copied from the durable tier
    std::string fetched = durable ? fetch_from_durable(cand) : "";
    // 1. manifest and files, checked by every rank (each a share of the files)
    json m;
    std::string why = check_candidate(cand, m);
    if (!fetched.empty()) why = fetched;
    if (!failed_ranks(*comm, !why.empty()).empty()) {
      skip(cand, why.empty() ? "another rank found a bad file (its log says which)" : why);
      continue;
    }
    // 2. the same model (a different one is an error, not a reason to fall back)
    check_same_model(m, mine, cand);
    // 3. this rank's pieces, from whichever old files hold them
    Staged staged;
    try {
      std::function<void(const json&)> fetch;
      PieceReader::Ranged ranged;
      if (fetchable(cand, m)) {
        const ckpt::Commit c{m.at("step").get<int64_t>(), line_of(m)};
        fetch = [this, &cand, c](const json& file) { durable->fetch_file(cand, c.line, file); };
        ranged = [this, c](const json& file) { return durable->open_ranged(c, file); };
      }
      PieceReader in(cand, m, disks, comm->rank(), [&cand](const json& file) { return here(cand, file); }, fetch,
                     ranged);
      stage_all(in, m, state, model, names, options.saved_names, place, *comm, dir, staged);
    } catch (const std::exception& e) {
      why = error_message(e);
    }
    // All or nothing: a load that fails on any rank (a file damaged in the durable tier,
    // another host's file out of reach) leaves every rank's model, optimizer and
    // generators as they were, and the ranks go on to the previous committed step together.
    why = agreed_failure(*comm, "loading " + cand.string(), why);
    if (!why.empty()) {
      skip(cand, why);
      continue;
    }
    // What this run saves from here on: the loaded step's history, on a line of its own (lineage.h).
    json next_lineage = branched(lineage_of(m), m.at("step").get<int64_t>(), new_line_id());
    for (auto& [live, value] : staged.tensors) live.copy_(value);
    for (auto& [dev, rng] : staged.generators) {
      auto gen = compat::default_generator(dev);  // a handle on the process's generator
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng);
    }
    for (size_t b = 0; b < staged.grad_shards.size(); ++b) {
      staged.grad_shards[b] = staged.grad_shards[b].to(state.buckets[b].master.device());
    }
    restore(staged.steps, m.at("loss_scale").get<double>(), m.at("loss_scale_clean_steps").get<int64_t>(),
            staged.grad_shards, staged.had_grad);
    const TrainingProgress progress = progress_of(m);
    if (durable && fetchable(cand, m)) {
      durable->note_committed(progress.step);
    } else if (durable && m.at("world_size").get<int>() == comm->size() && !line_of(m).empty()) {
      newest_saved = progress.step;  // not in the store (a run killed as it uploaded): make_durable() uploads it
    }
    lineage = std::move(next_lineage);
    log_info("checkpoint: loaded step " + std::to_string(progress.step) + " from " + cand.string() + " (saved by " +
             std::to_string(m.at("world_size").get<int>()) + " ranks, ZeRO stage " + std::to_string(zero_stage_of(m)) +
             ")");
    return progress;
  }
  TORCH_CHECK(false, "checkpoint: no checkpoint in '", dir, "' can be loaded: ", skipped.substr(2));
}

}  // namespace zeroshard
