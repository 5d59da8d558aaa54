// sharded_adamw.cpp — ShardedAdamW: construction, step, clipping, state.
// The gradient side (hooks, bucketed reduce-scatter) is in grad_reduction.cpp.
#include "shard/sharded_adamw_impl.h"

#include "optim/fused_adamw.h"
#include "optim/grad_norm.h"
#include "shard/rank_agreement.h"
#include "shard/tensor_alias.h"
#include "zeroshard/log.h"

#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <cmath>
#include <iomanip>
#include <limits>
#include <algorithm>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::OptimizerParamGroup;

std::string describe_options(const ShardedAdamWOptions& o, bool scaling) {
  std::ostringstream os;
  os << std::setprecision(17) << "options: stage=" << o.stage << " bucket_bytes=" << o.bucket_bytes
     << " max_inflight_buckets=" << o.max_inflight_buckets << " max_grad_norm=" << o.max_grad_norm
     << " reduce_every_backward=" << o.reduce_every_backward << " loss_scaling=" << scaling
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
  TORCH_CHECK_VALUE(options.stage == 1 || options.stage == 2, "ShardedAdamW: stage is ", options.stage,
                    "; ShardedAdamW implements stage 1 (optimizer states) and 2 (also gradients); "
                    "for stage 3 use zeroshard::fully_shard");
  TORCH_CHECK_VALUE(options.bucket_bytes > 0, "ShardedAdamW: bucket_bytes is ", options.bucket_bytes,
                    "; it must be positive (Default: 16 MiB)");
  TORCH_CHECK_VALUE(options.max_inflight_buckets >= 1, "ShardedAdamW: max_inflight_buckets is ",
                    options.max_inflight_buckets, "; it must be >= 1 (Default: 2)");
  TORCH_CHECK_VALUE(options.max_grad_norm >= 0, "ShardedAdamW: max_grad_norm is ", options.max_grad_norm,
                    "; it must be >= 0 (0 = no clipping)");
}

}  // namespace

ShardedAdamW::Impl::Impl(ShardedAdamW& owner_, std::shared_ptr<Communicator> comm_, ShardedAdamWOptions options_)
    : owner(owner_),
      comm(std::move(comm_)),
      options(options_),
      scaler(options_.loss_scale, false),
      target(std::make_shared<shard::HookTarget>()) {}

void ShardedAdamW::Impl::track(int64_t bytes) {
  transient_bytes += bytes;
  peak_transient = std::max(peak_transient, transient_bytes);
}

AdamWOptions& ShardedAdamW::Impl::group_options(int group) const {
  auto* o = dynamic_cast<AdamWOptions*>(&owner.param_groups()[static_cast<size_t>(group)].options());
  TORCH_CHECK_VALUE(o != nullptr, "ShardedAdamW: param group ", group,
                    " has options of another optimizer; give it torch::optim::AdamWOptions");
  TORCH_CHECK_VALUE(!o->amsgrad(), "ShardedAdamW: param group ", group,
                    " sets amsgrad(true), which ShardedAdamW does not support (it keeps no max_exp_avg_sq); use amsgrad(false)");
  return *o;
}

void ShardedAdamW::Impl::check_usable() {
  if (backward_aborted) {
    recover_from_aborted_backward();
    TORCH_CHECK(false, "ShardedAdamW: the last backward pass ended with an exception part-way, so this step's "
                       "gradients are incomplete; they were discarded. Call zero_grad() and run the step's "
                       "backward passes again "
                       "(ranks that did not fail may now be out of step: if only some ranks failed, restart "
                       "from the last checkpoint)");
  }
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

void ShardedAdamW::Impl::agree(bool with_norm) {
  if (agreed && (!with_norm || !std::isnan(global_sumsq))) return;
  std::vector<double> ctrl(1 + params.size());
  ctrl[0] = 0;
  if (with_norm) {
    for (const auto& b : buckets) {
      ctrl[0] += optim::sum_of_squares(b.grad_shard.data_ptr(), b.grad_shard.scalar_type(), b.grad_shard.numel());
    }
  }
  for (size_t i = 0; i < params.size(); ++i) ctrl[1 + i] = had_grad[i] ? 1.0 : 0.0;
  auto t = at::tensor(ctrl, at::kDouble);
  comm->all_reduce(t, ReduceOp::kSum)->wait();
  const double* v = t.data_ptr<double>();
  global_sumsq = with_norm ? v[0] : std::numeric_limits<double>::quiet_NaN();
  global_flags.assign(v + 1, v + 1 + params.size());
  agreed = true;
}

ShardedAdamW::ShardedAdamW(std::vector<torch::Tensor> params, std::shared_ptr<Communicator> comm,
                           AdamWOptions defaults, ShardedAdamWOptions options)
    : ShardedAdamW(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))}, std::move(comm),
                   std::move(defaults), std::move(options)) {}

ShardedAdamW::ShardedAdamW(const torch::OrderedDict<std::string, torch::Tensor>& named_params,
                           std::shared_ptr<Communicator> comm, AdamWOptions defaults, ShardedAdamWOptions options)
    : ShardedAdamW(std::vector<OptimizerParamGroup>{OptimizerParamGroup(named_params.values())}, std::move(comm),
                   std::move(defaults), std::move(options), &named_params) {}

ShardedAdamW::ShardedAdamW(std::vector<OptimizerParamGroup> groups, std::shared_ptr<Communicator> comm,
                           AdamWOptions defaults, ShardedAdamWOptions options)
    : ShardedAdamW(std::move(groups), std::move(comm), std::move(defaults), std::move(options), nullptr) {}

ShardedAdamW::ShardedAdamW(std::vector<OptimizerParamGroup> groups, std::shared_ptr<Communicator> comm,
                           AdamWOptions defaults, ShardedAdamWOptions options, const Names* names)
    : Optimizer(checked(std::move(groups), names), std::make_unique<AdamWOptions>(defaults)) {
  TORCH_CHECK_VALUE(comm != nullptr, "ShardedAdamW: the communicator is null; pass zeroshard::init_communicator()");
  impl_ = std::make_unique<Impl>(*this, std::move(comm), options);
  auto& im = *impl_;
  im.rank = im.comm->rank();
  im.world = im.comm->size();

  // Local checks first, but a rank that fails them still joins the agreement
  // below, so every rank fails together (naming the difference) instead of
  // the others waiting for it.
  std::string local_error;
  std::vector<std::string> entries;
  bool scaling = false;
  try {
    check_options(options);
    // Trained parameters: requires_grad, deduplicated (a tied weight listed twice).
    std::unordered_map<const void*, size_t> group_seen;
    std::unordered_map<const void*, std::string> storage_owner;
    bool any_half = false;
    for (size_t g = 0; g < param_groups().size(); ++g) {
      entries.push_back(shard::describe_param_group(static_cast<int>(g), im.group_options(static_cast<int>(g))));
      const auto& ps = param_groups()[g].params();
      im.group_sizes.push_back(ps.size());
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
        TORCH_CHECK_VALUE(p.device().is_cpu(), "ShardedAdamW: parameter '", name, "' is on ", p.device(),
                          " but the communicator moves CPU tensors; move the model to the CPU");
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
        im.params.push_back(p);
        im.infos.push_back({name, p.sizes().vec(), dt});
        im.group_of.push_back(static_cast<int>(g));
      }
    }
    TORCH_CHECK_VALUE(!im.params.empty(), "ShardedAdamW: no trainable parameters (none given, or all have "
                                          "requires_grad=false)");
    scaling = options.loss_scale.enabled < 0 ? any_half : options.loss_scale.enabled > 0;
    im.scaler = optim::LossScaler(options.loss_scale, scaling);
  } catch (const c10::Error& e) {
    local_error = e.what_without_backtrace();
  }

  // Every rank must have built the same thing before any data moves.
  entries.insert(entries.begin(), local_error.empty() ? "construction: ok" : "construction failed: " + local_error);
  entries.push_back(describe_options(options, scaling));
  for (size_t i = 0; i < im.infos.size(); ++i) {
    entries.push_back("group " + std::to_string(im.group_of[i]) + " " + im.infos[i].describe());
  }
  shard::check_same_on_all_ranks(*im.comm, entries, "ShardedAdamW parameters");
  TORCH_CHECK_VALUE(local_error.empty(), local_error);

  // Buckets, flat buffers, parameters aliased into them, rank 0's values everywhere.
  torch::NoGradGuard no_grad;
  const auto plan = plan_buckets(im.infos, im.group_of, options.bucket_bytes);
  im.location.resize(im.params.size());
  std::vector<std::shared_ptr<Work>> broadcasts;
  for (const auto& members : plan) {
    shard::Bucket b;
    std::vector<ParamInfo> infos;
    for (size_t i : members) infos.push_back(im.infos[i]);
    b.layout = make_flat_layout(std::move(infos), im.world);
    b.params = members;
    b.group = im.group_of[members.front()];
    b.shard = b.layout.shard(im.rank);
    b.segments = shard_segments(b.layout, im.rank);
    b.flat_params = at::zeros({b.layout.padded_numel}, at::TensorOptions().dtype(b.layout.dtype));
    for (size_t e = 0; e < members.size(); ++e) {
      auto& p = im.params[members[e]];
      const int64_t off = b.layout.offsets[e];
      b.flat_params.slice(0, off, off + p.numel()).view(p.sizes()).copy_(p.detach());
      p.set_data(shard::alias_of(b.flat_params, off, p.sizes()));
      im.location[members[e]] = {im.buckets.size(), e};
    }
    if (im.world > 1) broadcasts.push_back(im.comm->broadcast(b.flat_params, 0));
    im.buckets.push_back(std::move(b));
  }
  for (auto& w : broadcasts) w->wait();
  int64_t shard_elems = 0;
  for (auto& b : im.buckets) {
    auto mine = b.flat_params.slice(0, b.shard.begin, b.shard.end);
    b.master = b.layout.dtype == at::kFloat ? mine : mine.to(at::kFloat);
    b.exp_avg = at::zeros({b.shard.size()}, at::kFloat);
    b.exp_avg_sq = at::zeros({b.shard.size()}, at::kFloat);
    shard_elems += b.shard.size();
  }
  im.steps.assign(im.params.size(), 0);
  im.had_grad.assign(im.params.size(), 0);
  im.ready.assign(im.params.size(), 0);
  im.target->impl = impl_.get();
  im.register_hooks();

  int64_t total = 0;
  for (const auto& info : im.infos) total += info.numel();
  log_info("ShardedAdamW: stage " + std::to_string(options.stage) + ", " + std::to_string(im.params.size()) +
           " parameters (" + std::to_string(total) + " elements) in " + std::to_string(im.buckets.size()) +
           " buckets; this rank holds the optimizer state of " + std::to_string(shard_elems) + " elements" +
           (scaling ? "; dynamic loss scaling on" : ""));
}

ShardedAdamW::~ShardedAdamW() {
  if (!impl_) return;
  std::lock_guard<std::recursive_mutex> lock(impl_->target->mu);
  impl_->target->impl = nullptr;
  impl_->remove_hooks();
}

void ShardedAdamW::zero_grad(bool set_to_none) {
  at::NoGradGuard no_grad;
  for (auto& p : impl_->params) {
    if (!p.grad().defined()) continue;
    if (set_to_none && impl_->options.stage != 1) {
      p.mutable_grad() = at::Tensor();
    } else {
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

torch::Tensor ShardedAdamW::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  auto& im = *impl_;
  std::lock_guard<std::recursive_mutex> lock(im.target->mu);
  im.run_before_update();
  im.check_usable();
  im.peak_model_states = std::max(im.peak_model_states, memory().total());
  im.reduce_all();
  im.peak_model_states = std::max(im.peak_model_states, memory().total());
  const double max_norm = im.clip_max_norm > 0 ? im.clip_max_norm : im.options.max_grad_norm;
  im.agree(max_norm > 0 || im.scaler.enabled());
  const double scale = im.scaler.scale();
  const bool found_inf = im.scaler.enabled() && !std::isfinite(im.global_sumsq);
  im.last_skipped = im.scaler.update(found_inf);
  if (im.last_skipped) {
    log_info("ShardedAdamW: gradient overflow, step skipped on every rank; loss scale now " +
             std::to_string(im.scaler.scale()));
    im.release_step_gradients();
    return loss;
  }
  double multiplier = 1.0 / scale;
  if (max_norm > 0) {
    const double norm = std::sqrt(im.global_sumsq) / scale;
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1) multiplier *= coef;
  }
  for (size_t i = 0; i < im.params.size(); ++i) {
    if (im.global_flags[i] > 0) ++im.steps[i];
  }
  std::vector<std::shared_ptr<Work>> gathers;
  for (auto& b : im.buckets) {
    const auto& o = im.group_options(b.group);
    bool updated = false;
    for (size_t param : b.params) updated = updated || im.global_flags[param] > 0;
    if (!updated) continue;  // every rank agrees: nothing in this bucket changes
    const size_t gsize = b.grad_shard.element_size();
    for (const auto& seg : b.segments) {
      const size_t param = b.params[seg.param];
      if (im.global_flags[param] == 0) continue;
      const Range local = seg.local(b.layout, im.rank);
      const auto c = optim::adamw_coeffs(o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                                         o.weight_decay(), im.steps[param], multiplier);
      void* copy = nullptr;
      if (b.layout.dtype != at::kFloat) {
        copy = static_cast<char*>(b.flat_params.data_ptr()) + (b.shard.begin + local.begin) * 2;
      }
      optim::fused_adamw(c, b.master.data_ptr<float>() + local.begin,
                         static_cast<const char*>(b.grad_shard.data_ptr()) + local.begin * gsize,
                         b.grad_shard.scalar_type(), b.exp_avg.data_ptr<float>() + local.begin,
                         b.exp_avg_sq.data_ptr<float>() + local.begin, local.size(), copy, b.layout.dtype);
    }
    gathers.push_back(im.comm->all_gather(b.flat_params, b.flat_params.slice(0, b.shard.begin, b.shard.end)));
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& w : gathers) w->wait();
  im.waits.gathers += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  im.release_step_gradients();
  return loss;
}

double ShardedAdamW::clip_grad_norm(double max_norm) {
  TORCH_CHECK_VALUE(max_norm > 0, "ShardedAdamW::clip_grad_norm: max_norm is ", max_norm, "; it must be positive");
  torch::NoGradGuard no_grad;
  auto& im = *impl_;
  std::lock_guard<std::recursive_mutex> lock(im.target->mu);
  im.check_usable();
  im.reduce_all();
  im.agree(true);
  im.clip_max_norm = max_norm;
  return std::sqrt(im.global_sumsq) / im.scaler.scale();
}

ShardedAdamW::NoSyncGuard::NoSyncGuard(ShardedAdamW* opt) : opt_(opt) {
  std::lock_guard<std::recursive_mutex> lock(opt_->impl_->target->mu);
  ++opt_->impl_->no_sync_depth;
  // Decided here, not by which hooks fire, so every rank agrees that step() must reduce.
  if (opt_->impl_->options.stage == 2) opt_->impl_->local_grads_pending = true;
}

ShardedAdamW::NoSyncGuard::~NoSyncGuard() {
  if (opt_ == nullptr) return;
  std::lock_guard<std::recursive_mutex> lock(opt_->impl_->target->mu);
  --opt_->impl_->no_sync_depth;
}

ShardedAdamW::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept : opt_(other.opt_) { other.opt_ = nullptr; }

ShardedAdamW::NoSyncGuard ShardedAdamW::no_sync() { return NoSyncGuard(this); }

void ShardedAdamW::discard_gradients() {
  torch::NoGradGuard no_grad;
  auto& im = *impl_;
  std::lock_guard<std::recursive_mutex> lock(im.target->mu);
  if (im.backward_aborted) im.recover_from_aborted_backward();
  im.drain_all();
  for (auto& b : im.buckets) {
    b.rs_in = at::Tensor();
    b.ready = 0;
    if (b.flat_grads.defined()) b.flat_grads.zero_();
  }
  std::fill(im.ready.begin(), im.ready.end(), 0);
  im.next_launch = 0;
  im.local_grads_pending = false;
  for (auto& p : im.params) {  // stage 1's slices of flat_grads were zeroed above; others are dropped
    const auto& g = p.grad();
    const auto& flat = im.buckets[im.location[static_cast<size_t>(&p - im.params.data())].first].flat_grads;
    const bool in_flat = g.defined() && flat.defined() && g.storage().data() == flat.storage().data();
    if (g.defined() && !in_flat) p.mutable_grad() = at::Tensor();
  }
  im.release_step_gradients();
}

torch::Tensor ShardedAdamW::scale_loss(const torch::Tensor& loss) const {
  return impl_->scaler.enabled() ? loss * impl_->scaler.scale() : loss;
}

double ShardedAdamW::loss_scale() const { return impl_->scaler.scale(); }
bool ShardedAdamW::last_step_skipped() const { return impl_->last_skipped; }
const ShardedAdamWOptions& ShardedAdamW::sharded_options() const { return impl_->options; }
Communicator& ShardedAdamW::communicator() const { return *impl_->comm; }

ShardedState ShardedAdamW::sharded_state() const {
  const auto& im = *impl_;
  ShardedState s;
  s.rank = im.rank;
  s.world_size = im.world;
  s.stage = im.options.stage;
  s.params = im.infos;
  s.param_steps = im.steps;
  s.param_tensors = im.params;
  {
    std::lock_guard<std::recursive_mutex> lock(im.target->mu);
    impl_->drain_all();  // the gradient shards complete (waits only: every rank issued these)
  }
  s.local_gradients_pending = im.local_grads_pending || (im.options.stage == 1 && !im.reduced &&
                                                          std::any_of(im.had_grad.begin(), im.had_grad.end(),
                                                                      [](char h) { return h != 0; }));
  s.had_grad = im.had_grad;

  s.loss_scale = im.scaler.scale();
  s.loss_scale_clean_steps = im.scaler.clean_steps();
  for (const auto& b : im.buckets) {
    s.buckets.push_back({b.layout, b.params, b.group, b.shard, b.master, b.exp_avg, b.exp_avg_sq, b.grad_shard});
  }
  return s;
}

void ShardedAdamW::restore_sharded_state(const std::vector<int64_t>& param_steps, double loss_scale,
                                         int64_t loss_scale_clean_steps, const std::vector<at::Tensor>& grad_shards,
                                         const std::vector<char>& had_grad) {
  torch::NoGradGuard no_grad;
  auto& im = *impl_;
  std::lock_guard<std::recursive_mutex> lock(im.target->mu);
  im.run_before_update();
  TORCH_CHECK_VALUE(param_steps.size() == im.steps.size(), "ShardedAdamW::restore_sharded_state: ",
                    param_steps.size(), " step counts for ", im.steps.size(), " parameters");
  im.drain_all();
  im.release_step_gradients();
  for (auto& p : im.params) {
    if (p.grad().defined()) p.mutable_grad().zero_();  // stage 1's gradients alias its flat buffer: keep them
  }
  im.local_grads_pending = false;
  im.steps = param_steps;
  im.scaler.restore(loss_scale, loss_scale_clean_steps);
  std::vector<std::shared_ptr<Work>> gathers;
  for (auto& b : im.buckets) {
    auto mine = b.flat_params.slice(0, b.shard.begin, b.shard.end);
    if (b.layout.dtype != at::kFloat) mine.copy_(b.master);  // round to the parameters' dtype
    gathers.push_back(im.comm->all_gather(b.flat_params, mine));
  }
  for (auto& w : gathers) w->wait();
  if (!had_grad.empty()) {  // a step's accumulation in progress: its reduced gradients so far
    TORCH_CHECK_VALUE(had_grad.size() == im.had_grad.size() && grad_shards.size() == im.buckets.size(),
                      "ShardedAdamW::restore_sharded_state: gradients for ", grad_shards.size(), " buckets and ",
                      had_grad.size(), " parameters; this optimizer has ", im.buckets.size(), " and ",
                      im.had_grad.size());
    TORCH_CHECK_VALUE(im.options.stage == 2, "ShardedAdamW::restore_sharded_state: gradients of an accumulation in "
                      "progress need stage 2 (stage 1 keeps them unreduced in p.grad())");
    im.had_grad = had_grad;
    for (size_t k = 0; k < im.buckets.size(); ++k) im.buckets[k].grad_shard = grad_shards[k];
    im.flushed_since_step = true;  // nothing of this step is left in p.grad()
  }
}

void ShardedAdamW::call_before_next_update(std::function<void()> fn) {
  std::lock_guard<std::recursive_mutex> lock(impl_->target->mu);
  impl_->before_update.push_back(std::move(fn));
}

CommWaits ShardedAdamW::waits() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->target->mu);
  return impl_->waits;
}

ShardedMemory ShardedAdamW::memory() const {
  const auto& im = *impl_;
  std::lock_guard<std::recursive_mutex> lock(im.target->mu);
  ShardedMemory m;
  std::unordered_set<const void*> counted;
  for (const auto& b : im.buckets) {
    m.params += b.flat_params.nbytes();
    if (b.flat_grads.defined()) m.grads += b.flat_grads.nbytes();
    if (b.grad_shard.defined()) m.grad_shards += b.grad_shard.nbytes();
    if (b.layout.dtype != at::kFloat) m.master += b.master.nbytes();
    m.moments += b.exp_avg.nbytes() + b.exp_avg_sq.nbytes();
    if (b.flat_grads.defined()) counted.insert(b.flat_grads.storage().data());
  }
  for (const auto& p : im.params) {  // gradients outside our buffers (stage 2: no_sync, local accumulation)
    const auto& g = p.grad();
    if (g.defined() && counted.insert(g.storage().data()).second) m.grads += g.storage().nbytes();
  }
  m.peak_transient = im.peak_transient;
  m.peak_model_states = std::max(im.peak_model_states, m.total());
  return m;
}

void ShardedAdamW::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, "ShardedAdamW::save: torch::optim serialization would save none of the sharded state; "
                     "save sharded_state() of every rank (zeroshard checkpoints) instead");
}

void ShardedAdamW::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, "ShardedAdamW::load: the state is sharded across ranks; restore it through "
                     "sharded_state() (zeroshard checkpoints) instead");
}

}  // namespace zeroshard
