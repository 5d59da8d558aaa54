// sharded_optimizer.cpp — the part of ZeRO-1, 2 and 3 that does not depend on
// how gradients reach the shards: options, clipping, loss scaling, the update
// of every shard group, discarding. Its state is optimizer_core.h's; its
// checkpoint state, optimizer_state.cpp's.
#include "zeroshard/sharded_optimizer.h"

#include "shard/optimizer/optimizer_core.h"
#include "zeroshard/log.h"

#include <torch/optim/adam.h>

#include <cmath>
#include <typeinfo>

namespace zeroshard {

thread_local const ShardedOptimizer::Core* ShardedOptimizer::Core::stepping = nullptr;

namespace {

// AdamW's hyper-parameters from `options` (`what` names them in errors):
// AdamWOptions as they are; AdamOptions, from a loop written for
// torch::optim::Adam, with the same lr, betas and eps. Adam's weight decay is
// an L2 term added to the gradient before the moments, which the fused kernel
// does not compute (it decays decoupled, as AdamW): refused unless 0.
std::unique_ptr<torch::optim::AdamWOptions> as_adamw(const torch::optim::OptimizerOptions& options,
                                                     const std::string& name, const std::string& what) {
  if (typeid(options) == typeid(torch::optim::OptimizerOptions)) {  // `{}` for the argument: no options given
    return std::make_unique<torch::optim::AdamWOptions>();
  }
  if (const auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    return std::make_unique<torch::optim::AdamWOptions>(*w);
  }
  const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&options);
  TORCH_CHECK_VALUE(a != nullptr, name, ": ", what, " are options of another optimizer than Adam or AdamW; give ",
                    name, " torch::optim::AdamWOptions");
  TORCH_CHECK_VALUE(a->weight_decay() == 0, name, ": ", what, " are torch::optim::AdamOptions with weight_decay(",
                    a->weight_decay(), "), which is Adam's L2 penalty added to the gradient; ", name,
                    " decays weights decoupled, as AdamW. Pass torch::optim::AdamWOptions(lr).weight_decay(",
                    a->weight_decay(), ") for decoupled decay (not the same training), or weight_decay(0)");
  auto w = std::make_unique<torch::optim::AdamWOptions>(a->lr());
  w->betas(a->betas()).eps(a->eps()).weight_decay(0).amsgrad(a->amsgrad());
  return w;
}

// Every group's options as AdamWOptions, before torch::optim::Optimizer sees
// them (LibTorch 2.x would replace options of another type by the defaults).
std::vector<torch::optim::OptimizerParamGroup> as_adamw_groups(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                               const std::string& name) {
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!groups[g].has_options()) continue;
    groups[g].set_options(as_adamw(groups[g].options(), name, "param group " + std::to_string(g) + "'s options"));
  }
  return groups;
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                   const torch::optim::OptimizerOptions& defaults, std::string name, int zero_stage)
    : Optimizer(as_adamw_groups(std::move(groups), name), as_adamw(defaults, name, "the default options")),
      core_(std::make_unique<Core>()) {
  core_->name = std::move(name);
  core_->zero_stage = zero_stage;
}

ShardedOptimizer::~ShardedOptimizer() = default;

const torch::optim::AdamWOptions& ShardedOptimizer::adamw_options(size_t g) {
  auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&param_groups().at(g).options());
  TORCH_CHECK_VALUE(o != nullptr, core_->name, ": param group ", g,
                    " has options of another optimizer; give it torch::optim::AdamWOptions");
  TORCH_CHECK_VALUE(!o->amsgrad(), core_->name, ": param group ", g, " sets amsgrad(true), which ", core_->name,
                    " does not support (it keeps no max_exp_avg_sq); use amsgrad(false)");
  return *o;
}

void ShardedOptimizer::join(std::shared_ptr<StepAgreement> agreement) {
  auto& c = *core_;
  TORCH_CHECK_VALUE(agreement != nullptr, c.name, "::join: the agreement is null");
  const Communicator& mine = *c.shards.process_group.control;
  TORCH_CHECK_VALUE(agreement->communicator().size() == mine.size() && agreement->communicator().rank() == mine.rank(),
                    c.name, "::join: the agreement's communicator is rank ", agreement->communicator().rank(), " of ",
                    agreement->communicator().size(), " but the optimizer's data-parallel group is rank ", mine.rank(),
                    " of ", mine.size(), "; give it an agreement over the optimizer's ranks (a pipeline's stages "
                    "agree through the PipelineExecutor)");
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  c.join(std::move(agreement), nullptr, {});
}

void ShardedOptimizer::reduce_and_freeze() { core_->reduce_and_freeze(); }

torch::Tensor ShardedOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  auto& c = *core_;
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  c.run_before_update();
  c.shards.round->check_usable("step");
  core_->fe().check_ready("step");
  const auto sample_memory = [&] { c.peak_model_states = std::max(c.peak_model_states, stats().memory.total()); };
  sample_memory();
  reduce_and_freeze();
  for (auto* g : c.shards.groups) g->ensure_moments();
  sample_memory();  // gradients reduced, moments allocated: every model state exists now
  const double max_norm = c.clip_max_norm > 0 ? c.clip_max_norm : c.shards.max_grad_norm;
  c.agree();
  const double scale = c.scaler.scale();
  c.last_skipped = c.scaler.update(c.scaler.enabled() && !std::isfinite(c.norm_sumsq));
  if (c.last_skipped) {
    log_info(c.name + ": gradient overflow, step skipped on every rank; loss scale now " +
             std::to_string(c.scaler.scale()));
    c.end_step_state();
    core_->fe().end_step();
    return loss;
  }
  double multiplier = 1.0 / scale;
  if (max_norm > 0) {
    const double coef = max_norm / (std::sqrt(c.norm_sumsq) + 1e-6);
    if (coef < 1) multiplier *= coef;
  }
  for (size_t i = 0; i < c.steps.size(); ++i) {
    if (c.flags[i] > 0) ++c.steps[i];
  }
  for (const size_t k : c.shards.update_order) {
    auto& g = *c.shards.groups[k];
    shard::EntryCoefficients coeffs(g.params.size());
    bool changed = false;
    for (size_t e = 0; e < g.params.size(); ++e) {
      const size_t p = g.params[e];
      if (c.flags[p] == 0 || c.shards.group_of[p] < 0) continue;
      const auto& o = adamw_options(static_cast<size_t>(c.shards.group_of[p]));
      coeffs[e] = optim::adamw_coeffs(o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                                      o.weight_decay(), c.steps[p], multiplier);
      changed = true;
    }
    if (changed) shard::update_shard(g, coeffs);
    core_->fe().group_updated(k, changed);
  }
  core_->fe().finish_update();
  c.end_step_state();
  core_->fe().end_step();
  return loss;
}

double ShardedOptimizer::clip_grad_norm(double max_norm) {
  TORCH_CHECK_VALUE(max_norm > 0, core_->name, "::clip_grad_norm: max_norm is ", max_norm, "; it must be positive");
  torch::NoGradGuard no_grad;
  auto& c = *core_;
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  c.shards.round->check_usable("clip_grad_norm");
  core_->fe().check_ready("clip_grad_norm");
  reduce_and_freeze();
  c.agree();
  c.clip_max_norm = max_norm;
  return std::sqrt(c.norm_sumsq);
}

GradientNoiseSample ShardedOptimizer::last_gradient_noise() const {
  std::lock_guard<std::recursive_mutex> lock(core_->mu());
  return core_->noise;
}

ShardedOptimizer::NoSyncGuard::NoSyncGuard(ShardedOptimizer* opt) : opt_(opt) {
  std::lock_guard<std::recursive_mutex> lock(opt_->core_->mu());
  opt_->core_->shards.round->enter_no_sync();
}

ShardedOptimizer::NoSyncGuard::~NoSyncGuard() {
  if (opt_ == nullptr) return;
  std::lock_guard<std::recursive_mutex> lock(opt_->core_->mu());
  opt_->core_->shards.round->exit_no_sync();
}

ShardedOptimizer::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept : opt_(other.opt_) { other.opt_ = nullptr; }

ShardedOptimizer::NoSyncGuard ShardedOptimizer::no_sync() { return NoSyncGuard(this); }

// p.grad() is dropped whatever `set_to_none` says, except ZeRO-1's views of its
// flat buffers, which are zeroed: a zero tensor in p.grad() would cost the
// memory sharding saves and change nothing (no gradient and a zero one are
// the same to the update, as torch::optim::AdamW's with 1.13's zero_grad).
void ShardedOptimizer::zero_grad(bool /*set_to_none*/) { discard_gradients(); }

void ShardedOptimizer::discard_gradients() {
  torch::NoGradGuard no_grad;
  auto& c = *core_;
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  c.shards.round->check_not_in_pass("discard_gradients");
  core_->fe().drop_unreduced_gradients();
  c.end_step_state();
  core_->fe().end_step();
}

torch::Tensor ShardedOptimizer::scale_loss(const torch::Tensor& loss) const {
  return core_->scaler.enabled() ? loss * core_->scaler.scale() : loss;
}

bool ShardedOptimizer::loss_scaling() const { return core_->scaler.enabled(); }

double ShardedOptimizer::loss_scale() const { return core_->scaler.scale(); }
bool ShardedOptimizer::last_step_skipped() const { return core_->last_skipped; }
int ShardedOptimizer::zero_stage() const { return core_->zero_stage; }

ShardedStats ShardedOptimizer::stats() const {
  const auto& c = *core_;
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  ShardedStats s;
  core_->fe().add_stats(s);
  auto& m = s.memory;
  for (const auto* g : c.shards.groups) {
    if (g->grad_shard.defined()) m.grad_shards += g->grad_shard.nbytes();
    if (!g->master.is_same(g->values)) m.master += g->master.nbytes();
    if (g->exp_avg.defined()) m.moments += g->exp_avg.nbytes() + g->exp_avg_sq.nbytes();
  }
  m.peak_model_states = std::max(c.peak_model_states, m.total());
  return s;
}
Communicator& ShardedOptimizer::communicator() const { return *core_->shards.process_group.data; }

void ShardedOptimizer::call_before_next_update(std::function<void()> fn) {
  std::lock_guard<std::recursive_mutex> lock(core_->mu());
  core_->before_update.push_back(std::move(fn));
}

}  // namespace zeroshard
