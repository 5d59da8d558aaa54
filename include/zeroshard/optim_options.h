// zeroshard/optim_options.h — the options of the update's kernels, which
// every sharded optimizer takes: dynamic loss scaling, the AdamW kernel's
// instruction set. Loss scaling at work: docs/drop-in.md ("Mixed precision").
#pragma once

#include <cstdint>
#include <string>

namespace zeroshard {

// Dynamic loss scaling, for fp16 parameters (bf16 and fp32 do not need it).
// The loss is multiplied by scale() before backward; a step whose gradients
// hold an inf/NaN on any rank is skipped on every rank and the scale shrinks.
struct LossScaleOptions {
  // Default: -1 = on when any parameter is Half. 0 = off, 1 = on.
  int enabled = -1;
  double init_scale = 65536.0;     // Default: 2^16
  double growth_factor = 2.0;      // after growth_interval clean steps. Default: 2
  double backoff_factor = 0.5;     // after an overflow. Default: 0.5
  int64_t growth_interval = 2000;  // Default: 2000 steps
  double min_scale = 1.0;          // the scale never falls below this. Default: 1
};

// The instruction set of the AdamW kernel every sharded optimizer of this
// process runs: "avx512", "avx2" or "scalar" (each gives the same bits), or ""
// (the default) for the best this CPU has. Throws for a name it does not know
// or a set the CPU lacks. For comparing the paths, or working around a CPU.
void set_adamw_simd(const std::string& isa);

}  // namespace zeroshard
