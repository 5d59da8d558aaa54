// replica_groups.h — one replica group's part in a job of groups that trains on
// when a group is lost: the group registers in the coordinator (registration.h),
// and at each step boundary where the membership changed, or where the last
// step was lost, its ranks meet the live groups in a new communicator
// (group_comm.h), a group behind takes the state of one ahead (heal.h, with the
// trainer's step and the random generators), and the optimizer averages its
// reductions over the new communicator. Between those boundaries a step costs
// nothing more than the reductions across the groups: a change is learnt by a
// watch on the coordinator's keys (the group's first rank) and carried to the
// group's ranks in the step's one agreement.
//
//   ReplicaGroups groups(group, opt, agreement, options);
//   for (int64_t step = 0; step < steps;) {
//     const ReplicaTurn turn = groups.before_step(step);  // may move `step` (a heal)
//     ... this group's share of the global batch: turn.index of turn.count ...
//     try { backward; opt.step(); ++step; } catch (const ReplicaGroupLost& e) { groups.step_lost(e); }
//   }
//
// Thread-safety: the calls are the training thread's; a background thread of
// the group's first rank watches the coordinator.
#pragma once

#include "replica/etcd.h"
#include "replica/heal.h"
#include "replica/membership.h"
#include "replica/registration.h"
#include "zeroshard/comm.h"
#include "zeroshard/sharded_optimizer.h"
#include "zeroshard/step_agreement.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace zeroshard::replica {

struct ReplicaGroupsOptions {
  std::string coordinator;  // the etcd members: "etcd://HOST:PORT[,HOST:PORT...]"
  std::string job = "zeroshard";
  std::string group;        // this group's name in the job ([A-Za-z0-9._-], at most 64)
  std::chrono::seconds liveness{5};  // a group silent this long is lost (its lease's time to live)
  std::string listen_host = "127.0.0.1";  // where this rank listens for the other groups
  // A meeting of the groups (one membership's communicator, the heal): how long a rank waits
  // for the others to arrive.
  std::chrono::milliseconds meet_timeout = std::chrono::seconds(60);
  std::string config;  // what the groups must share (the global batch, the options), as text
};

// This group's place at a step.
struct ReplicaTurn {
  int index = 0, count = 1;  // the index-th of `count` live groups (in name order)
  int64_t generation = 0;    // the membership's
};

// A change of the groups that train, as the group saw it.
struct ReplicaChange {
  int64_t step = 0;        // the step taken next
  int64_t generation = 0;
  int groups = 0;          // live groups from then on
  double pause_seconds = 0;  // from the change seen (or the step lost) to the groups met again
  int64_t heal_bytes = 0;  // state this rank received (0: none)
  double heal_seconds = 0;
  bool step_retaken = false;  // the step in flight was lost and is taken again
};

class ReplicaGroups {
 public:
  // Collective over `group` (this group's ranks; its control communicator): its first rank
  // registers the group (refused by name when the live groups train another model, another
  // number of ranks or another configuration). `agreement`: the step's agreement `opt` runs
  // (joined to it here when it is not); null: one of its own over the group.
  ReplicaGroups(ProcessGroup group, ShardedOptimizer& opt, std::shared_ptr<StepAgreement> agreement,
                ReplicaGroupsOptions options);
  ~ReplicaGroups();  // leaves the job (the other groups see this one gone at once)
  ReplicaGroups(const ReplicaGroups&) = delete;
  ReplicaGroups& operator=(const ReplicaGroups&) = delete;

  // At a step boundary, before the step's batch is chosen: meets the live groups again when the
  // membership changed or the last step was lost. A group behind the others (one that joins, or
  // lost a step the others took) takes the state of the first group ahead, `step` and the
  // random generators included. Collective over the group (and, when they meet, the groups).
  ReplicaTurn before_step(int64_t& step);
  // The step threw ReplicaGroupLost: its gradients are discarded here, and the next
  // before_step() meets the groups again.
  void step_lost(const ReplicaGroupLost& e);

  const std::vector<ReplicaChange>& changes() const { return changes_; }
  const ReplicaTurn& turn() const { return turn_; }

 private:
  void meet(int64_t& step);  // the new membership, its communicator, the heal
  void watch();              // the first rank's background thread

  ProcessGroup group_;
  ShardedOptimizer& opt_;
  std::shared_ptr<StepAgreement> agreement_;
  int64_t slot_ = -1;
  ReplicaGroupsOptions options_;
  std::shared_ptr<Etcd> etcd_;
  std::unique_ptr<Registration> registration_;  // the first rank's
  std::unique_ptr<Membership> membership_;
  std::shared_ptr<Communicator> across_;
  ReplicaTurn turn_;
  bool met_ = false;
  bool lost_ = false;         // the last step was lost
  bool changed_ = false;      // the last agreement said the membership changed
  std::chrono::steady_clock::time_point since_;  // when the change or loss was seen
  std::vector<ReplicaChange> changes_;

  // The watch (first rank only).
  std::mutex mu_;
  MembershipView watched_;
  std::atomic<bool> seen_change_{false};
  std::atomic<bool> stopping_{false};
  std::thread watcher_;
};

}  // namespace zeroshard::replica
