// registration.h — a replica group's place in its job, held in the coordinator
// (etcd.h): the group's key, under the job's prefix, lives on a lease the group
// renews, so the key goes when the group stops (a process or host lost, a link
// cut) within the liveness window, and every other group's watch sees it go.
//
// Registering checks the group against the live groups: the same model (its
// parameters' hash), the same ranks per group and the same configuration, or
// it is refused by name, before it trains a step; and a group of the same name
// still registered a liveness window later is another live process (a duplicate
// launch), refused too. One started again after it was lost (its launcher's
// restart) revokes its old lease at once when the old process ran on this machine
// and is gone, so the other groups need not wait for it to expire; one started
// elsewhere waits it out.
// Thread-safety: one thread renews the lease in the background; the calls are
// safe from any thread.
#pragma once

#include "replica/etcd.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace zeroshard::replica {

// What a group says of itself when it registers.
struct GroupInfo {
  std::string group;   // its name in the job: "0", "host-a", ... ([A-Za-z0-9._-], at most 64)
  int ranks = 0;       // ranks per group (the shards of its state)
  std::string model;   // a hash of the model's parameters (names, shapes, dtypes)
  std::string config;  // what the groups must share (the optimizer's options, the global batch, ...), as text
  std::string host;    // where its first rank runs (for messages)
  int64_t pid = 0;     // its first rank's process
  // Where `pid` names that process: the boot's id and the pid namespace (set by Registration).
  // A group started again on the same machine finds its old process gone by it.
  std::string processes;
};

class Registration {
 public:
  // Registers `me` in `job` with a lease of `liveness` (renewed every third of it).
  // Throws, naming the difference and the fix, when a live group of the job has
  // another model, ranks per group or configuration, or one of the same name is still live
  // after `liveness` (its old lease, when this group was started again, runs out by then);
  // and in one line when the coordinator cannot be reached.
  Registration(Etcd& etcd, std::string job, GroupInfo me, std::chrono::seconds liveness);
  ~Registration();  // leaves: the lease revoked (its key goes at once), the renewals stopped
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  // The job's live groups, in name order, and the coordinator's revision read at.
  std::vector<GroupInfo> live(int64_t* revision = nullptr);
  // Changes to the job's groups after `revision` (joins and losses), waiting up to `timeout`.
  std::vector<WatchEvent> changes(int64_t revision, std::chrono::milliseconds timeout);
  // Whether this group's lease is still held (false once a renewal found it expired:
  // the others count this group as lost; it must register again).
  bool held() const { return held_; }
  const GroupInfo& info() const { return me_; }
  int64_t lease() const { return lease_; }
  std::string key() const;  // this group's key in the coordinator

  // The prefix of a job's group keys.
  static std::string groups_prefix(const std::string& job);

 private:
  void renew();  // the background thread

  Etcd& etcd_;
  std::string job_;
  GroupInfo me_;
  std::chrono::seconds liveness_;
  int64_t lease_ = 0;
  std::atomic<bool> held_{true};
  std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread renewer_;
};

// The JSON a group's key holds, and back (throws naming the key when it is not one).
std::string to_json(const GroupInfo& g);
GroupInfo group_from_json(const std::string& text, const std::string& key);

}  // namespace zeroshard::replica
