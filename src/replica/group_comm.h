// group_comm.h — the communicator across the live replica groups, formed in
// process through the coordinator: no launcher, no server of its own, no
// restart. Its ranks meet in an EtcdStore (a c10d::Store over etcd keys under
// one membership generation's prefix) and connect as any TCP communicator
// does (comm/tcp_communicator.h); a new membership forms a new one under its
// own generation, while the survivors keep their processes and their state.
#pragma once

#include "replica/etcd.h"
#include "zeroshard/comm.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard::replica {

// A c10d::Store over the etcd keys under `prefix`: set, get (waiting for the key up to
// the timeout), compareSet and add (atomic: a compare-and-put on the key's revision),
// check, wait, deleteKey and getNumKeys, as the TCP communicator's rendezvous uses them.
// `still_valid` (optional) runs before every check (so in every wait's polls): it throws to
// abandon the meeting (the membership it was for is gone).
class EtcdStore : public c10d::Store {
 public:
  EtcdStore(std::shared_ptr<Etcd> etcd, std::string prefix, std::chrono::milliseconds timeout,
            std::function<void()> still_valid = {});
#if TORCH_VERSION_MAJOR >= 2
  c10::intrusive_ptr<c10d::Store> clone() override;
#endif
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  std::shared_ptr<Etcd> etcd_;
  std::string prefix_;
  std::function<void()> still_valid_;
};

struct GroupCommOptions {
  std::string listen_host = "127.0.0.1";  // the address this rank listens on for the other groups
  CommOptions comm;                       // its rendezvous timeout bounds the meeting
};

// The communicator of one shard position (`position`: this rank's rank within its group)
// across the `count` live groups of membership `generation` (a revision of the coordinator:
// the same number on every group that saw the same membership), in which this group is the
// `index`-th (live groups in name order). Collective over those groups' ranks at `position`;
// a group missing from the meeting makes it time out naming the missing index. `still_current`
// (optional; Membership::check_current) runs as the meeting waits and throws to abandon it.
std::shared_ptr<Communicator> connect_groups(const std::shared_ptr<Etcd>& etcd, const std::string& job,
                                             int64_t generation, int position, int index, int count,
                                             const GroupCommOptions& options,
                                             const std::function<void()>& still_current = {});

// The coordinator's keys of the meetings of generations before `generation` (finished
// with): removed.
void forget_meetings(Etcd& etcd, const std::string& job, int64_t generation);

}  // namespace zeroshard::replica
