// pretraining.cpp — bart_pretrain's training run, in the order it happens:
// build (communicator, data, model, optimizers), resume (the last checkpoint,
// or a fresh start), and the loop (one optimizer step, then its metrics, saves
// and preemption); the summary is pretraining_report.cpp's. run_pretraining()
// at the end calls each once.
#include "pretraining_run.h"

#include "prepare.h"
#include "training.h"

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
double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }
std::string trace_path(const std::string& run_dir, int rank, int k) {
  return (fs::path(run_dir) / ("trace-rank-" + std::to_string(rank) + (k > 0 ? ".restart-" + std::to_string(k) : "") +
                               ".json")).string();
}

namespace {

// --gather-dtype: fp32 (the parameters' own), bf16 or int8 (FullyShardOptions::gather_dtype).
c10::ScalarType gather_dtype(const std::string& name) {
  return name == "bf16" ? torch::kBFloat16 : name == "int8" ? torch::kChar : c10::ScalarType::Undefined;
}

// --device: the CPU, or cuda:(LOCAL_RANK mod the GPUs visible), made current.
torch::Device training_device(const std::string& name, int local_rank) {
  if (name == "cpu") return torch::kCPU;
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  TORCH_CHECK_VALUE(gpus > 0, "--device cuda: no CUDA device is visible (CUDA_VISIBLE_DEVICES, the driver, or a "
                    "bart_pretrain built against a CPU LibTorch); use --device cpu");
  const torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus));
  c10::impl::VirtualGuardImpl(device.type()).setDevice(device);
  return device;
}

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

PretrainingRun::PretrainingRun(const RunOptions& o) : o_(o) {
  dist_ = zeroshard::read_dist_env();  // the launcher's variables, read once
  zeroshard::CommOptions comm_options;
  comm_options.liveness = std::chrono::milliseconds(static_cast<int64_t>(o.liveness * 1000));
  comm_ = zeroshard::init_communicator(dist_, comm_options);
  rank_ = comm_->rank();
  world_ = comm_->size();
  TORCH_CHECK_VALUE(o.pp >= 1 && world_ % o.pp == 0, "--pp ", o.pp, " must divide the ", world_, " ranks (each "
                    "pipeline stage gets world / pp of them)");
  dp_ = world_ / o.pp;  // without a pipeline, dp = world
  dp_rank_ = rank_ % dp_;
  shard_size_ = o.shard_size == "host" ? zeroshard::kShardPerHost : std::stoi(o.shard_size);
  TORCH_CHECK_VALUE(shard_size_ <= 0 || dp_ % shard_size_ == 0, "--shard-size ", o.shard_size, " must divide the ", dp_,
                    " data-parallel ranks (shard groups of that many ranks, replicated across the groups)");
  TORCH_CHECK_VALUE(o.global_batch % dp_ == 0, "--global-batch ", o.global_batch, " must divide by the ", dp_,
                    " data-parallel ranks (", world_, " ranks / --pp ", o.pp, "; each takes an equal share)");
  local_batch_ = o.global_batch / dp_;
  TORCH_CHECK_VALUE(o.micro_batches >= 1 && local_batch_ % o.micro_batches == 0, "--micro-batches ",
                    o.micro_batches, " must divide the per-rank batch ", local_batch_, " (--global-batch ",
                    o.global_batch, " / ", dp_, " data-parallel ranks)");
  TORCH_CHECK_VALUE(o.pp == 1 || o.save_logits.empty(), "--save-logits runs the whole model: use it with --pp 1");
  fs::create_directories(o.run_dir);
  if (o.trace) zeroshard::trace::enable();
  zeroshard::trace::set_thread_name("training");

  // Data: the prepared dataset's store, mapped; its examples packed once (a file beside it).
  std::string vocab, merges;
  tokenizer_ = obtain_tokenizer(o, *comm_, vocab, merges);
  dataset_ = obtain_dataset(o, vocab, merges, dist_.local_rank, *comm_);
  auto store = std::make_shared<const zeroshard::TokenStore>(store_prefix(dataset_));
  PackingOptions packing;
  packing.max_tokens = o.max_tokens;
  packing.validation_docs = o.validation_docs;
  const std::string packed = "packed-" + std::to_string(o.max_tokens) + "-" +
                             std::to_string(held_out_documents(store->documents(), o.validation_docs)) + ".bin";
  // Beside a prepared dataset when its directory can take it (every run on it reuses the file), else in the run's.
  const bool beside = fs::exists(fs::path(dataset_) / "manifest.json") && ::access(dataset_.c_str(), W_OK) == 0;
  examples_ = std::make_unique<PackedExamples>(std::move(store), packing,
                                               ((beside ? fs::path(dataset_) : fs::path(o.run_dir)) / packed).string());
  TORCH_CHECK_VALUE(examples_->train().size() >= o.global_batch, "the dataset '", dataset_, "' has ",
                    examples_->train().size(), " training examples, fewer than --global-batch ", o.global_batch);
  noise_ = o.noise;
  noise_.mask_id = tokenizer_.mask_id();
  noise_.bos_id = tokenizer_.id("<s>");
  noise_.eos_id = tokenizer_.id("</s>");
  pad_ = tokenizer_.pad_id();
  build_model();
}

// The model on its device and its optimizers: the whole model under one, or
// this rank's pipeline stages, each with its own.
void PretrainingRun::build_model() {
  const auto& o = o_;
  config_ = run_config(o, tokenizer_);
  // The sharding's collectives follow the device, on the CPU a communicator of their own (a dup): the world one
  // carries only control values (agreement, validation sums, checkpoints), which world_all_reduces counts.
  device_ = training_device(o.device, dist_.local_rank);
  const auto transport = o.device_comm == "nccl"     ? zeroshard::DeviceTransport::kNccl
                         : o.device_comm == "staged" ? zeroshard::DeviceTransport::kStaged
                                                     : zeroshard::DeviceTransport::kAuto;
  const zeroshard::ProcessGroup group = device_.is_cpu() ? zeroshard::ProcessGroup(comm_->dup(), comm_)
                                                         : zeroshard::device_group(comm_, device_, {}, transport);
  const auto dtype = o.precision == "bf16" ? torch::kBFloat16 : torch::kFloat;
  auto adamw = torch::optim::AdamWOptions(o.lr).betas({0.9, o.beta2}).eps(1e-6).weight_decay(o.weight_decay);
  if (o.pp > 1) {
    PipelineOptions po;
    po.pp = o.pp;
    po.schedule = o.schedule_pp;
    po.chunks = o.chunks;
    po.micro_batches = static_cast<int>(o.micro_batches);
    po.partition = o.partition;
    po.timing_rows = local_batch_ / o.micro_batches;  // a microbatch's sequences, at the longest
    po.timing_length = o.max_tokens;
    po.zero_stage = o.stage;
    po.shard_size = shard_size_;
    po.gather_dtype = gather_dtype(o.gather_dtype);
    po.unshard_per_step = o.pp_gather == "step";
    po.adamw = adamw;
    po.max_grad_norm = o.max_grad_norm;
    po.dtype = dtype;
    po.device = device_;
    po.seed = o.seed;
    pipe_ = std::make_unique<PipelinedBart>(group, config_, po);
    for (const auto& b : bart_blocks(config_)) numel_ += b.params;
    numel_ -= config_.vocab_size * config_.d_model;  // the head's copy of the embedding is the embedding
    for (const auto& st : pipe_->stages()) opts_.push_back(st.optimizer);
    parts_ = pipe_->checkpoint_parts();
  } else {
    zeroshard::FullyShardOptions fo;
    fo.shard_size = shard_size_;
    fo.gather_dtype = gather_dtype(o.gather_dtype);
    torch::manual_seed(o.seed);
    const bool deferred_init = o.stage == 3;
    {
      // ZeRO-3: each layer keeps only this rank's shard as soon as it is built.
      std::optional<zeroshard::DeferredInit> deferred;
      if (deferred_init) deferred.emplace(group, fo);
      model_ = BartForConditionalGeneration(config_);
    }
    if (deferred_init) {  // the units hold placeholders: count from the configuration
      for (const auto& b : bart_blocks(config_)) numel_ += b.params;
      numel_ -= config_.vocab_size * config_.d_model;  // the head's copy of the embedding is the embedding
    } else {
      for (const auto& p : model_->parameters()) numel_ += p.numel();
    }
    model_->to(device_, dtype);
    model_->checkpoint_layers = o.activation_checkpointing;
    if (o.stage == 3) {
      opts_.push_back(std::make_shared<zeroshard::FullyShardedAdamW>(zeroshard::fully_shard(model_, group, fo), adamw));
    } else {
      zeroshard::ShardedAdamWOptions so;
      so.zero_stage = o.stage;
      so.shard_size = shard_size_;
      opts_.push_back(std::make_shared<zeroshard::ShardedAdamW>(model_->named_parameters(), group, adamw, so));
    }
    parts_ = {{opts_.front().get(), model_.get()}};
  }
  zeroshard::LrSchedule::Options lo;
  lo.kind = zeroshard::LrSchedule::parse_kind(o.schedule);
  lo.warmup_steps = o.warmup_steps;
  lo.total_steps = o.max_steps;
  lo.min_ratio = o.min_lr_ratio;
  schedules_.assign(opts_.size(), zeroshard::LrSchedule(lo));
  for (size_t i = 0; i < opts_.size(); ++i) schedules_[i].attach(*opts_[i]);
}

int64_t PretrainingRun::bytes_sent() const {
  int64_t b = pipe_ ? pipe_->bytes_sent() : 0;
  for (const auto& x : opts_) b += x->stats().traffic.total().bytes_sent;
  return b;
}

int64_t PretrainingRun::world_all_reduces() const {
  const auto st = comm_->stats();
  return st.by_kind.count(zeroshard::OpKind::kAllReduce) ? st.by_kind.at(zeroshard::OpKind::kAllReduce).calls : 0;
}

int64_t PretrainingRun::peak_model_states() const {
  int64_t b = 0;
  for (const auto& x : opts_) b += x->stats().memory.peak_model_states;
  return b;
}

double PretrainingRun::waited() const {
  double w = 0;
  for (const auto& x : opts_) w += x->stats().waits.total();
  return w;
}

// Where training stands: fresh (then the first validation), or resumed from
// the last checkpoint. Every stage of a data-parallel index draws the same examples.
void PretrainingRun::resume() {
  const auto& o = o_;
  sampler_ = std::make_unique<zeroshard::DistributedSampler>(examples_->train().size(), dp_rank_, dp_, o.seed);
  record_.noise = zeroshard::GradientNoiseScale(o.noise_smoothing);
  const std::string ckpt_dir = o.ckpt_dir.empty() ? (fs::path(o.run_dir) / "checkpoints").string() : o.ckpt_dir;
  if (ckpt_dir != "none") {
    zeroshard::CheckpointOptions co;
    co.keep = o.keep;
    co.async = o.async_save;
    std::string local = ckpt_dir;
    if (ckpt_dir.rfind("s3://", 0) == 0) {  // the durable tier, with the local first tier under the run directory
      co.durable_uri = ckpt_dir;
      local = o.ckpt_local_dir.empty() ? (fs::path(o.run_dir) / "checkpoints").string() : o.ckpt_local_dir;
    }
    ckpt_ = std::make_unique<zeroshard::Checkpointer>(local, comm_, pipe_ ? pipe_->checkpoint_options(co) : co);
    durable_ = !co.durable_uri.empty();
    const auto t0 = Clock::now();
    if (auto progress = ckpt_->load(parts_)) {
      step_ = progress->step;
      const json extra = json::parse(progress->extra_json);
      if (extra.contains("sampler")) {
        const auto saved = extra["sampler"].value("dataset_size", int64_t{-1});
        TORCH_CHECK_VALUE(saved == examples_->train().size(), "cannot resume from step ", step_, " of ", ckpt_dir,
                          ": it was saved training on ", saved, " examples and this run has ",
                          examples_->train().size(), "; resume with the dataset (--dataset or --data), "
                          "--max-tokens, --validation-docs and tokenizer it was saved with");
        record_.from_json(extra, *sampler_);
        if (extra.contains("step_metrics")) carried_line_ = extra["step_metrics"].dump();
      } else {  // imported weights (zeroshard-ckpt import): a new run from them
        zeroshard::log_info("checkpoint: step " + std::to_string(step_) + " has no run record (imported); training "
                            "starts at its step with a fresh data order");
      }
      // What stopped the run before: the interruption this checkpoint was saved for, else a failure the
      // launcher restarted from, else nothing (a new launch, e.g. with a larger --max-steps).
      const json* interruption = record_.interruption_at(step_);
      resumed_ = {{"step", step_}, {"load_s", since(t0)}, {"restart", dist_.restart_count},
                  {"ranks", world_}, {"after", interruption ? interruption->value("cause", interruption->value("signal", std::string("a notice")))
                            : dist_.restart_count > 0 ? "a failure"
                                                      : "a new launch"}};
      zeroshard::log_info("resumed from step " + std::to_string(step_) + " of " + ckpt_dir + " (epoch " +
                          std::to_string(sampler_->epoch()) + ")");
    }
  }
  peers_.clear();
  for (int r = 0; r < dp_; ++r) {
    if (r == dp_rank_) continue;
    zeroshard::DistributedSampler peer(examples_->train().size(), r, dp_, o.seed);
    peer.load_state_json(sampler_->state_json());
    peers_.push_back(std::move(peer));
  }
  guard_ = std::make_unique<zeroshard::PreemptionGuard>(comm_);
  // The step's one blocking collective: the optimizer's agreement (or the
  // pipeline executor's, which carries the loss), the loss and the preemption vote.
  agreement_ = pipe_ ? pipe_->agreement() : std::make_shared<zeroshard::StepAgreement>(comm_);
  if (!pipe_) {
    opts_.front()->join(agreement_);
    agreement_->add(
        "summed token loss", 1, [this](double* v) { v[0] = loss_sum_.defined() ? loss_sum_.item<double>() : 0.0; },
        [this](const double* sum) { agreed_loss_ = sum[0]; });
  }
  guard_->join(agreement_);
  if (rank_ == 0) {
    metrics_ = zeroshard::MetricsLog((fs::path(o.run_dir) / "metrics.jsonl").string(), step_);
    // The run stopped after this checkpoint committed and before its step's line was written.
    if (!carried_line_.empty() && metrics_.restore(carried_line_)) {
      zeroshard::log_info("metrics: step " + std::to_string(step_) + "'s line restored from its checkpoint");
    }
  }
  progress_ = std::make_unique<zeroshard::ProgressLine>(o.max_steps, o.progress_interval);
  if (rank_ == 0 && step_ == 0) log_start();
  if (step_ == 0) last_val_ = evaluate(0);
}

double PretrainingRun::evaluate(int64_t at) {
  const auto t0 = Clock::now();
  const auto v = pipe_ ? validate(*pipe_, examples_->validation(), noise_, o_.eval_batch, pad_, device_)
                       : validate(model_, examples_->validation(), noise_, o_.eval_batch, pad_, *comm_, device_);
  if (!std::isfinite(record_.first_val_loss)) record_.first_val_loss = v.loss;
  metrics_.write_event("validation", at, json{{"val_loss", v.loss}, {"val_tokens", v.tokens}, {"eval_s", since(t0)}}.dump());
  char msg[160];
  std::snprintf(msg, sizeof(msg), "step %lld: validation loss %.4f (%lld tokens, %.1f s)", static_cast<long long>(at),
                v.loss, static_cast<long long>(v.tokens), since(t0));
  zeroshard::log_info(msg);
  return v.loss;
}

double PretrainingRun::save(int64_t at, const char* why) {
  const auto t0 = Clock::now();
  zeroshard::TrainingProgress p;
  p.step = at;
  p.epoch = sampler_->epoch();
  json extra = record_.to_json(*sampler_);
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
    Batch b = make_batch(examples_->train(), idx, ep, noise_, o_.seed, pad_);
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
  std::vector<Batch> micro = next_batches(r.data_wait).micro;
  int64_t local_tokens = 0;
  for (const auto& b : micro) local_tokens += b.target_tokens;
  // The global batch's target tokens, from the other ranks' examples' records: no collective.
  int64_t tokens = local_tokens;
  for (auto& peer : peers_) {
    std::vector<int64_t> epochs;
    for (int64_t i : next_indices(peer, local_batch_, epochs)) tokens += examples_->train().target_tokens(i);
  }
  r.global_tokens = static_cast<double>(tokens);
  if (!tokens_checked_) {  // once per run: the ranks' own counts, summed (every stage of a dp index counts the same)
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
    // Gradients are averaged over ranks: scale so the result is the mean over the global batch's tokens.
    model_->dropout_key = key(static_cast<int64_t>(m));
    auto l = summed_loss(model_, micro[m]);
    const auto ld = l.detach().to(torch::kDouble);
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + ld : ld;
    (l * (static_cast<double>(world_) / r.global_tokens)).backward();
  }
  r.fb_s = since(t_fb);
  r.fb_wait = waited() - waited_fb0;
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
    last_val_ = evaluate(step_);
    extra["val_loss"] = last_val_;
  }
  m.extra_json = extra.dump();  // never empty: it carries the step's data wait
  step_line_ = zeroshard::MetricsLog::step_line(m);  // what a preemption's save of this step carries
  metrics_.write(m);
  progress_->update(m, eff.progress());
  zeroshard::publish_step(dist_, step_);
  return end;
}

std::optional<int> PretrainingRun::train() {
  bytes_before_ = bytes_sent();
  if (o_.loader_threads > 0) {
    // The loader draws from a copy of the sampler as it stands: the same batches, ahead of the step.
    auto sampler = std::make_shared<zeroshard::DistributedSampler>(*sampler_);
    zeroshard::PrefetchOptions po;
    po.threads = o_.loader_threads;
    po.ahead = o_.prefetch;
    loader_ = std::make_unique<zeroshard::Prefetcher<StepPlan, StepBatches>>(
        [this, sampler] {
          StepPlan p;
          p.indices = next_indices(*sampler, local_batch_, p.epochs);
          return p;
        },
        [this](const StepPlan& p) { return build_batches(p); }, po);
  }
  while (step_ < o_.max_steps) {
    const auto t_step = Clock::now();
    const double waited0 = waited();
    const int64_t reduces0 = world_all_reduces();
    StepResult r = step_once(step_);
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
  const double left = guard_->options().grace_period_s - (unix_now() - guard_->notice_time()) - 1.0;
  const bool done = ckpt_->make_durable(std::chrono::milliseconds(static_cast<int64_t>(std::max(0.0, left) * 1000)));
  const auto st = ckpt_->durable_status();
  if (done) {
    zeroshard::log_info("preemption: step " + std::to_string(step_) + " is durable (" + o_.ckpt_dir + ")");
  } else {
    zeroshard::log_warn("preemption: step " + std::to_string(step_) + " is " +
                        (st.uploading_step >= 0 ? std::string("still uploading as the grace period ends")
                                                : "not durable (" + st.last_error + ")") +
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
    const double gap = unix_now() - (*interruption)["notice_unix_s"].get<double>();
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
