// summary.cpp — the closing report.
#include "train/summary.h"

#include <zeroshard/metrics.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace bart {

using json = nlohmann::json;

namespace {

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

std::string per_rank(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? " / " : "") + mib(v[i]);
  return out + " MiB";
}

// "n/a" for a loss that was not measured (no step ran, validation off).
std::string loss_str(double v) {
  if (!std::isfinite(v)) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", v);
  return buf;
}

// Long text cut to one readable line.
std::string line_of(std::string s, size_t max = 160) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  if (s.size() > max) s = s.substr(0, max - 3) + "...";
  return s;
}

}  // namespace

std::string Summary::text() const {
  std::ostringstream o;
  char buf[512];
  const std::string rule(72, '=');
  o << "\n" << rule << "\nBART pretraining summary\n" << rule << "\n";
  const std::string grid = pp > 1 ? " (" + std::to_string(pp) + " pipeline stages x " + std::to_string(world / pp) +
                                        " data-parallel)" : std::string();
  const std::string hybrid = shard_size == "0" ? "" : " (hybrid, shard groups: " + shard_size + ")";
  std::snprintf(buf, sizeof(buf), "model        %s BART, %.2fM parameters; %d ranks%s, ZeRO stage %d%s, %s\n",
                config.c_str(), params / 1e6, world, grid.c_str(), stage, hybrid.c_str(), precision.c_str());
  o << buf;
  std::snprintf(buf, sizeof(buf), "training     %lld steps, %s target tokens in %.1f s of steps: %s tokens/s\n",
                static_cast<long long>(steps), zeroshard::ProgressLine::with_commas(tokens).c_str(), train_seconds,
                zeroshard::ProgressLine::with_commas(train_seconds > 0 ? static_cast<int64_t>(tokens / train_seconds) : 0).c_str());
  o << buf;
  o << "train loss   " << loss_str(first_loss) << " -> " << loss_str(last_loss) << " (first step -> last step)\n";
  o << "val loss     " << loss_str(first_val_loss) << " -> " << loss_str(last_val_loss) << " (before training -> end";
  if (std::isfinite(first_val_loss) && std::isfinite(last_val_loss)) {
    std::snprintf(buf, sizeof(buf), "; %.0f%% lower", 100.0 * (1.0 - last_val_loss / first_val_loss));
    o << buf;
  }
  o << ")\n";
  if (std::isfinite(whole_val_loss)) {
    std::snprintf(buf, sizeof(buf), "val loss     %s on the whole validation set at the end (%s tokens; the line above: the same "
                  "part of it at every evaluation)\n", loss_str(whole_val_loss).c_str(),
                  zeroshard::ProgressLine::with_commas(whole_val_tokens).c_str());
    o << buf;
  }
  if (!val_loss_by_dataset.empty()) {
    o << "val loss by dataset  ";
    const char* sep = "";
    const json losses = json::parse(val_loss_by_dataset);  // kept alive through the loop
    for (const auto& [name, loss] : losses.items()) {
      o << sep << name << " " << loss_str(loss.get<double>());
      sep = ", ";
    }
    o << "\n";
  }
  if (std::isfinite(efficiency)) {
    std::snprintf(buf, sizeof(buf), "efficiency   gradient noise scale %s target tokens; statistical efficiency %.2f of a "
                  "%g-sequence batch's; goodput %s tokens/s\n",
                  std::isfinite(noise_scale) ? zeroshard::ProgressLine::with_commas(static_cast<int64_t>(noise_scale)).c_str() : "inf",
                  efficiency, reference_batch, zeroshard::ProgressLine::with_commas(static_cast<int64_t>(goodput)).c_str());
  } else {
    std::snprintf(buf, sizeof(buf), "efficiency   n/a: the gradient noise scale needs two batch sizes (more than one "
                  "rank, or ZeRO-2/3 with --micro-batches > 1)\n");
  }
  o << buf;
  o << "memory       peak RSS per rank: " << per_rank(peak_rss) << "\n";
  int64_t biggest = 0;
  for (auto b : model_states) biggest = std::max(biggest, b);
  std::snprintf(buf, sizeof(buf), "             model states per rank (parameters, gradients, AdamW): %s\n", per_rank(model_states).c_str());
  o << buf;
  std::snprintf(buf, sizeof(buf), "             unsharded (one process, 16 bytes/parameter): %s MiB, %.1fx a rank's\n",
                mib(unsharded_model_states()).c_str(),
                biggest > 0 ? static_cast<double>(unsharded_model_states()) / static_cast<double>(biggest) : 0.0);
  o << buf;
  std::snprintf(buf, sizeof(buf), "comm         %.1f MB sent by all ranks (%.2f MB per step)\n", bytes_sent / 1e6,
                steps > 0 ? bytes_sent / 1e6 / static_cast<double>(steps) : 0.0);
  o << buf;
  std::snprintf(buf, sizeof(buf), "checkpoints  %.2f s of training stalled by saves, in total\n", checkpoint_stall_s);
  o << buf;
  if (!durable.empty()) {
    const json d = json::parse(durable);
    const int64_t step = d.value("step", int64_t{-1});
    if (step >= 0) {
      std::snprintf(buf, sizeof(buf), "durable      step %lld committed in %s, %.1f s after its save began; %lld "
                    "upload(s) abandoned\n", static_cast<long long>(step), d.value("uri", std::string()).c_str(),
                    d.value("lag_s", 0.0), static_cast<long long>(d.value("abandoned", int64_t{0})));
    } else {
      std::snprintf(buf, sizeof(buf), "durable      no step committed in %s yet; %lld upload(s) abandoned\n",
                    d.value("uri", std::string()).c_str(), static_cast<long long>(d.value("abandoned", int64_t{0})));
    }
    o << buf;
  }
  std::snprintf(buf, sizeof(buf), "data         %.2f s of training waited for batches (%.2f%% of the steps' time)\n",
                data_wait_s, train_seconds > 0 ? 100 * data_wait_s / train_seconds : 0.0);
  o << buf;
  std::snprintf(buf, sizeof(buf), "evaluation   %.1f s, %.1f%% of the steps' and evaluations' time\n", eval_seconds,
                eval_share() * 100);
  o << buf;
  for (const auto& e : json::parse(stragglers)) {
    std::string who = "rank " + std::to_string(e.value("rank", 0));
    if (e.value("rank", 0) < 0) {
      who = "host (ranks";
      for (const auto& r : e.value("ranks", json::array())) who += " " + std::to_string(r.get<int>());
      who += ")";
    }
    if (e.value("kind", std::string("compute")) == "link") {
      std::snprintf(buf, sizeof(buf), "straggler    %s on %s: its links %.1f MB/s, the other ranks' median %.1f MB/s "
                    "(%.3gx) over %lld steps at step %lld (peak %.3gx)", who.c_str(),
                    e.value("host", std::string()).c_str(), e.value("mb_s", 0.0), e.value("median_mb_s", 0.0),
                    e.value("ratio", 0.0), static_cast<long long>(e.value("window", int64_t{0})),
                    static_cast<long long>(e.value("step", int64_t{0})), e.value("peak_ratio", 0.0));
    } else {
      std::snprintf(buf, sizeof(buf), "straggler    %s on %s: compute %.2fx the other ranks' median over %lld steps "
                    "at step %lld (peak %.2fx)", who.c_str(), e.value("host", std::string()).c_str(),
                    e.value("ratio", 0.0), static_cast<long long>(e.value("window", int64_t{0})),
                    static_cast<long long>(e.value("step", int64_t{0})), e.value("peak_ratio", 0.0));
    }
    o << buf;
    if (e.contains("end_step")) {
      o << ", back near the median at step " << e["end_step"].get<int64_t>();
    }
    o << "\n";
  }
  if (!replica_changes.empty()) {
    const json changes = json::parse(replica_changes);
    for (const auto& c : changes) {
      std::snprintf(buf, sizeof(buf), "groups       at step %lld: %d live group(s) (generation %lld), paused %.2f s",
                    static_cast<long long>(c.value("step", int64_t{0})), c.value("groups", 0),
                    static_cast<long long>(c.value("generation", int64_t{0})), c.value("pause_s", 0.0));
      o << buf;
      if (c.value("step_retaken", false)) o << ", the step in flight taken again";
      if (c.value("heal_bytes", int64_t{0}) > 0) {
        std::snprintf(buf, sizeof(buf), ", healed from a live group (%.2f MB on rank 0 in %.3f s)",
                      c["heal_bytes"].get<int64_t>() / 1e6, c.value("heal_s", 0.0));
        o << buf;
      }
      o << "\n";
    }
    std::snprintf(buf, sizeof(buf), "groups       %zu change(s), %lld step(s) taken again\n",
                  changes.size(), static_cast<long long>(steps_retaken));
    o << buf;
  }
  const json ints = json::parse(interruptions);
  if (ints.empty() && resumed.empty()) {
    o << "interrupted  no\n";
  } else {
    for (const auto& i : ints) {
      const std::string cause = i.value("cause", i.value("signal", std::string("?")));
      std::snprintf(buf, sizeof(buf), "interrupted  after step %lld by %s (a spot preemption notice): every rank saved "
                    "and exited 75", static_cast<long long>(i.value("step", int64_t{0})), cause.c_str());
      o << buf;
      if (i.contains("to_first_step_s")) {
        std::snprintf(buf, sizeof(buf), "; the first step after the restart ended %.1f s after the notice",
                      i["to_first_step_s"].get<double>());
        o << buf;
      }
      o << "\n";
    }
    if (!resumed.empty()) {
      const json r = json::parse(resumed);
      std::snprintf(buf, sizeof(buf), "resumed      from the step-%08lld checkpoint (restart %d, after %s, loaded in "
                    "%.2f s), then ran to the end\n",
                    static_cast<long long>(r.value("step", int64_t{0})), r.value("restart", 0),
                    r.value("after", std::string("?")).c_str(), r.value("load_s", 0.0));
      o << buf;
    }
  }
  if (has_sample) {
    const auto& d = denoising;
    std::snprintf(buf, sizeof(buf), "denoising    %lld held-out sentences, greedy decoding: %.1f%% of %s unmasked tokens "
                  "reproduced, %.1f%% of %s masked ones recovered, %lld exact\n",
                  static_cast<long long>(d.sentences), 100 * d.unmasked_accuracy(), zeroshard::ProgressLine::with_commas(d.unmasked).c_str(),
                  100 * d.masked_accuracy(), zeroshard::ProgressLine::with_commas(d.masked).c_str(), static_cast<long long>(d.exact));
    o << buf;
    o << "sample       masked input:   " << line_of(d.sample.masked) << "\n";
    o << "             reconstruction: " << line_of(d.sample.reconstruction) << "\n";
    o << "             original:       " << line_of(d.sample.original) << "\n";
  }
  o << "files        " << run_dir << "/metrics.jsonl";
  if (!plot.empty()) o << ", " << plot;
  o << ", " << run_dir << "/checkpoints/\n" << rule << "\n";
  return o.str();
}

std::string Summary::to_json() const {
  json j{{"config", config},
         {"ranks", world},
         {"stage", stage},
         {"shard_size", shard_size},
         {"pp", pp},
         {"precision", precision},
         {"params", params},
         {"steps", steps},
         {"tokens", tokens},
         {"train_seconds", train_seconds},
         {"eval_seconds", eval_seconds},
         {"eval_share", eval_share()},
         {"val_loss_whole_set", std::isfinite(whole_val_loss) ? json(whole_val_loss) : json()},
         {"tokens_per_s", train_seconds > 0 ? tokens / train_seconds : 0.0},
         {"first_loss", first_loss},
         {"last_loss", last_loss},
         {"first_val_loss", first_val_loss},
         {"last_val_loss", last_val_loss},
         {"peak_rss_bytes", peak_rss},
         {"model_state_bytes", model_states},
         {"unsharded_model_state_bytes", unsharded_model_states()},
         {"bytes_sent", bytes_sent},
         {"checkpoint_stall_s", checkpoint_stall_s}, {"data_wait_s", data_wait_s},
         {"noise_scale", noise_scale},
         {"efficiency", efficiency},
         {"goodput", goodput},
         {"reference_batch", reference_batch},
         {"interruptions", json::parse(interruptions)}};
  if (!resumed.empty()) j["resumed"] = json::parse(resumed);
  if (!durable.empty()) j["durable"] = json::parse(durable);
  j["stragglers"] = json::parse(stragglers);
  if (!replica_changes.empty()) {
    j["replica_changes"] = json::parse(replica_changes);
    j["steps_retaken"] = steps_retaken;
  }
  if (!val_loss_by_dataset.empty()) j["val_loss_by_dataset"] = json::parse(val_loss_by_dataset);
  if (has_sample) {
    const auto& d = denoising;
    j["sample"] = {{"masked", d.sample.masked}, {"reconstruction", d.sample.reconstruction}, {"original", d.sample.original}};
    j["denoising"] = {{"sentences", d.sentences}, {"unmasked_tokens", d.unmasked}, {"unmasked_reproduced", d.unmasked_right},
                      {"unmasked_accuracy", d.unmasked_accuracy()}, {"masked_tokens", d.masked},
                      {"masked_recovered", d.masked_right}, {"masked_accuracy", d.masked_accuracy()}, {"exact", d.exact}};
  }
  for (auto& [k, v] : j.items()) {
    if (v.is_number_float() && !std::isfinite(v.get<double>())) v = nullptr;
  }
  return j.dump();
}

}  // namespace bart
