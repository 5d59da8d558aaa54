// pretraining_setup.cpp — bart_pretrain's run before its first step: the
// communicator, the data, the model and its optimizers (build_model), and the
// resume from the last checkpoint or a fresh start (pretraining.cpp: the loop).
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
  if (!o.replica_group.empty()) {  // before the data is prepared: an unreachable coordinator fails at once
    zeroshard::ReplicaGroupsOptions ro;
    ro.coordinator = o.coordinator;
    ro.job = o.replica_job;
    zeroshard::ReplicaGroups::check_coordinator(ro);
  }
  fs::create_directories(o.run_dir);
  if (o.trace) zeroshard::trace::enable();
  zeroshard::trace::set_thread_name("training");

  // Data: each prepared dataset's store, mapped; its examples packed once (a file beside it).
  std::string vocab, merges;
  // "": the run prepares --data into RUN_DIR/dataset.
  const auto named = o.dataset.empty() ? std::vector<std::pair<std::string, double>>{{"", 1.0}} : parse_datasets(o.dataset);
  RunOptions first = o;
  first.dataset = named.front().first;
  tokenizer_ = obtain_tokenizer(first, *comm_, vocab, merges);
  std::vector<DataSource> sources;
  for (const auto& [path, weight] : named) {
    RunOptions one = o;
    one.dataset = path;
    DataSource source;
    source.name = obtain_dataset(one, vocab, merges, dist_.local_rank, *comm_);
    source.weight = weight;
    source.examples = pack_examples(source.name, sources.size());
    sources.push_back(std::move(source));
  }
  dataset_ = sources.front().name;
  data_ = std::make_unique<TrainingData>(std::move(sources));
  examples_ = data_->sources().front().examples.get();
  TORCH_CHECK_VALUE(data_->size() >= o.global_batch, data_->blended() ? "the blend of --dataset" : "the dataset '" +
                    dataset_ + "'", " has ", data_->size(), " training examples, fewer than --global-batch ",
                    o.global_batch);
  noise_ = o.noise;
  noise_.mask_id = tokenizer_.mask_id();
  noise_.bos_id = tokenizer_.id("<s>");
  noise_.eos_id = tokenizer_.id("</s>");
  pad_ = tokenizer_.pad_id();
  build_model();
}

// A dataset's examples packed for this run's --max-tokens and validation set:
// the file beside a prepared dataset when its directory can take it (every run
// on it reuses the file), else in the run's.
std::unique_ptr<PackedExamples> PretrainingRun::pack_examples(const std::string& dataset, size_t index) const {
  auto store = std::make_shared<const zeroshard::TokenStore>(store_prefix(dataset));
  PackingOptions packing;
  packing.max_tokens = o_.max_tokens;
  packing.validation.documents = o_.validation_docs;
  packing.validation.tokens = o_.validation_tokens;
  const std::string packed = "packed-" + std::to_string(o_.max_tokens) + "-" +
                             held_out_key(packing.validation, store->tokens()) + ".bin";
  const bool beside = fs::exists(fs::path(dataset) / "manifest.json") && ::access(dataset.c_str(), W_OK) == 0;
  const auto dir = beside ? fs::path(dataset) : fs::path(o_.run_dir);
  const std::string file = beside || index == 0 ? packed : "source-" + std::to_string(index) + "-" + packed;
  return std::make_unique<PackedExamples>(std::move(store), packing, (dir / file).string());
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

void PretrainingRun::place_samplers(const std::string& state) {
  const auto& o = o_;
  sampler_ = std::make_unique<zeroshard::DistributedSampler>(data_->size(), dp_rank_, dp_, o.seed, data_->shuffle());
  sampler_->load_state_json(state);
  peers_.clear();
  for (int r = 0; r < dp_; ++r) {
    if (r == dp_rank_) continue;
    zeroshard::DistributedSampler peer(data_->size(), r, dp_, o.seed, data_->shuffle());
    peer.load_state_json(state);
    peers_.push_back(std::move(peer));
  }
}

void PretrainingRun::follow_groups() {
  const int64_t before = step_;
  const zeroshard::ReplicaTurn turn = groups_->before_step(step_);
  if (turn.generation == generation_ && step_ == before) return;
  generation_ = turn.generation;
  const int dp = turn.count * world_;
  TORCH_CHECK_VALUE(o_.global_batch % (static_cast<int64_t>(dp) * o_.micro_batches) == 0, "--global-batch ",
                    o_.global_batch, " cannot be split over the ", turn.count, " live replica groups of ", world_,
                    " ranks and --micro-batches ", o_.micro_batches, " (", dp, " ranks); give every group a global "
                    "batch that divides by each number of groups the job may train with (e.g. a multiple of 12 "
                    "ranks x micro-batches for 1 to 4 groups)");
  const bool loading = loader_ != nullptr;
  loader_.reset();  // its threads build batches of the old split
  dp_ = dp;
  dp_rank_ = turn.index * world_ + rank_;
  local_batch_ = o_.global_batch / dp_;
  place_samplers(sampler_->state_json());  // the same position in the data, split over the live groups' ranks
  if (loading) start_loader();
  const zeroshard::ReplicaChange& c = groups_->changes().back();
  const json change{{"step", step_},          {"groups", c.groups},          {"generation", c.generation},
                    {"pause_s", c.pause_seconds}, {"heal_bytes", c.heal_bytes}, {"heal_s", c.heal_seconds},
                    {"step_retaken", c.step_retaken}};
  record_.replica_changes.push_back(change);
  if (rank_ == 0 && metrics_.enabled()) metrics_.write_event("replica_groups", step_, change.dump());
}

// Where training stands: fresh (then the first validation), or resumed from
// the last checkpoint. Every stage of a data-parallel index draws the same examples.
void PretrainingRun::resume() {
  const auto& o = o_;
  sampler_ = std::make_unique<zeroshard::DistributedSampler>(data_->size(), dp_rank_, dp_, o.seed, data_->shuffle());
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
        TORCH_CHECK_VALUE(saved == data_->size(), "cannot resume from step ", step_, " of ", ckpt_dir,
                          ": it was saved training on ", saved, " examples and this run has ",
                          data_->size(), "; resume with the dataset (--dataset or --data), "
                          "--max-tokens, --validation-docs or --validation-tokens and tokenizer it was saved with");
        // The mix: its datasets' sizes and weights in order, the weights normalised as the sampler takes them
        // (A:7,B:3 is A:0.7,B:0.3); a dataset may have moved: its path is not compared.
        const auto same_mix = [](const json& a, const json& b) {
          const auto total = [](const json& d) {
            double t = 0;
            for (const auto& s : d) t += s.at("weight").get<double>();
            return t;
          };
          if (a.size() != b.size()) return false;
          const double ta = total(a), tb = total(b);
          for (size_t i = 0; i < a.size(); ++i) {
            const double wa = a[i].at("weight").get<double>() / ta, wb = b[i].at("weight").get<double>() / tb;
            if (a[i].at("examples") != b[i].at("examples") || std::abs(wa - wb) > 1e-12) return false;
          }
          return true;
        };
        TORCH_CHECK_VALUE(!extra.contains("data") || same_mix(extra["data"], json::parse(data_->description())),
                          "cannot resume from step ", step_, " of ", ckpt_dir, ": it was saved training on ",
                          extra.value("data", json()).dump(), " and this run trains on ", data_->description(),
                          "; resume with the --dataset it was saved with (the same datasets and weights)");
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
  place_samplers(sampler_->state_json());
  zeroshard::PreemptionOptions po;
  po.grace_period_s = o.grace_period;
  guard_ = std::make_unique<zeroshard::PreemptionGuard>(comm_, po);
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
  rank_times_ = std::make_unique<zeroshard::RankTimes>(
      agreement_, zeroshard::RankTimesOptions{o.straggler_threshold, o.straggler_window, {}});
  // The exposed communication carried: the backward's waits (set() each step) and the optimizer's
  // before the agreement (ZeRO-2's reductions drained for the norms).
  rank_times_->count_waits([this] { return waited(); });
  if (!o.replica_group.empty()) {
    zeroshard::ReplicaGroupsOptions ro;
    ro.coordinator = o.coordinator;
    ro.job = o.replica_job;
    ro.group = o.replica_group;
    ro.liveness = std::chrono::seconds(std::max<int64_t>(1, std::llround(o.liveness)));
    ro.listen_host = o.replica_listen;
    ro.wait_when_alone = o.replica_alone == "wait";
    // What the groups must share to train one model: what shapes each step's update.
    ro.config = json{{"config", o.config}, {"global_batch", o.global_batch}, {"micro_batches", o.micro_batches},
                     {"stage", o.stage}, {"precision", o.precision}, {"lr", o.lr}, {"schedule", o.schedule},
                     {"warmup_steps", o.warmup_steps}, {"max_steps", o.max_steps}, {"weight_decay", o.weight_decay},
                     {"max_grad_norm", o.max_grad_norm}, {"seed", o.seed}, {"data", data_->description()}}.dump();
    groups_ = std::make_unique<zeroshard::ReplicaGroups>(zeroshard::ProcessGroup::of(comm_), *opts_.front(), agreement_,
                                                         ro);
    // A group behind takes the run's record (the data order's position among it) with the state.
    groups_->on_heal([this] { return record_.to_json(*sampler_).dump(); },
                     [this](const std::string& text) { record_.from_json(json::parse(text), *sampler_); });
  }
  // The first meeting: a group that joins a job under way takes its state here. Before the metrics
  // file opens: it keeps this group's lines up to the step the group goes on from (a group started
  // again from its checkpoint and healed past it took the steps between before it was lost).
  if (groups_) follow_groups();
  if (rank_ == 0) {
    zeroshard::MetricsOptions mo;
    if (o.tensorboard_dir != "none") {
      mo.tensorboard_dir = o.tensorboard_dir.empty() ? (fs::path(o.run_dir) / "tensorboard").string() : o.tensorboard_dir;
    }
    metrics_ = zeroshard::MetricsLog((fs::path(o.run_dir) / "metrics.jsonl").string(), step_, mo);
    if (!o.config_text.empty()) metrics_.write_text("config", step_, "```\n" + o.config_text + "```\n");
    // The run stopped after this checkpoint committed and before its step's line was written.
    if (!carried_line_.empty() && metrics_.restore(carried_line_)) {
      zeroshard::log_info("metrics: step " + std::to_string(step_) + "'s line restored from its checkpoint");
    }
    if (groups_) metrics_.write_event("replica_groups", step_, record_.replica_changes.back().dump());
  }
  progress_ = std::make_unique<zeroshard::ProgressLine>(o.max_steps, o.progress_interval);
  if (rank_ == 0 && step_ == 0) log_start();
  if (step_ == 0) last_val_ = evaluate(0);
}

}  // namespace bart
