// shard_topology.cpp — shard groups and replica groups from a data-parallel group.
#include "shard/core/shard_topology.h"

#include "runtime/host_name.h"
#include "zeroshard/sharded_optimizer.h"

#include <c10/util/Exception.h>

#include <map>
#include <numeric>
#include <vector>

namespace zeroshard::shard {
namespace {

// The ranks per host, when every host holds the same number of consecutive ranks.
int ranks_per_host(const ProcessGroup& group, const std::string& who) {
  const auto hosts = all_gather_text(*group.control, host_name());
  std::map<std::string, std::pair<int, int>> span;  // host -> (first rank, count)
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    auto [it, fresh] = span.emplace(hosts[r], std::make_pair(r, 0));
    TORCH_CHECK_VALUE(fresh || it->second.first + it->second.second == r, who, ": shard_size kShardPerHost needs each "
                      "host's ranks to be consecutive, but host '", hosts[r], "' holds rank ", r, " and rank ",
                      it->second.first, " with other hosts' ranks between them; launch the ranks host by host "
                      "(zeroshard-run and torchrun do) or give shard_size as a number");
    ++it->second.second;
  }
  const auto& first = *span.begin();
  for (const auto& [host, s] : span) {
    TORCH_CHECK_VALUE(s.second == first.second.second, who, ": shard_size kShardPerHost needs the same number of "
                      "ranks on every host, but host '", host, "' has ", s.second, " and host '", first.first, "' ",
                      first.second.second, "; give shard_size as a number that divides the ", hosts.size(), " ranks");
  }
  return first.second.second;
}

}  // namespace

std::string ShardTopology::describe() const {
  if (!hybrid()) return "";
  return " (hybrid: shard groups of " + std::to_string(shard_size) + " ranks, " + std::to_string(num_replicas) +
         " replicas)";
}

void ShardTopology::add_traffic(ShardedStats& stats, const Communicator& data) const {
  if (!hybrid()) return;
  stats.traffic += data.stats();
  stats.replica_traffic = replicas->stats();
  stats.traffic += stats.replica_traffic;
}

int resolve_shard_size(const ProcessGroup& group, int requested, const std::string& who) {
  const int n = group.data->size();
  TORCH_CHECK_VALUE(requested >= 0 || requested == kShardPerHost, who, ": shard_size is ", requested,
                    "; use 0 (every rank), kShardPerHost (", kShardPerHost, ": the ranks of one host) or a "
                    "number of ranks that divides the ", n, " ranks");
  const int s = requested == 0 ? n : requested == kShardPerHost ? ranks_per_host(group, who) : requested;
  TORCH_CHECK_VALUE(s <= n && n % s == 0, who, ": shard_size is ", s, " but there are ", n, " data-parallel ranks; "
                    "it must divide them (shard groups of shard_size ranks, replicated ", n, " / shard_size times)");
  return s;
}

ShardTopology make_shard_topology(const ProcessGroup& group, int requested, const std::string& who) {
  const int n = group.data->size(), r = group.data->rank();
  const int s = resolve_shard_size(group, requested, who);
  ShardTopology t;
  t.shard_size = s;
  t.shard_rank = r % s;
  t.num_replicas = n / s;
  t.replica_rank = r / s;
  if (t.num_replicas == 1) {
    t.shard = group.data;
    return t;
  }
  // Every rank takes part in every split; each keeps the one it belongs to.
  for (int g = 0; g < t.num_replicas; ++g) {
    std::vector<int> members(s);
    std::iota(members.begin(), members.end(), g * s);
    auto c = group.data->split(members);
    if (g == t.replica_rank) t.shard = std::move(c);
  }
  for (int j = 0; j < s; ++j) {
    std::vector<int> members;
    for (int g = 0; g < t.num_replicas; ++g) members.push_back(g * s + j);
    auto c = group.data->split(members);
    if (j == t.shard_rank) t.replicas = std::move(c);
  }
  TORCH_INTERNAL_ASSERT(t.shard != nullptr && t.replicas != nullptr);
  return t;
}

}  // namespace zeroshard::shard
