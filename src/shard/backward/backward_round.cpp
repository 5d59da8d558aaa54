// backward_round.cpp — the backward protocol both front-ends share.
#include "shard/backward/backward_round.h"

#include "compat/autograd_hooks.h"
#include "zeroshard/log.h"

#include <c10/util/Exception.h>

namespace zeroshard::shard {
namespace {

thread_local BackwardRound::NestedBackward* innermost_nested = nullptr;

}  // namespace

BackwardRound::NestedBackward::NestedBackward() : outer_(innermost_nested) { innermost_nested = this; }

BackwardRound::NestedBackward::~NestedBackward() {
  innermost_nested = outer_;
  if (outer_ != nullptr) {
    for (auto& h : held_) outer_->held_.push_back(std::move(h));
    return;
  }
  // Back in the outer backward (also when the nested one threw: the outer one
  // then fails, and autograd drops its callbacks, which abandons the rounds).
  for (auto& h : held_) {
    try {
      compat::on_end_of_backward(h.end, h.abandon);
    } catch (...) {
      h.abandon();  // no backward to end with: the pass cannot complete
    }
  }
}

BackwardRound::BackwardRound(Client& client, std::string name, bool reduces_in_backward, bool every_backward,
                             std::vector<ShardGroup*> groups)
    : client_(client),
      name_(std::move(name)),
      reduces_in_backward_(reduces_in_backward),
      every_backward_(every_backward),
      groups_(std::move(groups)) {
  anchor_->round = this;
}

BackwardRound::~BackwardRound() {
  std::lock_guard<std::recursive_mutex> lock(anchor_->mu);
  anchor_->round = nullptr;
}

bool BackwardRound::begin() {
  if (in_pass_) return false;
  TORCH_CHECK(!frozen_, name_, ": backward() ran after clip_grad_norm() and before step(); the gradients were "
                        "already reduced and clipped for this step. Call clip_grad_norm() after the last backward "
                        "of the step");
  syncs_ = reduces_in_backward_ && every_backward_ && no_sync_depth_ == 0;
  next_launch_ = 0;
  client_.begin_pass();  // may throw (ZeRO-3's first-step order check): then no pass began
  in_pass_ = true;
  abandoned_ = false;
  if (reduces_in_backward_ && !syncs_) local_pending_ = true;
  const uint64_t pass = ++pass_;
  std::weak_ptr<Anchor> weak = anchor_;
  auto with_round = [weak](void (BackwardRound::*fn)(uint64_t), uint64_t p) {
    if (auto a = weak.lock()) {
      std::lock_guard<std::recursive_mutex> lock(a->mu);
      if (a->round != nullptr) (a->round->*fn)(p);
    }
  };
  auto on_end = [with_round, pass] { with_round(&BackwardRound::end, pass); };
  auto on_abandon = [with_round, pass] { with_round(&BackwardRound::abandon, pass); };
  if (innermost_nested != nullptr) {
    innermost_nested->held_.push_back({std::move(on_end), std::move(on_abandon)});
  } else {
    compat::on_end_of_backward(std::move(on_end), std::move(on_abandon));
  }
  return true;
}

void BackwardRound::end(uint64_t pass) {
  if (pass != pass_ || !in_pass_) return;
  in_pass_ = false;
  client_.end_pass();
}

void BackwardRound::abandon(uint64_t pass) {
  if (pass != pass_ || !in_pass_) return;  // a pass that already ended, or a later one is running
  in_pass_ = false;
  abandoned_ = true;
  reductions_.clear();  // each Work keeps its tensors until it finishes; its result is not wanted
  local_pending_ = false;
  next_launch_ = 0;
  client_.abandon_pass();
  for (auto* g : groups_) g->clear_gradient();
  if (on_abandon_) on_abandon_();
  // At debug level: the backward's own exception is what a person reads (one line per failure),
  // and a step() before the next backward says the rest (check_usable).
  log_debug(name_ + ": a backward pass ended with an exception part-way; this step's gradients were dropped "
                   "(call zero_grad() and run the step's backward passes again)");
}

void BackwardRound::enter_no_sync() {
  ++no_sync_depth_;
  // Decided here, not by which hooks fire, so every rank agrees that the step must reduce.
  if (reduces_in_backward_) local_pending_ = true;
}

void BackwardRound::launch_in_order(size_t count, const std::function<bool(size_t)>& ready,
                                    const std::function<void(size_t)>& launch) {
  while (next_launch_ < count && (ready == nullptr || ready(next_launch_))) launch(next_launch_++);
}

void BackwardRound::check_not_in_pass(const char* op) const {
  TORCH_CHECK(!in_pass_, name_, "::", op, ": called during backward");
}

void BackwardRound::check_usable(const char* op) {
  check_not_in_pass(op);
  if (abandoned_) {
    abandoned_ = false;
    TORCH_CHECK(false, name_, "::", op, ": the last backward pass ended with an exception part-way, so this "
                "step's gradients are incomplete; they were discarded. Call zero_grad() and run the step's "
                "backward passes again (ranks that did not fail may now be out of step: if only some ranks "
                "failed, restart from the last checkpoint)");
  }
}

}  // namespace zeroshard::shard
