// zeroshard/pipeline_grid.h — the ranks of a pipelined run and their groups.
//
// world = pp × dp ranks: pipeline stage s, data-parallel index d is world rank
// s·dp + d (the data-parallel groups are contiguous; the pipeline is the outer
// dimension). Each rank belongs to
//   - dp: the dp ranks of its stage (ZeRO shards the stage's parameters over it),
//   - pp: the pp ranks with its data-parallel index (activations and their
//     gradients travel between neighbours of it, by posted send/recv),
//   - a tie group per set of tied stages (a parameter held by several stages,
//     such as a shared embedding on the first and the last), of the ranks of
//     those stages with its data-parallel index,
//   - and the world (step-level agreement: norms, overflow, loss, preemption).
// Each group is a ProcessGroup: its data plane on the world's device, its
// control plane on the CPU.
//
// Construction is collective over the world (it splits the world's
// communicators, the same splits in the same order on every rank).
// Thread-safety: the grid is immutable; its communicators are as documented in comm.h.
#pragma once

#include "zeroshard/comm.h"

#include <vector>

namespace zeroshard::pipeline {

struct GridOptions {
  // Pipeline stages (pp). REQUIRES: divides the world size. Default: 1.
  int stages = 1;
  // Sets of stages that share a parameter (each ascending, at least two
  // stages); a tie group is made per set. Default: none.
  std::vector<std::vector<int>> ties;
};

class PipelineGrid {
 public:
  PipelineGrid(ProcessGroup world, const GridOptions& options);

  int pp() const { return pp_; }
  int dp() const { return dp_; }
  int stage() const { return stage_; }     // of this rank
  int dp_rank() const { return dp_rank_; } // of this rank
  int world_rank(int stage, int dp_rank) const { return stage * dp_ + dp_rank; }

  const ProcessGroup& world() const { return world_; }
  const ProcessGroup& dp_group() const { return dp_group_; }  // this rank's stage
  const ProcessGroup& pp_group() const { return pp_group_; }  // rank i of it is stage i
  // The tie group of options.ties[k] when this rank's stage is in it; else an
  // empty group (null communicators). Rank i of it is the i-th stage of the set.
  const ProcessGroup& tie_group(size_t k) const { return ties_.at(k); }
  const GridOptions& options() const { return options_; }

 private:
  ProcessGroup world_, dp_group_, pp_group_;
  std::vector<ProcessGroup> ties_;
  GridOptions options_;
  int pp_ = 1, dp_ = 1, stage_ = 0, dp_rank_ = 0;
};

// The group of `ranks` (ascending ranks of `group`): both planes split, in
// this order, on every rank of `group` (collective); {} on ranks outside it.
ProcessGroup split_group(const ProcessGroup& group, const std::vector<int>& ranks);

}  // namespace zeroshard::pipeline
