// backward_round.h — the one backward protocol of ZeRO-0/1/2 and ZeRO-3.
//
// A round is one backward pass as the sharding sees it. Both front-ends
// (ShardedAdamW's buckets, fully_shard's units) call begin() from every
// autograd hook; the first call of a pass decides whether the pass reduces
// (not under no_sync(), and the front-end reduces in backward at all), resets
// the launch order and queues autograd's end-of-backward callback. When the
// pass ends the front-end's end_pass() launches what is left; when it ends
// with an exception instead, abandon: every reduction in flight is forgotten,
// the front-end drops its per-pass buffers (abandon_pass()), every shard
// group's gradient and noise measurement of this step is cleared, and the
// optimizer forgets the step's agreement and clipping. The next backward
// starts the step afresh; a step() before it refuses, naming the failure.
//
// Reductions launch in one fixed order on every rank (launch_in_order), so
// ranks issue the same collectives in the same order however autograd visits
// the parameters. The optimizer's core freezes the round once the step's
// gradients are reduced (a backward then is refused) and thaws it when the
// step ends.
//
// A backward nested inside another (activation_checkpoint recomputes its
// segment and runs an autograd backward of its own from inside the outer one)
// is part of the outer pass: a pass that begins there ends with the outer
// backward (NestedBackward), not after each checkpointed segment.
//
// Threads: hooks run on autograd's threads. Every method runs under the
// anchor's mutex, which is also the mutex the optimizer's core holds.
#pragma once

#include "shard/core/shard_group.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace zeroshard::shard {

class BackwardRound {
 public:
  // What a front-end does at the round's moments (under the anchor's mutex).
  class Client {
   public:
    virtual ~Client() = default;
    virtual void begin_pass() = 0;    // the first hook of a pass, after the round was reset
    virtual void end_pass() = 0;      // the pass ended: launch what is left (may throw out of backward)
    virtual void abandon_pass() = 0;  // it ended with an exception: drop per-pass buffers and state
  };

  // What autograd's hooks and callbacks hold: outlives the front-end.
  struct Anchor {
    std::recursive_mutex mu;
    BackwardRound* round = nullptr;  // null once the front-end is gone
  };

  // `name` prefixes errors ("ShardedAdamW"); `reduces_in_backward`: whether
  // backward passes reduce at all (ZeRO-1 never does); `every_backward`:
  // whether each pass reduces (else gradients accumulate in p.grad() and the
  // step reduces them once). `groups`: the shard groups an abandoned pass clears.
  BackwardRound(Client& client, std::string name, bool reduces_in_backward, bool every_backward,
                std::vector<ShardGroup*> groups);
  ~BackwardRound();
  BackwardRound(const BackwardRound&) = delete;
  BackwardRound& operator=(const BackwardRound&) = delete;

  std::recursive_mutex& mutex() const { return anchor_->mu; }
  // A function for autograd to hold: runs `fn` on the client, cast to the
  // front-end's type, under the mutex, while the front-end lives.
  template <class T>
  std::function<void()> guarded(std::function<void(T&)> fn) const {
    std::weak_ptr<Anchor> weak = anchor_;
    return [weak, fn = std::move(fn)] {
      if (auto a = weak.lock()) {
        std::lock_guard<std::recursive_mutex> lock(a->mu);
        if (a->round != nullptr) fn(static_cast<T&>(a->round->client_));
      }
    };
  }

  // While one lives on this thread, the backward passes autograd runs here
  // are nested inside an outer one (activation_checkpoint's recomputation):
  // a round that begins during it ends when the outer backward ends (or is
  // abandoned when it fails), because autograd's end-of-backward callback is
  // queued on the outer backward once the outermost NestedBackward ends.
  // Autograd runs a nested backward on the thread that asked for it.
  class NestedBackward {
   public:
    NestedBackward();
    ~NestedBackward();
    NestedBackward(const NestedBackward&) = delete;
    NestedBackward& operator=(const NestedBackward&) = delete;

   private:
    friend class BackwardRound;
    struct Held {
      std::function<void()> end, abandon;
    };
    NestedBackward* outer_;
    std::vector<Held> held_;  // the ends of rounds begun inside, for the outer backward
  };

  // From every hook. Returns true when this call began a pass.
  bool begin();
  bool in_pass() const { return in_pass_; }
  bool syncs() const { return syncs_; }  // this pass reduces its gradients

  // no_sync(): passes begun while the depth is > 0 leave gradients in p.grad().
  void enter_no_sync();
  void exit_no_sync() { --no_sync_depth_; }
  // Full gradients of this step wait in p.grad() (no_sync, or every_backward false).
  bool local_pending() const { return local_pending_; }
  void clear_local_pending() { local_pending_ = false; }

  // Launches `launch(k)` for k = next, next+1, ... < count while `ready(k)`
  // (all of them when `ready` is null). The position restarts with each pass.
  void launch_in_order(size_t count, const std::function<bool(size_t)>& ready,
                       const std::function<void(size_t)>& launch);
  size_t next_launch() const { return next_launch_; }
  void restart_order() { next_launch_ = 0; }
  ReductionQueue& reductions() { return reductions_; }
  const ReductionQueue& reductions() const { return reductions_; }

  // The optimizer's side. check_usable() throws when a pass is running, or
  // when the last pass was abandoned and none began since (the step's
  // gradients are incomplete; said once). freeze() after reducing the step's
  // gradients: backward is refused until end_step(), when the step is over
  // (done, skipped, discarded or replaced by a restore).
  void check_not_in_pass(const char* op) const;
  void check_usable(const char* op);
  void freeze() { frozen_ = true; }
  void end_step() {
    frozen_ = false;
    abandoned_ = false;
  }
  bool frozen() const { return frozen_; }
  // Called when a pass is abandoned, after the groups were cleared: the
  // optimizer forgets the step's agreement and clipping.
  void set_on_abandon(std::function<void()> fn) { on_abandon_ = std::move(fn); }

 private:
  void end(uint64_t pass);
  void abandon(uint64_t pass);

  Client& client_;
  const std::string name_;
  const bool reduces_in_backward_, every_backward_;
  std::vector<ShardGroup*> groups_;
  std::shared_ptr<Anchor> anchor_ = std::make_shared<Anchor>();
  std::function<void()> on_abandon_;
  ReductionQueue reductions_;
  uint64_t pass_ = 0;  // counts passes: a late callback of an earlier pass is ignored
  size_t next_launch_ = 0;
  int no_sync_depth_ = 0;
  bool in_pass_ = false, syncs_ = false, local_pending_ = false, abandoned_ = false, frozen_ = false;
};

}  // namespace zeroshard::shard
