// zeroshard/pipeline_grid.h — the ranks of a pipelined run and their groups: world = pp × dp
// ranks, where stage s, data-parallel index d is world rank s·dp + d.
//
//   zeroshard::pipeline::PipelineGrid grid(world, {.stages = 2, .ties = {{0, 1}}});   // collective
//   grid.dp_group();                 // ZeRO for this rank's stage runs on it
//
// Each group is a ProcessGroup: its data plane on the world's device, its control plane on the
// CPU. Thread-safety: the grid is immutable; its communicators are as comm.h says.
// How it works: docs/pipeline.md ("The grid").
#pragma once

#include "zeroshard/comm.h"

#include <vector>

namespace zeroshard::pipeline {

struct GridOptions {
  // Pipeline stages (pp). REQUIRES: divides the world size. Default: 1.
  int stages = 1;
  // Sets of stages that share a parameter (a shared embedding on the first and the last);
  // a tie group is made per set. REQUIRES: each set ascending, at least two stages.
  // Default: none.
  std::vector<std::vector<int>> ties;
};

class PipelineGrid {
 public:
  // Splits the world's communicators into the groups below, in the same order on every rank.
  // Collective over the world; ranks compare `options` first and throw on every rank, naming
  // the difference, when they disagree.
  PipelineGrid(ProcessGroup world, const GridOptions& options);

  int pp() const { return pp_; }
  int dp() const { return dp_; }
  int stage() const { return stage_; }     // of this rank
  int dp_rank() const { return dp_rank_; } // of this rank
  int world_rank(int stage, int dp_rank) const { return stage * dp_ + dp_rank; }

  // Every rank: the step's agreement (norms, overflow, loss, preemption).
  const ProcessGroup& world() const { return world_; }
  // The dp ranks of this rank's stage: ZeRO shards the stage's parameters over it.
  const ProcessGroup& dp_group() const { return dp_group_; }  // this rank's stage
  // The pp ranks with this rank's data-parallel index: activations and their gradients travel
  // between neighbours of it (posted send/recv).
  const ProcessGroup& pp_group() const { return pp_group_; }  // rank i of it is stage i
  // The tie group of options.ties[k] (the ranks of those stages with this rank's data-parallel
  // index) when this rank's stage is in it; else an empty group (null communicators). Rank i of
  // it is the i-th stage of the set.
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
