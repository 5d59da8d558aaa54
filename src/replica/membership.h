// membership.h — which replica groups train together, agreed through the
// coordinator: the job's membership key holds the names of the groups that
// train, and the revision it was last written at is the membership's
// generation, the same number on every group that reads it.
//
// agree() brings the key in line with the live groups (their registrations,
// registration.h): a group that finds them differ writes the live set with a
// compare-and-put on the key's revision, so concurrent writers converge on one
// value and one generation, whoever wins. A meeting of a generation (the
// communicator across groups, group_comm.h) is abandoned as soon as the key
// moves on or the live groups change, so no group waits for one that went to
// a newer generation or was lost.
#pragma once

#include "replica/etcd.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace zeroshard::replica {

// Thrown out of a meeting whose generation is no longer the membership.
class MembershipChanged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct MembershipView {
  int64_t generation = 0;            // the membership key's revision
  std::vector<std::string> groups;   // the groups that train, in name order
  int index = -1;                    // this group's place among them
};

class Membership {
 public:
  // `lease`: the group's registration's (0: any key of the name counts as this group's).
  Membership(std::shared_ptr<Etcd> etcd, std::string job, std::string me, int64_t lease = 0);

  // The membership of the live groups, once the coordinator's key holds exactly them (written
  // here when it does not), at a generation after `after`: a generation is met once (its
  // meeting's keys are used), so a group meeting again after a loss while the live groups are
  // still the same (the lost one's lease has not run out, or the loss was a link's blip) writes
  // the key again for a new one. Throws when this group is not live (its lease was lost: it must
  // register again) or when no agreement is reached within `timeout`.
  MembershipView agree(std::chrono::milliseconds timeout, int64_t after = 0);
  // Throws MembershipChanged when `generation` is no longer the membership: the key was
  // written since, or the live groups are no longer its groups.
  void check_current(const MembershipView& view);
  // Waits up to `timeout` for a change of the live groups after the view's generation;
  // whether one came.
  bool wait_for_change(const MembershipView& view, std::chrono::milliseconds timeout);

  std::string key() const;  // the membership key

 private:
  // *mine (if given): whether this group's key is on this group's lease.
  std::vector<std::string> live_groups(int64_t* revision = nullptr, bool* mine = nullptr);

  std::shared_ptr<Etcd> etcd_;
  std::string job_, me_;
  int64_t lease_ = 0;
};

}  // namespace zeroshard::replica
