// fully_sharded_adamw.cpp — AdamW over the units of a fully sharded model: the
// ZeRO-3 front-end of ShardedOptimizer, and the model's side of an update.
//
// Each unit is a shard group; its shard is the source of the next gather, so
// an update needs no all-gather: the next forward gathers the new values. The
// root unit stays gathered, so it is all-gathered after its update (first, so
// that the gather runs while the other units are updated).
#include "shard/optimizer/optimizer_access.h"
#include "shard/zero3/unit.h"

#include "comm/work.h"
#include "runtime/rank_agreement.h"
#include "shard/optimizer/options_text.h"
#include "zeroshard/log.h"
#include "zeroshard/trace.h"

#include <chrono>
#include <iomanip>
#include <sstream>
#include <unordered_map>

namespace zeroshard {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamGroup;

std::vector<torch::Tensor> trainable_params(const shard::ShardedModel& model) {
  std::vector<torch::Tensor> out;
  for (const auto& u : model.units) {
    for (size_t i = 0; i < u->tensors.size(); ++i) {
      if (u->trainable[i]) out.push_back(u->tensors[i]);
    }
  }
  return out;
}

// Every trainable parameter of the model in exactly one group, nothing else.
std::vector<OptimizerParamGroup> checked_groups(const shard::ShardedModel& model,
                                               std::vector<OptimizerParamGroup> groups) {
  struct Known {
    std::string name;
    bool trainable;
  };
  std::unordered_map<const c10::TensorImpl*, Known> known;
  for (const auto& u : model.units) {
    for (size_t i = 0; i < u->tensors.size(); ++i) {
      known[u->tensors[i].unsafeGetTensorImpl()] = {u->layout.params[i].name, u->trainable[i] != 0};
    }
  }
  TORCH_CHECK_VALUE(!groups.empty(), "FullyShardedAdamW: no param groups given; pass at least one");
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t j = 0; j < groups[g].params().size(); ++j) {
      const auto& p = groups[g].params()[j];
      TORCH_CHECK_VALUE(p.defined(), "FullyShardedAdamW: param group ", g, " entry ", j, " is an undefined tensor");
      auto it = known.find(p.unsafeGetTensorImpl());
      TORCH_CHECK_VALUE(it != known.end(), "FullyShardedAdamW: param group ", g, " entry ", j, " (shape ", p.sizes(),
                        ") is not a parameter of the sharded model; pass the model's own tensors "
                        "(module->parameters() after fully_shard)");
      TORCH_CHECK_VALUE(it->second.trainable, "FullyShardedAdamW: parameter '", it->second.name, "' in param group ",
                        g, " was frozen (requires_grad false) when fully_shard ran; drop it from the group");
      auto [prev, inserted] = seen.emplace(p.unsafeGetTensorImpl(), g);
      TORCH_CHECK_VALUE(inserted, "FullyShardedAdamW: parameter '", it->second.name, "' is in param groups ",
                        prev->second, " and ", g, "; put it in one");
    }
  }
  for (const auto& u : model.units) {  // in model order: the first missing one is named
    for (size_t i = 0; i < u->tensors.size(); ++i) {
      TORCH_CHECK_VALUE(!u->trainable[i] || seen.count(u->tensors[i].unsafeGetTensorImpl()),
                        "FullyShardedAdamW: parameter '", u->layout.params[i].name,
                        "' is in no param group; every trainable parameter must be in one (or freeze it before "
                        "fully_shard)");
    }
  }
  return groups;
}

bool any_half(const shard::ShardedModel& model) {
  for (const auto& u : model.units) {
    if (u->layout.dtype == at::kHalf) return true;
  }
  return false;
}

}  // namespace

FullyShardedAdamW::FullyShardedAdamW(std::shared_ptr<FullyShardedModel> model, const OptimizerOptions& defaults,
                                     FullyShardedAdamWOptions options)
    : FullyShardedAdamW(model, {OptimizerParamGroup(trainable_params(model->state()))}, defaults, options) {}

FullyShardedAdamW::FullyShardedAdamW(std::shared_ptr<FullyShardedModel> model, std::vector<OptimizerParamGroup> groups,
                                     const OptimizerOptions& defaults, FullyShardedAdamWOptions options)
    : ShardedOptimizer(checked_groups(model->state(), std::move(groups)), defaults, "FullyShardedAdamW", 3),
      model_(std::move(model)) {
  TORCH_CHECK_VALUE(options.max_grad_norm >= 0, "FullyShardedAdamW: max_grad_norm is ", options.max_grad_norm,
                    "; it must be >= 0 (0: no clipping)");
  auto& m = model_->state();
  shard::Shards shards;
  shards.front_end = &m;
  shards.process_group = m.group;
  shards.topology = m.topology;
  shards.round = m.round.get();
  shards.max_grad_norm = options.max_grad_norm;
  shards.loss_scale = options.loss_scale;
  shards.loss_scaling = options.loss_scale.enabled < 0 ? any_half(m) : options.loss_scale.enabled > 0;
  std::unordered_map<const c10::TensorImpl*, int> group;
  std::vector<std::string> entries;
  for (size_t g = 0; g < param_groups().size(); ++g) {
    entries.push_back(shard::describe_param_group(static_cast<int>(g), adamw_options(g)));
    for (const auto& p : param_groups()[g].params()) group[p.unsafeGetTensorImpl()] = static_cast<int>(g);
  }
  for (size_t k = 0; k < m.units.size(); ++k) {
    auto& u = *m.units[k];
    for (size_t i = 0; i < u.tensors.size(); ++i) {
      const int g = u.trainable[i] ? group.at(u.tensors[i].unsafeGetTensorImpl()) : -1;
      shards.group_of.push_back(g);
      shards.infos.push_back(u.layout.params[i]);
      shards.tensors.push_back(u.tensors[i]);
      entries.push_back("'" + u.layout.params[i].name + "' in group " + std::to_string(g));
    }
    shards.groups.push_back(&u);
    if (u.is_root) {
      shards.update_order.insert(shards.update_order.begin(), k);
    } else {
      shards.update_order.push_back(k);
    }
  }
  std::ostringstream os;
  os << std::setprecision(17) << "options: max_grad_norm=" << options.max_grad_norm
     << " loss_scaling=" << shards.loss_scaling << shard::describe_loss_scaling(options.loss_scale, shards.loss_scaling);
  entries.push_back(os.str());
  runtime::check_same_on_all_ranks(*m.group.control, entries, "FullyShardedAdamW param groups and options");
  shard::OptimizerAccess::attach(*this, std::move(shards));
}

FullyShardedAdamW::~FullyShardedAdamW() {
  std::lock_guard<std::recursive_mutex> lock(model_->state().mu());
  shard::OptimizerAccess::detach(*this);
}

// The model's side of the optimizer (its front-end).

bool shard::ShardedModel::local_gradients_pending() const { return round->local_pending(); }

void shard::ShardedModel::add_stats(ShardedStats& s) const {
  auto& m = s.memory;
  for (const auto& u : units) {
    if (u->is_root) {
      m.params += u->gathered.nbytes();
    } else if (!u->keeps_buffer()) {  // at one rank the gathered buffer is the shard, counted below
      m.params += u->gathered.storage().nbytes();
    }
    if (!u->is_root) m.param_shards += u->values.nbytes();
    for (const auto& p : u->tensors) {  // no_sync leftovers
      if (p.grad().defined()) m.grads += p.grad().nbytes();
    }
  }
  m.peak_transient = peak_gathered;
  s.waits = {exposed_gather_seconds, round->reductions().waited_seconds()};
  s.traffic = comm->stats();
  s.traffic += reduce_comm->stats();
  topology.add_traffic(s, *group.data);
}

void shard::ShardedModel::reduce_gradients() {
  reduce_local_gradients();
  drain_reductions();
}

void shard::ShardedModel::group_updated(size_t unit, bool) {
  auto& u = *units[unit];
  if (u.is_root || keep_gathered_depth > 0) {
    // The root in place (values is its slice; at one rank all of it: nothing
    // to do); a unit held gathered from its updated shard.
    if (world > 1) update_gathers.push_back(comm->all_gather(u.gathered, u.values));
  } else {
    u.reshard();  // a gathered copy would be stale now
  }
  u.refresh_gather_values();
}

void shard::ShardedModel::finish_update() {
  prefetch_first_forward_unit();  // behind the root's gather; overlaps whatever precedes the next forward
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& w : update_gathers) comm::block_current(*w, comm->device());
  exposed_gather_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (trace::enabled() && !update_gathers.empty()) trace::record("wait for gather of (root) after the update", "wait", t0);
  update_gathers.clear();
}

void shard::ShardedModel::drop_unreduced_gradients() {
  drain_reductions();
  for (auto& u : units) {
    u->clear_gradient();
    for (auto& p : u->tensors) p.mutable_grad() = at::Tensor();  // no_sync leftovers
  }
  round->clear_local_pending();
}

void shard::ShardedModel::install_masters() {
  std::vector<std::shared_ptr<Work>> gathers;
  for (auto& u : units) {
    if (!u->master.is_same(u->values)) u->values.copy_(u->master);  // round to the unit's dtype
    if (u->is_root || keep_gathered_depth > 0) {  // in place; a unit held gathered from its shard
      if (world > 1) gathers.push_back(comm->all_gather(u->gathered, u->values));
    } else {
      u->reshard();  // a gathered (or prefetched) copy would be stale
    }
    u->refresh_gather_values();
  }
  for (auto& w : gathers) comm::block_current(*w, comm->device());
}

}  // namespace zeroshard
