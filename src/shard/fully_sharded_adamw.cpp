// fully_sharded_adamw.cpp — AdamW over the units of a fully sharded model.
//
// Each unit's fp32 shard is both the parameters' master and the source of the
// next gather, so the update is one fused pass per parameter piece and no
// all-gather: the next forward gathers the new values. The root unit stays
// gathered, so it is all-gathered here.
#include "shard/unit.h"

#include "optim/fused_adamw.h"
#include "optim/grad_norm.h"
#include "zeroshard/trace.h"

#include <chrono>
#include <cmath>
#include <limits>

namespace zeroshard {
namespace {

std::vector<torch::Tensor> trainable_params(const FullyShardedModel& model) {
  std::vector<torch::Tensor> out;
  for (const auto& u : model.impl().units) {
    for (size_t i = 0; i < u->params.size(); ++i) {
      if (u->trainable[i]) out.push_back(u->params[i]);
    }
  }
  return out;
}

}  // namespace

FullyShardedAdamW::FullyShardedAdamW(std::shared_ptr<FullyShardedModel> model, torch::optim::AdamWOptions options)
    : Optimizer({torch::optim::OptimizerParamGroup(trainable_params(*model))},
                std::make_unique<torch::optim::AdamWOptions>(options)),
      model_(std::move(model)) {
  TORCH_CHECK_VALUE(!options.amsgrad(), "FullyShardedAdamW does not support amsgrad(true) (it keeps no max_exp_avg_sq); use amsgrad(false)");
  size_t total = 0;
  for (const auto& u : model_->impl().units) total += u->params.size();
  steps_.assign(total, 0);
}

FullyShardedAdamW::~FullyShardedAdamW() = default;

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
  return std::sqrt(sumsq_);
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
  m.reduce_local_gradients();
  m.drain_all();
  agree(clip_max_norm_ > 0);
  double multiplier = 1.0;
  if (clip_max_norm_ > 0) {
    const double coef = clip_max_norm_ / (std::sqrt(sumsq_) + 1e-6);
    if (coef < 1) multiplier = coef;
  }
  const auto& o = static_cast<torch::optim::AdamWOptions&>(param_groups()[0].options());
  TORCH_CHECK_VALUE(!o.amsgrad(), "FullyShardedAdamW does not support amsgrad(true) (it keeps no max_exp_avg_sq); use amsgrad(false)");
  if (moments_.size() != 2 * m.units.size()) {
    moments_.clear();
    for (const auto& u : m.units) {
      moments_.push_back(at::zeros({u->shard_range.size()}, at::kFloat));
      moments_.push_back(at::zeros({u->shard_range.size()}, at::kFloat));
    }
  }
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
        if (flags_[gi] == 0) continue;
        const Range local = seg.local(u.layout, m.rank);
        const auto c = optim::adamw_coeffs(o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                                           o.weight_decay(), steps_[gi], multiplier);
        const bool low = u.shard.scalar_type() != at::kFloat;  // bf16: write the rounded copy gathers send
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

void FullyShardedAdamW::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, "FullyShardedAdamW::save: the state is sharded across ranks; use zeroshard checkpoints");
}

void FullyShardedAdamW::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, "FullyShardedAdamW::load: the state is sharded across ranks; use zeroshard checkpoints");
}

}  // namespace zeroshard
