// sharded_optimizer.cpp — the part of ZeRO-1, 2 and 3 that does not depend on
// how gradients reach the shards: per-step agreement, clipping, loss scaling,
// the update of every shard group, discarding and checkpoint state.
#include "zeroshard/sharded_optimizer.h"

#include "optim/grad_norm.h"
#include "optim/loss_scaler.h"
#include "shard/backward_round.h"
#include "shard/front_end.h"
#include "shard/gradient_norms.h"
#include "shard/optimizer_access.h"
#include "shard/shard_group.h"
#include "zeroshard/log.h"
#include "zeroshard/step_agreement.h"

#include <torch/optim/adam.h>

#include <algorithm>
#include <cmath>
#include <typeinfo>

namespace zeroshard {

struct ShardedOptimizer::Core {
  std::string name;
  int zero_stage = 2;
  shard::Shards shards;
  shard::FrontEnd& fe() const { return *shards.front_end; }
  std::vector<int64_t> steps;         // AdamW step count per parameter
  optim::LossScaler scaler{LossScaleOptions{}, false};
  bool last_skipped = false;

  // Per step.
  bool agreed = false;                // `flags` and `norm_sumsq` are current
  std::vector<double> flags;          // per parameter: ranks that had a gradient
  double norm_sumsq = 0;              // squared global norm of the mean gradient, unscaled (inf/NaN: an overflow)
  double clip_max_norm = 0;           // set by clip_grad_norm() for this step
  GradientNoiseSample noise;          // of the step agreed last
  std::vector<std::function<void()>> before_update;
  int64_t peak_model_states = 0;

  std::recursive_mutex& mu() const { return shards.round->mutex(); }
  void run_before_update() {
    auto fns = std::move(before_update);
    before_update.clear();
    for (auto& fn : fns) fn();
  }
  optim::PendingSum grad_sumsq() const {  // of this rank's gradient shards
    std::vector<at::Tensor> grads;
    for (const auto* g : shards.groups) grads.push_back(g->grad_shard);
    return optim::pending_sum_of_squares(grads);
  }
  // ranks holding the same shard: a replicated shard counts 1/replicas on each
  int replicas() const { return zero_stage == 0 ? shards.process_group.data->size() : shards.topology.num_replicas; }
  // Σ over groups of reductions × their inputs' squared norms (scaled)
  optim::PendingSum unreduced_sumsq() const {
    optim::PendingSum s;
    for (const auto* g : shards.groups) s.add(g->unreduced_sumsq());
    return s;
  }
  // Per parameter: got a gradient on this rank this step.
  std::vector<char> had_grad() const {
    std::vector<char> had(shards.infos.size(), 0);
    for (const auto* g : shards.groups) {
      for (size_t e = 0; e < g->params.size(); ++e) had[g->params[e]] = g->had_grad[e];
    }
    return had;
  }
  int rounds() const {
    int r = 0;
    for (const auto* g : shards.groups) r = std::max(r, g->reductions);
    return r;
  }
  // The step's agreement, two slots of a StepAgreement (the optimizer's own,
  // the one a trainer joined it to, or a pipeline's world agreement): the
  // gradient norms (a GradientNorms: its own, or one shared by the optimizers
  // that clip as one model) and which parameters had a gradient on any rank.
  std::shared_ptr<StepAgreement> agreement;
  std::shared_ptr<shard::GradientNorms> norms;
  int64_t member = -1;  // in `norms`
  int64_t slot = -1;    // the flags' slot
  void join(std::shared_ptr<StepAgreement> a, std::shared_ptr<shard::GradientNorms> shared, std::string flags_name) {
    leave();
    agreement = std::move(a);
    norms = shared != nullptr ? std::move(shared)
                              : std::make_shared<shard::GradientNorms>(agreement, name + " (gradient norms, rounds)",
                                                                       shards.process_group.control->size());
    member = norms->join([this](shard::GradientNorms::Part& p) { return fill_norms(p); },
                         [this](const shard::GradientNorms::Result& r) { read_norms(r); });
    if (flags_name.empty()) flags_name = name + " (parameters with a gradient)";
    slot = agreement->add(std::move(flags_name), shards.infos.size(), [this](double* v) { fill_flags(v); },
                          [this](const double* v) { read_flags(v); });
  }
  // Its own agreement (until join()): the slots follow from the parameters, checked equal at construction.
  void join_own() {
    StepAgreementOptions ao;
    ao.check_slots = false;
    join(std::make_shared<StepAgreement>(shards.process_group.control, ao), nullptr, {});
  }
  void leave() {
    if (agreement == nullptr) return;
    agreement->remove(slot);
    norms->leave(member);
    norms = nullptr;
    agreement = nullptr;
  }
  ~Core() { leave(); }
  // Finishes the step's gradient reductions; backward may not add to them after this.
  void reduce_and_freeze() {
    fe().reduce_gradients();
    shards.round->freeze();
  }
  // Another optimizer joined to the same agreement ran it for its own step()
  // or clip_grad_norm() (a GAN's discriminator, stepping before the generator
  // has run its backward): this optimizer's slots sit that agreement out
  // (zeros on every rank, not read), so it neither reduces nor freezes what it
  // has. An agree() the trainer calls itself is every joined optimizer's.
  bool sits_out() const { return stepping != nullptr && stepping != this; }
  static thread_local const Core* stepping;  // whose step() or clip_grad_norm() runs agree() now
  bool fill_norms(shard::GradientNorms::Part& p) {
    std::lock_guard<std::recursive_mutex> lock(mu());
    if (sits_out()) return false;
    shards.round->check_usable("the step's agreement");
    fe().check_ready("the step's agreement");
    reduce_and_freeze();  // what clip_grad_norm() and step() do first, for an agree() the trainer called
    const double scale2 = scaler.scale() * scaler.scale();
    p.sumsq.push_back({grad_sumsq(), replicas() * scale2});
    p.unreduced.push_back({unreduced_sumsq(), scale2});
    p.rounds = std::max(p.rounds, rounds());
    return true;
  }
  void read_norms(const shard::GradientNorms::Result& r) {
    std::lock_guard<std::recursive_mutex> lock(mu());
    norm_sumsq = r.sumsq;
    noise = r.noise;
  }
  void fill_flags(double* v) {
    std::lock_guard<std::recursive_mutex> lock(mu());
    if (sits_out()) return;
    reduce_and_freeze();  // done by the norms' fill already; a no-op then
    const auto had = had_grad();
    for (size_t p = 0; p < had.size(); ++p) v[p] = had[p] ? 1.0 : 0.0;
  }
  void read_flags(const double* v) {
    std::lock_guard<std::recursive_mutex> lock(mu());
    if (sits_out()) return;
    flags.assign(v, v + shards.infos.size());
    agreed = true;
  }
  void agree() {
    if (agreed) return;  // the trainer's agree() ran since the backward
    TORCH_CHECK(agreement != nullptr, name, ": its model's shards are gone (the model was destroyed first)");
    struct Stepping {  // this optimizer's, until agree() returns or throws
      const Core* outer = stepping;
      explicit Stepping(const Core* c) { stepping = c; }
      ~Stepping() { stepping = outer; }
    } scope(this);
    agreement->agree();
    TORCH_CHECK(agreed, name, ": the step's agreement ran without this optimizer's slot (a bug)");
  }
  // The step's agreement and clipping (also when its backward failed: the round cleared the groups).
  void forget_agreement() {
    agreed = false;
    clip_max_norm = 0;
  }
  void end_step_state() {
    for (auto* g : shards.groups) g->clear_gradient();
    forget_agreement();
    shards.round->end_step();
  }
};

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

void ShardedOptimizer::attach_shards(shard::Shards shards) {
  auto& c = *core_;
  c.shards = std::move(shards);
  if (c.shards.update_order.empty()) {
    for (size_t k = 0; k < c.shards.groups.size(); ++k) c.shards.update_order.push_back(k);
  }
  c.steps.assign(c.shards.infos.size(), 0);
  c.scaler = optim::LossScaler(c.shards.loss_scale, c.shards.loss_scaling);
  c.shards.round->set_on_abandon([&c] { c.forget_agreement(); });
  c.join_own();
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

void ShardedOptimizer::detach_shards() {
  if (core_->shards.round == nullptr) return;
  core_->leave();  // its slot reads the shards
  core_->shards.round->set_on_abandon(nullptr);
  core_->shards.round = nullptr;
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

ShardedState ShardedOptimizer::sharded_state() {
  auto& c = *core_;
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  core_->fe().drain_reductions();  // the gradient shards complete (waits only: every rank issued these)
  ShardedState s;
  s.rank = c.shards.process_group.data->rank();
  s.world_size = c.shards.process_group.data->size();
  s.zero_stage = c.zero_stage;
  s.shard_rank = c.shards.topology.shard_rank;  // stage 0 is never hybrid: rank, 1 and 0
  s.num_replicas = c.shards.topology.num_replicas;
  s.replica_rank = c.shards.topology.replica_rank;
  s.params = c.shards.infos;
  s.param_tensors = c.shards.tensors;
  s.param_steps = c.steps;
  s.local_gradients_pending = core_->fe().local_gradients_pending();
  s.had_grad = c.had_grad();
  s.loss_scale = c.scaler.scale();
  s.loss_scale_clean_steps = c.scaler.clean_steps();
  for (auto* g : c.shards.groups) {
    g->ensure_moments();
    ShardedBucketState b;
    b.layout = g->layout;
    b.params = g->params;
    for (size_t e = 0; e < g->params.size(); ++e) {
      const size_t p = g->params[e];
      if (c.shards.group_of[p] > 0 && b.group == 0) b.group = c.shards.group_of[p];
    }
    b.shard = g->shard;
    b.master = g->master;
    b.exp_avg = g->exp_avg;
    b.exp_avg_sq = g->exp_avg_sq;
    b.grad_shard = g->grad_shard;
    s.buckets.push_back(std::move(b));
  }
  return s;
}

void ShardedOptimizer::restore_sharded_state(const std::vector<int64_t>& param_steps, double loss_scale,
                                             int64_t loss_scale_clean_steps,
                                             const std::vector<at::Tensor>& grad_shards,
                                             const std::vector<char>& had_grad) {
  torch::NoGradGuard no_grad;
  auto& c = *core_;
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  c.run_before_update();
  TORCH_CHECK_VALUE(param_steps.size() == c.steps.size(), c.name, "::restore_sharded_state: ", param_steps.size(),
                    " step counts for ", c.steps.size(), " parameters");
  c.shards.round->check_not_in_pass("restore_sharded_state");
  core_->fe().drop_unreduced_gradients();
  c.end_step_state();
  core_->fe().end_step();
  c.steps = param_steps;
  c.scaler.restore(loss_scale, loss_scale_clean_steps);
  core_->fe().install_masters();
  if (had_grad.empty()) return;
  // A step's accumulation in progress: its reduced gradients so far.
  TORCH_CHECK_VALUE(had_grad.size() == c.steps.size() && grad_shards.size() == c.shards.groups.size(), c.name,
                    "::restore_sharded_state: gradients for ", grad_shards.size(), " groups and ", had_grad.size(),
                    " parameters; this optimizer has ", c.shards.groups.size(), " and ", c.steps.size());
  core_->fe().accept_restored_gradients();
  for (size_t k = 0; k < c.shards.groups.size(); ++k) {
    auto& g = *c.shards.groups[k];
    g.grad_shard = grad_shards[k];
    for (size_t e = 0; e < g.params.size(); ++e) g.had_grad[e] = had_grad[g.params[e]];
  }
}

void ShardedOptimizer::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, core_->name, "::save (torch::save of the optimizer) would save none of the sharded state: "
                                  "each rank holds its own part of it. Save the model and the optimizer with "
                                  "zeroshard::Checkpointer (zeroshard/checkpoint.h): Checkpointer(dir, comm).save(opt, "
                                  "model, progress) on every rank, and resume with its load()");
}

void ShardedOptimizer::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, core_->name, "::load (torch::load into the optimizer): the state is sharded across ranks; "
                                  "resume from a zeroshard::Checkpointer checkpoint (zeroshard/checkpoint.h) with "
                                  "Checkpointer(dir, comm).load(opt, model) on every rank");
}

}  // namespace zeroshard

namespace zeroshard::shard {

std::optional<OptimizerAccess::Owned> OptimizerAccess::owned(ShardedOptimizer& opt, const at::Tensor& param) {
  auto& c = *opt.core_;
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  for (auto* g : c.shards.groups) {
    for (size_t e = 0; e < g->params.size(); ++e) {
      if (!c.shards.tensors[g->params[e]].is_same(param)) continue;
      const Range whole = g->layout.param_range(e);
      const Range piece = intersect(whole, g->shard);
      return Owned{g, piece, {piece.begin - whole.begin, piece.end - whole.begin}, c.replicas()};
    }
  }
  return std::nullopt;
}

void OptimizerAccess::install_masters(ShardedOptimizer& opt) {
  torch::NoGradGuard no_grad;
  std::lock_guard<std::recursive_mutex> lock(opt.core_->mu());
  opt.core_->fe().install_masters();
}

size_t OptimizerAccess::num_params(const ShardedOptimizer& opt) { return opt.core_->shards.infos.size(); }

void OptimizerAccess::reduce_gradients(ShardedOptimizer& opt) {
  torch::NoGradGuard no_grad;
  auto& c = *opt.core_;
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  c.shards.round->check_usable("reduce_gradients");
  c.fe().check_ready("reduce_gradients");
  c.reduce_and_freeze();
}

void OptimizerAccess::join(ShardedOptimizer& opt, std::shared_ptr<GradientNorms> norms, std::string flags_name) {
  auto& c = *opt.core_;
  if (norms == nullptr) {  // back to its own
    if (c.shards.round == nullptr) return;  // its shards are gone (it agrees nothing any more)
    std::lock_guard<std::recursive_mutex> lock(c.mu());
    c.join_own();
    return;
  }
  TORCH_CHECK_VALUE(norms->ranks() == c.shards.process_group.control->size(), c.name, " shards over ",
                    c.shards.process_group.control->size(), " ranks but joins gradient norms over ", norms->ranks(),
                    " data-parallel ranks");
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  auto agreement = norms->agreement();
  c.join(std::move(agreement), std::move(norms), std::move(flags_name));
}

}  // namespace zeroshard::shard
