// zeroshard/lr_schedule.h — learning-rate schedules for the optimizers'
// param groups: linear warmup, then constant, inverse square root (fairseq's
// BART/transformer schedule) or cosine decay.
//
//   zeroshard::LrSchedule sched({.kind = LrSchedule::kCosine, .warmup_steps = 100, .total_steps = 2000});
//   sched.attach(opt);               // remembers each group's lr as its peak
//   for (int64_t step = start; step < total; ++step) {
//     sched.apply(opt, step + 1);    // lr of the update that is about to run
//     ...; opt.step();
//   }
//
// The schedule is a pure function of the step, so a resumed run needs only the
// step to continue it exactly. Not thread-safe; a plain value.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

class LrSchedule {
 public:
  enum Kind { kConstant, kInverseSqrt, kCosine };
  struct Options {
    Kind kind = kInverseSqrt;   // Default: kInverseSqrt
    int64_t warmup_steps = 0;   // linear from peak/warmup to peak over these updates. Default: 0
    int64_t total_steps = 0;    // kCosine: the decay ends here (REQUIRES > warmup_steps)
    double min_ratio = 0.0;     // kCosine: the final lr as a fraction of the peak. Default: 0
  };
  explicit LrSchedule(Options options);
  // "constant", "inverse-sqrt", "cosine"; throws naming the valid ones.
  static Kind parse_kind(const std::string& name);
  static std::string kind_name(Kind kind);

  // The multiplier of the peak lr for update number `step` (1 = the first update).
  double factor(int64_t step) const;
  // Remembers every param group's current lr as its peak.
  void attach(torch::optim::Optimizer& opt);
  // Sets each attached group's lr to peak * factor(step); returns group 0's.
  double apply(torch::optim::Optimizer& opt, int64_t step) const;
  const Options& options() const { return options_; }

 private:
  Options options_;
  std::vector<double> peaks_;
};

}  // namespace zeroshard
