// pretraining_report.cpp — what a training run tells: the start (sizes, grid,
// pipeline), --save-logits, and the summary (printed, written to the metrics,
// and the loss plot). See pretraining_run.h.
#include "train/pretraining_run.h"

#include "train/summary.h"
#include "train/training.h"

#include <zeroshard/log.h>
#include <zeroshard/metrics.h>
#include <zeroshard/pipeline_schedule.h>
#include <zeroshard/trace.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace bart {

namespace fs = std::filesystem;

namespace {

double total_weight(const std::vector<DataSource>& sources) {
  double w = 0;
  for (const auto& s : sources) w += s.weight;
  return w;
}

// "215 examples, 39 spans within 1 document (21,489 tokens, 2.22% of 966,241; ...)"
std::string validation_text(const PackedExamples& examples) {
  const auto& h = examples.held_out();
  const auto with_commas = zeroshard::ProgressLine::with_commas;
  char share[160];
  std::snprintf(share, sizeof(share), "%s tokens, %.2f%% of %s", with_commas(h.tokens).c_str(),
                100.0 * static_cast<double>(h.tokens) / static_cast<double>(std::max<int64_t>(1, examples.tokens())),
                with_commas(examples.tokens()).c_str());
  return with_commas(examples.validation().size()) + " examples, " +
         (h.within_documents ? with_commas(h.spans) + (h.spans == 1 ? " span" : " spans") + " within " +
                                   with_commas(h.documents) + (h.documents == 1 ? " document" : " documents") + " (" +
                                   share + "; too few documents to hold whole ones out)"
                             : with_commas(h.documents) + (h.documents == 1 ? " whole document" : " whole documents") +
                                   " spread over the dataset (" + share + ")");
}

}  // namespace

void PretrainingRun::log_start() const {
  const auto& o = o_;
  // Every dataset's, for a blend (each is named with its share below).
  long long training = 0, validation = 0, tokens = 0;
  for (const auto& src : data_->sources()) {
    training += static_cast<long long>(src.examples->train().size());
    validation += static_cast<long long>(src.examples->validation().size());
    tokens += static_cast<long long>(src.examples->tokens());
  }
  char msg[400];
  std::snprintf(msg, sizeof(msg),
                "BART %s: %.2fM parameters, vocabulary %lld; %lld training / %lld validation examples (%lld tokens); "
                "%d ranks on %s, ZeRO stage %d%s, %s, global batch %lld = %d x %lld micro-batches x %lld",
                o.config.c_str(), numel_ / 1e6, static_cast<long long>(config_.vocab_size),
                training, validation, tokens, world_, device_.str().c_str(),
                o.stage, o.shard_size == "0" ? "" : (" (hybrid, shard groups: " + o.shard_size + ")").c_str(),
                o.precision.c_str(), static_cast<long long>(o.global_batch), dp_,
                static_cast<long long>(o.micro_batches), static_cast<long long>(local_batch_ / o.micro_batches));
  zeroshard::log_info(msg);
  for (const auto& src : data_->sources()) {
    const std::string which = data_->blended() ? " of '" + src.name + "'" : "";
    if (data_->blended()) {
      char share[200];
      std::snprintf(share, sizeof(share), "data: '%s', weight %g: %lld training examples, %.2f%% of each global batch",
                    src.name.c_str(), src.weight, static_cast<long long>(src.examples->train().size()),
                    100.0 * src.weight / total_weight(data_->sources()));
      zeroshard::log_info(share);
    }
    zeroshard::log_info("validation" + which + ": " + validation_text(*src.examples));
  }
  if (!pipe_) return;
  zeroshard::log_info("pipeline: " + std::to_string(o.pp) + " stages x " + std::to_string(dp_) +
                      " data-parallel ranks, schedule " + o.schedule_pp +
                      (o.chunks > 1 ? " (" + std::to_string(o.chunks) + " stages per rank)" : std::string()) +
                      ", blocks '" + zeroshard::pipeline::to_layout(bart_blocks(config_), pipe_->partition()) + "'");
  if (!pipe_->timed_blocks().empty()) {
    const auto& t = pipe_->timed_blocks();
    zeroshard::log_info("pipeline: blocks timed forward + backward (us): E " + std::to_string(t.front().params) +
                        ", e " + std::to_string(t[1].params) + ", d " +
                        std::to_string(t[static_cast<size_t>(1 + config_.encoder_layers)].params) + ", L " +
                        std::to_string(t.back().params));
  }
}

// The last save committed; --save-logits: the model's logits on four validation examples.
void PretrainingRun::finish() {
  if (ckpt_) ckpt_->wait();
  if (durable_) {  // the last checkpoint uploaded: the run ends with it durable (or its failure said)
    ckpt_->make_durable(std::chrono::hours(24));  // bounded by the upload's own limits
    json ignored;
    note_durable(ignored);
  }
  if (o_.save_logits.empty() || examples_->validation().empty()) return;
  torch::NoGradGuard no_grad;
  model_->eval();
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < std::min<int64_t>(4, examples_->validation().size()); ++i) idx.push_back(i);
  const auto b = make_batch(examples_->validation(), idx, std::vector<int64_t>(idx.size(), 0), noise_, 0, pad_, device_);
  const auto logits = model_->forward(b.input_ids, shift_tokens_right(b.labels, pad_, config_.decoder_start_token_id))
                          .to(torch::kFloat).cpu().contiguous();
  model_->train();
  if (rank_ == 0) {
    std::ofstream out(o_.save_logits, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(logits.data_ptr()), static_cast<std::streamsize>(logits.nbytes()));
    TORCH_CHECK(out.good(), "cannot write --save-logits '", o_.save_logits, "'");
  }
}

// Figures from every rank, printed by rank 0 (and written to the metrics, and the loss plot).
void PretrainingRun::summarize() {
  const auto& o = o_;
  Summary s;
  s.config = o.config;
  s.world = world_;
  s.stage = o.stage;
  s.shard_size = o.shard_size;
  s.pp = o.pp;
  s.precision = o.precision;
  s.params = numel_;
  s.steps = step_;
  s.first_loss = record_.first_loss;
  s.last_loss = loss_;
  s.first_val_loss = record_.first_val_loss;
  s.last_val_loss = last_val_;
  if (data_->blended() && !last_val_by_source_.is_null()) s.val_loss_by_dataset = last_val_by_source_.dump();
  s.tokens = record_.tokens;
  s.train_seconds = record_.train_seconds;
  s.checkpoint_stall_s = record_.checkpoint_stall_s;
  s.data_wait_s = record_.data_wait_s;
  s.eval_seconds = record_.eval_seconds;
  s.whole_val_loss = whole_val_;
  s.whole_val_tokens = whole_val_tokens_;
  s.interruptions = record_.interruptions.dump();
  json stragglers = json::array();
  for (const auto& e : rank_times_->episodes()) stragglers.push_back(json::parse(e.json()));
  s.stragglers = stragglers.dump();
  if (groups_) {
    s.replica_changes = record_.replica_changes.dump();
    s.steps_retaken = record_.steps_retaken;
  }
  if (durable_) {
    s.durable = json{{"uri", o.ckpt_dir}, {"step", record_.durable_step}, {"lag_s", record_.durable_lag_s},
                     {"abandoned", record_.durable_abandoned}}.dump();
  }
  s.noise_scale = record_.noise.noise_scale();
  s.reference_batch = o.reference_batch;
  const double steps = static_cast<double>(std::max<int64_t>(step_, 1));
  s.efficiency = record_.noise.steps() > 0
                     ? record_.noise.efficiency(static_cast<double>(record_.tokens) / steps,
                                                o.reference_batch * static_cast<double>(record_.tokens) /
                                                    (steps * static_cast<double>(o.global_batch)))
                     : NAN;
  s.goodput = record_.efficient_seconds > 0 ? record_.efficient_tokens / record_.efficient_seconds : NAN;
  s.resumed = resumed_.is_null() ? "" : resumed_.dump();
  s.run_dir = o.run_dir;
  s.wall_seconds = since(run_start_);
  auto per_rank = torch::tensor({static_cast<double>(zeroshard::peak_rss_bytes()),
                                 static_cast<double>(peak_model_states()), static_cast<double>(bytes_sent())},
                                torch::kDouble);
  auto all = torch::empty({3 * world_}, torch::kDouble);
  comm_->all_gather(all, per_rank)->wait();
  for (int r = 0; r < world_; ++r) {
    s.peak_rss.push_back(static_cast<int64_t>(all[3 * r].item<double>()));
    s.model_states.push_back(static_cast<int64_t>(all[3 * r + 1].item<double>()));
    s.bytes_sent += static_cast<int64_t>(all[3 * r + 2].item<double>());
  }
  s.bytes_sent += record_.bytes_sent;  // earlier attempts'
  if (!o.no_sample && !pipe_ && !examples_->validation().empty()) {  // decoding runs the whole model
    s.denoising = denoising_accuracy(model_, examples_->validation(), o.sample_sentences,
                                     std::min<int64_t>(o.max_tokens - 2, 60), noise_, tokenizer_, device_);
    s.has_sample = s.denoising.sentences > 0;
  }
  if (o.trace) zeroshard::trace::write_chrome_trace(trace_file(), rank_);
  if (rank_ == 0) {
    if (!o.no_plot && metrics_.enabled()) {
      const auto png = (fs::path(o.run_dir) / "loss.png").string();
      const auto why = zeroshard::plot_metrics(metrics_.path(), png, "BART " + o.config + ", " +
                                                                         std::to_string(world_) + " ranks, ZeRO-" +
                                                                         std::to_string(o.stage));
      if (why.empty()) s.plot = png; else zeroshard::log_warn("loss plot: " + why);
    }
    metrics_.write_event("summary", step_, s.to_json());
    std::fputs(s.text().c_str(), stdout);
    std::fflush(stdout);
  }
  comm_->barrier();
}

}  // namespace bart
