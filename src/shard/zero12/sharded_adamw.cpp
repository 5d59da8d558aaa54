// sharded_adamw.cpp — ShardedAdamW: construction, step, clipping, state.
// The gradient side (hooks, bucketed reduce-scatter) is in grad_reduction.cpp.
#include "shard/optimizer/optimizer_access.h"
#include "shard/zero12/sharded_adamw_impl.h"

#include "comm/work.h"
#include "runtime/rank_agreement.h"
#include "shard/optimizer/options_text.h"
#include "shard/core/tensor_alias.h"
#include "zeroshard/sharded_adamw.h"
#include "zeroshard/log.h"

#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamGroup;

std::string describe_options(const ShardedAdamWOptions& o, bool scaling) {
  std::ostringstream os;
  os << std::setprecision(17) << "options: zero_stage=" << o.zero_stage << " bucket_bytes=" << o.bucket_bytes
     << " max_inflight_buckets=" << o.max_inflight_buckets << " max_grad_norm=" << o.max_grad_norm
     << " reduce_every_backward=" << o.reduce_every_backward << " shard_size=" << o.shard_size
     << " loss_scaling=" << scaling
     << shard::describe_loss_scaling(o.loss_scale, scaling);
  return os.str();
}

using Names = torch::OrderedDict<std::string, torch::Tensor>;

std::string name_in(const Names* names, const torch::Tensor& p, size_t g, size_t j) {
  if (names != nullptr && p.defined()) {
    for (const auto& item : *names) {
      if (item.value().unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return item.key();
    }
  }
  return "param_groups[" + std::to_string(g) + "][" + std::to_string(j) + "]";
}

// Runs before torch::optim::Optimizer's constructor, whose own checks do not
// name the parameter.
std::vector<OptimizerParamGroup> checked(std::vector<OptimizerParamGroup> groups, const Names* names) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& ps = groups[g].params();
    for (size_t j = 0; j < ps.size(); ++j) {
      TORCH_CHECK_VALUE(ps[j].defined(), "ShardedAdamW: parameter '", name_in(names, ps[j], g, j),
                        "' is an undefined tensor");
      TORCH_CHECK_VALUE(ps[j].is_leaf(), "ShardedAdamW: parameter '", name_in(names, ps[j], g, j),
                        "' is not a leaf tensor (it was computed from other tensors); optimize the module's "
                        "own parameters");
    }
  }
  return groups;
}

void check_options(const ShardedAdamWOptions& options) {
  TORCH_CHECK_VALUE(options.zero_stage >= 0 && options.zero_stage <= 2, "ShardedAdamW: zero_stage is ",
                    options.zero_stage,
                    "; ShardedAdamW implements stage 1 (optimizer states), 2 (also gradients) and 0 (nothing "
                    "sharded: DDP-style replication); for stage 3 use zeroshard::fully_shard");
  TORCH_CHECK_VALUE(options.bucket_bytes > 0, "ShardedAdamW: bucket_bytes is ", options.bucket_bytes,
                    "; it must be positive (Default: 16 MiB)");
  TORCH_CHECK_VALUE(options.max_inflight_buckets >= 1, "ShardedAdamW: max_inflight_buckets is ",
                    options.max_inflight_buckets, "; it must be >= 1 (Default: 2)");
  TORCH_CHECK_VALUE(options.max_grad_norm >= 0, "ShardedAdamW: max_grad_norm is ", options.max_grad_norm,
                    "; it must be >= 0 (0 = no clipping)");
  TORCH_CHECK_VALUE(options.zero_stage != 0 || options.shard_size == 0, "ShardedAdamW: shard_size is ",
                    options.shard_size, " at zero_stage 0, which shards nothing; use stage 1 or 2 for hybrid "
                    "sharding, or leave shard_size at 0");
}

}  // namespace

ShardedAdamW::Impl::Impl(ShardedAdamW& owner_, ProcessGroup group_, ShardedAdamWOptions options_)
    : owner(owner_),
      group(std::move(group_)),
      comm(group.data),
      options(options_) {}

void ShardedAdamW::Impl::track(int64_t bytes) {
  transient_bytes += bytes;
  peak_transient = std::max(peak_transient, transient_bytes);
}

void ShardedAdamW::Impl::check_ready(const char*) {
  check_groups_unchanged();
  check_params_in_place();
}

void ShardedAdamW::Impl::check_params_in_place() const {
  for (const auto& b : buckets) {
    const void* base = b.flat_params.storage().data();
    for (size_t e = 0; e < b.params.size(); ++e) {
      const auto& p = params[b.params[e]];
      const bool in_place = p.numel() == 0 || (p.storage().data() == base &&
                                               p.storage_offset() == b.layout.offsets[e] &&
                                               p.sizes() == at::IntArrayRef(infos[b.params[e]].shape));
      TORCH_CHECK(in_place, "ShardedAdamW: parameter '", infos[b.params[e]].name,
                  "' no longer uses the optimizer's flat buffer: its data was replaced after the optimizer "
                  "was built (torch::load, set_data, module->to(), ...), so updates would not reach it. Load "
                  "weights and move the model before constructing ShardedAdamW");
    }
  }
}

void ShardedAdamW::Impl::check_groups_unchanged() const {
  const auto& groups = owner.param_groups();
  bool same = groups.size() == group_sizes.size();
  for (size_t g = 0; same && g < groups.size(); ++g) same = groups[g].params().size() == group_sizes[g];
  TORCH_CHECK(same, "ShardedAdamW: param groups changed after construction (add_param_group or "
                    "edited params()); the sharded layout is fixed, so construct a new ShardedAdamW");
}

bool ShardedAdamW::Impl::any_had_grad() const {
  for (const auto& b : buckets) {
    for (char h : b.had_grad) {
      if (h != 0) return true;
    }
  }
  return false;
}

ShardedAdamW::ShardedAdamW(std::vector<torch::Tensor> params, ProcessGroup group,
                           const OptimizerOptions& defaults, ShardedAdamWOptions options)
    : ShardedAdamW(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))}, std::move(group),
                   defaults, std::move(options)) {}

ShardedAdamW::ShardedAdamW(const torch::OrderedDict<std::string, torch::Tensor>& named_params,
                           ProcessGroup group, const OptimizerOptions& defaults, ShardedAdamWOptions options)
    : ShardedAdamW(std::vector<OptimizerParamGroup>{OptimizerParamGroup(named_params.values())}, std::move(group),
                   defaults, std::move(options), &named_params) {}

ShardedAdamW::ShardedAdamW(std::vector<OptimizerParamGroup> groups, ProcessGroup group,
                           const OptimizerOptions& defaults, ShardedAdamWOptions options)
    : ShardedAdamW(std::move(groups), std::move(group), defaults, std::move(options), nullptr) {}

// The trained parameters of the param groups: requires_grad, each once (a tied weight
// listed twice), on the communicator's device, dense, Float, BFloat16 or Half, each
// with storage of its own. Returns whether any is Half (loss scaling's default).
bool ShardedAdamW::Impl::collect_params(const std::vector<OptimizerParamGroup>& param_groups,
                                        const torch::OrderedDict<std::string, torch::Tensor>* names) {
  std::unordered_map<const void*, size_t> group_seen;
  std::unordered_map<const void*, std::string> storage_owner;
  bool any_half = false;
  for (size_t g = 0; g < param_groups.size(); ++g) {
    const auto& ps = param_groups[g].params();
    group_sizes.push_back(ps.size());
    for (size_t j = 0; j < ps.size(); ++j) {
      const auto& p = ps[j];
      if (!p.requires_grad()) continue;
      const std::string name = name_in(names, p, g, j);
      const void* key = p.unsafeGetTensorImpl();
      auto seen = group_seen.find(key);
      if (seen != group_seen.end()) {
        TORCH_CHECK_VALUE(seen->second == g, "ShardedAdamW: parameter '", name, "' appears in param groups ",
                          seen->second, " and ", g, "; a parameter may belong to one group only");
        continue;
      }
      group_seen.emplace(key, g);
      TORCH_CHECK_VALUE(p.device() == comm->device(), "ShardedAdamW: parameter '", name, "' is on ", p.device(),
                        " but the communicator moves ", comm->device(), " tensors; move the model to ",
                        comm->device(), " before constructing the optimizer, or pass a communicator of ", p.device(),
                        " (init_nccl for CUDA)");
      TORCH_CHECK_VALUE(p.layout() == at::kStrided, "ShardedAdamW: parameter '", name,
                        "' is sparse; only dense parameters can be sharded");
      const auto dt = p.scalar_type();
      TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "ShardedAdamW: parameter '",
                        name, "' has dtype ", c10::toString(dt),
                        "; ShardedAdamW trains Float, BFloat16 and Half parameters (fp32 master); convert it "
                        "or set requires_grad(false) to leave it out");
      if (p.numel() > 0) {
        auto [owner, fresh] = storage_owner.emplace(p.storage().data(), name);
        TORCH_CHECK_VALUE(fresh, "ShardedAdamW: parameters '", owner->second, "' and '", name,
                          "' share memory (two tensors over one storage, e.g. weights tied with set_data); "
                          "register the shared tensor itself in both modules so it is one parameter");
      }
      any_half = any_half || dt == at::kHalf;
      params.push_back(p);
      infos.push_back({name, p.sizes().vec(), dt});
      group_of.push_back(static_cast<int>(g));
    }
  }
  TORCH_CHECK_VALUE(!params.empty(), "ShardedAdamW: no trainable parameters (none given, or all have "
                                     "requires_grad=false)");
  return any_half;
}

// The buckets and their flat buffers, the parameters aliased into them, rank 0's
// values everywhere; each bucket's shard (values, fp32 master, moments).
void ShardedAdamW::Impl::build_buckets() {
  torch::NoGradGuard no_grad;
  const auto plan = plan_buckets(infos, group_of, options.bucket_bytes);
  // Stage 0 lays every bucket out for one rank: each rank holds all of it.
  const int layout_world = options.zero_stage == 0 ? 1 : world;
  location.resize(params.size());
  std::vector<std::shared_ptr<Work>> broadcasts;
  for (const auto& members : plan) {
    shard::Bucket b;
    std::vector<ParamInfo> bucket_infos;
    for (size_t i : members) bucket_infos.push_back(infos[i]);
    b.layout = make_flat_layout(std::move(bucket_infos), layout_world);
    b.params = members;
    b.group = group_of[members.front()];
    b.shard = b.layout.shard(b.layout.shard_of_rank(rank));
    b.segments = shard_segments(b.layout, b.layout.shard_of_rank(rank));
    b.had_grad.assign(members.size(), 0);
    b.flat_params = at::zeros({b.layout.padded_numel}, at::TensorOptions().dtype(b.layout.dtype).device(comm->device()));
    for (size_t e = 0; e < members.size(); ++e) {
      auto& p = params[members[e]];
      const int64_t off = b.layout.offsets[e];
      b.flat_params.slice(0, off, off + p.numel()).view(p.sizes()).copy_(p.detach());
      p.set_data(shard::alias_of(b.flat_params, off, p.sizes()));
      location[members[e]] = {buckets.size(), e};
    }
    if (group.data->size() > 1) broadcasts.push_back(group.data->broadcast(b.flat_params, 0));
    buckets.push_back(std::move(b));
  }
  for (auto& w : broadcasts) comm::block_current(*w, group.data->device());
  for (auto& b : buckets) {
    b.values = b.flat_params.slice(0, b.shard.begin, b.shard.end);
    b.master = b.layout.dtype == at::kFloat ? b.values : b.values.to(at::kFloat);
    b.ensure_moments();
  }
  arrivals.assign(params.size(), 0);
  step_max_arrivals.assign(params.size(), 0);
  expected_arrivals.assign(params.size(), 0);
}

ShardedAdamW::ShardedAdamW(std::vector<OptimizerParamGroup> groups, ProcessGroup group,
                           const OptimizerOptions& defaults, ShardedAdamWOptions options, const Names* names)
    : ShardedOptimizer(checked(std::move(groups), names), defaults, "ShardedAdamW", options.zero_stage) {
  TORCH_CHECK_VALUE(group.data != nullptr, "ShardedAdamW: the communicator is null; pass zeroshard::init_communicator()");
  impl_ = std::make_unique<Impl>(*this, std::move(group), options);
  auto& im = *impl_;

  // Local checks first, but a rank that fails them still joins the agreement
  // below, so every rank fails together (naming the difference) instead of
  // the others waiting for it.
  std::string local_error;
  std::vector<std::string> entries;
  bool scaling = false;
  try {
    check_options(options);
    for (size_t g = 0; g < param_groups().size(); ++g) {
      entries.push_back(shard::describe_param_group(static_cast<int>(g), adamw_options(g)));
    }
    const bool any_half = im.collect_params(param_groups(), names);
    scaling = options.loss_scale.enabled < 0 ? any_half : options.loss_scale.enabled > 0;
  } catch (const c10::Error& e) {
    local_error = e.what_without_backtrace();
  }

  // Every rank must have built the same thing before any data moves.
  entries.insert(entries.begin(), local_error.empty() ? "construction: ok" : "construction failed: " + local_error);
  entries.push_back(describe_options(options, scaling));
  for (size_t i = 0; i < im.infos.size(); ++i) {
    entries.push_back("group " + std::to_string(im.group_of[i]) + " " + im.infos[i].describe());
  }
  runtime::check_same_on_all_ranks(*im.group.control, entries, "ShardedAdamW parameters");
  TORCH_CHECK_VALUE(local_error.empty(), local_error);
  im.topology = shard::make_shard_topology(im.group, options.shard_size, "ShardedAdamW");
  im.comm = im.topology.shard;
  im.rank = im.topology.shard_rank;
  im.world = im.topology.shard_size;
  im.build_buckets();

  // The core's view of the shards, and the backward round over them.
  shard::Shards shards;
  for (auto& b : im.buckets) shards.groups.push_back(&b);
  im.round = std::make_unique<shard::BackwardRound>(im, "ShardedAdamW", im.reduce_in_backward(),
                                                    options.reduce_every_backward, shards.groups);
  im.round->reductions().set_replicas(im.topology.replicas);
  shards.front_end = &im;
  shards.process_group = im.group;
  shards.topology = im.topology;
  shards.round = im.round.get();
  shards.infos = im.infos;
  shards.tensors = im.params;
  shards.group_of = im.group_of;
  shards.max_grad_norm = options.max_grad_norm;
  shards.loss_scale = options.loss_scale;
  shards.loss_scaling = scaling;
  shard::OptimizerAccess::attach(*this, std::move(shards));
  im.register_hooks();

  int64_t total = 0, shard_elems = 0;
  for (const auto& info : im.infos) total += info.numel();
  for (const auto& b : im.buckets) shard_elems += b.shard.size();
  log_info("ShardedAdamW: stage " + std::to_string(options.zero_stage) +
           (options.zero_stage == 0 ? " (replicated)" : "") + ", " + std::to_string(im.params.size()) +
           " parameters (" + std::to_string(total) + " elements) in " + std::to_string(im.buckets.size()) +
           " buckets; this rank holds the optimizer state of " + std::to_string(shard_elems) + " elements" +
           im.topology.describe() +
           (scaling ? "; dynamic loss scaling on" : ""));
}

ShardedAdamW::~ShardedAdamW() {
  if (!impl_ || !impl_->round) return;
  std::lock_guard<std::recursive_mutex> lock(impl_->round->mutex());
  shard::OptimizerAccess::detach(*this);
  impl_->remove_hooks();
}

void ShardedAdamW::Impl::group_updated(size_t k, bool changed) {
  // Every rank agrees whether anything in this bucket changed; laid out for
  // one rank (one rank, or stage 0) the shard is the whole flat buffer,
  // already updated in place.
  auto& b = buckets[k];
  if (!changed || b.layout.world_size == 1) return;
  gathers.push_back(comm->all_gather(b.flat_params, b.values));
}

void ShardedAdamW::Impl::finish_update() {
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& w : gathers) comm::block_current(*w, comm->device());
  gathers.clear();
  gather_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void ShardedAdamW::Impl::drop_unreduced_gradients() {
  drain_reductions();
  for (auto& b : buckets) {
    b.rs_in = b.late_in = b.late_held = at::Tensor();
    if (b.flat_grads.defined()) b.flat_grads.zero_();
  }
  begin_pass();
  std::fill(step_max_arrivals.begin(), step_max_arrivals.end(), 0);
  round->restart_order();
  round->clear_local_pending();
  for (size_t i = 0; i < params.size(); ++i) {  // stage 1's slices of flat_grads were zeroed above; others go
    auto& p = params[i];
    const auto& g = p.grad();
    const auto& flat = buckets[location[i].first].flat_grads;
    const bool in_flat = g.defined() && flat.defined() && g.storage().data() == flat.storage().data();
    if (g.defined() && !in_flat) p.mutable_grad() = at::Tensor();
  }
}

bool ShardedAdamW::Impl::local_gradients_pending() const {
  return round->local_pending() || (options.zero_stage == 1 && !round->frozen() && any_had_grad());
}

void ShardedAdamW::Impl::install_masters() {
  std::vector<std::shared_ptr<Work>> gathers;
  for (auto& b : buckets) {
    if (b.layout.dtype != at::kFloat) b.values.copy_(b.master);  // round to the parameters' dtype
    if (b.layout.world_size > 1) gathers.push_back(comm->all_gather(b.flat_params, b.values));
  }
  for (auto& w : gathers) comm::block_current(*w, comm->device());
}

void ShardedAdamW::Impl::accept_restored_gradients() {
  TORCH_CHECK_VALUE(reduce_in_backward(), "ShardedAdamW::restore_sharded_state: gradients of an "
                    "accumulation in progress need stage 2 or 0 (stage 1 keeps them unreduced in p.grad())");
  flushed_since_step = true;  // nothing of this step is left in p.grad()
}

void ShardedAdamW::Impl::add_stats(ShardedStats& s) const {
  auto& m = s.memory;
  std::unordered_set<const void*> counted;
  for (const auto& b : buckets) {
    m.params += b.flat_params.nbytes();
    if (b.flat_grads.defined()) {
      m.grads += b.flat_grads.nbytes();
      counted.insert(b.flat_grads.storage().data());
    }
  }
  for (const auto& p : params) {  // gradients outside our buffers (stage 2: no_sync, local accumulation)
    const auto& g = p.grad();
    if (g.defined() && counted.insert(g.storage().data()).second) m.grads += g.storage().nbytes();
  }
  m.peak_transient = peak_transient;
  s.waits = {gather_seconds, round->reductions().waited_seconds()};
  s.traffic = comm->stats();
  topology.add_traffic(s, *group.data);
}

}  // namespace zeroshard
