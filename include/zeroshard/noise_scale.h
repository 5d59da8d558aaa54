// zeroshard/noise_scale.h — the gradient noise scale, statistical efficiency
// and goodput of a run, from two squared gradient norms per step.
//
//   zeroshard::GradientNoiseScale gns;               // one per run (rank 0 suffices; any may)
//   for (...) {
//     ...backward, opt.step()...
//     const auto n = opt.last_gradient_noise();     // measured inside step(), no extra collective
//     gns.update(n.small_sumsq, tokens / n.parts(), n.big_sumsq, tokens);
//     double phi = gns.noise_scale();                // in the unit of the batch sizes (tokens here)
//     double e = gns.efficiency(tokens, reference);  // Pollux: (phi + M0) / (phi + M)
//     double goodput = tokens_per_second * e;
//   }
//
// The noise scale is B_noise = tr Σ / |G|² (McCandlish et al. 2018), from moving averages of
// unbiased estimates of |G|² and tr Σ; efficiency is Pollux's E(M) = (B_noise + M0) /
// (B_noise + M) (Qiao et al., OSDI 2021); goodput is throughput × E.
// Not thread-safe; a plain value (copyable), saved and restored as JSON.
// How it works, with the estimators: docs/observability.md ("Statistical efficiency and goodput").
#pragma once

#include <cstdint>
#include <string>

namespace zeroshard {

class GradientNoiseScale {
 public:
  // `smoothing`: the moving averages' weight of the past. REQUIRES: in [0, 1).
  // Default: 0.95 (about the last 20 steps).
  explicit GradientNoiseScale(double smoothing = 0.95);

  // One step's measurement: the squared L2 norms of the mean gradient over `small_batch`
  // examples (|G_small|², e.g. one rank's) and over `big_batch` (|G_big|², the whole step's).
  // Batches in any unit (examples, tokens), the same for all calls. Returns false, changing
  // nothing, when a norm is not finite or not 0 < small_batch < big_batch.
  bool update(double small_sumsq, double small_batch, double big_sumsq, double big_batch);

  // The smoothed |G|² and tr(Σ) (NaN before the first update). Either can be
  // negative early on: they are differences of noisy terms.
  double gradient_sq() const;
  double trace_cov() const;
  // tr Σ / |G|², in the batches' unit: NaN before the first update; +inf while
  // the smoothed |G|² is ≤ 0 (noise swamps the signal); 0 while tr Σ ≤ 0.
  double noise_scale() const;
  // (B_noise + reference) / (B_noise + batch): 1 while B_noise is +inf; NaN
  // before the first update. REQUIRES: batch > 0, reference > 0.
  double efficiency(double batch, double reference) const;
  // Steps accepted by update().
  int64_t steps() const { return steps_; }

  // {"smoothing":…, "steps":…, "g2":…, "s":…} and back (a resumed run goes on from the same
  // averages). from_json throws naming what is missing.
  std::string to_json() const;
  void from_json(const std::string& json);

 private:
  double smoothing_;
  int64_t steps_ = 0;
  double g2_ = 0, s_ = 0;  // uncorrected moving averages
  double correction() const;
};

}  // namespace zeroshard
