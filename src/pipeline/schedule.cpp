// schedule.cpp — actions, kinds, and the text form of a schedule.
#include "zeroshard/pipeline_schedule.h"

#include <c10/util/Exception.h>
#include <xxhash.h>

#include <array>
#include <cctype>
#include <cstdio>
#include <sstream>
#include <utility>

namespace zeroshard::pipeline {
namespace {

constexpr std::array<std::pair<Op, const char*>, 9> kOpNames{{{Op::kForward, "F"},
                                                               {Op::kBackward, "B"},
                                                               {Op::kSendF, "SEND_F"},
                                                               {Op::kRecvF, "RECV_F"},
                                                               {Op::kSendB, "SEND_B"},
                                                               {Op::kRecvB, "RECV_B"},
                                                               {Op::kUnshard, "UNSHARD"},
                                                               {Op::kReshard, "RESHARD"},
                                                               {Op::kReduceGrad, "REDUCE_GRAD"}}};

bool per_step(Op op) { return op == Op::kUnshard || op == Op::kReshard || op == Op::kReduceGrad; }

// Reads a non-negative decimal number at text[pos...]; returns the digits consumed (0: none).
size_t read_number(const std::string& text, size_t pos, int& value) {
  size_t n = 0;
  value = 0;
  while (pos + n < text.size() && std::isdigit(static_cast<unsigned char>(text[pos + n])) && n < 9) {
    value = value * 10 + (text[pos + n] - '0');
    ++n;
  }
  return n;
}

}  // namespace

std::string to_string(Op op) {
  for (const auto& [o, name] : kOpNames) {
    if (o == op) return name;
  }
  return "?";
}

Action receive_for(const Action& send) {
  TORCH_CHECK(send.op == Op::kSendF || send.op == Op::kSendB, "receive_for: ", to_string(send), " is not a send");
  return send.op == Op::kSendF ? Action{send.stage + 1, Op::kRecvF, send.microbatch}
                               : Action{send.stage - 1, Op::kRecvB, send.microbatch};
}

Action send_for(const Action& recv) {
  TORCH_CHECK(recv.op == Op::kRecvF || recv.op == Op::kRecvB, "send_for: ", to_string(recv), " is not a receive");
  return recv.op == Op::kRecvF ? Action{recv.stage - 1, Op::kSendF, recv.microbatch}
                               : Action{recv.stage + 1, Op::kSendB, recv.microbatch};
}

std::string to_string(const Action& action) {
  std::string s = std::to_string(action.stage) + to_string(action.op);
  if (!per_step(action.op)) s += std::to_string(action.microbatch);
  return s;
}

Action parse_action(const std::string& text) {
  Action a;
  const size_t digits = read_number(text, 0, a.stage);
  size_t pos = digits;
  bool found = false;
  // Longest name first, so that "SEND_F" is not read as something shorter.
  size_t best = 0;
  for (const auto& [op, name] : kOpNames) {
    const size_t len = std::char_traits<char>::length(name);
    if (len > best && text.compare(pos, len, name) == 0) {
      a.op = op;
      best = len;
      found = true;
    }
  }
  pos += best;
  const size_t mb_digits = per_step(a.op) ? 0 : read_number(text, pos, a.microbatch);
  TORCH_CHECK_VALUE(digits > 0 && found && (per_step(a.op) || mb_digits > 0) && pos + mb_digits == text.size(),
                    "pipeline schedule: '", text, "' is not an action; write stage, op and microbatch, as in "
                    "'2F0', '1SEND_B3' or '0REDUCE_GRAD' (ops: F, B, SEND_F, RECV_F, SEND_B, RECV_B, UNSHARD, "
                    "RESHARD, REDUCE_GRAD)");
  if (per_step(a.op)) a.microbatch = -1;
  return a;
}

std::string to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kInterleaved1F1B: return "interleaved-1f1b";
    case ScheduleKind::kForward: return "forward";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B, ScheduleKind::kForward}) {
    if (to_string(kind) == name) return kind;
  }
  TORCH_CHECK_VALUE(false, "pipeline schedule: unknown schedule '", name,
                    "'; use gpipe, 1f1b or interleaved-1f1b (or forward, for evaluation)");
}

double formula_bubble(const Schedule& s) {
  const int v = s.stages / s.ranks;
  return static_cast<double>(s.ranks - 1) / (v * s.microbatches + s.ranks - 1);
}

bool forward_only(const Schedule& schedule) {
  for (const auto& list : schedule.actions) {
    for (const auto& a : list) {
      if (a.op == Op::kBackward || a.op == Op::kSendB || a.op == Op::kRecvB || a.op == Op::kReduceGrad) return false;
    }
  }
  return true;
}

std::string to_text(const Schedule& schedule) {
  std::ostringstream os;
  os << "pipeline-schedule ranks=" << schedule.ranks << " stages=" << schedule.stages
     << " microbatches=" << schedule.microbatches << "\n";
  for (size_t r = 0; r < schedule.actions.size(); ++r) {
    os << "rank " << r << ":";
    for (const auto& a : schedule.actions[r]) os << " " << to_string(a);
    os << "\n";
  }
  return os.str();
}

Schedule from_text(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  Schedule s;
  TORCH_CHECK_VALUE(std::getline(in, line) && std::sscanf(line.c_str(), "pipeline-schedule ranks=%d stages=%d microbatches=%d",
                                                            &s.ranks, &s.stages, &s.microbatches) == 3,
                    "pipeline schedule: the first line is '", line.substr(0, 80),
                    "'; expected 'pipeline-schedule ranks=P stages=S microbatches=M'");
  TORCH_CHECK_VALUE(s.ranks >= 1 && s.stages >= 1 && s.microbatches >= 1, "pipeline schedule: '", line,
                    "' needs ranks, stages and microbatches >= 1");
  s.actions.resize(static_cast<size_t>(s.ranks));
  for (int r = 0; r < s.ranks; ++r) {
    const std::string want = "rank " + std::to_string(r) + ":";
    TORCH_CHECK_VALUE(std::getline(in, line) && line.compare(0, want.size(), want) == 0, "pipeline schedule: line ",
                      r + 2, " is '", line.substr(0, 80), "'; expected '", want, " ...' (one line per rank, in order)");
    std::istringstream words(line.substr(want.size()));
    std::string word;
    while (words >> word) s.actions[static_cast<size_t>(r)].push_back(parse_action(word));
  }
  while (std::getline(in, line)) {
    TORCH_CHECK_VALUE(line.find_first_not_of(" \t\r") == std::string::npos, "pipeline schedule: '",
                      line.substr(0, 80), "' after the last rank's line (", s.ranks, " ranks in the header)");
  }
  return s;
}

uint64_t schedule_hash(const Schedule& schedule) {
  const std::string text = to_text(schedule);
  return XXH3_64bits(text.data(), text.size());
}

}  // namespace zeroshard::pipeline
