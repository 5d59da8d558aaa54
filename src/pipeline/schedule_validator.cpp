// schedule_validator.cpp — a schedule's checks, and its run on the
// transport's semantics (posted sends and receives, FIFO channels, passes
// that wait for their data).
#include "zeroshard/pipeline_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

namespace zeroshard::pipeline {
namespace {

bool is_pass(Op op) { return op == Op::kForward || op == Op::kBackward; }
bool is_send(Op op) { return op == Op::kSendF || op == Op::kSendB; }
bool is_recv(Op op) { return op == Op::kRecvF || op == Op::kRecvB; }

std::string where(int rank, size_t step, const Action& a) {
  return "rank " + std::to_string(rank) + " step " + std::to_string(step) + " (" + to_string(a) + ")";
}

// The peer rank a send goes to or a receive comes from.
int peer_of(const Schedule& s, const Action& a) {
  const bool downstream = a.op == Op::kSendF || a.op == Op::kRecvB;
  return s.rank_of(downstream ? a.stage + 1 : a.stage - 1);
}

// A message in flight: the receive it is for, and the rank receiving it.
using MessageKey = std::tuple<int, int, int, int>;
MessageKey message(const Action& recv, int rank) {
  return {recv.stage, static_cast<int>(recv.op), recv.microbatch, rank};
}

// Each action in range, on the rank that holds its stage, with a neighbour to talk to.
void check_actions(const Schedule& s) {
  TORCH_CHECK_VALUE(s.ranks >= 1 && s.stages >= s.ranks && s.stages % s.ranks == 0 && s.microbatches >= 1,
                    "pipeline schedule: ", s.stages, " stages on ", s.ranks, " ranks with ", s.microbatches,
                    " microbatches; stages must be a positive multiple of the ranks");
  TORCH_CHECK_VALUE(static_cast<int>(s.actions.size()) == s.ranks, "pipeline schedule: ", s.actions.size(),
                    " action lists for ", s.ranks, " ranks");
  for (int r = 0; r < s.ranks; ++r) {
    const auto& list = s.actions[static_cast<size_t>(r)];
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      TORCH_CHECK_VALUE(a.stage >= 0 && a.stage < s.stages, "pipeline schedule: ", where(r, i, a), ": stage ",
                        a.stage, " of ", s.stages);
      TORCH_CHECK_VALUE(s.rank_of(a.stage) == r, "pipeline schedule: ", where(r, i, a), ": stage ", a.stage,
                        " lives on rank ", s.rank_of(a.stage), ", not rank ", r);
      const bool per_step = a.op == Op::kUnshard || a.op == Op::kReshard || a.op == Op::kReduceGrad;
      TORCH_CHECK_VALUE(per_step ? a.microbatch == -1 : (a.microbatch >= 0 && a.microbatch < s.microbatches),
                        "pipeline schedule: ", where(r, i, a), ": microbatch ", a.microbatch, " of ",
                        s.microbatches);
      const bool up = a.op == Op::kSendF || a.op == Op::kRecvB, down = a.op == Op::kSendB || a.op == Op::kRecvF;
      TORCH_CHECK_VALUE(!(up && a.stage == s.stages - 1) && !(down && a.stage == 0), "pipeline schedule: ",
                        where(r, i, a), ": stage ", a.stage, " has no ", up ? "next" : "previous", " stage");
    }
  }
}

// Every (stage, microbatch) has one F and then one B on its rank; every pass
// that needs data has its receive before it, and every result another stage
// needs has its send after it; per-step actions once, in their place.
void check_passes(const Schedule& s) {
  const int last = s.stages - 1;
  const bool training = !forward_only(s);
  for (int r = 0; r < s.ranks; ++r) {
    const auto& list = s.actions[static_cast<size_t>(r)];
    std::map<std::pair<Op, std::pair<int, int>>, size_t> seen;  // (op, (stage, microbatch)) -> step
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      const auto key = std::make_pair(a.op, std::make_pair(a.stage, a.microbatch));
      const auto [it, fresh] = seen.emplace(key, i);
      TORCH_CHECK_VALUE(fresh, "pipeline schedule: ", where(r, i, a), " repeats step ", it->second);
      auto before = [&](Op op) { return seen.count({op, {a.stage, a.microbatch}}) > 0; };
      auto stage_before = [&](Op op) { return seen.count({op, {a.stage, -1}}) > 0; };
      if (a.op == Op::kForward) {
        TORCH_CHECK_VALUE(a.stage == 0 || before(Op::kRecvF), "pipeline schedule: ", where(r, i, a),
                          " has no RECV_F", a.stage, "/", a.microbatch, " before it: its input never arrives");
      } else if (a.op == Op::kBackward) {
        TORCH_CHECK_VALUE(before(Op::kForward), "pipeline schedule: ", where(r, i, a), " comes before its forward ",
                          a.stage, "F", a.microbatch);
        TORCH_CHECK_VALUE(a.stage == last || before(Op::kRecvB), "pipeline schedule: ", where(r, i, a),
                          " has no RECV_B before it: the gradient of its output never arrives");
      } else if (a.op == Op::kSendF || a.op == Op::kSendB) {
        TORCH_CHECK_VALUE(before(a.op == Op::kSendF ? Op::kForward : Op::kBackward), "pipeline schedule: ",
                          where(r, i, a), " sends a result its rank has not computed yet");
      }
      TORCH_CHECK_VALUE(!(is_pass(a.op) && stage_before(Op::kReshard)), "pipeline schedule: ", where(r, i, a),
                        " runs after its stage's RESHARD");
      TORCH_CHECK_VALUE(!(a.op == Op::kBackward && stage_before(Op::kReduceGrad)), "pipeline schedule: ",
                        where(r, i, a), " runs after its stage's REDUCE_GRAD: that gradient would be lost");
    }
    for (int stage = r; stage < s.stages; stage += s.ranks) {
      for (int mb = 0; mb < s.microbatches; ++mb) {
        for (Op op : {Op::kForward, Op::kBackward}) {
          if (op == Op::kBackward && !training) continue;
          TORCH_CHECK_VALUE(seen.count({op, {stage, mb}}), "pipeline schedule: rank ", r, " never runs ",
                            to_string(Action{stage, op, mb}));
        }
        if (stage < last) {
          TORCH_CHECK_VALUE(seen.count({Op::kSendF, {stage, mb}}), "pipeline schedule: rank ", r,
                            " never sends the output of ", to_string(Action{stage, Op::kForward, mb}));
        }
        if (stage > 0 && training) {
          TORCH_CHECK_VALUE(seen.count({Op::kSendB, {stage, mb}}), "pipeline schedule: rank ", r,
                            " never sends the input gradient of ", to_string(Action{stage, Op::kBackward, mb}));
        }
      }
    }
  }
}

// Each channel (one queue per direction between two ranks) carries its sends
// to its receives in order: the k-th receive posted takes the k-th message.
void check_channels(const Schedule& s) {
  using Entry = std::pair<Action, std::pair<int, size_t>>;  // the receive it is, (rank, step) where
  std::map<std::pair<int, int>, std::vector<Entry>> sends, recvs;
  for (int r = 0; r < s.ranks; ++r) {
    const auto& list = s.actions[static_cast<size_t>(r)];
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      if (is_send(a.op)) sends[{r, peer_of(s, a)}].push_back({receive_for(a), {r, i}});
      if (is_recv(a.op)) recvs[{peer_of(s, a), r}].push_back({a, {r, i}});
    }
  }
  auto name = [&](const Entry& e) {
    return where(e.second.first, e.second.second, s.actions[static_cast<size_t>(e.second.first)][e.second.second]);
  };
  for (const auto& [ch, out] : sends) {
    const auto& in = recvs[ch];
    const std::string channel = "channel rank " + std::to_string(ch.first) + " -> rank " + std::to_string(ch.second);
    for (size_t k = 0; k < std::min(out.size(), in.size()); ++k) {
      TORCH_CHECK_VALUE(out[k].first == in[k].first, "pipeline schedule: ", channel, ": message ", k, " is ",
                        name(out[k]), " but the receive posted for it is ", name(in[k]),
                        "; receives between two ranks must be posted in the order of the sends (one queue per "
                        "direction), or each gets another microbatch's data");
    }
    TORCH_CHECK_VALUE(out.size() <= in.size(), "pipeline schedule: ", channel, ": ", name(out[in.size()]),
                      " is never received (", out.size(), " sends, ", in.size(), " receives)");
  }
  for (const auto& [ch, in] : recvs) {
    const size_t n = sends.count(ch) ? sends.at(ch).size() : 0;
    TORCH_CHECK_VALUE(in.size() <= n, "pipeline schedule: channel rank ", ch.first, " -> rank ", ch.second, ": ",
                      name(in[n]), " waits for a message that is never sent (", n, " sends, ", in.size(),
                      " receives)");
  }
}

// The rank × step grid, each rank's next action [marked], with why it waits.
std::string stuck_grid(const Schedule& s, const std::vector<size_t>& pc, const std::vector<std::string>& why) {
  std::ostringstream os;
  for (int r = 0; r < s.ranks; ++r) {
    const auto& list = s.actions[static_cast<size_t>(r)];
    os << "\n  rank " << r << ":";
    for (size_t i = 0; i < list.size(); ++i) {
      const bool here = i == pc[static_cast<size_t>(r)];
      os << (here ? " [" : " ") << to_string(list[i]) << (here ? "]" : "");
    }
    if (pc[static_cast<size_t>(r)] >= list.size()) os << "   (done)";
    if (!why[static_cast<size_t>(r)].empty()) os << "   <- " << why[static_cast<size_t>(r)];
  }
  return os.str();
}

}  // namespace

Simulation validate(const Schedule& s, const PassCosts& costs) {
  check_actions(s);
  check_passes(s);
  check_channels(s);
  const bool training = !forward_only(s);
  const double chunk = static_cast<double>(s.ranks) / s.stages;  // an interleaved rank's stage: 1/v of the work
  const size_t p = static_cast<size_t>(s.ranks);
  std::vector<size_t> pc(p, 0);
  std::vector<double> clock(p, 0.0);
  std::map<MessageKey, double> sent;  // message -> when sent
  std::vector<std::map<std::pair<int, int>, char>> in_flight(p);  // forwarded, not yet backwarded
  Simulation sim;
  sim.peak_in_flight.assign(p, 0);
  sim.busy.assign(p, 0.0);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < p; ++r) {
      const auto& list = s.actions[r];
      while (pc[r] < list.size()) {
        const Action& a = list[pc[r]];
        if (is_pass(a.op)) {
          const bool first = a.op == Op::kForward ? a.stage == 0 : a.stage == s.stages - 1;
          if (!first) {  // its data: the message its receive (posted earlier, checked above) takes
            const Action recv{a.stage, a.op == Op::kForward ? Op::kRecvF : Op::kRecvB, a.microbatch};
            auto it = sent.find(message(recv, static_cast<int>(r)));
            if (it == sent.end()) break;  // not sent yet: this rank waits
            clock[r] = std::max(clock[r], it->second);
          }
          const double cost = (a.op == Op::kForward ? costs.forward : costs.backward) * chunk;
          clock[r] += cost;
          sim.busy[r] += cost;
          auto& live = in_flight[r];
          if (a.op == Op::kForward && training) {  // a forward-only pass keeps nothing
            live[{a.stage, a.microbatch}] = 1;
            sim.peak_in_flight[r] = std::max(sim.peak_in_flight[r], static_cast<int>(live.size()));
          } else if (a.op == Op::kBackward) {
            live.erase({a.stage, a.microbatch});
          }
        } else if (is_send(a.op)) {
          sent[message(receive_for(a), peer_of(s, a))] = clock[r];
        }  // receives are posted (no wait); UNSHARD, RESHARD, REDUCE_GRAD take no pipeline time here
        ++pc[r];
        progress = true;
      }
    }
  }
  std::vector<std::string> why(p);
  bool stuck = false;
  for (size_t r = 0; r < p; ++r) {
    if (pc[r] >= s.actions[r].size()) continue;
    stuck = true;
    const Action& a = s.actions[r][pc[r]];
    const Action send = send_for(Action{a.stage, a.op == Op::kForward ? Op::kRecvF : Op::kRecvB, a.microbatch});
    why[r] = "waits for rank " + std::to_string(s.rank_of(send.stage)) + "'s " + to_string(send);
  }
  TORCH_CHECK_VALUE(!stuck, "pipeline schedule: deadlock: every unfinished rank waits for data that a waiting rank "
                    "would send. The rank x step grid, with each rank's waiting action [marked]:",
                    stuck_grid(s, pc, why));
  sim.makespan = *std::max_element(clock.begin(), clock.end());
  double busy = 0;
  for (double b : sim.busy) busy += b;
  sim.bubble = sim.makespan > 0 ? 1.0 - busy / (static_cast<double>(p) * sim.makespan) : 0.0;
  return sim;
}

}  // namespace zeroshard::pipeline
