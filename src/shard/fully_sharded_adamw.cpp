// fully_sharded_adamw.cpp — AdamW over the units of a fully sharded model.
//
// Each unit's fp32 shard is both the parameters' master and the source of the
// next gather, so the update is one fused pass per parameter piece and no
// all-gather: the next forward gathers the new values. The root unit stays
// gathered, so it is all-gathered here.
#include "shard/unit.h"

#include "optim/fused_adamw.h"
#include "optim/grad_norm.h"
#include "optim/loss_scaler.h"
#include "shard/rank_agreement.h"
#include "zeroshard/log.h"
#include "zeroshard/trace.h"

#include <chrono>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>
#include <unordered_map>

namespace zeroshard {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::OptimizerParamGroup;

std::vector<torch::Tensor> trainable_params(const FullyShardedModel& model) {
  std::vector<torch::Tensor> out;
  for (const auto& u : model.impl().units) {
    for (size_t i = 0; i < u->params.size(); ++i) {
      if (u->trainable[i]) out.push_back(u->params[i]);
    }
  }
  return out;
}

// Every trainable parameter of the model in exactly one group, nothing else.
std::vector<OptimizerParamGroup> checked_groups(const FullyShardedModel& model, std::vector<OptimizerParamGroup> groups) {
  struct Known {
    std::string name;
    bool trainable;
  };
  std::unordered_map<const c10::TensorImpl*, Known> known;
  for (const auto& u : model.impl().units) {
    for (size_t i = 0; i < u->params.size(); ++i) {
      known[u->params[i].unsafeGetTensorImpl()] = {u->layout.params[i].name, u->trainable[i] != 0};
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
  for (const auto& u : model.impl().units) {  // in model order: the first missing one is named
    for (size_t i = 0; i < u->params.size(); ++i) {
      TORCH_CHECK_VALUE(!u->trainable[i] || seen.count(u->params[i].unsafeGetTensorImpl()),
                        "FullyShardedAdamW: parameter '", u->layout.params[i].name,
                        "' is in no param group; every trainable parameter must be in one (or freeze it before "
                        "fully_shard)");
    }
  }
  return groups;
}

bool any_half(const FullyShardedModel& model) {
  for (const auto& u : model.impl().units) {
    if (u->layout.dtype == at::kHalf) return true;
  }
  return false;
}

}  // namespace

FullyShardedAdamW::FullyShardedAdamW(std::shared_ptr<FullyShardedModel> model, AdamWOptions defaults,
                                     FullyShardedAdamWOptions options)
    : FullyShardedAdamW(model, {OptimizerParamGroup(trainable_params(*model))}, defaults, options) {}

FullyShardedAdamW::FullyShardedAdamW(std::shared_ptr<FullyShardedModel> model, std::vector<OptimizerParamGroup> groups,
                                     AdamWOptions defaults, FullyShardedAdamWOptions options)
    : Optimizer(checked_groups(*model, std::move(groups)), std::make_unique<AdamWOptions>(defaults)),
      model_(std::move(model)),
      options_(options) {
  TORCH_CHECK_VALUE(options.max_grad_norm >= 0, "FullyShardedAdamW: max_grad_norm is ", options.max_grad_norm,
                    "; it must be >= 0 (0: no clipping)");
  const bool scaling = options.loss_scale.enabled < 0 ? any_half(*model_) : options.loss_scale.enabled > 0;
  scaler_ = std::make_unique<optim::LossScaler>(options.loss_scale, scaling);
  std::unordered_map<const c10::TensorImpl*, int> group;
  std::vector<std::string> entries;
  for (size_t g = 0; g < param_groups().size(); ++g) {
    const auto& o = static_cast<const AdamWOptions&>(param_groups()[g].options());
    TORCH_CHECK_VALUE(!o.amsgrad(), "FullyShardedAdamW: param group ", g,
                      " sets amsgrad(true), which is not supported (no max_exp_avg_sq is kept); use amsgrad(false)");
    entries.push_back(shard::describe_param_group(static_cast<int>(g), o));
    for (const auto& p : param_groups()[g].params()) group[p.unsafeGetTensorImpl()] = static_cast<int>(g);
  }
  for (const auto& u : model_->impl().units) {
    for (size_t i = 0; i < u->params.size(); ++i) {
      const int g = u->trainable[i] ? group.at(u->params[i].unsafeGetTensorImpl()) : -1;
      group_of_.push_back(g);
      entries.push_back("'" + u->layout.params[i].name + "' in group " + std::to_string(g));
    }
  }
  std::ostringstream os;
  os << std::setprecision(17) << "options: max_grad_norm=" << options.max_grad_norm << " loss_scaling=" << scaling
     << shard::describe_loss_scaling(options.loss_scale, scaling);
  entries.push_back(os.str());
  shard::check_same_on_all_ranks(model_->communicator(), entries, "FullyShardedAdamW param groups and options");
  steps_.assign(group_of_.size(), 0);
}

FullyShardedAdamW::~FullyShardedAdamW() = default;

torch::Tensor FullyShardedAdamW::scale_loss(const torch::Tensor& loss) const {
  return scaler_->enabled() ? loss * scaler_->scale() : loss;
}

double FullyShardedAdamW::loss_scale() const { return scaler_->scale(); }

void FullyShardedAdamW::agree(bool with_norm) {
  if (agreed_ && (!with_norm || sumsq_ >= 0)) return;
  auto& m = model_->impl();
  std::vector<double> ctrl{0.0};
  for (const auto& u : m.units) {
    if (with_norm && u->grad_shard.defined()) {
      ctrl[0] += optim::sum_of_squares(u->grad_shard.data_ptr(), u->grad_shard.scalar_type(), u->grad_shard.numel());
    }
    for (char h : u->had_grad) ctrl.push_back(h ? 1.0 : 0.0);
  }
  auto t = at::tensor(ctrl, at::kDouble);
  m.comm->all_reduce(t, ReduceOp::kSum)->wait();
  const double* v = t.data_ptr<double>();
  sumsq_ = with_norm ? v[0] : -1;
  flags_.assign(v + 1, v + t.numel());
  agreed_ = true;
}

double FullyShardedAdamW::clip_grad_norm(double max_norm) {
  TORCH_CHECK_VALUE(max_norm > 0, "FullyShardedAdamW::clip_grad_norm: max_norm is ", max_norm, "; it must be positive");
  torch::NoGradGuard no_grad;
  auto& m = model_->impl();
  std::lock_guard<std::recursive_mutex> lock(m.guard->mu);
  m.reduce_local_gradients();
  m.drain_all();
  agree(true);
  m.gradients_agreed = true;
  clip_max_norm_ = max_norm;
  return std::sqrt(sumsq_) / scaler_->scale();
}

torch::Tensor FullyShardedAdamW::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  auto& m = model_->impl();
  std::lock_guard<std::recursive_mutex> lock(m.guard->mu);
  TORCH_CHECK(!m.in_backward, "FullyShardedAdamW::step: called during backward");
  run_before_update();
  m.reduce_local_gradients();
  m.drain_all();
  const double max_norm = clip_max_norm_ > 0 ? clip_max_norm_ : options_.max_grad_norm;
  agree(max_norm > 0 || scaler_->enabled());
  const double scale = scaler_->scale();
  last_skipped_ = scaler_->update(scaler_->enabled() && !std::isfinite(sumsq_));
  if (last_skipped_) {
    log_info("FullyShardedAdamW: gradient overflow, step skipped on every rank; loss scale now " +
             std::to_string(scaler_->scale()));
    discard_gradients();
    return loss;
  }
  double multiplier = 1.0 / scale;
  if (max_norm > 0) {
    const double coef = max_norm / (std::sqrt(sumsq_) / scale + 1e-6);
    if (coef < 1) multiplier *= coef;
  }
  ensure_moments();
  // The root first: its all-gather (it stays gathered) then runs while the
  // other units' shards are updated.
  std::vector<size_t> order, bases(m.units.size(), 0);
  for (size_t k = 0, b = 0; k < m.units.size(); b += m.units[k]->params.size(), ++k) {
    bases[k] = b;
    if (m.units[k]->is_root) order.insert(order.begin(), k); else order.push_back(k);
  }
  std::vector<std::shared_ptr<Work>> gathers;
  for (const size_t k : order) {
    auto& u = *m.units[k];
    const size_t base = bases[k];
    for (size_t i = 0; i < u.params.size(); ++i) {
      if (flags_[base + i] > 0) ++steps_[base + i];
    }
    if (u.grad_shard.defined()) {
      for (const auto& seg : u.segments) {
        const size_t gi = base + seg.param;
        if (flags_[gi] == 0 || group_of_[gi] < 0) continue;
        const auto& o = static_cast<const torch::optim::AdamWOptions&>(param_groups()[group_of_[gi]].options());
        TORCH_CHECK_VALUE(!o.amsgrad(), "FullyShardedAdamW: param group ", group_of_[gi],
                          " sets amsgrad(true), which is not supported (no max_exp_avg_sq is kept); use amsgrad(false)");
        const Range local = seg.local(u.layout, m.rank);
        const auto c = optim::adamw_coeffs(o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                                           o.weight_decay(), steps_[gi], multiplier);
        const bool low = u.shard.scalar_type() != at::kFloat;  // 16-bit: write the rounded copy gathers send
        optim::fused_adamw(c, u.master.data_ptr<float>() + local.begin,
                           static_cast<const char*>(u.grad_shard.data_ptr()) + local.begin * u.grad_shard.element_size(),
                           u.grad_shard.scalar_type(), moments_[2 * k].data_ptr<float>() + local.begin,
                           moments_[2 * k + 1].data_ptr<float>() + local.begin, local.size(),
                           low ? static_cast<char*>(u.shard.data_ptr()) + local.begin * 2 : nullptr,
                           u.shard.scalar_type());
      }
    }
    if (u.is_root) {
      gathers.push_back(m.comm->all_gather(u.gathered, u.shard));  // in place: shard is its slice
    } else {
      u.reshard();  // a gathered copy would be stale now
    }
    u.grad_shard = at::Tensor();
    std::fill(u.had_grad.begin(), u.had_grad.end(), 0);
  }
  m.prefetch_first_forward_unit();  // behind the root's gather; overlaps whatever precedes the next forward
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& w : gathers) w->wait();
  m.exposed_gather_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (trace::enabled() && !gathers.empty()) trace::record("wait for gather of (root) after the update", "wait", t0);
  agreed_ = false;
  m.gradients_agreed = false;
  sumsq_ = -1;
  clip_max_norm_ = 0;
  return loss;
}

void FullyShardedAdamW::ensure_moments() {
  const auto& m = model_->impl();
  if (moments_.size() == 2 * m.units.size()) return;
  moments_.clear();
  for (const auto& u : m.units) {
    moments_.push_back(at::zeros({u->shard_range.size()}, at::kFloat));
    moments_.push_back(at::zeros({u->shard_range.size()}, at::kFloat));
  }
}

ShardedState FullyShardedAdamW::sharded_state() {
  auto& m = model_->impl();
  std::lock_guard<std::recursive_mutex> lock(m.guard->mu);
  ensure_moments();
  ShardedState s;
  s.rank = m.rank;
  s.world_size = m.world;
  s.stage = 3;
  s.param_steps = steps_;
  s.loss_scale = scaler_->scale();
  s.loss_scale_clean_steps = scaler_->clean_steps();
  m.drain_all();  // the gradient shards complete (waits only: every rank issued these)
  s.local_gradients_pending = m.local_grads_pending;
  for (const auto& u : m.units) s.had_grad.insert(s.had_grad.end(), u->had_grad.begin(), u->had_grad.end());
  size_t base = 0;
  for (size_t k = 0; k < m.units.size(); ++k) {
    const auto& u = *m.units[k];
    ShardedBucketState b;
    b.layout = u.layout;
    for (size_t i = 0; i < u.params.size(); ++i) {
      s.params.push_back(u.layout.params[i]);
      s.param_tensors.push_back(u.params[i]);
      b.params.push_back(base + i);
      if (group_of_[base + i] > 0 && b.group == 0) b.group = group_of_[base + i];
    }
    b.shard = u.shard_range;
    b.master = u.master;
    b.exp_avg = moments_[2 * k];
    b.exp_avg_sq = moments_[2 * k + 1];
    b.grad_shard = u.grad_shard;
    s.buckets.push_back(std::move(b));
    base += u.params.size();
  }
  return s;
}

void FullyShardedAdamW::restore_sharded_state(const std::vector<int64_t>& param_steps, double loss_scale,
                                              int64_t loss_scale_clean_steps, const std::vector<at::Tensor>& grad_shards,
                                              const std::vector<char>& had_grad) {
  torch::NoGradGuard no_grad;
  auto& m = model_->impl();
  std::lock_guard<std::recursive_mutex> lock(m.guard->mu);
  TORCH_CHECK(!m.in_backward, "FullyShardedAdamW::restore_sharded_state: called during backward");
  run_before_update();
  TORCH_CHECK_VALUE(param_steps.size() == steps_.size(), "FullyShardedAdamW::restore_sharded_state: ",
                    param_steps.size(), " step counts for ", steps_.size(), " parameters");
  discard_gradients();
  steps_ = param_steps;
  scaler_->restore(loss_scale, loss_scale_clean_steps);
  std::vector<std::shared_ptr<Work>> gathers;
  for (auto& u : m.units) {
    if (!u->master.is_same(u->shard)) u->shard.copy_(u->master);  // round to the unit's dtype
    if (u->is_root) {
      gathers.push_back(m.comm->all_gather(u->gathered, u->shard));
    } else {
      u->reshard();  // a gathered (or prefetched) copy would be stale
    }
  }
  for (auto& w : gathers) w->wait();
  if (!had_grad.empty()) {  // a step's accumulation in progress: its reduced gradients so far
    TORCH_CHECK_VALUE(had_grad.size() == steps_.size() && grad_shards.size() == m.units.size(),
                      "FullyShardedAdamW::restore_sharded_state: gradients for ", grad_shards.size(), " units and ",
                      had_grad.size(), " parameters; this model has ", m.units.size(), " and ", steps_.size());
    size_t base = 0;
    for (size_t k = 0; k < m.units.size(); ++k) {
      auto& u = *m.units[k];
      u.grad_shard = grad_shards[k];
      std::copy(had_grad.begin() + static_cast<std::ptrdiff_t>(base),
                had_grad.begin() + static_cast<std::ptrdiff_t>(base + u.params.size()), u.had_grad.begin());
      base += u.params.size();
    }
  }
}

void FullyShardedAdamW::discard_gradients() {
  auto& m = model_->impl();
  std::lock_guard<std::recursive_mutex> lock(m.guard->mu);
  TORCH_CHECK(!m.in_backward, "FullyShardedAdamW::discard_gradients: called during backward");
  m.drain_all();
  for (auto& u : m.units) {
    u->grad_shard = at::Tensor();
    std::fill(u->had_grad.begin(), u->had_grad.end(), 0);
    for (auto& p : u->params) p.mutable_grad() = at::Tensor();  // no_sync leftovers
  }
  m.local_grads_pending = false;
  m.gradients_agreed = false;
  agreed_ = false;
  sumsq_ = -1;
  clip_max_norm_ = 0;
}

int64_t FullyShardedAdamW::state_bytes() const {
  int64_t n = 0;
  for (const auto& t : moments_) n += t.nbytes();
  return n;
}

int64_t FullyShardedAdamW::model_state_bytes() const {
  const auto m = model_->memory();
  int64_t shard_numel = 0;
  for (const auto& u : model_->units()) shard_numel += u.shard.size();
  return m.shards + m.master + m.root_params + state_bytes() + 4 * shard_numel;
}

void FullyShardedAdamW::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, "FullyShardedAdamW::save: the state is sharded across ranks; use zeroshard checkpoints");
}

void FullyShardedAdamW::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, "FullyShardedAdamW::load: the state is sharded across ranks; use zeroshard checkpoints");
}

}  // namespace zeroshard
