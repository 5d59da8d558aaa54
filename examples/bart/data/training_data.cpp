// training_data.cpp — one dataset or a blend, drawn by position.
#include "data/training_data.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>

namespace bart {

std::vector<std::pair<std::string, double>> parse_datasets(const std::string& text) {
  std::vector<std::pair<std::string, double>> out;
  size_t at = 0;
  while (at <= text.size()) {
    size_t end = text.find(',', at);
    end = end == std::string::npos ? text.size() : end;
    const std::string part = text.substr(at, end - at);
    const size_t colon = part.rfind(':');
    char* stop = nullptr;
    const double w = colon == std::string::npos ? 0 : std::strtod(part.c_str() + colon + 1, &stop);
    const bool weighted = colon != std::string::npos && colon + 1 < part.size() && stop == part.c_str() + part.size();
    if (weighted) {
      TORCH_CHECK_VALUE(std::isfinite(w) && w > 0 && colon > 0, "--dataset '", text, "': '", part, "' has weight ",
                        part.substr(colon + 1), "; give each dataset a positive weight: A:0.7,B:0.3");
      out.emplace_back(part.substr(0, colon), w);
    } else {
      TORCH_CHECK_VALUE(!part.empty() && end == text.size() && at == 0, "--dataset '", text, "': '", part,
                        "' has no weight; a blend names each dataset with its weight: A:0.7,B:0.3");
      out.emplace_back(part, 1.0);
    }
    at = end + 1;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(out[i].first != out[j].first, "--dataset '", text, "' names '", out[i].first,
                        "' twice; give each dataset once, with its whole weight");
    }
  }
  return out;
}

TrainingData::TrainingData(std::vector<DataSource> sources) : sources_(std::move(sources)) {
  TORCH_CHECK_VALUE(!sources_.empty(), "BART data: no dataset");
  std::vector<zeroshard::BlendSource> blend;
  for (const auto& s : sources_) {
    const auto& e = *s.examples;
    TORCH_CHECK_VALUE(e.train().size() > 0, "dataset '", s.name, "' has no training examples",
                      e.validation().size() > 0
                          ? ": its validation set took all of its text (" + std::to_string(e.validation().size()) +
                                " example(s) of " + std::to_string(e.tokens()) + " tokens: every sentence the held-out "
                                "spans touch is held out, and this corpus is too small to keep any for training); give "
                                "more text"
                          : std::string(": it holds no text"));
    blend.push_back({s.examples->train().size(), s.weight});
  }
  if (sources_.size() > 1) blend_.emplace(std::move(blend));
}

int64_t TrainingData::size() const { return blend_ ? blend_->size() : sources_.front().examples->train().size(); }

TrainingData::Drawn TrainingData::draw(int64_t epoch, int64_t position, uint64_t seed) const {
  if (!blend_) return Drawn{0, position, epoch};
  const auto p = blend_->at(epoch, position, seed);
  return Drawn{p.source, p.index, p.epoch};
}

Example TrainingData::example(const Drawn& d) const {
  return sources_[static_cast<size_t>(d.source)].examples->train().at(d.index);
}

int64_t TrainingData::target_tokens(const Drawn& d) const {
  return sources_[static_cast<size_t>(d.source)].examples->train().target_tokens(d.index);
}

std::string TrainingData::description() const {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& s : sources_) {
    j.push_back({{"dataset", s.name}, {"weight", s.weight}, {"examples", s.examples->train().size()}});
  }
  return j.dump();
}

}  // namespace bart
