// zeroshard/rank_times.h — every rank's time of a step, and the slow rank named.
//
//   zeroshard::RankTimes times(agreement);  // collective (the ranks' host names), after the
//                                           // agreement's other contributors have joined
//   for (...) {
//     times.step_began();
//     ...data, forward, backward...
//     times.set(compute_s, data_wait_s, exposed_comm_s);  // before the step's agreement
//     opt.step();                                         // the agreement carries them
//     const auto spread = times.spread(step);             // every rank's, the same on each rank
//     m.extra_json = ... spread.json ...;                 // "ranks": min/median/max, the slowest rank
//     for (const auto& e : spread.named) metrics.write_event("straggler", step, e.json());
//   }
//
// Each rank's figures travel in the step's one agreement (a per-rank slot of four values: no
// collective of their own). A straggler is a rank whose compute, averaged over the last `window`
// steps, stays at `threshold` times the median of the other ranks' or more: named once per episode (on rank
// 0's log: the rank, its host, the ratio); the episode ends when the ratio falls under the midpoint
// between 1 and the threshold (1.15 for 1.3), so that a rank hovering at the threshold is one episode.
// Where every rank of a host (of several ranks, in a job of several hosts) is slow, the host is named
// once instead of each of its ranks.
#pragma once

#include "zeroshard/step_agreement.h"

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

struct RankTimesOptions {
  double threshold = 1.3;  // a rank's compute over the other ranks' median, averaged over the window
  int64_t window = 50;     // steps; 0: no straggler detection (the spread is still reported)
  std::string host;        // this rank's host as episodes name it ("": gethostname())
};

struct StragglerEpisode {
  int64_t step = 0;     // the step at which it was named
  int rank = 0;         // -1: a whole host (every rank of it slow)
  std::vector<int> ranks;  // the rank, or the host's ranks
  std::string host;
  double ratio = 0;     // its compute over the other ranks' median, over the window, when named
  int64_t window = 0;
  double threshold = 0;
  int64_t end_step = -1;  // the step at which it came back near the median (-1: not yet)
  double peak_ratio = 0;  // the highest ratio of the episode
  // {"step":…, "rank":…, "ranks":[…], "host":…, "ratio":…, "window":…, "threshold":…, "peak_ratio":…[,
  // "end_step":…]}
  std::string json() const;
  std::string who() const;  // "rank 3 on host h1", or "host h1 (all its ranks: 2, 3)"
};

struct RankSpread {
  // {"compute_s": {"min":…, "median":…, "max":…, "slowest": RANK}, "data_wait_s": {…},
  //  "exposed_comm_s": {…}, "arrive_s": {…}}: a StepMetrics::extra_json member ("ranks").
  std::string json;
  std::vector<StragglerEpisode> named;      // stragglers named at this step
  std::vector<StragglerEpisode> recovered;  // back near the median at this step
};

class RankTimes {
 public:
  // Joins `agreement` (a per-rank slot) and gathers the ranks' host names (collective over the
  // agreement's communicator). REQUIRES: options.threshold > 1, options.window >= 0.
  explicit RankTimes(std::shared_ptr<StepAgreement> agreement, RankTimesOptions options = {});
  ~RankTimes();
  RankTimes(const RankTimes&) = delete;
  RankTimes& operator=(const RankTimes&) = delete;

  // The step's start: `arrive_s` counts from here to this rank's arrival at the agreement.
  void step_began();
  // This rank's figures of the step, before the agreement runs: its compute (forward and
  // backward, less the communication they waited for), its wait for data and its exposed
  // communication so far.
  void set(double compute_s, double data_wait_s, double exposed_comm_s);
  // After the step's agreement: every rank's figures summarised, and the straggler rule applied
  // (the same on every rank). Throws when no agreement ran since the last call.
  RankSpread spread(int64_t step);
  // Every episode named so far.
  const std::vector<StragglerEpisode>& episodes() const { return episodes_; }
  const std::vector<std::string>& hosts() const { return hosts_; }

  static constexpr int kFigures = 4;  // compute_s, data_wait_s, exposed_comm_s, arrive_s

 private:
  std::shared_ptr<StepAgreement> agreement_;
  RankTimesOptions options_;
  int64_t slot_ = -1;
  std::vector<std::string> hosts_;
  double began_ = 0;
  double mine_[kFigures] = {};
  std::vector<double> all_;  // the last agreement's: rank r's figures at [r * kFigures, ...)
  int64_t read_at_ = -1, spread_at_ = -1;
  std::deque<std::vector<double>> compute_;  // the window's compute per rank
  std::deque<std::vector<double>> medians_;  // the window's median compute of the other ranks, per rank
  std::map<std::string, int> open_;          // "rank R" or "host H": its open episode's index
  std::vector<StragglerEpisode> episodes_;
};

}  // namespace zeroshard
