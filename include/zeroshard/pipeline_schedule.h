// zeroshard/pipeline_schedule.h — pipeline schedules as data: per rank of a pipeline, the list
// of actions it runs in one optimizer step (passes, sends and receives, and per stage UNSHARD,
// REDUCE_GRAD and RESHARD), with generators, a validator and a text form.
//
//   auto s = make_schedule(ScheduleKind::k1F1B, /*ranks=*/4, /*microbatches=*/8);
//   auto sim = validate(s);              // throws on any problem; else the simulated run
//   std::string text = to_text(s);       // one line per rank; from_text reads it back
//
// `ranks` (p) ranks hold `stages` = p·v stages, stage s on rank s mod p (v > 1: rank r holds
// stages r, r+p, r+2p, ...). Schedules are checked against zeroshard's transport: sends and
// receives are posted, and messages between two ranks arrive in send order (one queue per
// direction). Thread-safety: values and pure functions. How it works: docs/pipeline.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard::pipeline {

enum class Op { kForward, kBackward, kSendF, kRecvF, kSendB, kRecvB, kUnshard, kReshard, kReduceGrad };
// F, B, SEND_F, RECV_F, SEND_B, RECV_B, UNSHARD, RESHARD, REDUCE_GRAD.
std::string to_string(Op op);

// One action of one rank. SEND_F(s, m) sends the output of stage s's forward of microbatch m
// to stage s+1; RECV_F(s, m) receives stage s's input from stage s-1. SEND_B(s, m) sends the
// gradient of stage s's input to stage s-1; RECV_B(s, m) receives the gradient of stage s's
// output from stage s+1.
struct Action {
  int stage = 0;
  Op op = Op::kForward;
  int microbatch = -1;  // -1 for UNSHARD, RESHARD and REDUCE_GRAD (once per step)
  bool operator==(const Action& o) const { return stage == o.stage && op == o.op && microbatch == o.microbatch; }
  bool operator!=(const Action& o) const { return !(*this == o); }
};
// The receive that takes what `send` (SEND_F or SEND_B) sends: RECV_F(s+1, m)
// for SEND_F(s, m), RECV_B(s−1, m) for SEND_B(s, m).
Action receive_for(const Action& send);
// The send whose message `recv` (RECV_F or RECV_B) takes: the inverse of receive_for.
Action send_for(const Action& recv);
// "2F0", "1SEND_F3", "0REDUCE_GRAD": stage, op, microbatch (torch.distributed.pipelining's form).
std::string to_string(const Action& action);
// The inverse of to_string; throws naming the text on anything else.
Action parse_action(const std::string& text);

struct Schedule {
  int ranks = 1;         // p
  int stages = 1;        // p·v
  int microbatches = 1;  // m
  std::vector<std::vector<Action>> actions;  // per rank, in the order it runs them
  int rank_of(int stage) const { return stage % ranks; }
  bool operator==(const Schedule& o) const {
    return ranks == o.ranks && stages == o.stages && microbatches == o.microbatches && actions == o.actions;
  }
};

enum class ScheduleKind { kGPipe, k1F1B, kInterleaved1F1B, kForward };
// "gpipe", "1f1b", "interleaved-1f1b", "forward".
std::string to_string(ScheduleKind kind);
ScheduleKind parse_schedule_kind(const std::string& name);  // throws listing the names

// The forward and backward passes of each rank, in the order `kind` runs them (no
// communication; lower() adds it):
// - GPipe: every forward, then every backward.
// - 1F1B: p−r−1 warm-up forwards on rank r, then one forward and one backward in turn, then
//   the remaining backwards (PipeDream-Flush).
// - interleaved 1F1B: the same with `chunks` (v) stages per rank, microbatches taken p at a
//   time through each of a rank's stages in turn (Megatron-LM's).
// - forward: forwards only, for evaluation, through each rank's `chunks` stages.
// REQUIRES (throws naming the argument and the fix): ranks, microbatches, chunks >= 1;
// GPipe and 1F1B: chunks == 1; 1F1B: microbatches >= ranks; interleaved: chunks >= 2 and
// microbatches a multiple of ranks.
Schedule compute_schedule(ScheduleKind kind, int ranks, int microbatches, int chunks = 1);
// Whether `schedule` has no backward at all (a "forward" schedule).
bool forward_only(const Schedule& schedule);
// (p−1)/(v·m+p−1), with m microbatches and v = stages / p: the idle share of GPipe, 1F1B and
// interleaved 1F1B when every pass costs the same and sends are free.
double formula_bubble(const Schedule& schedule);

struct LoweringOptions {
  // UNSHARD each stage before its first pass and RESHARD it after its last (ZeRO-3 units
  // gathered once per step). Default: false.
  bool unshard = false;
  // REDUCE_GRAD each stage after its last backward. Default: true.
  bool reduce_grad = true;
};

// Adds the communication to a compute schedule: a SEND after each pass whose result another
// stage needs, and its RECV before the pass that needs it, posted in the order the sender
// sends (so each receive takes its own message).
Schedule lower(const Schedule& compute, const LoweringOptions& options = {});

// lower(compute_schedule(kind, ranks, microbatches, chunks), options).
Schedule make_schedule(ScheduleKind kind, int ranks, int microbatches, int chunks = 1,
                       const LoweringOptions& options = {});

// Cost of one stage's pass over one microbatch, in any unit. Default: 1 and 2.
struct PassCosts {
  double forward = 1;
  double backward = 2;
};

struct Simulation {
  double makespan = 0;                // when the last rank finishes
  double bubble = 0;                  // 1 − Σ busy / (p · makespan)
  std::vector<int> peak_in_flight;    // per rank: most (stage, microbatch) forwarded and not yet backwarded
  std::vector<double> busy;           // per rank: time spent in passes
};

// Checks `schedule` and simulates it on the transport's semantics with `costs` per stage pass
// (an interleaved rank's stage costs 1/v of them); one simulation decides every timing.
// Throws c10::Error for the first problem, naming the rank, the step (index in its list) and
// the action:
// - an action on a rank that does not hold its stage, or out of range;
// - a (stage, microbatch) without exactly one F and one B, or B before F;
// - a pass without its receive before it, a result without its send after it;
// - a channel whose receives are not its sends, in order;
// - a deadlock: the rank × step grid, each rank's stuck action [marked] with what it waits for.
Simulation validate(const Schedule& schedule, const PassCosts& costs = {});

// The text form: "pipeline-schedule ranks=P stages=S microbatches=M", then one line per rank,
// "rank R: A A A ..." (actions as to_string writes them).
std::string to_text(const Schedule& schedule);
Schedule from_text(const std::string& text);  // throws naming the line
// A hash of to_text(): ranks compare it before running a schedule.
uint64_t schedule_hash(const Schedule& schedule);

}  // namespace zeroshard::pipeline
