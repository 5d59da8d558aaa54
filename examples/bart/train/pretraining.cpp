// pretraining.cpp — bart_pretrain's training loop, in the order it happens:
// one optimizer step, then its metrics, saves and preemption
// (pretraining_setup.cpp builds and resumes; pretraining_report.cpp sums up).
// run_pretraining() at the end calls each once.
#include "train/pretraining_run.h"

#include "data/prepare.h"
#include "train/training.h"

#include "zeroshard/sharded_adamw.h"
#include <zeroshard/fully_shard.h>
#include <zeroshard/log.h>
#include <zeroshard/pipeline_schedule.h>
#include <zeroshard/trace.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include <unistd.h>

namespace bart {

namespace fs = std::filesystem;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
std::string trace_path(const std::string& run_dir, int rank, int k) {
  return (fs::path(run_dir) / ("trace-rank-" + std::to_string(rank) + (k > 0 ? ".restart-" + std::to_string(k) : "") +
                               ".json")).string();
}

namespace {

// This rank's next `n` sample indices, continuing into the next epoch when
// one ends; epochs[i] is the epoch of out[i] (it seeds the noise).
std::vector<int64_t> next_indices(zeroshard::DistributedSampler& sampler, int64_t n, std::vector<int64_t>& epochs) {
  std::vector<int64_t> out;
  epochs.clear();
  while (static_cast<int64_t>(out.size()) < n) {
    const auto got = sampler.next(n - static_cast<int64_t>(out.size()));
    out.insert(out.end(), got.begin(), got.end());
    epochs.insert(epochs.end(), got.size(), sampler.epoch());
  }
  return out;
}

double all_sum(zeroshard::Communicator& comm, double v) {
  auto t = torch::tensor({v}, torch::kDouble);
  comm.all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
  return t.item<double>();
}

}  // namespace

int64_t PretrainingRun::eval_limit() const {
  const auto& o = o_;
  if (o.eval_full || (o.eval_iters == 0 && o.eval_every <= 0)) return 0;  // only at the start and the end: all
  const int64_t pass = o.eval_batch * dp_;  // examples of one forward pass over the ranks
  if (o.eval_iters > 0) return o.eval_iters * pass;
  // 15% of the examples trained between two evaluations, shared by the datasets: a forward pass costs
  // about a third of a training step, so this is about 5% of the training time.
  const int64_t sets = static_cast<int64_t>(data_->sources().size());
  const int64_t budget = (15 * o.eval_every * o.global_batch + 100 * sets - 1) / (100 * sets);
  return std::max<int64_t>(1, (budget + pass - 1) / pass) * pass;
}

double PretrainingRun::evaluate(int64_t at, bool end) {
  const auto t0 = Clock::now();
  const int64_t limit = eval_limit();
  // Each dataset's validation set apart; the loss of all of them weighted as the blend weighs them in
  // training (Megatron's blended validation set draws its examples by the same weights), so that the
  // headline follows the mix trained on, not whichever set holds out more tokens. One dataset: its loss.
  struct Pass {
    double loss = 0;
    int64_t tokens = 0, examples = 0, whole = 0;  // examples evaluated, of `whole` in the sets
    json by_source = json::object();
  };
  const auto run = [&](int64_t keep) {
    Pass p;
    double summed = 0, weights = 0;
    for (const auto& src : data_->sources()) {
      const auto& held = src.examples->validation();
      const auto v = pipe_ ? validate(*pipe_, held, noise_, o_.eval_batch, pad_, device_, keep)
                           : validate(model_, held, noise_, o_.eval_batch, pad_, *comm_, device_, keep);
      summed += v.loss * src.weight;
      weights += src.weight;
      p.tokens += v.tokens;
      p.examples += v.examples;
      p.whole += held.size();
      p.by_source[src.name] = v.loss;
    }
    p.loss = summed / weights;
    return p;
  };
  const Pass pass = run(limit);
  const double loss = pass.loss;
  const int64_t tokens = pass.tokens;
  const json& by_source = pass.by_source;
  if (!std::isfinite(record_.first_val_loss)) record_.first_val_loss = loss;
  json event{{"val_loss", loss}, {"val_tokens", tokens}, {"val_examples", pass.examples},
             {"val_whole_set", pass.examples == pass.whole}};
  if (end && pass.examples < pass.whole) {  // the end: the whole set as well
    const Pass whole = run(0);
    whole_val_ = whole.loss;
    whole_val_tokens_ = whole.tokens;
    event["val_loss_whole_set"] = whole.loss;
    event["val_tokens_whole_set"] = whole.tokens;
  }
  const double seconds = since(t0);
  record_.eval_seconds += seconds;
  event["eval_s"] = seconds;
  if (data_->blended()) {
    event["val_loss_by_dataset"] = by_source;
    last_val_by_source_ = by_source;
  }
  metrics_.write_event("validation", at, event.dump());
  char msg[240];
  std::snprintf(msg, sizeof(msg), "step %lld: validation loss %.4f (%lld tokens, %lld of %lld examples, %.1f s)%s",
                static_cast<long long>(at), loss, static_cast<long long>(tokens),
                static_cast<long long>(pass.examples), static_cast<long long>(pass.whole), seconds,
                event.contains("val_loss_whole_set")
                    ? ("; the whole set: " + std::to_string(event["val_loss_whole_set"].get<double>())).c_str()
                    : "");
  zeroshard::log_info(msg + (data_->blended() ? "; by dataset " + by_source.dump() : std::string()));
  return loss;
}

double PretrainingRun::save(int64_t at, const char* why) {
  const auto t0 = Clock::now();
  zeroshard::TrainingProgress p;
  p.step = at;
  p.epoch = sampler_->epoch();
  json extra = record_.to_json(*sampler_);
  extra["data"] = json::parse(data_->description());
  // The step's record goes with its checkpoint: a crash after the commit and before the line is written
  // leaves it here, and the resumed run writes it (resume()).
  if (!step_line_.empty()) {
    const json line = json::parse(step_line_);
    if (line.value("step", int64_t{-1}) == at) extra["step_metrics"] = line;
  }
  extra["bytes_sent"] = record_.bytes_sent + static_cast<int64_t>(all_sum(*comm_, static_cast<double>(bytes_sent())));
  p.extra_json = extra.dump();
  ckpt_->save(parts_, p);
  const double stall = since(t0);
  record_.checkpoint_stall_s += stall;
  metrics_.write_event("checkpoint", at, json{{"reason", why}, {"stall_s", stall}, {"async", o_.async_save}}.dump());
  return stall;
}

// A step's micro-batches from its plan (on a loader thread, or the training thread).
StepBatches PretrainingRun::build_batches(const StepPlan& plan) const {
  StepBatches out;
  out.plan = plan;
  const int64_t per_micro = local_batch_ / o_.micro_batches;
  for (int64_t m = 0; m < o_.micro_batches; ++m) {
    const auto from = static_cast<std::ptrdiff_t>(m * per_micro), to = from + per_micro;
    std::vector<int64_t> idx(plan.indices.begin() + from, plan.indices.begin() + to);
    std::vector<int64_t> ep(plan.epochs.begin() + from, plan.epochs.begin() + to);  // a batch may straddle two epochs
    Batch b = make_batch(*data_, idx, ep, noise_, o_.seed, pad_);
    if (device_.is_cuda()) {  // page-locked, so the step's copy is asynchronous
      b.input_ids = b.input_ids.pin_memory();
      b.labels = b.labels.pin_memory();
    }
    out.micro.push_back(std::move(b));
  }
  return out;
}

StepBatches PretrainingRun::next_batches(double& waited) {
  StepPlan plan;
  plan.indices = next_indices(*sampler_, local_batch_, plan.epochs);  // where training stands, for checkpoints
  const auto t0 = Clock::now();
  StepBatches b;
  if (loader_) {
    const double before = loader_->waited_seconds();
    b = loader_->next();
    waited = loader_->waited_seconds() - before;
    TORCH_CHECK(b.plan.indices == plan.indices && b.plan.epochs == plan.epochs, "BART data: the loader's batch is "
                "not the sampler's (a bug: the loader's sampler must run as the run's)");
  } else {
    b = build_batches(plan);
    waited = since(t0);
  }
  for (auto& m : b.micro) {
    m.input_ids = m.input_ids.to(device_, /*non_blocking=*/true);
    m.labels = m.labels.to(device_, /*non_blocking=*/true);
  }
  return b;
}

// One optimizer step: the global batch's share of this rank, forward and
// backward (its micro-batches, or the pipeline's schedule), the update.
StepResult PretrainingRun::step_once(int64_t step) {
  const auto& o = o_;
  StepResult r;
  StepBatches batches = next_batches(r.data_wait);
  std::vector<Batch> micro = std::move(batches.micro);
  int64_t local_tokens = 0;
  for (const auto& b : micro) local_tokens += b.target_tokens;
  // The global batch's target tokens, from the other ranks' examples' records: no collective; a blend's
  // examples by dataset, from every rank's positions.
  int64_t tokens = local_tokens;
  r.by_dataset.assign(data_->sources().size(), 0);
  auto count = [&](const std::vector<int64_t>& positions, const std::vector<int64_t>& epochs, bool others) {
    for (size_t k = 0; k < positions.size(); ++k) {
      const auto d = data_->draw(epochs[k], positions[k], o.seed);
      ++r.by_dataset[static_cast<size_t>(d.source)];
      if (others) tokens += data_->target_tokens(d);
    }
  };
  if (data_->blended()) count(batches.plan.indices, batches.plan.epochs, false);  // only a blend reports them
  for (auto& peer : peers_) {
    std::vector<int64_t> epochs;
    const auto positions = next_indices(peer, local_batch_, epochs);
    count(positions, epochs, true);
  }
  r.global_tokens = static_cast<double>(tokens);
  // Once per run: the ranks' own counts, summed (every stage of a dp index counts the same). With replica
  // groups the other groups' ranks are not on this communicator: not checked.
  if (!tokens_checked_ && !groups_) {
    const double summed = all_sum(*comm_, static_cast<double>(local_tokens)) / o.pp;
    TORCH_CHECK(summed == r.global_tokens, "BART data: this rank counts ", r.global_tokens, " target tokens in the "
                "global batch from the samplers, the ranks' batches hold ", summed, " (a bug: the ranks' samplers "
                "are not in step)");
    tokens_checked_ = true;
  }
  for (size_t i = 0; i < opts_.size(); ++i) r.lr = schedules_[i].apply(*opts_[i], step + 1);
  // Dropout keyed by (seed, step, microbatch of the global batch, block): the same masks at any pp.
  const auto key = [&](int64_t m) { return DropoutKey{o.seed, step, m * dp_ + dp_rank_}; };
  if (pipe_) {
    std::vector<Microbatch> mbs;
    for (size_t m = 0; m < micro.size(); ++m) {
      mbs.push_back(pipeline_microbatch(micro[m], config_, key(static_cast<int64_t>(m))));
    }
    const double waited0 = waited();
    // The executor's agreement runs inside its schedule: only the data wait is known before it.
    rank_times_->set(0, r.data_wait, 0);
    const auto s = pipe_->train_step(std::move(mbs), r.global_tokens);
    // The executor's step: its F and B passes, and the rest (waits for the
    // neighbours, the step's reductions and update) as this rank's bubble.
    r.fb_s = s.compute_seconds;
    r.bubble_s = s.step_seconds - s.compute_seconds;
    r.opt_wait = waited() - waited0;
    r.grad_norm = s.grad_norm;
    r.noise = s.noise;
    r.skipped = !s.updated;
    r.loss = s.loss;
    return r;
  }
  auto& opt = *opts_.front();
  opt.zero_grad();  // stage 1 keeps gradients in p.grad(); stages 2 and 3 have already moved them into shards
  const auto t_fb = Clock::now();
  const double waited_fb0 = waited();
  // Summed on the device (in double, as the host would): reading it after each microbatch would stop the host
  // until the device drains; it is read once, for the step's agreement.
  loss_sum_ = torch::Tensor();
  for (size_t m = 0; m < micro.size(); ++m) {
    // Gradients are averaged over the data-parallel ranks (with replica groups: over each group's, then
    // over the groups): scale so the result is the mean over the global batch's tokens.
    model_->dropout_key = key(static_cast<int64_t>(m));
    auto l = summed_loss(model_, micro[m]);
    const auto ld = l.detach().to(torch::kDouble);
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + ld : ld;
    (l * (static_cast<double>(dp_) / r.global_tokens)).backward();
  }
  r.fb_s = since(t_fb);
  r.fb_wait = waited() - waited_fb0;
  rank_times_->set(r.fb_s - r.fb_wait, r.data_wait, r.fb_wait);  // the agreement carries them
  const auto t_opt = Clock::now();
  const double waited_opt0 = waited();
  // Runs the step's agreement: the optimizer's norms and flags, the loss and the preemption vote in one all-reduce.
  r.grad_norm = opt.clip_grad_norm(o.max_grad_norm > 0 ? o.max_grad_norm : 1e30);
  opt.step();
  r.opt_s = since(t_opt);
  r.opt_wait = waited() - waited_opt0;
  r.skipped = opt.last_step_skipped();
  r.noise = opt.last_gradient_noise();
  r.loss = agreed_loss_ / r.global_tokens;
  if (groups_) {
    // The agreement summed this group's loss; the other groups' is added here. The noise sample's
    // small batches are this group's ranks' while its big one is every group's: not a sample.
    std::vector<double> loss{agreed_loss_};
    r.loss = groups_->sum_across(loss) ? loss[0] / r.global_tokens : NAN;  // NaN: a group lost after the update
    r.noise = {};
  }
  return r;
}

bool PretrainingRun::record_step(const StepResult& r, Clock::time_point t_step, double waited0) {
  const auto& o = o_;
  if (!std::isfinite(record_.first_loss)) record_.first_loss = r.loss;
  record_.tokens += static_cast<int64_t>(r.global_tokens);
  // Before a save, so that a resumed run goes on from the averages this step made.
  const auto eff = statistical_efficiency(record_, r.noise, r.global_tokens,
                                          o.reference_batch * r.global_tokens / o.global_batch);
  const bool end = step_ == o.max_steps;
  zeroshard::StepMetrics m;
  m.step = step_;
  m.loss = r.loss;
  m.lr = r.lr;
  m.grad_norm = r.grad_norm;
  m.tokens = static_cast<int64_t>(r.global_tokens);
  m.seconds = since(t_step);
  m.compute_seconds = r.fb_s - r.fb_wait;
  m.exposed_comm_seconds = waited() - waited0;
  m.optimizer_seconds = std::max(0.0, r.opt_s - r.opt_wait);
  const auto other = [&] {
    return std::max(0.0, m.seconds - m.compute_seconds - m.exposed_comm_seconds - m.optimizer_seconds -
                             m.checkpoint_stall_seconds);
  };
  m.other_seconds = other();
  m.peak_rss_bytes = zeroshard::peak_rss_bytes();
  const int64_t bytes_now = bytes_sent();
  m.bytes_sent = bytes_now - bytes_before_;
  bytes_before_ = bytes_now;
  m.loss_scale = opts_.front()->loss_scale();
  m.skipped = r.skipped;
  json extra = json::object();
  // The step's blocking world collectives: its agreement, once (the first step also checks the token count, and
  // with a pipeline lays out the stages' slots); more would be a collective the step should not have.
  extra["world_all_reduces"] = r.world_all_reduces;
  if (pipe_) {  // this rank's (rank 0 writes the metrics: stage 0's), beside the schedule's formula
    extra["bubble_s"] = r.bubble_s;
    extra["bubble_formula"] = zeroshard::pipeline::formula_bubble(pipe_->schedule());
  }
  if (std::isfinite(eff.efficiency)) {
    record_.efficient_tokens += eff.efficiency * r.global_tokens;
    record_.efficient_seconds += m.seconds;
    extra["noise_scale"] = eff.noise_scale;
    extra["efficiency"] = eff.efficiency;
    extra["goodput"] = eff.efficiency * m.tokens_per_second();
  }
  record_.train_seconds += m.seconds;
  record_.data_wait_s += r.data_wait;
  extra["data_wait_s"] = r.data_wait;
  // Every rank's figures (min, median, max, the slowest rank), from the step's agreement.
  const auto spread = rank_times_->spread(step_);
  extra["ranks"] = json::parse(spread.json);
  if (data_->blended()) extra["examples_by_dataset"] = r.by_dataset;
  if (groups_) {  // the groups that trained this step, and the samples they trained: the whole global batch
    extra["replica_groups"] = groups_->turn().count;
    extra["samples"] = o.global_batch;
  }
  if (durable_) note_durable(extra);
  if (ckpt_ && (step_ % o.save_every == 0 || end)) {
    // The save carries this step's line as it stands (without the save's own time), and the run's
    // record with this step in it.
    m.extra_json = extra.dump();
    step_line_ = zeroshard::MetricsLog::step_line(m);
    m.checkpoint_stall_seconds = save(step_, end ? "end" : "interval");
    if (o.crash_after_save == step_ && rank_ == 0) {  // the instant a crash test asks for
      ckpt_->wait();
      std::raise(SIGKILL);
    }
    const double before = m.seconds;
    m.seconds = since(t_step);
    m.other_seconds = other();
    record_.train_seconds += m.seconds - before;
    if (std::isfinite(eff.efficiency)) {
      record_.efficient_seconds += m.seconds - before;
      extra["goodput"] = eff.efficiency * m.tokens_per_second();
    }
  }
  if ((o.eval_every > 0 && step_ % o.eval_every == 0) || end) {
    last_val_ = evaluate(step_, end);
    extra["val_loss"] = last_val_;
  }
  m.extra_json = extra.dump();  // never empty: it carries the step's data wait
  step_line_ = zeroshard::MetricsLog::step_line(m);  // what a preemption's save of this step carries
  metrics_.write(m);
  for (const auto& e : spread.named) metrics_.write_event("straggler", step_, e.json());
  for (const auto& e : spread.recovered) metrics_.write_event("straggler_end", step_, e.json());
  progress_->update(m, eff.progress());
  zeroshard::publish_step(dist_, step_);
  return end;
}

void PretrainingRun::start_loader() {
  loader_.reset();  // its threads end before the new one draws
  // The loader draws from a copy of the sampler as it stands: the same batches, ahead of the step.
  auto sampler = std::make_shared<zeroshard::DistributedSampler>(*sampler_);
  zeroshard::PrefetchOptions po;
  po.threads = o_.loader_threads;
  po.ahead = o_.prefetch;
  const int64_t batch = local_batch_;
  loader_ = std::make_unique<zeroshard::Prefetcher<StepPlan, StepBatches>>(
      [this, sampler, batch] {
        StepPlan p;
        p.indices = next_indices(*sampler, batch, p.epochs);
        return p;
      },
      [this](const StepPlan& p) { return build_batches(p); }, po);
}

std::optional<int> PretrainingRun::train() {
  bytes_before_ = bytes_sent();
  if (o_.loader_threads > 0) start_loader();
  while (step_ < o_.max_steps) {
    if (groups_) {
      follow_groups();  // a heal may have moved the step to the end
      if (step_ >= o_.max_steps) break;
    }
    const auto t_step = Clock::now();
    const double waited0 = waited();
    const int64_t reduces0 = world_all_reduces();
    rank_times_->step_began();
    const std::string sampler_at = groups_ ? sampler_->state_json() : std::string();
    StepResult r;
    try {
      r = step_once(step_);
    } catch (const zeroshard::ReplicaGroupLost& e) {
      // Nothing of the step was applied on this group: the same step again, from the same data.
      groups_->step_lost(e);
      place_samplers(sampler_at);
      if (loader_) start_loader();
      ++record_.steps_retaken;
      continue;
    }
    r.world_all_reduces = world_all_reduces() - reduces0;
    ++step_;
    loss_ = r.loss;
    const bool end = record_step(r, t_step, waited0);
    note_resume(true);
    if (end || !guard_->should_stop()) continue;
    json interruption{{"cause", guard_->cause()}, {"notice_unix_s", guard_->notice_time()}};
    metrics_.write_event("interruption", step_, interruption.dump());
    interruption["step"] = step_;
    record_.interruptions.push_back(interruption);
    if (!ckpt_) {
      zeroshard::log_warn("preempted at step " + std::to_string(step_) + " with --ckpt-dir none: nothing saved");
      return guard_->exit_code();
    }
    double s = save(step_, "preemption");
    ckpt_->wait();
    if (durable_) s += wait_durable();
    guard_->check_save_fits(s);
    if (o_.trace) zeroshard::trace::write_chrome_trace(trace_file(), rank_);
    zeroshard::log_info("preempted after step " + std::to_string(step_) + ": checkpoint committed; exiting with " +
                        std::to_string(guard_->exit_code()) + " so the launcher restarts the run");
    return guard_->exit_code();
  }
  note_resume(false);  // a resume with no step left to take
  loader_.reset();
  return std::nullopt;
}

// The durable tier's progress: the newest durable step in every step's line, and an
// event when a step became durable (with its upload's lag) or its upload was abandoned.
void PretrainingRun::note_durable(json& extra) {
  const auto st = ckpt_->durable_status();
  extra["durable_step"] = st.durable_step;
  if (st.durable_step > durable_seen_) {
    durable_seen_ = st.durable_step;
    record_.durable_step = st.durable_step;
    record_.durable_lag_s = st.lag_seconds;
    if (rank_ == 0) {
      metrics_.write_event("durable", st.durable_step,
                           json{{"lag_s", st.lag_seconds}, {"bytes", st.durable_bytes}, {"seen_at_step", step_}}.dump());
    }
  }
  if (st.abandoned > abandoned_seen_) {
    record_.durable_abandoned += st.abandoned - abandoned_seen_;
    abandoned_seen_ = st.abandoned;
    if (rank_ == 0) metrics_.write_event("durable_abandoned", step_, json{{"error", st.last_error}}.dump());
  }
}

// After a preemption's save: that step made durable (after the upload in flight, when its
// own was skipped for it), within what is left of the grace period.
double PretrainingRun::wait_durable() {
  const auto t0 = Clock::now();
  // What is left of the grace period, less 3 s: an upload still in flight is cancelled as the
  // Checkpointer goes (up to 1.5 s, its last words to the store included), then the process ends.
  const double left = guard_->options().grace_period_s - (zeroshard::unix_time() - guard_->notice_time()) - 3.0;
  const bool done = ckpt_->make_durable(std::chrono::milliseconds(static_cast<int64_t>(std::max(0.0, left) * 1000)));
  const auto st = ckpt_->durable_status();
  if (done) {
    zeroshard::log_info("preemption: step " + std::to_string(step_) + " is durable (" + o_.ckpt_dir + ")");
  } else {
    zeroshard::log_warn("preemption: step " + std::to_string(step_) + " is not durable: " +
                        (st.uploading_step >= 0
                             ? "step " + std::to_string(st.uploading_step) + "'s upload is still in flight as the " +
                                   "grace period ends (is the store slow or stalled?)"
                             : !st.last_error.empty()
                                 ? st.last_error
                                 : std::string("its upload was skipped (another rank was still uploading an earlier "
                                               "step)")) +
                        "; the durable tier holds step " + std::to_string(st.durable_step));
  }
  return since(t0);
}

// The resume event, written once the first step after it ended: with the time
// from the notice that stopped the run to that moment, when a notice did.
void PretrainingRun::note_resume(bool stepped) {
  if (resumed_.is_null() || resume_noted_) return;
  resume_noted_ = true;
  json* interruption = record_.interruption_at(resumed_["step"].get<int64_t>());
  if (stepped && interruption != nullptr && interruption->contains("notice_unix_s")) {
    const double gap = zeroshard::unix_time() - (*interruption)["notice_unix_s"].get<double>();
    (*interruption)["to_first_step_s"] = gap;  // the summary's, and later checkpoints'
    resumed_["to_first_step_s"] = gap;
  }
  if (rank_ == 0) metrics_.write_event("resume", resumed_["step"].get<int64_t>(), resumed_.dump());
}

int run_pretraining(const RunOptions& o) {
  check_options(o);
  // First, so every thread started from here on (LibTorch's pool, the
  // communicators') inherits it: x86's FTZ/DAZ are per thread.
  if (!o.keep_denormals) at::globalContext().setFlushDenormal(true);
  zeroshard::set_adamw_simd(o.simd);
  PretrainingRun run(o);
  run.resume();
  if (const auto preempted = run.train()) return *preempted;
  run.finish();
  run.summarize();
  return 0;
}

}  // namespace bart
