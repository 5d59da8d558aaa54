// rank_times.cpp — every rank's step figures through the step's agreement; the straggler rule.
#include "zeroshard/rank_times.h"

#include "runtime/link_stats.h"
#include "runtime/host_name.h"
#include "zeroshard/comm.h"
#include "zeroshard/log.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

namespace zeroshard {

namespace {

using json = nlohmann::json;

double steady_now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr const char* kNames[RankTimes::kFigures] = {"compute_s", "data_wait_s", "exposed_comm_s", "arrive_s"};

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

std::string StragglerEpisode::who() const {
  if (rank >= 0) return "rank " + std::to_string(rank) + " on host " + host;
  std::string list;
  for (int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
  return "host " + host + " (all its ranks: " + list + ")";
}

std::string StragglerEpisode::json() const {
  nlohmann::json j{{"kind", kind}, {"step", step}, {"rank", rank}, {"ranks", ranks}, {"host", host}, {"ratio", ratio},
                   {"window", window}, {"threshold", threshold}, {"peak_ratio", peak_ratio}};
  if (kind == "link") {
    j["mb_s"] = mb_s;
    j["median_mb_s"] = median_mb_s;
  }
  if (end_step >= 0) j["end_step"] = end_step;
  return j.dump();
}

RankTimes::RankTimes(std::shared_ptr<StepAgreement> agreement, RankTimesOptions options)
    : agreement_(std::move(agreement)), options_(options) {
  TORCH_CHECK_VALUE(agreement_ != nullptr, "RankTimes: the agreement is null");
  TORCH_CHECK_VALUE(options_.threshold > 1, "RankTimes: threshold ", options_.threshold,
                    " must be above 1 (a rank's compute over the other ranks' median)");
  TORCH_CHECK_VALUE(options_.window >= 0, "RankTimes: window ", options_.window, " must be 0 (no straggler rule) or more");
  auto& comm = agreement_->communicator();
  // Each rank's host and world rank (the transport's key for its links), in one gather.
  const auto mine = (options_.host.empty() ? host_name() : options_.host) + "\n" + std::to_string(link_self());
  for (const auto& text : all_gather_text(comm, mine)) {
    const auto cut = text.rfind('\n');
    hosts_.push_back(text.substr(0, cut));
    world_.push_back(std::stoi(text.substr(cut + 1)));
  }
  // Links are told apart by world rank: none where a rank has none or two ranks share one.
  if (std::set<int>(world_.begin(), world_.end()).size() != world_.size() ||
      std::count(world_.begin(), world_.end(), -1) > 0) {
    world_.assign(world_.size(), -1);
  }
  take_links();  // what came before (the rendezvous, a checkpoint's load) is not a step's
  began_ = steady_now_s();
  slot_ = agreement_->add_per_rank(
      "rank times", kSlot,
      [this](double* v) {
        mine_[3] = steady_now_s() - began_;
        std::copy(mine_, mine_ + kFigures, v);
        if (waited_) v[2] += waited_() - waited_at_set_;
        fill_links(v + kFigures);
      },
      [this](const double* all) {
        all_.assign(all, all + static_cast<size_t>(kSlot) * hosts_.size());
        read_at_ = agreement_->agreements() + 1;  // read before agree() counts itself
      });
}

RankTimes::~RankTimes() {
  if (agreement_ != nullptr) agreement_->remove(slot_);
}

void RankTimes::fill_links(double* v) {
  std::fill(v, v + kLinkFigures, 0.0);
  const int me = agreement_->communicator().rank();
  double slow = INFINITY, fast = -1;
  for (const auto& [world, t] : take_links()) {
    const auto it = std::find(world_.begin(), world_.end(), world);
    if (world < 0 || it == world_.end() || t.seconds <= 0) continue;
    const int q = static_cast<int>(it - world_.begin());
    if (hosts_[static_cast<size_t>(q)] == hosts_[static_cast<size_t>(me)]) continue;  // loopback is not a link
    const double rate = static_cast<double>(t.bytes) / t.seconds;
    if (rate < slow) {
      slow = rate;
      v[0] = q + 1, v[1] = static_cast<double>(t.bytes), v[2] = t.seconds;
    }
    if (rate > fast) {
      fast = rate;
      v[3] = q + 1, v[4] = static_cast<double>(t.bytes), v[5] = t.seconds;
    }
  }
}

// Each rank's rate over the window (its fastest link's, sent or received; NaN: no link) and the
// other ranks' median rate over it (0: not judged). A rank whose links, at that median rate, would
// have saved less than (threshold - 1) / 2 of the window's time (the ranks' median step) reads at
// most 1: a link slower than the others' that costs the job nothing is no straggler (between hosts
// on one machine, memory-bound rates differ by 30% from run to run).
std::vector<double> RankTimes::link_ratios(std::vector<double>& rate) {
  const int n = static_cast<int>(hosts_.size());
  std::map<std::pair<int, int>, std::pair<double, double>> links;  // (from, to) -> bytes, seconds
  for (const auto& step : links_) {
    for (const auto& l : step) {
      auto& t = links[{l.from, l.to}];
      t.first += l.bytes;
      t.second += l.seconds;
    }
  }
  rate.assign(static_cast<size_t>(n), NAN);
  for (const auto& [ends, t] : links) {
    const double r = t.first / t.second;
    for (int end : {ends.first, ends.second}) {
      auto& mine = rate[static_cast<size_t>(end)];
      if (std::isnan(mine) || r > mine) mine = r;
    }
  }
  std::vector<double> ratio(static_cast<size_t>(n), 0.0);
  for (int r = 0; r < n; ++r) {
    if (std::isnan(rate[static_cast<size_t>(r)])) continue;
    std::vector<double> rest;
    for (int q = 0; q < n; ++q) {
      if (q != r && !std::isnan(rate[static_cast<size_t>(q)])) rest.push_back(rate[static_cast<size_t>(q)]);
    }
    if (rest.empty()) continue;
    const double median = median_of(rest);
    double excess = 0;  // seconds its links took beyond the median rate's
    for (const auto& [ends, t] : links) {
      if (ends.first == r || ends.second == r) excess += std::max(0.0, t.second - t.first / median);
    }
    ratio[static_cast<size_t>(r)] = median / rate[static_cast<size_t>(r)];
    if (excess < (options_.threshold - 1) / 2 * window_time()) {
      ratio[static_cast<size_t>(r)] = std::min(ratio[static_cast<size_t>(r)], 1.0);
    }
  }
  return ratio;
}

double RankTimes::window_time() const {
  double s = 0;
  for (double step : steps_) s += step;
  return s;
}

void RankTimes::step_began() {
  began_ = steady_now_s();
  std::fill(mine_, mine_ + kFigures, 0.0);
}

void RankTimes::set(double compute_s, double data_wait_s, double exposed_comm_s) {
  mine_[0] = compute_s;
  mine_[1] = data_wait_s;
  mine_[2] = exposed_comm_s;
  if (waited_) waited_at_set_ = waited_();
}

void RankTimes::count_waits(std::function<double()> waited) {
  waited_ = std::move(waited);
  if (waited_) waited_at_set_ = waited_();
}

RankSpread RankTimes::spread(int64_t step) {
  TORCH_CHECK(read_at_ > spread_at_, "RankTimes::spread: the step's agreement has not run since the last call (",
              agreement_->agreements(), " agreements); call it once per step, after the step's agreement");
  spread_at_ = read_at_;
  const int n = static_cast<int>(hosts_.size());
  RankSpread out;
  json j = json::object();
  std::vector<double> compute(static_cast<size_t>(n));
  for (int f = 0; f < kFigures; ++f) {
    std::vector<double> v(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) v[static_cast<size_t>(r)] = all_[static_cast<size_t>(r * kSlot + f)];
    if (f == 0) compute = v;
    const auto slowest = std::max_element(v.begin(), v.end()) - v.begin();
    j[kNames[f]] = json{{"min", *std::min_element(v.begin(), v.end())}, {"median", median_of(v)},
                        {"max", v[static_cast<size_t>(slowest)]}, {"slowest", slowest}};
  }
  // The links between hosts this step: each rank's slowest and fastest sender.
  std::vector<LinkSample> links;
  double slowest_rate = INFINITY;
  std::vector<double> slowest_in;
  int slowest_to = -1, slowest_from = -1;
  for (int r = 0; r < n; ++r) {
    const double* l = &all_[static_cast<size_t>(r * kSlot + kFigures)];
    for (int k = 0; k < 2; ++k) {
      const double* one = l + 3 * k;
      if (one[0] < 1 || one[2] <= 0) continue;
      const int from = static_cast<int>(one[0]) - 1;
      if (k == 1 && from == static_cast<int>(l[0]) - 1) continue;  // one sender: slowest and fastest alike
      links.push_back({from, r, one[1], one[2]});
      if (k == 0) {
        const double rate = one[1] / one[2] / 1e6;
        slowest_in.push_back(rate);
        if (rate < slowest_rate) slowest_rate = rate, slowest_to = r, slowest_from = from;
      }
    }
  }
  if (!slowest_in.empty()) {
    j["link_mb_s"] = json{{"min", slowest_rate}, {"median", median_of(slowest_in)},
                          {"max", *std::max_element(slowest_in.begin(), slowest_in.end())},
                          {"slowest", slowest_to}, {"from", slowest_from}};
  }
  out.json = j.dump();
  if (options_.window == 0 || n < 2) return out;
  links_.push_back(std::move(links));
  std::vector<double> arrive(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) arrive[static_cast<size_t>(r)] = all_[static_cast<size_t>(r * kSlot + 3)];
  steps_.push_back(median_of(arrive));
  if (static_cast<int64_t>(links_.size()) > options_.window) {
    links_.pop_front();
    steps_.pop_front();
  }
  // Each rank against the median of the others (at 2 ranks, the other one: a rank three times as
  // slow as its peer is 3x, not the 1.5x of the median of both).
  std::vector<double> others(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    std::vector<double> rest;
    for (int q = 0; q < n; ++q) {
      if (q != r) rest.push_back(compute[static_cast<size_t>(q)]);
    }
    others[static_cast<size_t>(r)] = median_of(rest);
  }
  compute_.push_back(compute);
  medians_.push_back(others);
  if (static_cast<int64_t>(compute_.size()) > options_.window) {
    compute_.pop_front();
    medians_.pop_front();
  }
  if (static_cast<int64_t>(compute_.size()) < options_.window) return out;
  std::vector<double> ratio(static_cast<size_t>(n), 0.0);
  for (int r = 0; r < n; ++r) {
    double sum = 0, median_sum = 0;
    for (size_t k = 0; k < compute_.size(); ++k) {
      sum += compute_[k][static_cast<size_t>(r)];
      median_sum += medians_[k][static_cast<size_t>(r)];
    }
    ratio[static_cast<size_t>(r)] = median_sum > 0 ? sum / median_sum : 0.0;
    // A rank slower than the others by less than (threshold - 1) / 2 of the window's time costs
    // them little: reads at most 1 (a compute of a tenth of the step, on a busy machine, varies
    // by half from step to step).
    if (sum - median_sum < (options_.threshold - 1) / 2 * window_time()) {
      ratio[static_cast<size_t>(r)] = std::min(ratio[static_cast<size_t>(r)], 1.0);
    }
  }
  // The units: each host of several ranks (when the job spans hosts), at its least slow rank's
  // ratio (a host is slow when every rank of it is), then each rank that an open episode of its
  // host does not cover.
  const bool many_hosts = std::any_of(hosts_.begin(), hosts_.end(), [&](const auto& h) { return h != hosts_[0]; });
  std::vector<bool> covered(static_cast<size_t>(n), false);
  // A link unit's rate (MB/s) and the other ranks' median rate, when named.
  double unit_mb_s = 0, unit_median_mb_s = 0;
  auto unit = [&](const std::string& kind, const std::string& key, const std::vector<int>& ranks, double r_ratio) {
    auto it = open_.find(key);
    const bool host = ranks.size() > 1;
    if (it == open_.end() && r_ratio >= options_.threshold) {
      StragglerEpisode e;
      e.kind = kind;
      e.mb_s = unit_mb_s;
      e.median_mb_s = unit_median_mb_s;
      e.step = step;
      e.rank = host ? -1 : ranks[0];
      e.ranks = ranks;
      e.host = hosts_[static_cast<size_t>(ranks[0])];
      e.ratio = e.peak_ratio = r_ratio;
      e.window = options_.window;
      e.threshold = options_.threshold;
      open_[key] = static_cast<int>(episodes_.size());
      episodes_.push_back(e);
      out.named.push_back(e);
      if (agreement_->communicator().rank() == 0 && kind == "link") {
        char text[160];
        std::snprintf(text, sizeof(text), "%.1f MB/s, %.3gx under the other ranks' median (%.1f MB/s)", e.mb_s,
                      r_ratio, e.median_mb_s);
        log_warn("straggler: " + e.who() + ": its fastest link to another host moved " + text + " over the last " +
                 std::to_string(options_.window) + " steps (step " + std::to_string(step) + "; threshold " +
                 std::to_string(options_.threshold).substr(0, 4) + "x): every rank waits for its data; look at "
                 "that host's network (its link's rate and errors, a shaping rule, a flapping NIC)");
      } else if (agreement_->communicator().rank() == 0) {
        char text[96];
        std::snprintf(text, sizeof(text), "%.2fx", r_ratio);
        log_warn("straggler: " + e.who() + " computed " + text + " the other ranks' median time over the last " +
                 std::to_string(options_.window) + " steps (step " + std::to_string(step) + "; threshold " +
                 std::to_string(options_.threshold).substr(0, 4) + "x): every rank waits for it at each step's "
                 "agreement; look at that host's load, clocks and throttling");
      }
    } else if (it != open_.end()) {
      auto& e = episodes_[static_cast<size_t>(it->second)];
      e.peak_ratio = std::max(e.peak_ratio, r_ratio);
      // Back when under the midpoint between 1 and the threshold: a unit that hovers at the
      // threshold is one episode, not one per crossing.
      if (r_ratio < 1 + (options_.threshold - 1) / 2) {
        e.end_step = step;
        out.recovered.push_back(e);
        open_.erase(it);
        if (agreement_->communicator().rank() == 0) {
          log_info("straggler: " + e.who() + (kind == "link" ? "'s links are" : " is") + " back near the median at step " + std::to_string(step) +
                   " (named at step " + std::to_string(e.step) + ")");
        }
      }
    }
    if (host && open_.count(key) > 0) {
      for (int r : ranks) covered[static_cast<size_t>(r)] = true;
    }
  };
  // The same units for compute, then for links (only between hosts: a job on one host has none).
  std::vector<double> rate;
  const auto link_ratio = link_ratios(rate);
  for (const std::string kind : {"compute", "link"}) {
    const auto& ratios = kind == "compute" ? ratio : link_ratio;
    const std::string prefix = kind == "compute" ? "" : "link ";
    std::fill(covered.begin(), covered.end(), false);
    // A unit's rate and the other ranks' median: of its least slow rank (a host: the one its ratio is of).
    auto set_rates = [&](int r) {
      unit_mb_s = kind == "link" ? rate[static_cast<size_t>(r)] / 1e6 : 0;
      unit_median_mb_s = ratios[static_cast<size_t>(r)] * unit_mb_s;
    };
    if (many_hosts) {
      std::map<std::string, std::vector<int>> by_host;
      for (int r = 0; r < n; ++r) by_host[hosts_[static_cast<size_t>(r)]].push_back(r);
      for (const auto& [h, ranks] : by_host) {
        if (ranks.size() < 2) continue;
        int least = ranks[0];
        for (int r : ranks) {
          if (ratios[static_cast<size_t>(r)] < ratios[static_cast<size_t>(least)]) least = r;
        }
        set_rates(least);
        unit(kind, prefix + "host " + h, ranks, ratios[static_cast<size_t>(least)]);
      }
    }
    for (int r = 0; r < n; ++r) {  // a covered rank's own episode, open from before, may still end
      const std::string key = prefix + "rank " + std::to_string(r);
      set_rates(r);
      if (!covered[static_cast<size_t>(r)] || open_.count(key) > 0) unit(kind, key, {r}, ratios[static_cast<size_t>(r)]);
    }
  }
  return out;
}

}  // namespace zeroshard
