// executor.cpp — one rank's actions of a pipeline schedule.
#include "zeroshard/pipeline_executor.h"
#include "zeroshard/log.h"

#include "comm/work.h"
#include "optim/grad_norm.h"
#include "pipeline/payload.h"
#include "shard/gradient_norms.h"
#include "shard/optimizer_access.h"
#include "runtime/rank_agreement.h"
#include "zeroshard/trace.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>

namespace zeroshard::pipeline {

struct PipelineExecutor::Impl {
  const PipelineGrid& grid;
  Schedule schedule;
  StageFunctions fns;
  ExecutorOptions options;
  Communicator& pipe;  // the pipeline group's data plane: rank i is stage i mod pp
  const bool training;  // the schedule has backwards (else: forwards without gradients, nothing kept)

  struct Sharding {  // a stage given StageShards
    StageShards shards;
    size_t last_backward = 0;  // index of the stage's last B in this rank's list
    // Per step: gradients accumulate locally until the last backward; ZeRO-3
    // units held gathered from UNSHARD to RESHARD; REDUCE_GRAD done.
    std::optional<ShardedOptimizer::NoSyncGuard> local;
    std::optional<FullyShardedModel::KeepGatheredGuard> gathered;
    bool reduced = false;
  };
  std::map<int, Sharding> sharded;
  // The step's agreement over the world: the header's slot (the loss), what
  // others joined, then, laid out at the first step, the stages' gradient
  // norms (one slot every stage's optimizer fills on every rank) and each
  // stage's flags (its optimizer's slot on its ranks, zeros elsewhere).
  std::shared_ptr<StepAgreement> agreement;
  std::vector<int64_t> slots;  // this executor's: the header, the other ranks' stages' flags
  static constexpr size_t kHeader = 2;
  std::vector<double> header;  // of the last agree(): [loss sum, ranks whose loss was not finite]
  std::shared_ptr<shard::GradientNorms> norms;  // with StageShards, from the first step
  // What the pipeline adds to the norms: each tied gradient counted once (reduce_ties()).
  std::vector<shard::GradientNorms::Part::Term> tie_terms;
  bool laid_out = false;

  struct Tie {  // this rank's copy of a parameter tied across stages
    size_t set;
    int stage;
    at::Tensor param;
    ProcessGroup group;  // the set's tie group: rank i is its i-th stage
  };
  std::vector<Tie> ties;  // in set order
  bool ties_synced = false;

  using Key = std::pair<int, int>;  // (stage, microbatch)
  std::map<Key, PayloadRecv> inputs, output_grads;  // posted receives
  struct Live {                                      // a forward awaiting its backward
    Payload input;                                   // its float tensors collect the input's gradient
    Payload output;
    at::Tensor loss;                                 // the last stage's
  };
  std::map<Key, Live> live;
  std::map<Key, Payload> to_send;                    // results whose SEND comes next
  std::vector<std::shared_ptr<Work>> sends;
  double loss_sum = 0;
  int peak_in_flight = 0;
  int64_t memory_base = 0, memory_peak = 0;  // ExecutorOptions::memory_probe's, this step
  std::chrono::steady_clock::time_point step_start, passes_end;
  double compute_seconds = 0;                           // in F and B, from their data's arrival
  std::chrono::steady_clock::time_point pass_start;     // of the current F or B, its data arrived

  Impl(const PipelineGrid& g, Schedule s, StageFunctions f, ExecutorOptions o)
      : grid(g), schedule(std::move(s)), fns(std::move(f)), options(o), pipe(*g.pp_group().data),
        training(!forward_only(schedule)), agreement(std::make_shared<StepAgreement>(g.world().control)) {
    add_header();
  }
  ~Impl() {
    for (int64_t id : slots) agreement->remove(id);
    // The stages' optimizers outlive the executor: back to agreements of their own.
    if (norms == nullptr) return;
    for (auto& [stage, sh] : sharded) shard::OptimizerAccess::join(*sh.shards.optimizer, nullptr, {});
  }

  const std::vector<Action>& my_actions() const { return schedule.actions[static_cast<size_t>(pipe.rank())]; }

  int last_stage() const { return schedule.stages - 1; }
  std::string name(int stage, int mb) const {
    return "stage " + std::to_string(stage) + " (microbatch " + std::to_string(mb) + ")";
  }

  void forward(const Action& a) {
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

  void backward(const Action& a) {
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

  void run(const Action& a) {
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

  // Sends that finished: their errors surface now and their buffers go,
  // rather than at the end of the step.
  void retire_sends() {
    const auto done = std::partition(sends.begin(), sends.end(), [](const auto& w) { return !w->is_completed(); });
    for (auto it = done; it != sends.end(); ++it) (*it)->wait();
    sends.erase(done, sends.end());
  }

  // The stage's gradients reduced over its data-parallel group: those of the
  // backwards since the last one that did not communicate, ZeRO-1's all.
  void reduce(Sharding& sh) {
    if (sh.reduced) return;
    sh.local.reset();
    shard::OptimizerAccess::reduce_gradients(*sh.shards.optimizer);
    sh.reduced = true;
  }

  // The elements of a tied parameter this rank owns in its stage's shards.
  shard::OptimizerAccess::Owned owned(const Tie& t) {
    auto o = shard::OptimizerAccess::owned(*sharded.at(t.stage).shards.optimizer, t.param);
    TORCH_CHECK_VALUE(o.has_value(), "PipelineExecutor::tie: the parameter tied across set ", t.set,
                      " is not trained by stage ", t.stage, "'s optimizer; tie one of the parameters given to "
                      "shard_stage(", t.stage, ")");
    return *o;
  }
  std::string tie_name(const Tie& t) const {
    return "the parameter tied across stages " + c10::Join(", ", grid_ties()[t.set]) + " (set " +
           std::to_string(t.set) + ")";
  }
  const std::vector<std::vector<int>>& grid_ties() const { return grid.options().ties; }

  // First step: every copy takes the set's first stage's values (a broadcast
  // of each owned piece's master over the tie group, then each changed stage
  // brings its parameters to the masters over its data-parallel group).
  void sync_ties() {
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

  // After every stage's reduction: each copy's owned gradient becomes the sum
  // over the copies; the norm counts it on the set's first stage only (each
  // stage's optimizer counts its copy, now the sum: a term takes it out again
  // on the other stages).
  void reduce_ties() {
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

  void begin_step() {
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

  // Runs f; an error it raises names this pipeline rank and `where` in the step.
  template <typename F>
  void in_context(const std::string& where, F&& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "pipeline rank ", pipe.rank(), ", ", where, ": ", e.what_without_backtrace());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "pipeline rank ", pipe.rank(), ", ", where, ": ", error_message(e));
    }
  }

  void run_actions() {
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

  // First step: every stage's parameter count, to lay out the stages' slots
  // of the step's agreement (one exchange over the world, once); checks that
  // every stage on every rank has StageShards, or none does. Then the stages'
  // optimizers join the world agreement: one gradient norms slot that all
  // fill (with what the pipeline adds: tied gradients counted once, a
  // non-finite loss as an overflow), and each stage's flags side by side.
  void lay_out() {
    if (laid_out) return;
    std::vector<double> v(1 + static_cast<size_t>(schedule.stages), 0.0);
    v[0] = static_cast<double>(sharded.size());
    for (auto& [stage, sh] : sharded) {
      v[1 + static_cast<size_t>(stage)] = static_cast<double>(shard::OptimizerAccess::num_params(*sh.shards.optimizer));
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

  // The step's header in the agreement: [loss, non-finite loss].
  void add_header() {
    slots.push_back(agreement->add(
        "pipeline step (loss, non-finite)", kHeader,
        [this](double* v) {
          v[0] = std::isfinite(loss_sum) ? loss_sum : 0.0;
          v[1] = std::isfinite(loss_sum) ? 0.0 : 1.0;
        },
        [this](const double* v) { header.assign(v, v + kHeader); }));
  }

  // The step's one world all-reduce (StepAgreement): the header, the stages'
  // norms and flags, and whatever else joined it (a PreemptionGuard's vote).
  // Every stage's optimizer read its part there, so its step() issues no
  // collective of its own; then every stage updates, or none does.
  StepResult finish_step() {
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
};

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
