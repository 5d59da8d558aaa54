// schedule_generators.cpp — GPipe, 1F1B and interleaved 1F1B, and the
// lowering that adds their communication.
#include "zeroshard/pipeline_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

namespace zeroshard::pipeline {
namespace {

Action pass(int stage, Op op, int microbatch) { return Action{stage, op, microbatch}; }

// One rank's order for 1F1B and its interleaved form: `warmup` forwards, then
// a forward and a backward in turn, then the remaining backwards.
std::vector<Action> one_f_one_b(const std::vector<Action>& forwards, const std::vector<Action>& backwards,
                                size_t warmup) {
  std::vector<Action> out(forwards.begin(), forwards.begin() + static_cast<std::ptrdiff_t>(warmup));
  size_t b = 0;
  for (size_t f = warmup; f < forwards.size(); ++f) {
    out.push_back(forwards[f]);
    out.push_back(backwards[b++]);
  }
  while (b < backwards.size()) out.push_back(backwards[b++]);
  return out;
}

}  // namespace

Schedule compute_schedule(ScheduleKind kind, int ranks, int microbatches, int chunks) {
  TORCH_CHECK_VALUE(ranks >= 1, "pipeline schedule: ranks is ", ranks, "; a pipeline has at least 1 rank");
  TORCH_CHECK_VALUE(microbatches >= 1, "pipeline schedule: microbatches is ", microbatches, "; use at least 1");
  const int p = ranks, m = microbatches;
  if (kind == ScheduleKind::kInterleaved1F1B) {
    TORCH_CHECK_VALUE(chunks >= 2, "pipeline schedule: interleaved-1f1b with ", chunks,
                      " stage(s) per rank; it needs at least 2 (with 1, use 1f1b)");
    TORCH_CHECK_VALUE(m % p == 0, "pipeline schedule: interleaved-1f1b takes microbatches ", p,
                      " at a time through each of a rank's stages, so microbatches (", m,
                      ") must be a multiple of the ranks (", p, "); use ", (m / p + 1) * p);
  } else if (kind == ScheduleKind::kForward) {
    TORCH_CHECK_VALUE(chunks >= 1, "pipeline schedule: forward with ", chunks, " stages per rank; use at least 1");
  } else {
    TORCH_CHECK_VALUE(chunks == 1, "pipeline schedule: ", to_string(kind), " places one stage per rank, not ", chunks,
                      "; use interleaved-1f1b for several");
  }
  TORCH_CHECK_VALUE(kind != ScheduleKind::k1F1B || m >= p, "pipeline schedule: 1f1b with ", m,
                    " microbatches on ", p, " ranks; 1F1B needs at least as many microbatches as ranks (", p,
                    "), or the pipeline never fills: use --micro-batches ", p, " or more, or gpipe");
  Schedule s;
  s.ranks = p;
  s.stages = p * chunks;
  s.microbatches = m;
  s.actions.resize(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& out = s.actions[static_cast<size_t>(r)];
    if (kind == ScheduleKind::kForward) {
      for (int mb = 0; mb < m; ++mb) {
        for (int c = 0; c < chunks; ++c) out.push_back(pass(c * p + r, Op::kForward, mb));
      }
    } else if (kind == ScheduleKind::kGPipe) {
      for (int mb = 0; mb < m; ++mb) out.push_back(pass(r, Op::kForward, mb));
      for (int mb = 0; mb < m; ++mb) out.push_back(pass(r, Op::kBackward, mb));
    } else if (kind == ScheduleKind::k1F1B) {
      std::vector<Action> f, b;
      for (int mb = 0; mb < m; ++mb) {
        f.push_back(pass(r, Op::kForward, mb));
        b.push_back(pass(r, Op::kBackward, mb));
      }
      out = one_f_one_b(f, b, static_cast<size_t>(std::min(p - r - 1, m)));
    } else {
      // Forwards run microbatches g·p .. g·p+p−1 through the rank's stages
      // r, r+p, ... in turn; backwards through them in reverse.
      const int v = chunks, total = v * m;
      std::vector<Action> f, b;
      for (int k = 0; k < total; ++k) {
        const int group = k / (p * v), chunk = (k % (p * v)) / p, mb = group * p + k % p;
        f.push_back(pass(chunk * p + r, Op::kForward, mb));
        b.push_back(pass((v - 1 - chunk) * p + r, Op::kBackward, mb));
      }
      const int warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
      out = one_f_one_b(f, b, static_cast<size_t>(warmup));
    }
  }
  return s;
}

Schedule lower(const Schedule& compute, const LoweringOptions& options) {
  Schedule s = compute;
  const int last = compute.stages - 1;
  // Pass 1: each pass followed by its send; this fixes every channel's order.
  std::map<std::pair<int, int>, std::vector<Action>> channel;  // (from, to) -> receives, in send order
  std::vector<std::vector<Action>> with_sends(compute.actions.size());
  for (size_t r = 0; r < compute.actions.size(); ++r) {
    for (const auto& a : compute.actions[r]) {
      with_sends[r].push_back(a);
      Action send;
      if (a.op == Op::kForward && a.stage < last) {
        send = pass(a.stage, Op::kSendF, a.microbatch);
      } else if (a.op == Op::kBackward && a.stage > 0) {
        send = pass(a.stage, Op::kSendB, a.microbatch);
      } else {
        continue;
      }
      with_sends[r].push_back(send);
      const Action recv = receive_for(send);
      channel[{compute.rank_of(send.stage), compute.rank_of(recv.stage)}].push_back(recv);
    }
  }
  // Pass 2: before a pass that needs a message, post the receives of its
  // channel up to that message, in the sender's order.
  std::map<std::pair<int, int>, size_t> posted;
  for (size_t r = 0; r < with_sends.size(); ++r) {
    auto& out = s.actions[r];
    out.clear();
    std::set<int> unsharded;
    for (const auto& a : with_sends[r]) {
      if (options.unshard && (a.op == Op::kForward || a.op == Op::kBackward) && unsharded.insert(a.stage).second) {
        out.push_back(pass(a.stage, Op::kUnshard, -1));
      }
      const bool needs = (a.op == Op::kForward && a.stage > 0) || (a.op == Op::kBackward && a.stage < last);
      if (needs) {
        const Action recv = a.op == Op::kForward ? pass(a.stage, Op::kRecvF, a.microbatch)
                                                 : pass(a.stage, Op::kRecvB, a.microbatch);
        const int from = compute.rank_of(a.op == Op::kForward ? a.stage - 1 : a.stage + 1);
        const auto key = std::make_pair(from, static_cast<int>(r));
        const auto& queue = channel[key];
        auto& next = posted[key];
        const auto it = std::find(queue.begin(), queue.end(), recv);
        TORCH_CHECK(it != queue.end(), "pipeline lower: rank ", r, "'s ", to_string(a), " needs ", to_string(recv),
                    " but rank ", from, " never sends it (the compute schedule lacks a pass)");
        for (const size_t upto = static_cast<size_t>(it - queue.begin()); next <= upto; ++next) out.push_back(queue[next]);
      }
      out.push_back(a);
    }
    // Per stage, after its last backward: the reduction of its gradients, then
    // the release (a forward-only schedule: the release after its last forward).
    const bool training = !forward_only(compute);
    for (int stage = static_cast<int>(r); stage < compute.stages; stage += compute.ranks) {
      const auto last = std::find_if(out.rbegin(), out.rend(), [&](const Action& x) {
        return x.stage == stage && (training ? x.op == Op::kBackward || x.op == Op::kSendB
                                             : x.op == Op::kForward || x.op == Op::kSendF);
      });
      auto at = last.base();  // after it
      if (options.reduce_grad && training) at = out.insert(at, pass(stage, Op::kReduceGrad, -1)) + 1;
      if (options.unshard) out.insert(at, pass(stage, Op::kReshard, -1));
    }
  }
  return s;
}

Schedule make_schedule(ScheduleKind kind, int ranks, int microbatches, int chunks, const LoweringOptions& options) {
  return lower(compute_schedule(kind, ranks, microbatches, chunks), options);
}

}  // namespace zeroshard::pipeline
