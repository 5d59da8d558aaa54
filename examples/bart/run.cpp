// run.cpp — bart_pretrain's training run: data, model, ZeRO stage, checkpoints,
// preemption, metrics, and the closing summary.
#include "run.h"

#include "bart_model.h"
#include "corpus.h"
#include "pipeline_training.h"
#include "run_record.h"
#include "summary.h"
#include "tokenizer.h"
#include "training.h"

#include <zeroshard/checkpoint.h>
#include <zeroshard/comm.h>
#include <zeroshard/fully_shard.h>
#include <zeroshard/log.h>
#include <zeroshard/lr_schedule.h>
#include <zeroshard/metrics.h>
#include <zeroshard/pipeline_schedule.h>
#include <zeroshard/preemption.h>
#include <zeroshard/sampler.h>
#include <zeroshard/sharded_optimizer.h>
#include <zeroshard/trace.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace bart {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

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



// Trains into `dir` atomically (a temporary directory renamed), so a crash
// never leaves half a vocabulary that a restart would load.
void train_tokenizer_into(const std::vector<std::string>& texts, int64_t vocab_size, const std::string& dir) {
  const auto t0 = Clock::now();
  const auto tok = ByteLevelBpe::train(texts, vocab_size);
  const fs::path tmp = dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  tok.save((tmp / "vocab.json").string(), (tmp / "merges.txt").string());
  fs::remove_all(dir);
  fs::rename(tmp, dir);
  char msg[200];
  std::snprintf(msg, sizeof(msg), "tokenizer: trained %lld entries in %.1f s into ", static_cast<long long>(tok.vocab_size()),
                since(t0));
  zeroshard::log_info(msg + dir);
}

// The same corpus on every rank (deterministic), or rank 0 trains the
// tokenizer first when the run has none.
ByteLevelBpe obtain_tokenizer(const RunOptions& o, const std::vector<std::string>& texts, zeroshard::Communicator& comm) {
  if (!o.tokenizer_dir.empty()) {
    TORCH_CHECK_VALUE(fs::exists(tokenizer_files_in(o.tokenizer_dir)), "--tokenizer '", o.tokenizer_dir,
                      "' has no vocab.json; give a directory with vocab.json and merges.txt, or leave --tokenizer "
                      "out to train one from --data");
    return load_tokenizer(o.tokenizer_dir);
  }
  const std::string dir = (fs::path(o.run_dir) / "tokenizer").string();
  std::string err;
  if (comm.rank() == 0 && !fs::exists(tokenizer_files_in(dir))) {
    try {
      train_tokenizer_into(texts, o.vocab_size, dir);
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  // The others wait here, for as long as the training takes: a barrier could time out.
  auto failed = torch::tensor({err.empty() ? 0.0 : 1.0}, torch::kDouble);
  comm.all_reduce(failed, zeroshard::ReduceOp::kMax)->wait(std::chrono::hours(1));
  TORCH_CHECK(failed.item<double>() == 0, "tokenizer: training on rank 0 failed",
              err.empty() ? std::string(" (its log says why)") : ": " + err);
  return load_tokenizer(dir);
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

// trace-rank-N.json; a restarted run's: trace-rank-N.restart-K.json (each process traces its own part).
std::string trace_path(const std::string& run_dir, int rank, int k) {
  return (fs::path(run_dir) / ("trace-rank-" + std::to_string(rank) + (k > 0 ? ".restart-" + std::to_string(k) : "") +
                               ".json")).string();
}

double all_sum(zeroshard::Communicator& comm, double v) {
  auto t = torch::tensor({v}, torch::kDouble);
  comm.all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
  return t.item<double>();
}


}  // namespace

std::string tokenizer_files_in(const std::string& dir) { return (fs::path(dir) / "vocab.json").string(); }

ByteLevelBpe load_tokenizer(const std::string& dir) {
  return ByteLevelBpe::load((fs::path(dir) / "vocab.json").string(), (fs::path(dir) / "merges.txt").string());
}

BartConfig run_config(const RunOptions& o, const ByteLevelBpe& tokenizer) {
  auto config = BartConfig::named(o.config);
  config.vocab_size = tokenizer.vocab_size();
  config.pad_token_id = tokenizer.pad_id();
  config.bos_token_id = tokenizer.id("<s>");
  config.eos_token_id = config.decoder_start_token_id = tokenizer.id("</s>");
  config.max_position_embeddings = std::max(config.max_position_embeddings, o.max_tokens + 16);
  if (o.dropout >= 0) config.dropout = config.attention_dropout = config.activation_dropout = o.dropout;
  return config;
}

int train_tokenizer_command(const RunOptions& o, const std::string& out_dir) {
  train_tokenizer_into(read_texts(o.data), o.vocab_size, out_dir);
  return 0;
}

int encode_command(const std::string& tokenizer_dir) {
  TORCH_CHECK_VALUE(fs::exists(tokenizer_files_in(tokenizer_dir)), "encode: --tokenizer '", tokenizer_dir,
                    "' has no vocab.json; give a directory with vocab.json and merges.txt");
  const auto tokenizer = load_tokenizer(tokenizer_dir);
  std::string line;
  for (int64_t n = 1; std::getline(std::cin, line); ++n) {
    const json text = json::parse(line, nullptr, /*allow_exceptions=*/false);
    TORCH_CHECK_VALUE(text.is_string(), "encode: input line ", n, " is not a JSON string; give one per line, "
                      "e.g. \"it's 10\\u00b5m\"");
    std::cout << json(tokenizer.encode(text.get<std::string>())).dump() << '\n';
  }
  std::cout.flush();
  TORCH_CHECK(std::cout.good(), "encode: writing the ids failed");
  return 0;
}

int run_pretraining(const RunOptions& o) {
  check_options(o);
  // First, so every thread started from here on (LibTorch's pool, the
  // communicators') inherits it: x86's FTZ/DAZ are per thread.
  if (!o.keep_denormals) at::globalContext().setFlushDenormal(true);
  const auto run_start = Clock::now();
  const auto dist = zeroshard::read_dist_env();  // the launcher's variables, read once
  auto comm = zeroshard::init_communicator(dist);
  const int rank = comm->rank(), world = comm->size();
  TORCH_CHECK_VALUE(o.pp >= 1 && world % o.pp == 0, "--pp ", o.pp, " must divide the ", world, " ranks (each "
                    "pipeline stage gets world / pp of them)");
  // The grid: rank = stage * dp + data-parallel index (pipeline_grid.h); without a pipeline, dp = world.
  const int dp = world / o.pp, dp_rank = rank % dp;
  TORCH_CHECK_VALUE(o.global_batch % dp == 0, "--global-batch ", o.global_batch, " must divide by the ", dp,
                    " data-parallel ranks (", world, " ranks / --pp ", o.pp, "; each takes an equal share)");
  const int64_t local_batch = o.global_batch / dp;
  TORCH_CHECK_VALUE(o.micro_batches >= 1 && local_batch % o.micro_batches == 0, "--micro-batches ", o.micro_batches,
                    " must divide the per-rank batch ", local_batch, " (--global-batch ", o.global_batch, " / ", dp,
                    " data-parallel ranks)");
  TORCH_CHECK_VALUE(o.pp == 1 || o.save_logits.empty(), "--save-logits runs the whole model: use it with --pp 1");
  fs::create_directories(o.run_dir);
  if (o.trace) zeroshard::trace::enable();
  zeroshard::trace::set_thread_name("training");

  // Data: every rank builds the same corpus.
  const auto texts = read_texts(o.data);
  const auto tokenizer = obtain_tokenizer(o, texts, *comm);
  CorpusOptions copts;
  copts.max_tokens = o.max_tokens;
  copts.validation_every = o.validation_every;
  const auto corpus = build_corpus(texts, tokenizer, copts);
  TORCH_CHECK_VALUE(static_cast<int64_t>(corpus.train.size()) >= o.global_batch, "the corpus under '", o.data,
                    "' has ", corpus.train.size(), " training examples, fewer than --global-batch ", o.global_batch);
  NoiseOptions noise = o.noise;
  noise.mask_id = tokenizer.mask_id();
  noise.bos_id = tokenizer.id("<s>");
  noise.eos_id = tokenizer.id("</s>");
  const int64_t pad = tokenizer.pad_id();

  // Model.
  const auto config = run_config(o, tokenizer);
  // The device: cpu, or this rank's GPU; the sharding's collectives follow it
  // (agreement, validation sums and checkpoints stay on the CPU communicator).
  const torch::Device device = training_device(o.device, dist.local_rank);
  const auto transport = o.device_comm == "nccl"     ? zeroshard::DeviceTransport::kNccl
                         : o.device_comm == "staged" ? zeroshard::DeviceTransport::kStaged
                                                     : zeroshard::DeviceTransport::kAuto;
  const zeroshard::ProcessGroup group = zeroshard::device_group(comm, device, {}, transport);
  const auto dtype = o.precision == "bf16" ? torch::kBFloat16 : torch::kFloat;
  auto adamw = torch::optim::AdamWOptions(o.lr).betas({0.9, o.beta2}).eps(1e-6).weight_decay(o.weight_decay);
  int64_t numel = 0;
  BartForConditionalGeneration model{nullptr};  // without a pipeline
  std::unique_ptr<PipelinedBart> pipe;          // with one: this rank's stages
  std::vector<std::shared_ptr<zeroshard::ShardedOptimizer>> opts;  // every optimizer of this rank
  torch::nn::Module* saved_module = nullptr;    // without a pipeline: the model checkpoints save
  if (o.pp > 1) {
    PipelineOptions po;
    po.pp = o.pp;
    po.schedule = o.schedule_pp;
    po.chunks = o.chunks;
    po.micro_batches = static_cast<int>(o.micro_batches);
    po.partition = o.partition;
    po.timing_rows = local_batch / o.micro_batches;  // a microbatch's sequences, at the longest
    po.timing_length = o.max_tokens;
    po.zero_stage = o.stage;
    po.unshard_per_step = o.pp_gather == "step";
    po.adamw = adamw;
    po.max_grad_norm = o.max_grad_norm;
    po.dtype = dtype;
    po.device = device;
    po.seed = o.seed;
    pipe = std::make_unique<PipelinedBart>(group, config, po);
    for (const auto& b : bart_blocks(config)) numel += b.params;
    numel -= config.vocab_size * config.d_model;  // the head's copy of the embedding is the embedding
    for (const auto& st : pipe->stages()) opts.push_back(st.optimizer);
  } else {
    torch::manual_seed(o.seed);
    model = BartForConditionalGeneration(config);
    for (const auto& p : model->parameters()) numel += p.numel();
    model->to(device, dtype);
    if (o.stage == 3) {
      opts.push_back(std::make_shared<zeroshard::FullyShardedAdamW>(zeroshard::fully_shard(model, group), adamw));
    } else {
      zeroshard::ShardedAdamWOptions so;
      so.zero_stage = o.stage;
      opts.push_back(std::make_shared<zeroshard::ShardedAdamW>(model->named_parameters(), group, adamw, so));
    }
    saved_module = model.get();
  }
  zeroshard::ShardedOptimizer* opt = opts.front().get();
  // What checkpoints save: every stage of this rank, or the whole model.
  const std::vector<zeroshard::Checkpointer::Part> parts =
      pipe ? pipe->checkpoint_parts() : std::vector<zeroshard::Checkpointer::Part>{{opt, saved_module}};
  // Everything this rank sent: the optimizers' communicators, and the pipeline's sends.
  const auto bytes_sent = [&] {
    int64_t b = pipe ? pipe->bytes_sent() : 0;
    for (const auto& x : opts) b += x->stats().traffic.total().bytes_sent;
    return b;
  };
  const auto peak_model_states = [&] {
    int64_t b = 0;
    for (const auto& x : opts) b += x->stats().memory.peak_model_states;
    return b;
  };
  const auto waited = [&] {
    double w = 0;
    for (const auto& x : opts) w += x->stats().waits.total();
    return w;
  };
  zeroshard::LrSchedule::Options lo;
  lo.kind = zeroshard::LrSchedule::parse_kind(o.schedule);
  lo.warmup_steps = o.warmup_steps;
  lo.total_steps = o.max_steps;
  lo.min_ratio = o.min_lr_ratio;
  std::vector<zeroshard::LrSchedule> schedules(opts.size(), zeroshard::LrSchedule(lo));  // one per optimizer
  for (size_t i = 0; i < opts.size(); ++i) schedules[i].attach(*opts[i]);

  // Where training stands: fresh, or resumed from the last checkpoint. Every
  // stage of a data-parallel index draws the same examples.
  zeroshard::DistributedSampler sampler(static_cast<int64_t>(corpus.train.size()), dp_rank, dp, o.seed);
  RunRecord record;
  record.noise = zeroshard::GradientNoiseScale(o.noise_smoothing);
  int64_t step = 0;
  const std::string ckpt_dir = o.ckpt_dir.empty() ? (fs::path(o.run_dir) / "checkpoints").string() : o.ckpt_dir;
  std::unique_ptr<zeroshard::Checkpointer> ckpt;
  json resumed = nullptr;
  if (ckpt_dir != "none") {
    zeroshard::CheckpointOptions co;
    co.keep = o.keep;
    co.async = o.async_save;
    ckpt = std::make_unique<zeroshard::Checkpointer>(ckpt_dir, comm, pipe ? pipe->checkpoint_options(co) : co);
    const auto t0 = Clock::now();
    if (auto progress = ckpt->load(parts)) {
      step = progress->step;
      const json extra = json::parse(progress->extra_json);
      if (extra.contains("sampler")) {
        record.from_json(extra, sampler);
      } else {  // imported weights (zeroshard-ckpt import): a new run from them
        zeroshard::log_info("checkpoint: step " + std::to_string(step) + " has no run record (imported); training "
                            "starts at its step with a fresh data order");
      }
      resumed = {{"step", step}, {"load_s", since(t0)}, {"restart", dist.restart_count}};
      zeroshard::log_info("resumed from step " + std::to_string(step) + " of " + ckpt_dir + " (epoch " +
                          std::to_string(sampler.epoch()) + ")");
    }
  }
  zeroshard::PreemptionGuard guard(comm);

  zeroshard::MetricsLog metrics;
  if (rank == 0) metrics = zeroshard::MetricsLog((fs::path(o.run_dir) / "metrics.jsonl").string(), step);
  if (rank == 0 && !resumed.is_null()) metrics.write_event("resume", step, resumed.dump());
  zeroshard::ProgressLine progress(o.max_steps, o.progress_interval);
  if (rank == 0 && step == 0) {
    char msg[300];
    std::snprintf(msg, sizeof(msg),
                  "BART %s: %.2fM parameters, vocabulary %lld; %zu training / %zu validation examples (%lld tokens); "
                  "%d ranks on %s, ZeRO stage %d, %s, global batch %lld = %d x %lld micro-batches x %lld",
                  o.config.c_str(), numel / 1e6, static_cast<long long>(config.vocab_size), corpus.train.size(),
                  corpus.validation.size(), static_cast<long long>(corpus.tokens), world, device.str().c_str(), o.stage,
                  o.precision.c_str(),
                  static_cast<long long>(o.global_batch), dp, static_cast<long long>(o.micro_batches),
                  static_cast<long long>(local_batch / o.micro_batches));
    zeroshard::log_info(msg);
    if (pipe) {
      zeroshard::log_info("pipeline: " + std::to_string(o.pp) + " stages x " + std::to_string(dp) +
                          " data-parallel ranks, schedule " + o.schedule_pp +
                          (o.chunks > 1 ? " (" + std::to_string(o.chunks) + " stages per rank)" : std::string()) +
                          ", blocks '" + zeroshard::pipeline::to_layout(bart_blocks(config), pipe->partition()) + "'");
      if (!pipe->timed_blocks().empty()) {
        const auto& t = pipe->timed_blocks();
        zeroshard::log_info("pipeline: blocks timed forward + backward (us): E " + std::to_string(t.front().params) +
                            ", e " + std::to_string(t[1].params) + ", d " +
                            std::to_string(t[static_cast<size_t>(1 + config.encoder_layers)].params) + ", L " +
                            std::to_string(t.back().params));
      }
    }
  }
  auto evaluate = [&](int64_t at) {
    const auto t0 = Clock::now();
    const auto v = pipe ? validate(*pipe, corpus.validation, noise, o.eval_batch, pad, device)
                        : validate(model, corpus.validation, noise, o.eval_batch, pad, *comm, device);
    if (!std::isfinite(record.first_val_loss)) record.first_val_loss = v.loss;
    metrics.write_event("validation", at, json{{"val_loss", v.loss}, {"val_tokens", v.tokens}, {"eval_s", since(t0)}}.dump());
    char msg[160];
    std::snprintf(msg, sizeof(msg), "step %lld: validation loss %.4f (%lld tokens, %.1f s)", static_cast<long long>(at),
                  v.loss, static_cast<long long>(v.tokens), since(t0));
    zeroshard::log_info(msg);
    return v.loss;
  };
  double last_val = NAN;
  if (step == 0) last_val = evaluate(0);

  auto save = [&](int64_t at, const char* why) -> double {
    const auto t0 = Clock::now();
    zeroshard::TrainingProgress p;
    p.step = at;
    p.epoch = sampler.epoch();
    json extra = record.to_json(sampler);
    extra["bytes_sent"] = record.bytes_sent + static_cast<int64_t>(all_sum(*comm, static_cast<double>(bytes_sent())));
    p.extra_json = extra.dump();
    ckpt->save(parts, p);
    const double stall = since(t0);
    record.checkpoint_stall_s += stall;
    metrics.write_event("checkpoint", at, json{{"reason", why}, {"stall_s", stall}, {"async", o.async_save}}.dump());
    return stall;
  };

  // The loop.
  double loss_value = NAN;
  int64_t bytes_before = bytes_sent();
  std::vector<int64_t> epochs;
  while (step < o.max_steps) {
    const auto t_step = Clock::now();
    const double waited0 = waited();
    const auto indices = next_indices(sampler, local_batch, epochs);
    std::vector<Batch> micro;
    const int64_t per_micro = local_batch / o.micro_batches;
    int64_t local_tokens = 0;
    for (int64_t m = 0; m < o.micro_batches; ++m) {
      const auto from = static_cast<std::ptrdiff_t>(m * per_micro), to = from + per_micro;
      std::vector<int64_t> idx(indices.begin() + from, indices.begin() + to);
      std::vector<int64_t> ep(epochs.begin() + from, epochs.begin() + to);  // a batch may straddle two epochs
      Batch b = make_batch(corpus.train, idx, ep, noise, o.seed, pad, device);
      local_tokens += b.target_tokens;
      micro.push_back(std::move(b));
    }
    // Every stage of a data-parallel index counts the same tokens: the world's sum counts them pp times.
    const double global_tokens = all_sum(*comm, static_cast<double>(local_tokens)) / o.pp;
    double lr = 0;
    for (size_t i = 0; i < opts.size(); ++i) lr = schedules[i].apply(*opts[i], step + 1);
    // Dropout keyed by (seed, step, microbatch of the global batch, block): the same masks at any pp.
    const auto key = [&](int64_t m) { return DropoutKey{o.seed, step, m * dp + dp_rank}; };
    double fb_s = 0, fb_wait = 0, opt_s = 0, opt_wait = 0, loss_comm = 0, grad_norm = 0, bubble_s = -1;
    zeroshard::GradientNoiseSample noise_sample;
    bool skipped = false;
    if (pipe) {
      std::vector<Microbatch> mbs;
      for (size_t m = 0; m < micro.size(); ++m) mbs.push_back(pipeline_microbatch(micro[m], config, key(static_cast<int64_t>(m))));
      const double waited0_fb = waited();
      const auto r = pipe->train_step(std::move(mbs), global_tokens);
      // The executor's step: its F and B passes, and the rest (waits for the
      // neighbours, the step's reductions and update) as this rank's bubble.
      fb_s = r.compute_seconds;
      bubble_s = r.step_seconds - r.compute_seconds;
      opt_wait = waited() - waited0_fb;
      grad_norm = r.grad_norm;
      noise_sample = r.noise;
      skipped = !r.updated;
      loss_value = r.loss;
    } else {
      opt->zero_grad();  // stage 1 keeps gradients in p.grad(); stages 2 and 3 have already moved them into shards
      const auto t_fb = Clock::now();
      const double waited_fb0 = waited();
      double loss_sum = 0;
      for (size_t m = 0; m < micro.size(); ++m) {
        // Gradients are averaged over ranks: scale so the result is the mean over the global batch's tokens.
        model->dropout_key = key(static_cast<int64_t>(m));
        auto l = summed_loss(model, micro[m]);
        loss_sum += l.item<double>();
        (l * (static_cast<double>(world) / global_tokens)).backward();
      }
      fb_s = since(t_fb);
      fb_wait = waited() - waited_fb0;
      const auto t_opt = Clock::now();
      const double waited_opt0 = waited();
      grad_norm = opt->clip_grad_norm(o.max_grad_norm > 0 ? o.max_grad_norm : 1e30);
      opt->step();
      opt_s = since(t_opt);
      opt_wait = waited() - waited_opt0;
      skipped = opt->last_step_skipped();
      noise_sample = opt->last_gradient_noise();
      const auto t_loss = Clock::now();
      loss_value = all_sum(*comm, loss_sum) / global_tokens;
      loss_comm = since(t_loss);
    }
    ++step;
    if (!std::isfinite(record.first_loss)) record.first_loss = loss_value;
    record.tokens += static_cast<int64_t>(global_tokens);
    // Before a save, so that a resumed run goes on from the averages this step made.
    const auto eff = statistical_efficiency(record, noise_sample, global_tokens, o.reference_batch * global_tokens / o.global_batch);

    double stall = 0;
    const bool end = step == o.max_steps;
    if (ckpt && (step % o.save_every == 0 || end)) stall = save(step, end ? "end" : "interval");
    zeroshard::StepMetrics m;
    m.step = step;
    m.loss = loss_value;
    m.lr = lr;
    m.grad_norm = grad_norm;
    m.tokens = static_cast<int64_t>(global_tokens);
    m.seconds = since(t_step);
    m.compute_seconds = fb_s - fb_wait;
    m.exposed_comm_seconds = waited() - waited0 + loss_comm;
    m.optimizer_seconds = std::max(0.0, opt_s - opt_wait);
    m.checkpoint_stall_seconds = stall;
    m.other_seconds = std::max(0.0, m.seconds - m.compute_seconds - m.exposed_comm_seconds - m.optimizer_seconds - stall);
    m.peak_rss_bytes = zeroshard::peak_rss_bytes();
    const int64_t bytes_now = bytes_sent();
    m.bytes_sent = bytes_now - bytes_before;
    bytes_before = bytes_now;
    m.loss_scale = opt->loss_scale();
    m.skipped = skipped;
    record.train_seconds += m.seconds;
    json extra = json::object();
    if (pipe) {  // this rank's (rank 0 writes the metrics: stage 0's), beside the schedule's formula
      extra["bubble_s"] = bubble_s;
      extra["bubble_formula"] = zeroshard::pipeline::formula_bubble(pipe->schedule());
    }
    if (std::isfinite(eff.efficiency)) {
      record.efficient_tokens += eff.efficiency * global_tokens;
      record.efficient_seconds += m.seconds;
      extra["noise_scale"] = eff.noise_scale;
      extra["efficiency"] = eff.efficiency;
      extra["goodput"] = eff.efficiency * m.tokens_per_second();
    }
    if ((o.eval_every > 0 && step % o.eval_every == 0) || end) {
      last_val = evaluate(step);
      extra["val_loss"] = last_val;
    }
    if (!extra.empty()) m.extra_json = extra.dump();
    metrics.write(m);
    progress.update(m, eff.progress());
    zeroshard::publish_step(dist, step);

    if (!end && guard.should_stop()) {
      record.interruptions.push_back({{"step", step}, {"signal", guard.signaled() ? "SIGTERM" : "notice"}});
      if (!ckpt) {
        zeroshard::log_warn("preempted at step " + std::to_string(step) + " with --ckpt-dir none: nothing saved");
        return guard.exit_code();
      }
      const double s = save(step, "preemption");
      ckpt->wait();
      guard.check_save_fits(s);
      if (o.trace) zeroshard::trace::write_chrome_trace(trace_path(o.run_dir, rank, dist.restart_count), rank);
      zeroshard::log_info("preempted after step " + std::to_string(step) + ": checkpoint committed; exiting with " +
                          std::to_string(guard.exit_code()) + " so the launcher restarts the run");
      return guard.exit_code();
    }
  }
  if (ckpt) ckpt->wait();
  if (!o.save_logits.empty() && !corpus.validation.empty()) {
    torch::NoGradGuard no_grad;
    model->eval();
    std::vector<int64_t> idx;
    for (int64_t i = 0; i < std::min<int64_t>(4, corpus.validation.size()); ++i) idx.push_back(i);
    const auto b = make_batch(corpus.validation, idx, std::vector<int64_t>(idx.size(), 0), noise, 0, pad, device);
    const auto logits = model->forward(b.input_ids, shift_tokens_right(b.labels, pad, config.decoder_start_token_id))
                            .to(torch::kFloat).cpu().contiguous();
    model->train();
    if (rank == 0) {
      std::ofstream out(o.save_logits, std::ios::binary | std::ios::trunc);
      out.write(static_cast<const char*>(logits.data_ptr()), static_cast<std::streamsize>(logits.nbytes()));
      TORCH_CHECK(out.good(), "cannot write --save-logits '", o.save_logits, "'");
    }
  }

  // The summary: figures from every rank, printed by rank 0.
  Summary s;
  s.config = o.config;
  s.world = world;
  s.stage = o.stage;
  s.pp = o.pp;
  s.precision = o.precision;
  s.params = numel;
  s.steps = step;
  s.first_loss = record.first_loss;
  s.last_loss = loss_value;
  s.first_val_loss = record.first_val_loss;
  s.last_val_loss = last_val;
  s.tokens = record.tokens;
  s.train_seconds = record.train_seconds;
  s.checkpoint_stall_s = record.checkpoint_stall_s;
  s.interruptions = record.interruptions.dump();
  s.noise_scale = record.noise.noise_scale();
  s.reference_batch = o.reference_batch;
  s.efficiency = record.noise.steps() > 0 ? record.noise.efficiency(static_cast<double>(record.tokens) / std::max<int64_t>(step, 1),
                                                                   o.reference_batch * static_cast<double>(record.tokens) /
                                                                       static_cast<double>(std::max<int64_t>(step, 1) * o.global_batch))
                                          : NAN;
  s.goodput = record.efficient_seconds > 0 ? record.efficient_tokens / record.efficient_seconds : NAN;
  s.resumed = resumed.is_null() ? "" : resumed.dump();
  s.run_dir = o.run_dir;
  s.wall_seconds = since(run_start);
  auto per_rank = torch::tensor({static_cast<double>(zeroshard::peak_rss_bytes()), static_cast<double>(peak_model_states()),
                                 static_cast<double>(bytes_sent())}, torch::kDouble);
  auto all = torch::empty({3 * world}, torch::kDouble);
  comm->all_gather(all, per_rank)->wait();
  for (int r = 0; r < world; ++r) {
    s.peak_rss.push_back(static_cast<int64_t>(all[3 * r].item<double>()));
    s.model_states.push_back(static_cast<int64_t>(all[3 * r + 1].item<double>()));
    s.bytes_sent += static_cast<int64_t>(all[3 * r + 2].item<double>());
  }
  s.bytes_sent += record.bytes_sent;  // earlier attempts'
  if (!o.no_sample && !pipe && !corpus.validation.empty()) {  // decoding runs the whole model
    s.denoising = denoising_accuracy(model, corpus.validation, o.sample_sentences, std::min<int64_t>(o.max_tokens - 2, 60),
                                     noise, tokenizer, device);
    s.has_sample = s.denoising.sentences > 0;
  }
  if (o.trace) {
    zeroshard::trace::write_chrome_trace(trace_path(o.run_dir, rank, dist.restart_count), rank);
  }
  if (rank == 0) {
    if (!o.no_plot && metrics.enabled()) {
      const auto png = (fs::path(o.run_dir) / "loss.png").string();
      const auto why = zeroshard::plot_metrics(metrics.path(), png, "BART " + o.config + ", " + std::to_string(world) +
                                                                         " ranks, ZeRO-" + std::to_string(o.stage));
      if (why.empty()) s.plot = png; else zeroshard::log_warn("loss plot: " + why);
    }
    metrics.write_event("summary", step, s.to_json());
    std::fputs(s.text().c_str(), stdout);
    std::fflush(stdout);
  }
  comm->barrier();
  return 0;
}

}  // namespace bart
