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
// Each rank's figures travel in the step's one agreement (a per-rank slot of ten values: no
// collective of their own): its times, and the rate of the bulk data it received from other hosts'
// ranks over the TCP transport (its slowest and its fastest sender; each frame timed from its
// header to its last byte, so a late sender does not count, only the link moving the bytes). A straggler is a rank whose compute, averaged over the last `window`
// steps, stays at `threshold` times the median of the other ranks' or more: named once per episode (on rank
// 0's log: the rank, its host, the ratio); the episode ends when the ratio falls under the midpoint
// between 1 and the threshold (1.15 for 1.3), so that a rank hovering at the threshold is one episode.
// A rank is named only when it costs the others: its compute over the window exceeds the others'
// median by (threshold - 1) / 2 of the window's time (the ranks' median arrive_s) or more, so that
// a compute of a tenth of the step, which varies by half on a busy machine, names no one.
// Where every rank of a host (of several ranks, in a job of several hosts) is slow, the host is named
// once instead of each of its ranks.
//
// A slow link is named by the same rule on rates: over the window, each link between two hosts (a
// sender, a receiver) moved so many bytes in so many seconds; a rank's rate is its fastest link's
// (sent or received), and a rank whose rate the other ranks' median exceeds `threshold` times is
// named (kind "link"), when its links at that median rate would have saved (threshold - 1) / 2 of the
// window's time at least: the one end that every slow link shares. A host whose NIC or shaping is slow
// makes all its links slow and no other rank's fastest link. Two hosts' one link has no faster link
// to be measured against: it is never named.
#pragma once

#include "zeroshard/step_agreement.h"

#include <cstdint>
#include <deque>
#include <functional>
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
  std::string kind = "compute";  // "compute": its compute time; "link": its links' rate
  int64_t step = 0;     // the step at which it was named
  int rank = 0;         // -1: a whole host (every rank of it slow)
  std::vector<int> ranks;  // the rank, or the host's ranks
  std::string host;
  double ratio = 0;     // its compute over the other ranks' median, over the window, when named (a
                        // link: the other ranks' median rate over its rate)
  double mb_s = 0;         // a link episode: its rate (MB/s) over the window, when named
  double median_mb_s = 0;  // a link episode: the other ranks' median rate, when named
  int64_t window = 0;
  double threshold = 0;
  int64_t end_step = -1;  // the step at which it came back near the median (-1: not yet)
  double peak_ratio = 0;  // the highest ratio of the episode
  // {"kind":…, "step":…, "rank":…, "ranks":[…], "host":…, "ratio":…, "window":…, "threshold":…,
  // "peak_ratio":…[, "mb_s":…, "median_mb_s":…][, "end_step":…]}
  std::string json() const;
  std::string who() const;  // "rank 3 on host h1", or "host h1 (all its ranks: 2, 3)"
};

struct RankSpread {
  // {"compute_s": {"min":…, "median":…, "max":…, "slowest": RANK}, "data_wait_s": {…},
  //  "exposed_comm_s": {…}, "arrive_s": {…}[, "link_mb_s": {"min":…, "median":…, "max":…,
  //  "slowest": RANK, "from": RANK}]}: a StepMetrics::extra_json member ("ranks"). link_mb_s: each
  //  rank's slowest sender on another host this step (ranks that received bulk data from one);
  //  "slowest" received from "from" at "min".
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
  // Where the trainer's cumulative exposed-communication seconds are read (e.g. its optimizers'
  // stats().waits.total()): the figure carried is then set()'s exposed_comm_s plus what `waited`
  // grew by from set() to the agreement (the reductions a step's optimizer waits for before it).
  void count_waits(std::function<double()> waited);
  // After the step's agreement: every rank's figures summarised, and the straggler rule applied
  // (the same on every rank). Throws when no agreement ran since the last call.
  RankSpread spread(int64_t step);
  // Every episode named so far.
  const std::vector<StragglerEpisode>& episodes() const { return episodes_; }
  const std::vector<std::string>& hosts() const { return hosts_; }

  static constexpr int kFigures = 4;  // compute_s, data_wait_s, exposed_comm_s, arrive_s
  // Then the links: the slowest sender (its rank + 1, 0: none), bytes, seconds; the fastest, the same.
  static constexpr int kLinkFigures = 6;
  static constexpr int kSlot = kFigures + kLinkFigures;

 private:
  struct LinkSample {
    int from = 0, to = 0;
    double bytes = 0, seconds = 0;
  };
  void fill_links(double* v);
  std::vector<double> link_ratios(std::vector<double>& rate);
  double window_time() const;  // the window's steps (each the ranks' median arrive_s), seconds


  std::shared_ptr<StepAgreement> agreement_;
  RankTimesOptions options_;
  int64_t slot_ = -1;
  std::vector<std::string> hosts_;
  double began_ = 0;
  std::vector<int> world_;    // each rank's world rank as its transport knows it (-1: none)
  double mine_[kFigures] = {};
  std::function<double()> waited_;  // count_waits()
  double waited_at_set_ = 0;
  std::vector<double> all_;  // the last agreement's: rank r's figures at [r * kSlot, ...)
  int64_t read_at_ = -1, spread_at_ = -1;
  std::deque<std::vector<double>> compute_;  // the window's compute per rank
  std::deque<std::vector<double>> medians_;  // the window's median compute of the other ranks, per rank
  std::deque<std::vector<LinkSample>> links_;  // the window's links between hosts, per step
  std::deque<double> steps_;                   // the window's median step time (arrive_s) of the ranks
  std::map<std::string, int> open_;          // "rank R" or "host H": its open episode's index
  std::vector<StragglerEpisode> episodes_;
};

}  // namespace zeroshard
