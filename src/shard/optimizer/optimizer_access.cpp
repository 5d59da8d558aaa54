// optimizer_access.cpp — what the library's own callers reach inside a ShardedOptimizer.
#include "shard/optimizer/optimizer_access.h"

#include "shard/optimizer/optimizer_core.h"

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

size_t OptimizerAccess::flags_width(const ShardedOptimizer& opt) { return opt.core_->flags_width(); }

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

void OptimizerAccess::set_replica_groups(ShardedOptimizer& opt, std::shared_ptr<Communicator> across) {
  auto& c = *opt.core_;
  TORCH_CHECK(c.shards.round != nullptr, c.name, ": its model's shards are gone (the model was destroyed first)");
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  TORCH_CHECK_VALUE(!c.shards.topology.hybrid(), c.name, " shards its state in hybrid groups", c.shards.topology.describe(),
                    " but trains in replica groups: the other groups are its replicas; shard over the group's ranks "
                    "(shard_size 0)");
  c.shards.round->check_not_in_pass("the change of replica groups");
  TORCH_CHECK(c.shards.round->reductions().size() == 0, c.name, ": the replica groups changed with ",
              c.shards.round->reductions().size(), " gradient reductions in flight; change them between steps "
              "(after step() or discard_gradients())");
  c.shards.round->reductions().set_replicas(std::move(across), ReductionQueue::Replicas::kGroups);
}

std::shared_ptr<StepAgreement> OptimizerAccess::agreement(ShardedOptimizer& opt) {
  std::lock_guard<std::recursive_mutex> lock(opt.core_->mu());
  return opt.core_->agreement;
}

void OptimizerAccess::attach(ShardedOptimizer& opt, Shards shards) {
  auto& c = *opt.core_;
  c.shards = std::move(shards);
  if (c.shards.update_order.empty()) {
    for (size_t k = 0; k < c.shards.groups.size(); ++k) c.shards.update_order.push_back(k);
  }
  c.steps.assign(c.shards.infos.size(), 0);
  c.scaler = optim::LossScaler(c.shards.loss_scale, c.shards.loss_scaling);
  c.shards.round->set_on_abandon([&c] { c.forget_agreement(); });
  c.join_own();
}

void OptimizerAccess::detach(ShardedOptimizer& opt) {
  if (opt.core_->shards.round == nullptr) return;
  opt.core_->leave();  // its slot reads the shards
  opt.core_->shards.round->set_on_abandon(nullptr);
  opt.core_->shards.round = nullptr;
}

}  // namespace zeroshard::shard
