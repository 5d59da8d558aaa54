// optimizer_core.h — ShardedOptimizer's state behind the public class: its
// shard groups, the step counts, the loss scaler, and its part of the step's
// agreement (the gradient norms and which parameters had a gradient).
#pragma once

#include "zeroshard/sharded_optimizer.h"

#include "optim/grad_norm.h"
#include "optim/loss_scaler.h"
#include "shard/backward/backward_round.h"
#include "shard/core/shard_group.h"
#include "shard/optimizer/front_end.h"
#include "shard/optimizer/gradient_norms.h"
#include "zeroshard/step_agreement.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

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
  size_t flags_width() const { return shards.infos.size() * (fe().counts_arrivals() ? 4 : 1); }
  void join(std::shared_ptr<StepAgreement> a, std::shared_ptr<shard::GradientNorms> shared, std::string flags_name) {
    leave();
    agreement = std::move(a);
    norms = shared != nullptr ? std::move(shared)
                              : std::make_shared<shard::GradientNorms>(agreement, name + " (gradient norms, rounds)",
                                                                       shards.process_group.control->size());
    member = norms->join([this](shard::GradientNorms::Part& p) { return fill_norms(p); },
                         [this](const shard::GradientNorms::Result& r) { read_norms(r); },
                         [this] { reduce_late(); });
    if (flags_name.empty()) flags_name = name + " (parameters with a gradient)";
    // Per parameter: whether it had a gradient; with counted arrivals also their sum, the ranks
    // that had any, and the sum of their squares (equal counts on those ranks iff sum² = ranks × squares).
    slot = agreement->add(std::move(flags_name), flags_width(), [this](double* v) { fill_flags(v); },
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
    if (fe().holds_late()) ++p.late;
    const std::string& lost = shards.round->reductions().replicas_lost();
    if (!lost.empty()) {
      ++p.replicas_lost;
      if (p.lost_why.empty()) p.lost_why = name + ": " + lost;
    }
    return true;
  }
  void reduce_late() {
    std::lock_guard<std::recursive_mutex> lock(mu());
    fe().reduce_late();
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
    const size_t n = had.size();
    for (size_t p = 0; p < n; ++p) v[p] = had[p] ? 1.0 : 0.0;
    if (!fe().counts_arrivals()) return;
    const auto arrivals = fe().step_arrivals();
    for (size_t p = 0; p < n; ++p) {
      v[n + p] = arrivals[p];
      v[2 * n + p] = arrivals[p] > 0 ? 1.0 : 0.0;
      v[3 * n + p] = static_cast<double>(arrivals[p]) * arrivals[p];
    }
  }
  void read_flags(const double* v) {
    std::lock_guard<std::recursive_mutex> lock(mu());
    if (sits_out()) return;
    const size_t n = shards.infos.size();
    flags.assign(v, v + n);
    agreed = true;
    if (!fe().counts_arrivals()) return;
    std::vector<int> counts(n, -1);
    for (size_t p = 0; p < n; ++p) {
      const double sum = v[n + p], ranks = v[2 * n + p], squares = v[3 * n + p];
      if (ranks == 0) continue;
      TORCH_CHECK(sum * sum == ranks * squares, name, ": the gradient of '", shards.infos[p].name,
                  "' arrived a different number of times in one backward on different ranks (", sum / ranks,
                  " on average over ", ranks, " ranks): activation checkpointing reuses it differently across "
                  "ranks, and ZeRO-", zero_stage, " reduces each arrival beyond the agreed count in a round of "
                  "its own, so the ranks' reductions no longer pair; fix: run every rank through the same "
                  "checkpointed segments, or use ZeRO-1 (which reduces once, at step())");
      counts[p] = static_cast<int>(sum / ranks);
    }
    fe().agreed_arrivals(counts);
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
    shards.round->reductions().forget_replicas_lost();
    forget_agreement();
    shards.round->end_step();
  }
};

}  // namespace zeroshard
