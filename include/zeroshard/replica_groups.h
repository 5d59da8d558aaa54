// zeroshard/replica_groups.h — replica groups that train on when one is lost: a
// job of R groups, each holding the whole model state (sharded over its own ranks
// at any ZeRO stage), whose gradients are averaged across the live groups. A
// group lost mid-step (a rank or host killed, a link cut) costs the others that
// step, taken again, and a pause: they abandon it as one, meet again among the
// live groups in the same processes, and split the same global batch over
// fewer groups, so every sample is still trained once. A group that joins (or
// returns) takes the state of a live group at a step boundary, verified by
// checksums. The groups meet through a coordinator (etcd): a lease per group
// for its liveness, a membership key whose revision is the generation, and a
// watch to learn of a change, carried to the group's ranks in the step's one
// agreement; a step costs nothing else.
//
//   zeroshard::ReplicaGroups groups(group, opt, agreement, options);
//   for (int64_t step = 0; step < steps;) {
//     const ReplicaTurn turn = groups.before_step(step);  // may move `step` (a heal)
//     ... this group's share of the global batch: turn.index of turn.count ...
//     try { backward; opt.step(); ++step; } catch (const ReplicaGroupLost& e) { groups.step_lost(e); }
//   }
//
// Each group is launched on its own (zeroshard-run, torchrun or srun per group:
// its ranks are this group's communicator) and names the coordinator, etcd
// (Debian's etcd-server; docs/cluster.md). Inside a group any ZeRO stage; the
// other groups are its replicas (no hybrid sharding inside a group).
// Thread-safety: the calls are the training thread's; a background thread of
// the group's first rank watches the coordinator. Link zeroshard::replica.
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/sharded_optimizer.h"
#include "zeroshard/step_agreement.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

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
  // A group alone with no state (step 0) in a job whose groups reached a later step (the
  // coordinator's record; every group that held the state was lost): true waits for a live group
  // to take the state from; false throws, naming the job's step and the fixes. A group alone with
  // a checkpoint's state (a step > 0) trains from it, saying which steps it takes again.
  bool wait_when_alone = true;
};

// This group's place at a step.
struct ReplicaTurn {
  int index = 0, count = 1;  // the index-th of `count` live groups (in name order)
  int64_t generation = 0;    // the membership's
};

// A change of the groups that train, as this rank saw it.
struct ReplicaChange {
  int64_t step = 0;           // the step taken next
  int64_t generation = 0;
  int groups = 0;             // live groups from then on
  double pause_seconds = 0;   // from the change seen (or the start of the step lost) to the groups met again
  int64_t heal_bytes = 0;     // state this rank received (0: none)
  double heal_seconds = 0;
  bool step_retaken = false;  // the step in flight was lost and is taken again
};

class ReplicaGroups {
 public:
  // Collective over `group` (this group's ranks; its control communicator): its first rank
  // registers the group (refused by name when the live groups train another model, another
  // number of ranks or another configuration; in one line when the coordinator cannot be
  // reached). `agreement`: the step's agreement `opt` runs (joined to it here when it is not);
  // null: one of its own over the group. REQUIRES: `opt` outlives this object.
  ReplicaGroups(ProcessGroup group, ShardedOptimizer& opt, std::shared_ptr<StepAgreement> agreement,
                ReplicaGroupsOptions options);
  ~ReplicaGroups();  // leaves the job (the other groups see this one gone at once)
  // Throws in one line, naming the fix, when `options.coordinator` does not parse or no member
  // of it answers: a check a trainer can run before its slow set-up. No collective.
  static void check_coordinator(const ReplicaGroupsOptions& options);
  ReplicaGroups(const ReplicaGroups&) = delete;
  ReplicaGroups& operator=(const ReplicaGroups&) = delete;

  // The trainer's own state a group behind takes with the step (its sampler's position, its
  // records), as text: `send` runs on the group it comes from, `receive` on the groups behind.
  void on_heal(std::function<std::string()> send, std::function<void(const std::string&)> receive);
  // At a step boundary, before the step's batch is chosen: meets the live groups again when the
  // membership changed or the last step was lost. A group behind the others (one that joins, or
  // lost a step the others took) takes the state of the first group ahead, `step` and the CPU's
  // random generator included. Collective over the group (and, when they meet, the groups).
  ReplicaTurn before_step(int64_t& step);
  // The step threw ReplicaGroupLost: its gradients are discarded here, and the next
  // before_step() meets the groups again.
  void step_lost(const ReplicaGroupLost& e);
  // `values` summed over the live groups (each group's the same on its ranks: e.g. the step's
  // loss), after the step, on this shard position's communicator across them; as they are when
  // the group trains alone. False when a group was lost meanwhile: `values` are then this group's,
  // and the group's next step throws ReplicaGroupLost on every rank (not only where this failed),
  // so that its ranks meet again together.
  bool sum_across(std::vector<double>& values);

  const std::vector<ReplicaChange>& changes() const;
  const ReplicaTurn& turn() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
