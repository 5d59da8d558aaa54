// snapshot.cpp — what a save takes from the live state: this rank's pieces
// of the optimizer's groups, the tensors it writes in full, the generators'
// states, and who writes what (copies to host memory, now or deferred).
#include "checkpointer_impl.h"

#include "compat/torch_compat.h"
#include "host_copy.h"

#include <ATen/CPUGeneratorImpl.h>

#include <unordered_map>

namespace zeroshard {

using namespace ckpt;

namespace {

// Who writes what. The replicated tensors: the first rank of the stage's
// data-parallel group, and without a shared filesystem also the stage's first
// rank on each other disk (a copy there). Returns whether this rank writes its
// optimizer shards: with hybrid sharding a shard is saved once, by its first
// replica, and without a shared filesystem also by its first holder on each
// other disk.
bool decide_writers(Snapshot& snap, const ShardedState& state, const Place& place, const Disks& disks,
                    const std::vector<std::pair<int, int>>& places) {
  snap.writes_replicated = place.dp_rank == 0;
  if (!disks.shared() && place.dp_rank != 0) {  // a copy on each disk: by the stage's first rank there
    bool first_here = true;
    for (int r : disks.members(snap.rank)) {
      const auto& [stage, dp_rank] = places[static_cast<size_t>(r)];
      if (stage == place.pp_stage && (dp_rank == 0 || r < snap.rank)) first_here = false;
    }
    snap.writes_replicated = first_here;
  }
  bool writes_shards = state.replica_rank == 0;
  if (state.num_replicas > 1 && !writes_shards && !disks.shared()) {
    const int shard_size = place.dp_size / state.num_replicas;
    writes_shards = true;
    for (int r : disks.members(snap.rank)) {
      const auto& [stage, dp_rank] = places[static_cast<size_t>(r)];
      if (stage == place.pp_stage && dp_rank % shard_size == state.shard_rank && dp_rank < place.dp_rank) {
        writes_shards = false;
      }
    }
  }
  return writes_shards;
}

// This rank's pieces of the optimizer's groups it writes: master, moments and
// (during an accumulation) the reduced gradients, copied to host memory now or,
// `defer_copies`, when the write runs.
void snapshot_owned(Snapshot& snap, const ShardedState& state, const Place& place, bool writes_shards,
                    bool defer_copies) {
  for (const auto& b : state.buckets) {
    snap.groups.push_back({b.layout, b.params});
    // A replicated group (stage 0) is saved once, by the first rank of its data-parallel group
    // (and, without a shared filesystem, copied by the group's first rank on each other disk).
    const int shard = b.layout.shard_of_rank(state.shard_rank);
    const bool replicated = b.layout.world_size == 1 && place.dp_size > 1;
    const bool copy = replicated ? state.rank != 0 : state.replica_rank != 0;
    if (replicated ? copy && !snap.writes_replicated : !writes_shards) continue;
    for (const auto& seg : shard_segments(b.layout, shard)) {
      const Range local = seg.local(b.layout, shard);
      // Gradients are always copied now: the next backward adds into them.
      const bool defer = (defer_copies || snap.on_device) && !snap.gradients;
      auto copy_of = [&](const at::Tensor& t) {
        auto v = t.slice(0, local.begin, local.end);
        return defer ? v : snap.host->copy(v);
      };
      snap.deferred = defer;
      at::Tensor grad;
      if (snap.gradients) {
        grad = b.grad_shard.defined() ? snap.host->copy(b.grad_shard.slice(0, local.begin, local.end), at::kFloat)
                                      : at::zeros({local.size()}, at::kFloat);
      }
      snap.owned.push_back({b.params[seg.param], seg.param_offset, copy_of(b.master), copy_of(b.exp_avg),
                            copy_of(b.exp_avg_sq), grad, copy});
      snap.bytes += (snap.gradients ? 16 : 12) * local.size();
    }
  }
}

// The module's parameters the optimizer does not hold, and its buffers, in full
// (copied by the ranks that write them; the others keep empty placeholders).
void snapshot_replicated(Snapshot& snap, torch::nn::Module& model, const std::map<std::string, std::string>& saved) {
  std::unordered_map<std::string, bool> trained;
  for (const auto& n : snap.names) trained[n] = true;
  auto add = [&](const std::string& name, const char* kind, const at::Tensor& t) {
    storage_type(t.scalar_type(), name);  // refuse unsupported dtypes now, on every rank
    Snapshot::Replicated r{name, kind, at::Tensor()};
    if (snap.writes_replicated) {
      r.value = snap.host->copy(t.detach());
      snap.bytes += static_cast<int64_t>(r.value.nbytes());
    } else {
      r.value = torch::empty({0}, t.options().device(at::kCPU));  // another rank writes these
    }
    snap.replicated.push_back(std::move(r));
  };
  for (const auto& item : model.named_parameters()) {
    const std::string name = saved_name(saved, item.key());
    if (!trained.count(name)) add(name, "parameter", item.value());
  }
  for (const auto& item : model.named_buffers()) add(saved_name(saved, item.key()), "buffer", item.value());
}

// The random generators' states: the CPU's, and the device's (dropout on a GPU draws from it).
void snapshot_rng(Snapshot& snap, const ShardedState& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    snap.rng = gen.get_state();
  }
  const c10::Device device = state.buckets.empty() ? c10::Device(c10::kCPU) : state.buckets.front().master.device();
  if (device.is_cuda()) {  // dropout on the GPU draws from the device's generator
    auto dev_gen = compat::default_generator(device);
    std::lock_guard<std::mutex> lock(dev_gen.mutex());
    snap.device_rng = dev_gen.get_state();
  }
}

}  // namespace

Snapshot Checkpointer::Impl::snapshot(const ShardedState& state, torch::nn::Module& model,
                                      const TrainingProgress& progress, bool defer_copies) {
  torch::NoGradGuard no_grad;
  // Gradients of an accumulation in progress: reduced ones (in the shards) are
  // saved; unreduced ones (in p.grad()) cannot be resharded, so that is refused.
  const Place place = place_of(state);
  bool any_grad = false;
  for (char h : state.had_grad) any_grad = any_grad || h;
  for (const auto& b : state.buckets) any_grad = any_grad || b.grad_shard.defined();
  std::vector<std::pair<int, int>> places;  // every rank's (stage, dp rank)
  const auto any = agree_on_places(*comm, place, {state.local_gradients_pending, any_grad}, &places);
  TORCH_CHECK_VALUE(!any[0], "checkpoint: this step's gradients are still in p.grad() on some rank "
                    "(stage 1, no_sync() or reduce_every_backward=false), unreduced: a checkpoint cannot hold "
                    "them. Save after step(), or accumulate with reduced backwards (the default)");
  Snapshot snap;
  snap.gradients = any[1] != 0;
  snap.had_grad = state.had_grad;
  snap.progress = progress;
  snap.rank = comm->rank();
  snap.world = comm->size();
  snap.place = place;
  snap.zero_stage = state.zero_stage;
  snap.replica = state.zero_stage == 0 ? 0 : state.replica_rank;
  const bool writes_shards = decide_writers(snap, state, place, disks, places);
  snap.names = module_names(state, model, options.saved_names);
  snap.params = state.params;
  for (size_t i = 0; i < snap.params.size(); ++i) snap.params[i].name = snap.names[i];
  snap.steps = state.param_steps;
  snap.loss_scale = state.loss_scale;
  snap.loss_scale_clean_steps = state.loss_scale_clean_steps;
  // Device tensors are copied to host memory by a HostCopier, after the work
  // queued so far on their devices (no synchronization of the training stream).
  std::vector<at::Tensor> sources;
  for (const auto& b : state.buckets) sources.insert(sources.end(), {b.master, b.grad_shard});
  for (const auto& item : model.named_parameters()) sources.push_back(item.value());
  for (const auto& item : model.named_buffers()) sources.push_back(item.value());
  snap.host = std::make_shared<HostCopier>(sources);
  for (const auto& s : sources) snap.on_device = snap.on_device || (s.defined() && !s.device().is_cpu());
  snapshot_owned(snap, state, place, writes_shards, defer_copies);
  snapshot_replicated(snap, model, options.saved_names);
  snapshot_rng(snap, state);
  snap.host->finish();  // what was copied now (gradients, replicated tensors) is in host memory
  return snap;
}

}  // namespace zeroshard
