// run_record.cpp — the run record's JSON, and a step's statistical efficiency.
#include "train/run_record.h"

#include <zeroshard/metrics.h>

#include <cstdio>

namespace bart {

using json = nlohmann::json;

json RunRecord::to_json(const zeroshard::DistributedSampler& sampler) const {
  const auto finite = [](double v) { return std::isfinite(v) ? json(v) : json(); };
  return {{"sampler", json::parse(sampler.state_json())}, {"tokens", tokens}, {"train_seconds", train_seconds},
          {"noise_scale", json::parse(noise.to_json())}, {"efficient_tokens", efficient_tokens},
          {"efficient_seconds", efficient_seconds}, {"checkpoint_stall_s", checkpoint_stall_s}, {"data_wait_s", data_wait_s},
          {"eval_seconds", eval_seconds},
          {"first_loss", finite(first_loss)}, {"first_val_loss", finite(first_val_loss)},
          {"bytes_sent", bytes_sent}, {"interruptions", interruptions}, {"durable_step", durable_step},
          {"durable_lag_s", durable_lag_s}, {"durable_abandoned", durable_abandoned},
          {"replica_changes", replica_changes}, {"steps_retaken", steps_retaken}};
}

void RunRecord::from_json(const json& j, zeroshard::DistributedSampler& sampler) {
  const auto number = [&](const char* key) { return j.contains(key) && j[key].is_number() ? j[key].get<double>() : NAN; };
  sampler.load_state_json(j.at("sampler").dump());
  tokens = j.value("tokens", int64_t{0});
  train_seconds = j.value("train_seconds", 0.0);
  checkpoint_stall_s = j.value("checkpoint_stall_s", 0.0);
  data_wait_s = j.value("data_wait_s", 0.0);
  eval_seconds = j.value("eval_seconds", 0.0);
  first_loss = number("first_loss");
  first_val_loss = number("first_val_loss");
  bytes_sent = j.value("bytes_sent", int64_t{0});
  interruptions = j.value("interruptions", json::array());
  durable_step = j.value("durable_step", int64_t{-1});
  durable_lag_s = j.value("durable_lag_s", 0.0);
  durable_abandoned = j.value("durable_abandoned", int64_t{0});
  if (j.contains("noise_scale")) noise.from_json(j["noise_scale"].dump());
  efficient_tokens = j.value("efficient_tokens", 0.0);
  efficient_seconds = j.value("efficient_seconds", 0.0);
  replica_changes = j.value("replica_changes", json::array());
  steps_retaken = j.value("steps_retaken", int64_t{0});
}

json* RunRecord::interruption_at(int64_t step) {
  if (interruptions.empty() || interruptions.back().value("step", int64_t{-1}) != step) return nullptr;
  return &interruptions.back();
}

std::string Efficiency::progress() const {
  if (!std::isfinite(efficiency)) return "";
  char buf[96];
  std::snprintf(buf, sizeof(buf), "noise scale %s tok | efficiency %.2f",
                std::isfinite(noise_scale) ? zeroshard::ProgressLine::with_commas(static_cast<int64_t>(noise_scale)).c_str() : "inf",
                efficiency);
  return buf;
}

Efficiency statistical_efficiency(RunRecord& record, const zeroshard::GradientNoiseSample& sample, double tokens,
                                  double reference_tokens) {
  if (sample.parts() > 1) record.noise.update(sample.small_sumsq, tokens / sample.parts(), sample.big_sumsq, tokens);
  Efficiency e;
  if (record.noise.steps() == 0) return e;
  e.noise_scale = record.noise.noise_scale();
  e.efficiency = record.noise.efficiency(tokens, reference_tokens);
  return e;
}

}  // namespace bart
