// executor_step.cpp — what a pipeline step adds around the schedule's actions:
// each stage's reduction, tied parameters kept equal, the step's one world
// agreement and every stage's update (or none).
#include "pipeline/executor_impl.h"

namespace zeroshard::pipeline {

void PipelineExecutor::Impl::reduce(Sharding& sh) {
  if (sh.reduced) return;
  sh.local.reset();
  shard::OptimizerAccess::reduce_gradients(*sh.shards.optimizer);
  sh.reduced = true;
}

shard::OptimizerAccess::Owned PipelineExecutor::Impl::owned(const Tie& t) {
  auto o = shard::OptimizerAccess::owned(*sharded.at(t.stage).shards.optimizer, t.param);
  TORCH_CHECK_VALUE(o.has_value(), "PipelineExecutor::tie: the parameter tied across set ", t.set,
                    " is not trained by stage ", t.stage, "'s optimizer; tie one of the parameters given to "
                    "shard_stage(", t.stage, ")");
  return *o;
}

void PipelineExecutor::Impl::sync_ties() {
  if (ties_synced) return;
  ties_synced = true;
  std::set<int> changed;
  for (const auto& t : ties) {
    const auto o = owned(t);
    runtime::check_same_on_all_ranks(*t.group.control,
                                   {"elements [" + std::to_string(o.of_param.begin) + ", " +
                                    std::to_string(o.of_param.end) + ") of " + std::to_string(t.param.numel()) +
                                    " on data-parallel rank " + std::to_string(grid.dp_rank())},
                                   "the shard each stage's data-parallel rank owns of " + tie_name(t) +
                                       " (give it a param group (ZeRO-1/2) or unit (ZeRO-3) of its own on every stage)");
    if (!o.piece.empty()) {
      auto master = o.slice(o.group->master);
      auto piece = master.contiguous();
      comm::block_current(*t.group.data->broadcast(piece, 0), t.param.device());
      if (!piece.is_same(master)) master.copy_(piece);
    }
    changed.insert(t.stage);
  }
  for (int stage : changed) shard::OptimizerAccess::install_masters(*sharded.at(stage).shards.optimizer);
}

void PipelineExecutor::Impl::reduce_ties() {
  tie_terms.clear();
  for (const auto& t : ties) {
    auto& opt = *sharded.at(t.stage).shards.optimizer;
    const auto o = owned(t);
    if (o.piece.empty()) continue;
    TORCH_CHECK(o.group->grad_shard.defined(), "pipeline: stage ", t.stage, "'s copy of ", tie_name(t),
                " got no gradient this step; every stage of a tie set must use its copy");
    at::Tensor g = o.slice(o.group->grad_shard);
    // The optimizer counts a replicated piece 1/replicas on each rank, scaled.
    const double divisor = opt.loss_scale() * opt.loss_scale() * o.replicas;
    at::Tensor sum = g.contiguous();
    comm::block_current(*t.group.data->all_reduce(sum, ReduceOp::kSum), sum.device());
    if (!sum.is_same(g)) g.copy_(sum);
    if (t.group.data->rank() != 0) tie_terms.push_back({optim::pending_sum_of_squares({sum}), -divisor});
  }
}

void PipelineExecutor::Impl::lay_out() {
  if (laid_out) return;
  std::vector<double> v(1 + static_cast<size_t>(schedule.stages), 0.0);
  v[0] = static_cast<double>(sharded.size());
  for (auto& [stage, sh] : sharded) {
    v[1 + static_cast<size_t>(stage)] = static_cast<double>(shard::OptimizerAccess::flags_width(*sh.shards.optimizer));
  }
  auto t = at::tensor(v, at::kDouble);
  grid.world().control->all_reduce(t, ReduceOp::kSum)->wait();
  const double* c = t.data_ptr<double>();
  const int every = schedule.stages * grid.dp();
  TORCH_CHECK_VALUE(c[0] == 0 || static_cast<int>(c[0]) == every, "PipelineExecutor: ", static_cast<int>(c[0]),
                    " of the ", every, " (stage, data-parallel rank) pairs have StageShards; give every stage on "
                    "every rank its StageShards (shard_stage), or none");
  laid_out = true;
  if (c[0] == 0) return;
  norms = std::make_shared<shard::GradientNorms>(agreement, "pipeline (gradient norms, rounds: every stage)",
                                                 grid.dp());
  norms->join(
      [this](shard::GradientNorms::Part& p) {
        p.sumsq.insert(p.sumsq.end(), tie_terms.begin(), tie_terms.end());
        if (!std::isfinite(loss_sum)) p.sumsq.push_back({{std::numeric_limits<double>::infinity(), {}}, 1});
        return true;
      },
      nullptr);
  for (int s = 0; s < schedule.stages; ++s) {
    const std::string name = "pipeline stage " + std::to_string(s) + " (parameters with a gradient)";
    if (auto it = sharded.find(s); it != sharded.end()) {
      shard::OptimizerAccess::join(*it->second.shards.optimizer, norms, name);
    } else {  // another rank's stage: zeros here
      slots.push_back(agreement->add(name, static_cast<size_t>(std::lround(c[1 + s] / grid.dp())),
                                     [](double*) {}, nullptr));
    }
  }
}

void PipelineExecutor::Impl::add_header() {
  slots.push_back(agreement->add(
      "pipeline step (loss, non-finite)", kHeader,
      [this](double* v) {
        v[0] = std::isfinite(loss_sum) ? loss_sum : 0.0;
        v[1] = std::isfinite(loss_sum) ? 0.0 : 1.0;
      },
      [this](const double* v) { header.assign(v, v + kHeader); }));
}

StepResult PipelineExecutor::Impl::finish_step() {
  lay_out();
  agreement->agree();
  StepResult r;
  r.peak_in_flight = peak_in_flight;
  r.peak_memory_bytes = memory_peak;
  r.passes_seconds = std::chrono::duration<double>(passes_end - step_start).count();
  r.compute_seconds = compute_seconds;
  r.finite = header[1] == 0;  // with StageShards, a non-finite loss made the norms inf too
  if (norms != nullptr) {
    const auto& n = norms->last();
    r.finite = std::isfinite(n.sumsq);
    r.grad_norm = r.finite ? std::sqrt(n.sumsq) : std::numeric_limits<double>::infinity();
    r.noise = n.noise;
    if (!r.finite) r.noise.big_sumsq = std::numeric_limits<double>::quiet_NaN();
  }
  r.loss = r.finite ? header[0] / grid.dp() : std::numeric_limits<double>::quiet_NaN();
  if (sharded.empty()) return r;
  r.updated = true;
  for (auto& [stage, sh] : sharded) {
    auto& opt = *sh.shards.optimizer;
    if (!r.finite && !opt.loss_scaling()) {  // no loss scaling to skip the step: drop the gradients
      opt.discard_gradients();
      r.updated = false;
      continue;
    }
    if (options.max_grad_norm > 0) opt.clip_grad_norm(options.max_grad_norm);  // the agreed norm: no collective
    opt.step();  // an inf norm skips it (and shrinks the loss scale)
    r.updated = r.updated && !opt.last_step_skipped();
  }
  return r;
}

}  // namespace zeroshard::pipeline
