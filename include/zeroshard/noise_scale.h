// zeroshard/noise_scale.h — the gradient noise scale, statistical efficiency
// and goodput of a run, from two squared gradient norms per step.
//
//   zeroshard::GradientNoiseScale gns;               // one per run (rank 0 suffices; every rank may keep one)
//   for (...) {
//     ...backward, opt.step()...
//     const auto n = opt.last_gradient_noise();     // measured inside step(), no extra collective
//     gns.update(n.small_sumsq, tokens / n.parts(), n.big_sumsq, tokens);
//     double phi = gns.noise_scale();                // in the unit of the batch sizes (tokens here)
//     double e = gns.efficiency(tokens, reference);  // Pollux: (phi + M0) / (phi + M)
//     double goodput = tokens_per_second * e;
//   }
//
// The estimators (McCandlish et al. 2018, "An Empirical Model of Large-Batch
// Training", appendix A.1). A batch of B examples has mean gradient G_B with
// E|G_B|² = |G|² + tr(Σ)/B, Σ the per-example gradient covariance. Two sizes
// B_small < B_big give unbiased estimates
//   |G|²  ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
//   tr Σ  ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)
// Each is smoothed by an exponential moving average (bias-corrected as Adam's
// moments are), and the noise scale is their ratio, B_noise = tr Σ / |G|²:
// the batch size at which a step makes about half the progress of an
// infinitely large batch. Statistical efficiency of batch M against a
// reference batch M0 is Pollux's (Qiao et al., OSDI 2021, eq. 5),
//   E(M) = (B_noise + M0) / (B_noise + M),
// the progress per example at M relative to M0 (≤ 1 for M ≥ M0); goodput is
// throughput × E. docs/observability.md has the derivations.
//
// Not thread-safe; a plain value (copyable), saved and restored as JSON.
#pragma once

#include <cstdint>
#include <string>

namespace zeroshard {

class GradientNoiseScale {
 public:
  // `smoothing`: the moving averages' weight of the past, in [0, 1).
  // Default: 0.95 (about the last 20 steps).
  explicit GradientNoiseScale(double smoothing = 0.95);

  // One step's measurement: the squared L2 norms of the mean gradient over
  // `small_batch` examples (|G_small|², e.g. one rank's) and over `big_batch`
  // (|G_big|², the whole step's). Batches in any unit (examples, tokens), the
  // same for all calls. Returns false, changing nothing, when the step cannot
  // be used: a norm not finite, or not 0 < small_batch < big_batch.
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

  // {"smoothing":…, "steps":…, "g2":…, "s":…} and back (a resumed run goes on
  // from the same averages). from_json throws naming what is missing.
  std::string to_json() const;
  void from_json(const std::string& json);

 private:
  double smoothing_;
  int64_t steps_ = 0;
  double g2_ = 0, s_ = 0;  // uncorrected moving averages
  double correction() const;
};

}  // namespace zeroshard
