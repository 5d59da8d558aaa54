// blend.cpp — Blend: a block's slots by weight, a position's source example.
#include "zeroshard/blend.h"

#include "zeroshard/sampler.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace zeroshard {

namespace {

// Slots per block by weight: floor of each share, the slots left to the largest remainders
// (the lower source first on a tie).
std::vector<int64_t> share_slots(const std::vector<BlendSource>& sources, int64_t slots) {
  const double total = std::accumulate(sources.begin(), sources.end(), 0.0,
                                       [](double a, const BlendSource& s) { return a + s.weight; });
  std::vector<int64_t> out;
  std::vector<std::pair<double, size_t>> remainders;
  int64_t given = 0;
  for (size_t d = 0; d < sources.size(); ++d) {
    const double exact = sources[d].weight / total * static_cast<double>(slots);
    out.push_back(static_cast<int64_t>(std::floor(exact)));
    given += out.back();
    remainders.emplace_back(-(exact - std::floor(exact)), d);
  }
  std::sort(remainders.begin(), remainders.end());
  for (size_t k = 0; given < slots; ++k, ++given) ++out[remainders[k % remainders.size()].second];
  return out;
}

}  // namespace

Blend::Blend(std::vector<BlendSource> sources, int64_t slots) : sources_(std::move(sources)) {
  TORCH_CHECK_VALUE(!sources_.empty(), "Blend: no sources");
  TORCH_CHECK_VALUE(slots > 0 && slots <= (int64_t{1} << 24), "Blend: slots is ", slots, "; give 1 to 2^24");
  double total = 0;
  for (size_t d = 0; d < sources_.size(); ++d) {
    TORCH_CHECK_VALUE(sources_[d].size > 0, "Blend: source ", d, " has ", sources_[d].size,
                      " examples; every source needs some");
    TORCH_CHECK_VALUE(std::isfinite(sources_[d].weight) && sources_[d].weight > 0, "Blend: source ", d,
                      "'s weight is ", sources_[d].weight, "; weights must be positive");
    total += sources_[d].weight;
  }
  per_block_ = share_slots(sources_, slots);
  for (size_t d = 0; d < sources_.size(); ++d) {
    TORCH_CHECK_VALUE(per_block_[d] > 0, "Blend: source ", d, "'s weight ", sources_[d].weight, " is ",
                      sources_[d].weight / total, " of the whole, below one slot in ", slots,
                      "; give it a larger weight or leave it out");
  }
  // The order within a block: each next slot to the source furthest below its share
  // (Megatron-LM's build_blending_indices rule; the first source on a tie).
  std::vector<int64_t> taken(sources_.size(), 0);
  for (int64_t i = 0; i < slots; ++i) {
    size_t best = 0;
    double best_error = -1e300;
    for (size_t d = 0; d < sources_.size(); ++d) {
      const double error = static_cast<double>(per_block_[d]) / static_cast<double>(slots) *
                               static_cast<double>(i + 1) - static_cast<double>(taken[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    order_.push_back(static_cast<int32_t>(best));
    rank_.push_back(taken[best]++);
  }
  for (size_t d = 0; d < sources_.size(); ++d) {
    TORCH_CHECK(taken[d] == per_block_[d], "Blend: a block holds ", taken[d], " slots of source ", d, " and not ",
                per_block_[d], " (a bug)");
  }
  int64_t examples = 0;
  for (const auto& s : sources_) examples += s.size;
  size_ = (examples + slots - 1) / slots * slots;
}

Blend::Pick Blend::at(int64_t epoch, int64_t position, uint64_t seed) const {
  TORCH_CHECK_INDEX(position >= 0 && position < size_ && epoch >= 0, "Blend: position ", position, " of epoch ",
                    epoch, " is outside 0..", size_);
  const int64_t block = position / slots(), slot = position % slots();
  const auto d = static_cast<size_t>(order_[static_cast<size_t>(slot)]);
  // The source's slots before this one, over the blend's epochs: its k-th example of the run.
  const int64_t k = (epoch * (size_ / slots()) + block) * per_block_[d] + rank_[static_cast<size_t>(slot)];
  const int64_t n = sources_[d].size;
  Pick p;
  p.source = static_cast<int>(d);
  p.epoch = k / n;
  p.index = shuffled_position(k % n, n, seed ^ (0x9E3779B97F4A7C15ull * (d + 1)), p.epoch);
  return p;
}

std::string Blend::to_json() const {
  nlohmann::json j{{"slots", slots()}, {"size", size_}, {"sources", nlohmann::json::array()}};
  for (size_t d = 0; d < sources_.size(); ++d) {
    j["sources"].push_back({{"size", sources_[d].size}, {"weight", sources_[d].weight}, {"slots", per_block_[d]}});
  }
  return j.dump();
}

}  // namespace zeroshard
