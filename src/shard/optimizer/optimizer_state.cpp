// optimizer_state.cpp — a sharded optimizer's state for checkpoints: what
// ShardedState holds of it, restoring it, and the refusal of torch::save/load.
#include "shard/optimizer/optimizer_core.h"

namespace zeroshard {

ShardedState ShardedOptimizer::sharded_state() {
  auto& c = *core_;
  std::lock_guard<std::recursive_mutex> lock(c.mu());
  core_->fe().drain_reductions();  // the gradient shards complete (waits only: every rank issued these)
  TORCH_CHECK(!c.fe().holds_late(), c.name, ": cannot save its state now: this step's backward reused a parameter "
              "more often than the ranks agreed, and those gradients are reduced at the step's agreement; save "
              "after step() (or before the backward)");
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
