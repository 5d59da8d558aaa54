// grid.cpp — the pp × dp grid of a pipelined run and its groups.
#include "zeroshard/pipeline_grid.h"

#include "runtime/rank_agreement.h"

#include <c10/util/Exception.h>

namespace zeroshard::pipeline {

ProcessGroup split_group(const ProcessGroup& group, const std::vector<int>& ranks) {
  auto data = group.data->split(ranks);
  // A CPU group is its own control plane: one split serves both.
  auto control = group.control == group.data ? data : group.control->split(ranks);
  if (!data) return {};
  return ProcessGroup{std::move(data), std::move(control)};
}

PipelineGrid::PipelineGrid(ProcessGroup world, const GridOptions& options)
    : world_(std::move(world)), options_(options) {
  TORCH_CHECK_VALUE(world_.data != nullptr, "PipelineGrid: the world's communicator is null");
  const int n = world_.data->size(), rank = world_.data->rank();
  // Local checks, whose failure still joins the agreement below, so that
  // every rank fails together naming the difference instead of waiting.
  std::string local_error;
  std::vector<std::string> entries{"stages " + std::to_string(options.stages)};
  try {
    TORCH_CHECK_VALUE(options.stages >= 1 && n % options.stages == 0, "PipelineGrid: ", options.stages,
                      " pipeline stages do not divide the ", n, " ranks; use a divisor of ", n,
                      " (each stage gets world / stages data-parallel ranks)");
    for (size_t k = 0; k < options.ties.size(); ++k) {
      const auto& tied = options.ties[k];
      TORCH_CHECK_VALUE(tied.size() >= 2, "PipelineGrid: tie ", k, " names ", tied.size(),
                        " stage(s); a tie joins at least two stages");
      std::string entry = "tie";
      for (size_t i = 0; i < tied.size(); ++i) {
        TORCH_CHECK_VALUE(tied[i] >= 0 && tied[i] < options.stages && (i == 0 || tied[i] > tied[i - 1]),
                          "PipelineGrid: tie ", k, " names stage ", tied[i],
                          "; stages are ascending, distinct and below ", options.stages);
        entry += ' ';
        entry += std::to_string(tied[i]);
      }
      entries.push_back(entry);
    }
  } catch (const c10::Error& e) {
    local_error = e.what_without_backtrace();
  }
  entries.insert(entries.begin(), local_error.empty() ? "options: ok" : "options failed: " + local_error);
  runtime::check_same_on_all_ranks(*world_.control, entries, "PipelineGrid options");  // before any split
  TORCH_CHECK_VALUE(local_error.empty(), local_error);
  pp_ = options.stages;
  dp_ = n / pp_;
  stage_ = rank / dp_;
  dp_rank_ = rank % dp_;
  for (int s = 0; s < pp_; ++s) {
    std::vector<int> ranks;
    for (int d = 0; d < dp_; ++d) ranks.push_back(world_rank(s, d));
    auto g = split_group(world_, ranks);
    if (s == stage_) dp_group_ = std::move(g);
  }
  for (int d = 0; d < dp_; ++d) {
    std::vector<int> ranks;
    for (int s = 0; s < pp_; ++s) ranks.push_back(world_rank(s, d));
    auto g = split_group(world_, ranks);
    if (d == dp_rank_) pp_group_ = std::move(g);
  }
  for (const auto& tied : options.ties) {
    ProcessGroup mine;
    for (int d = 0; d < dp_; ++d) {
      std::vector<int> ranks;
      for (int s : tied) ranks.push_back(world_rank(s, d));
      auto g = split_group(world_, ranks);
      if (d == dp_rank_ && g.data) mine = std::move(g);
    }
    ties_.push_back(std::move(mine));
  }
}

}  // namespace zeroshard::pipeline
