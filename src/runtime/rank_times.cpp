// rank_times.cpp — every rank's step figures through the step's agreement; the straggler rule.
#include "zeroshard/rank_times.h"

#include "runtime/host_name.h"
#include "zeroshard/comm.h"
#include "zeroshard/log.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <map>
#include <cstdio>

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
  nlohmann::json j{{"step", step}, {"rank", rank}, {"ranks", ranks}, {"host", host}, {"ratio", ratio},
                   {"window", window}, {"threshold", threshold}, {"peak_ratio", peak_ratio}};
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
  hosts_ = all_gather_text(comm, options_.host.empty() ? host_name() : options_.host);
  began_ = steady_now_s();
  slot_ = agreement_->add_per_rank(
      "rank times", kFigures,
      [this](double* v) {
        mine_[3] = steady_now_s() - began_;
        std::copy(mine_, mine_ + kFigures, v);
      },
      [this](const double* all) {
        all_.assign(all, all + static_cast<size_t>(kFigures) * hosts_.size());
        read_at_ = agreement_->agreements() + 1;  // read before agree() counts itself
      });
}

RankTimes::~RankTimes() {
  if (agreement_ != nullptr) agreement_->remove(slot_);
}

void RankTimes::step_began() {
  began_ = steady_now_s();
  std::fill(mine_, mine_ + kFigures, 0.0);
}

void RankTimes::set(double compute_s, double data_wait_s, double exposed_comm_s) {
  mine_[0] = compute_s;
  mine_[1] = data_wait_s;
  mine_[2] = exposed_comm_s;
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
    for (int r = 0; r < n; ++r) v[static_cast<size_t>(r)] = all_[static_cast<size_t>(r * kFigures + f)];
    if (f == 0) compute = v;
    const auto slowest = std::max_element(v.begin(), v.end()) - v.begin();
    j[kNames[f]] = json{{"min", *std::min_element(v.begin(), v.end())}, {"median", median_of(v)},
                        {"max", v[static_cast<size_t>(slowest)]}, {"slowest", slowest}};
  }
  out.json = j.dump();
  if (options_.window == 0 || n < 2) return out;
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
  }
  // The units: each host of several ranks (when the job spans hosts), at its least slow rank's
  // ratio (a host is slow when every rank of it is), then each rank that an open episode of its
  // host does not cover.
  const bool many_hosts = std::any_of(hosts_.begin(), hosts_.end(), [&](const auto& h) { return h != hosts_[0]; });
  std::vector<bool> covered(static_cast<size_t>(n), false);
  auto unit = [&](const std::string& key, const std::vector<int>& ranks, double r_ratio) {
    auto it = open_.find(key);
    const bool host = ranks.size() > 1;
    if (it == open_.end() && r_ratio >= options_.threshold) {
      StragglerEpisode e;
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
      if (agreement_->communicator().rank() == 0) {
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
          log_info("straggler: " + e.who() + " is back near the median at step " + std::to_string(step) +
                   " (named at step " + std::to_string(e.step) + ")");
        }
      }
    }
    if (host && open_.count(key) > 0) {
      for (int r : ranks) covered[static_cast<size_t>(r)] = true;
    }
  };
  if (many_hosts) {
    std::map<std::string, std::vector<int>> by_host;
    for (int r = 0; r < n; ++r) by_host[hosts_[static_cast<size_t>(r)]].push_back(r);
    for (const auto& [h, ranks] : by_host) {
      if (ranks.size() < 2) continue;
      double least = ratio[static_cast<size_t>(ranks[0])];
      for (int r : ranks) least = std::min(least, ratio[static_cast<size_t>(r)]);
      unit("host " + h, ranks, least);
    }
  }
  for (int r = 0; r < n; ++r) {  // a covered rank's own episode, open from before, may still end
    const std::string key = "rank " + std::to_string(r);
    if (!covered[static_cast<size_t>(r)] || open_.count(key) > 0) unit(key, {r}, ratio[static_cast<size_t>(r)]);
  }
  return out;
}

}  // namespace zeroshard
