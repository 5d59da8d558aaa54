// sharded_model.cpp — what ZeRO-3 does at each moment of a forward and a
// backward pass (the protocol itself is BackwardRound's): gathers and
// prefetches in the recorded order, reductions in a fixed order, resharding at
// the end; and the FullyShardedModel a trainer holds.
#include "shard/zero3/unit.h"

#include "shard/zero3/module_access.h"

#include "comm/work.h"
#include "compat/autograd_hooks.h"
#include "compat/torch_compat.h"
#include "runtime/rank_agreement.h"
#include "zeroshard/log.h"

namespace zeroshard {

ShardedModule::~ShardedModule() = default;

bool ShardedModule::is_unit() const { return state_ && state_->unit; }

void ShardedModule::before_forward() {
  auto& unit = *state_->unit;
  std::lock_guard<std::recursive_mutex> lock(unit.model.mu());
  unit.before_forward();
}

at::Tensor ShardedModule::after_forward(at::Tensor out) {
  auto& unit = *state_->unit;
  std::lock_guard<std::recursive_mutex> lock(unit.model.mu());
  return unit.after_forward(std::move(out));
}

std::vector<at::Tensor> ShardedModule::after_forward(std::vector<at::Tensor> out) {
  for (auto& t : out) t = after_forward(std::move(t));
  return out;
}

void ShardedModule::end_forward() {
  auto& unit = *state_->unit;
  std::lock_guard<std::recursive_mutex> lock(unit.model.mu());
  unit.end_forward();
}

void shard::ShardedModel::begin_pass() {
  if (recording_forward) {
    // Before backward issues any reduction: ranks that ran their units in
    // different orders fail here, together, naming the first difference.
    recording_forward = false;
    check_order_across_ranks(forward_order, "forward");
  }
  forward_pos = 0;
  backward_pos = 0;
  backward_prefetch_off = false;
  for (auto& u : units) u->start_backward();
}

void shard::ShardedModel::abandon_pass() {
  // The round dropped the reductions and the units' gradient shards; free
  // what the pass gathered. A first backward's order is recorded again.
  if (recording_backward) backward_order.clear();
  for (auto& u : units) {
    try {
      u->reshard();
    } catch (const std::exception& e) {  // a gather in flight failed too: backward reports that error
      log_debug(std::string("fully_shard: resharding '") + u->name + "' after a failed backward: " + error_message(e));
    }
  }
}

void shard::ShardedModel::prefetch(const std::vector<size_t>& order, size_t next) {
  if (!options.prefetch) return;
  for (size_t k = next; k < order.size() && k < next + static_cast<size_t>(options.max_inflight_gathers); ++k) {
    units[order[k]]->start_unshard();
  }
}

bool shard::ShardedModel::backward_comes_next(size_t unit) const {
  return options.keep_last_unit_for_backward && at::GradMode::is_enabled() && !recording_forward &&
         !forward_prefetch_off && forward_pos == forward_order.size() && forward_order.back() == unit;
}

void shard::ShardedModel::prefetch_first_forward_unit() {
  if (options.prefetch && !recording_forward && !forward_order.empty()) units[forward_order[0]]->start_unshard();
}

void shard::ShardedModel::on_forward(size_t unit) {
  if (recording_forward) {
    forward_order.push_back(unit);
    return;
  }
  if (forward_pos >= forward_order.size() || (forward_order[forward_pos] != unit && forward_order[0] == unit)) {
    forward_pos = 0;  // a new forward pass
    forward_prefetch_off = false;
  }
  if (forward_prefetch_off || forward_order[forward_pos] != unit) {
    // Inference passes (generation, evaluation of part of a model) often take
    // another order: said at debug level. Training passes: once, as a warning.
    if (!forward_prefetch_off && !c10::GradMode::is_enabled()) {
      log_debug("fully_shard: unit '" + units[unit]->name + "' ran out of the recorded forward order in a pass "
                "without gradients; prefetch is off for this pass");
    } else if (!forward_prefetch_off && !warned_order) {
      log_warn("fully_shard: unit '" + units[unit]->name + "' ran out of the recorded forward order; prefetch is "
               "off for this pass (results are unaffected). Shown once.");
      warned_order = true;
    }
    forward_prefetch_off = true;
    return;
  }
  ++forward_pos;
  prefetch(forward_order, forward_pos);
}

void shard::ShardedModel::on_pre_backward(size_t unit) {
  if (recording_backward) {
    backward_order.push_back(unit);
    return;
  }
  if (backward_prefetch_off || backward_pos >= backward_order.size() || backward_order[backward_pos] != unit) {
    if (!backward_prefetch_off && !warned_order) {
      log_warn("fully_shard: unit '" + units[unit]->name + "' ran out of the recorded backward order; prefetch is "
               "off for this pass (results are unaffected). Shown once.");
      warned_order = true;
    }
    backward_prefetch_off = true;
    return;
  }
  ++backward_pos;
  prefetch(backward_order, backward_pos);
}

void shard::ShardedModel::check_order_across_ranks(const std::vector<size_t>& order, const std::string& what) {
  std::vector<std::string> entries;
  for (size_t u : order) entries.push_back("unit '" + (units[u]->is_root ? std::string("(root)") : units[u]->name) + "'");
  runtime::check_same_on_all_ranks(check_comm(), entries, "fully_shard: the " + what + " orders of units (first step)");
}

void shard::ShardedModel::try_launch() {
  round->launch_in_order(
      launch_order.size(), [this](size_t k) { return units[launch_order[k]]->complete(); },
      [this](size_t k) { launch(launch_order[k]); });
}

void shard::ShardedModel::launch(size_t unit, ReductionQueue::Input kind) {
  auto& u = *units[unit];
  round->reductions().launch(*reduce_comm, u, u.take_packed_gradients(), /*in_is_scratch=*/true, u.label(), kind);
  round->reductions().drain_to(static_cast<size_t>(options.max_inflight_reductions));
}

void shard::ShardedModel::end_pass() {
  if (round->syncs()) {
    // Units that did not get every gradient (unused parameters) reduce what
    // they have, leftovers of no_sync backwards included.
    for (size_t k = round->next_launch(); k < launch_order.size(); ++k) {
      auto& u = units[launch_order[k]];
      if (!u->complete()) u->complete_gradients();
    }
    try_launch();
    for (auto& u : units) {  // second rounds that did not get every gradient
      if (u->late_round()) {
        u->complete_gradients();
        u->finish_round();
      }
    }
    round->clear_local_pending();
  }
  for (auto& u : units) u->reshard();  // e.g. units gathered by a forward whose output got no gradient
  forward_pos = 0;
  forward_prefetch_off = false;
  if (recording_backward) {
    recording_backward = false;
    check_order_across_ranks(backward_order, "backward");  // throws out of backward(), naming the difference
  }
}

void shard::ShardedModel::reduce_local_gradients() {
  if (!round->local_pending()) return;
  for (size_t u : launch_order) {
    units[u]->complete_gradients();
    launch(u);
  }
  round->clear_local_pending();
}

void shard::ShardedModel::drain_reductions() { round->reductions().drain_all(); }

FullyShardedModel::FullyShardedModel(std::unique_ptr<State> state) : state_(std::move(state)) {}

FullyShardedModel::~FullyShardedModel() {
  std::lock_guard<std::recursive_mutex> lock(state_->mu());
  for (auto& u : state_->units) u->remove_hooks();
  // The modules outlive this object: make their Sharded<> wrappers pass-through
  // again (their parameters stay as they are: resharded ones hold no elements).
  for (auto& weak : state_->unit_modules) {
    if (auto module = weak.lock()) {
      if (auto* marker = dynamic_cast<ShardedModule*>(module.get())) shard::ModuleAccess::unit(*marker).reset();
    }
  }
}

FullyShardedMemory FullyShardedModel::memory() const {
  std::lock_guard<std::recursive_mutex> lock(state_->mu());
  FullyShardedMemory m;
  for (const auto& u : state_->units) {
    if (u->is_root) {
      m.root_params += u->gathered.nbytes();
    } else {
      m.shards += u->values.nbytes();
      if (!u->keeps_buffer()) m.gathered += u->gathered.storage().nbytes();
    }
    if (!u->master.is_same(u->values)) m.master += u->master.nbytes();
    if (u->grad_shard.defined()) m.grad_shards += u->grad_shard.nbytes();
  }
  m.peak_gathered = state_->peak_gathered;
  return m;
}

CommStats FullyShardedModel::reduction_stats() const { return state_->reduce_comm->stats(); }

FullyShardedWaits FullyShardedModel::waits() const {
  std::lock_guard<std::recursive_mutex> lock(state_->mu());
  return {state_->exposed_gather_seconds, state_->round->reductions().waited_seconds()};
}

std::vector<FullyShardedModel::UnitInfo> FullyShardedModel::units() const {
  std::lock_guard<std::recursive_mutex> lock(state_->mu());
  std::vector<UnitInfo> out;
  for (const auto& u : state_->units) out.push_back({u->name, u->layout, u->shard, u->is_gathered});
  return out;
}

Communicator& FullyShardedModel::communicator() const { return *state_->comm; }

FullyShardedModel::FullParamsGuard::FullParamsGuard(FullyShardedModel* model) : model_(model) {
  auto& m = *model_->state_;
  std::lock_guard<std::recursive_mutex> lock(m.mu());
  TORCH_CHECK(!m.round->in_pass(), "summon_full_params: not during backward");
  torch::NoGradGuard no_grad;
  for (auto& u : m.units) u->unshard();
}

FullyShardedModel::FullParamsGuard::~FullParamsGuard() {
  if (model_ == nullptr) return;
  auto& m = *model_->state_;
  std::lock_guard<std::recursive_mutex> lock(m.mu());
  torch::NoGradGuard no_grad;
  for (auto& u : m.units) u->reshard();
}

FullyShardedModel::FullParamsGuard::FullParamsGuard(FullParamsGuard&& other) noexcept : model_(other.model_) {
  other.model_ = nullptr;
}

FullyShardedModel::FullParamsGuard FullyShardedModel::summon_full_params() { return FullParamsGuard(this); }

FullyShardedModel::KeepGatheredGuard::KeepGatheredGuard(FullyShardedModel* model) : model_(model) {
  auto& m = *model_->state_;
  std::lock_guard<std::recursive_mutex> lock(m.mu());
  TORCH_CHECK(!m.round->in_pass(), "keep_gathered: not during backward");
  torch::NoGradGuard no_grad;
  for (auto& u : m.units) u->start_unshard();  // every gather in flight at once
  for (auto& u : m.units) u->unshard();
  ++m.keep_gathered_depth;
}

FullyShardedModel::KeepGatheredGuard::~KeepGatheredGuard() {
  if (model_ == nullptr) return;
  auto& m = *model_->state_;
  std::lock_guard<std::recursive_mutex> lock(m.mu());
  if (--m.keep_gathered_depth > 0) return;
  torch::NoGradGuard no_grad;
  for (auto& u : m.units) u->reshard();
}

FullyShardedModel::KeepGatheredGuard::KeepGatheredGuard(KeepGatheredGuard&& other) noexcept : model_(other.model_) {
  other.model_ = nullptr;
}

FullyShardedModel::KeepGatheredGuard FullyShardedModel::keep_gathered() { return KeepGatheredGuard(this); }

}  // namespace zeroshard
