// executor.cpp — one rank's actions of a pipeline schedule, and the executor's public side.
#include "pipeline/executor_impl.h"

namespace zeroshard::pipeline {

void PipelineExecutor::Impl::forward(const Action& a) {
  const Key key{a.stage, a.microbatch};
  Payload input;
  if (a.stage > 0) {
    auto it = inputs.find(key);
    TORCH_INTERNAL_ASSERT(it != inputs.end(), "no posted receive for ", to_string(a));
    trace::Span wait("wait", "input of " + to_string(a));
    input = it->second.wait();
    inputs.erase(it);
    for (auto& [n, t] : input) {
      if (training && at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
    }
  }
  pass_start = std::chrono::steady_clock::now();  // the input is here
  if (!training) {  // evaluation: no graph, nothing kept but what is sent
    at::NoGradGuard no_grad;
    Payload out = fns.forward(a.stage, a.microbatch, input);
    if (a.stage == last_stage()) {
      loss_sum += fns.loss(a.microbatch, out).item<double>();
    } else {
      check_payload(out, fns.input_spec(a.stage + 1, a.microbatch), name(a.stage, a.microbatch) + "'s output");
      to_send[key] = std::move(out);
    }
    return;
  }
  Live l;
  l.output = fns.forward(a.stage, a.microbatch, input);
  l.input = std::move(input);
  if (a.stage == last_stage()) {
    l.loss = fns.loss(a.microbatch, l.output);
    TORCH_CHECK_VALUE(l.loss.defined() && l.loss.numel() == 1, "pipeline: the loss of microbatch ", a.microbatch,
                      " is not a scalar");
    loss_sum += l.loss.item<double>();
  } else {
    check_payload(l.output, fns.input_spec(a.stage + 1, a.microbatch), name(a.stage, a.microbatch) + "'s output");
    Payload out;
    for (const auto& [n, t] : l.output) out.emplace_back(n, t.detach());
    to_send[key] = std::move(out);
  }
  live.emplace(key, std::move(l));
  peak_in_flight = std::max(peak_in_flight, static_cast<int>(live.size()));
  if (options.memory_probe) memory_peak = std::max(memory_peak, options.memory_probe() - memory_base);
}

void PipelineExecutor::Impl::backward(const Action& a) {
  const Key key{a.stage, a.microbatch};
  auto it = live.find(key);
  TORCH_INTERNAL_ASSERT(it != live.end(), "no forward for ", to_string(a));
  Live l = std::move(it->second);
  live.erase(it);
  pass_start = std::chrono::steady_clock::now();
  if (a.stage == last_stage()) {
    auto s = sharded.find(a.stage);
    (s == sharded.end() ? l.loss : s->second.shards.optimizer->scale_loss(l.loss)).backward();
  } else {
    auto g = output_grads.find(key);
    TORCH_INTERNAL_ASSERT(g != output_grads.end(), "no posted receive for ", to_string(a));
    std::optional<trace::Span> wait(std::in_place, "wait", "gradient of " + to_string(a));
    const Payload grads = g->second.wait();
    wait.reset();
    output_grads.erase(g);
    pass_start = std::chrono::steady_clock::now();  // the gradient is here
    std::vector<at::Tensor> outs, gs;
    for (size_t i = 0; i < l.output.size(); ++i) {
      if (l.output[i].second.requires_grad()) {
        outs.push_back(l.output[i].second);
        gs.push_back(grads[i].second);
      }
    }
    if (!outs.empty()) torch::autograd::backward(outs, gs);
  }
  if (a.stage > 0) {
    Payload input_grads;  // what stage a.stage - 1's output gets: zeros where no gradient reached
    for (const auto& [n, t] : l.input) {
      if (!at::isFloatingType(t.scalar_type())) continue;
      input_grads.emplace_back(n, t.grad().defined() ? t.grad() : at::zeros_like(t));
    }
    to_send[key] = std::move(input_grads);
  }
}

void PipelineExecutor::Impl::run(const Action& a) {
  const int rank = pipe.rank();
  switch (a.op) {
    case Op::kRecvF:
      inputs.emplace(std::piecewise_construct, std::forward_as_tuple(a.stage, a.microbatch),
                     std::forward_as_tuple(pipe, schedule.rank_of(a.stage - 1), a, fns.input_spec(a.stage, a.microbatch)));
      break;
    case Op::kRecvB: {
      PayloadSpec spec;  // the gradient of this stage's output: its float tensors
      for (const auto& t : fns.input_spec(a.stage + 1, a.microbatch)) {
        if (at::isFloatingType(t.dtype)) spec.push_back(t);
      }
      output_grads.emplace(std::piecewise_construct, std::forward_as_tuple(a.stage, a.microbatch),
                           std::forward_as_tuple(pipe, schedule.rank_of(a.stage + 1), a, std::move(spec)));
      break;
    }
    case Op::kForward: forward(a); break;
    case Op::kBackward: backward(a); break;
    case Op::kSendF:
    case Op::kSendB: {
      auto it = to_send.find({a.stage, a.microbatch});
      TORCH_INTERNAL_ASSERT(it != to_send.end(), "nothing to send for ", to_string(a), " on rank ", rank);
      const int dst = schedule.rank_of(a.op == Op::kSendF ? a.stage + 1 : a.stage - 1);
      trace::Span post("comm", to_string(a) + " to pipeline rank " + std::to_string(dst));
      for (auto& w : send_payload(pipe, dst, a, it->second)) sends.push_back(std::move(w));
      to_send.erase(it);
      break;
    }
    case Op::kUnshard:
    case Op::kReshard:
    case Op::kReduceGrad:
      if (auto s = sharded.find(a.stage); s != sharded.end()) {
        auto& sh = s->second;
        if (a.op == Op::kReduceGrad) reduce(sh);
        if (a.op == Op::kUnshard && sh.shards.model) sh.gathered.emplace(sh.shards.model->keep_gathered());
        if (a.op == Op::kReshard) sh.gathered.reset();
      }
      if (fns.stage_hook) fns.stage_hook(a.op, a.stage);
      break;
  }
}

void PipelineExecutor::Impl::retire_sends() {
  const auto done = std::partition(sends.begin(), sends.end(), [](const auto& w) { return !w->is_completed(); });
  for (auto it = done; it != sends.end(); ++it) (*it)->wait();
  sends.erase(done, sends.end());
}

void PipelineExecutor::Impl::begin_step() {
  inputs.clear();
  output_grads.clear();
  live.clear();
  to_send.clear();
  sends.clear();
  loss_sum = 0;
  peak_in_flight = 0;
  memory_peak = 0;
  if (options.memory_probe) memory_base = options.memory_probe();
  step_start = passes_end = std::chrono::steady_clock::now();
  compute_seconds = 0;
  tie_terms.clear();
  sync_ties();
  for (auto& [stage, sh] : sharded) {
    sh.gathered.reset();
    sh.local.reset();
    sh.shards.optimizer->zero_grad();
    // Alone in its data-parallel group a stage's reductions cost nothing, so
    // ZeRO-2/3 reduce every backward: each microbatch's gradient is then a
    // small batch of the gradient noise sample.
    if (grid.dp() > 1 || sh.shards.optimizer->zero_stage() == 1) sh.local.emplace(sh.shards.optimizer->no_sync());
    sh.reduced = false;
  }
}

void PipelineExecutor::Impl::run_actions() {
  const auto& list = my_actions();
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    if (a.op == Op::kBackward) {  // the stage's last backward reduces its gradients
      if (auto s = sharded.find(a.stage); s != sharded.end() && s->second.last_backward == i) s->second.local.reset();
    }
    const bool pass = a.op == Op::kForward || a.op == Op::kBackward;
    in_context("action " + std::to_string(i) + " (" + to_string(a) + ")", [&] {
      if (pass) retire_sends();  // a send of an earlier action may fail here
      run(a);
    });
    if (pass) {  // the pass itself, not the wait for its input
      passes_end = std::chrono::steady_clock::now();
      compute_seconds += std::chrono::duration<double>(passes_end - pass_start).count();
      if (trace::enabled()) trace::record(to_string(a), "compute", pass_start);
    }
  }
  in_context("after the last action (reducing gradients, waiting for sends)", [&] {
    for (auto& [stage, sh] : sharded) {
      reduce(sh);
      sh.gathered.reset();
    }
    reduce_ties();
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& w : sends) w->wait();
    if (trace::enabled() && !sends.empty()) trace::record("wait for sends", "wait", t0);
    sends.clear();
  });
  TORCH_INTERNAL_ASSERT(live.empty() && to_send.empty() && inputs.empty() && output_grads.empty(),
                        "pipeline: the step left work behind");
}
PipelineExecutor::PipelineExecutor(const PipelineGrid& grid, Schedule schedule, StageFunctions functions,
                                   ExecutorOptions options) {
  TORCH_CHECK_VALUE(schedule.ranks == grid.pp(), "PipelineExecutor: the schedule has ", schedule.ranks,
                    " ranks but the pipeline has ", grid.pp(), " stages' ranks");
  TORCH_CHECK_VALUE(functions.forward && functions.input_spec && functions.loss,
                    "PipelineExecutor: StageFunctions needs forward, input_spec and loss");
  validate(schedule);
  runtime::check_same_on_all_ranks(*grid.pp_group().control, {to_text(schedule)}, "pipeline schedules");
  TORCH_CHECK_VALUE(options.max_grad_norm >= 0, "PipelineExecutor: max_grad_norm is ", options.max_grad_norm,
                    "; it must be >= 0 (0: no clipping)");
  impl_ = std::make_unique<Impl>(grid, std::move(schedule), std::move(functions), options);
}

PipelineExecutor::~PipelineExecutor() = default;

const Schedule& PipelineExecutor::schedule() const { return impl_->schedule; }

std::shared_ptr<StepAgreement> PipelineExecutor::agreement() const { return impl_->agreement; }

void PipelineExecutor::shard_stage(int stage, StageShards shards) {
  auto& im = *impl_;
  TORCH_CHECK_VALUE(stage >= 0 && stage < im.schedule.stages && im.schedule.rank_of(stage) == im.pipe.rank(),
                    "PipelineExecutor::shard_stage: stage ", stage, " is not one of this rank's (pipeline rank ",
                    im.pipe.rank(), " of ", im.schedule.ranks, " holds the stages s with s % ", im.schedule.ranks,
                    " == ", im.pipe.rank(), ")");
  TORCH_CHECK_VALUE(shards.optimizer != nullptr, "PipelineExecutor::shard_stage: stage ", stage,
                    "'s optimizer is null");
  TORCH_CHECK_VALUE(im.training, "PipelineExecutor::shard_stage: this executor's schedule has no backward (an "
                    "evaluation schedule); shard the stages of the executor that trains");
  TORCH_CHECK_VALUE(shards.optimizer->communicator().size() == im.grid.dp(), "PipelineExecutor::shard_stage: stage ",
                    stage, "'s optimizer shards over ", shards.optimizer->communicator().size(),
                    " ranks but the grid's data-parallel group has ", im.grid.dp(), "; build it on grid.dp_group()");
  TORCH_CHECK_VALUE(!shards.model || shards.optimizer->zero_stage() == 3, "PipelineExecutor::shard_stage: stage ",
                    stage, " has a fully sharded model but a ZeRO-", shards.optimizer->zero_stage(),
                    " optimizer; give the model's FullyShardedAdamW");
  Impl::Sharding sh;
  sh.shards = std::move(shards);
  const auto& list = im.my_actions();
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].op == Op::kBackward && list[i].stage == stage) sh.last_backward = i;
  }
  im.sharded.erase(stage);
  im.sharded.emplace(stage, std::move(sh));
}

void PipelineExecutor::tie(size_t set, int stage, const at::Tensor& param) {
  auto& im = *impl_;
  const auto& sets = im.grid_ties();
  TORCH_CHECK_VALUE(set < sets.size(), "PipelineExecutor::tie: set ", set, " is not one of the grid's ", sets.size(),
                    " tie sets (GridOptions::ties)");
  TORCH_CHECK_VALUE(im.sharded.count(stage), "PipelineExecutor::tie: stage ", stage,
                    " has no StageShards; call shard_stage(", stage, ", ...) first");
  const auto& members = sets[set];
  TORCH_CHECK_VALUE(std::find(members.begin(), members.end(), stage % im.grid.pp()) != members.end() &&
                        im.grid.tie_group(set).data != nullptr,
                    "PipelineExecutor::tie: stage ", stage, " is on pipeline rank ", stage % im.grid.pp(),
                    ", which is not in tie set ", set, " (", c10::Join(", ", members), ")");
  for (const auto& t : im.ties) {
    TORCH_CHECK_VALUE(t.set != set, "PipelineExecutor::tie: this rank already holds a copy of set ", set,
                      " (stage ", t.stage, "); each stage of a set holds one copy");
  }
  Impl::Tie t{set, stage, param, im.grid.tie_group(set)};
  (void)im.owned(t);  // the parameter is the stage's
  im.ties.push_back(std::move(t));
  std::sort(im.ties.begin(), im.ties.end(), [](const Impl::Tie& a, const Impl::Tie& b) { return a.set < b.set; });
  im.ties_synced = false;
}

StepResult PipelineExecutor::run_step() {
  auto& im = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  im.in_context("starting the step", [&] { im.begin_step(); });
  im.run_actions();
  StepResult r;
  im.in_context("finishing the step (the step's agreement and update)", [&] { r = im.finish_step(); });
  r.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace zeroshard::pipeline

