// heal.cpp — the state of one shard position, broadcast from the source group.
#include "replica/heal.h"

#include "checksum.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <chrono>
#include <sstream>

namespace zeroshard::replica {

namespace {

// What must match between groups for a shard's state to mean the same: the parameters
// (names, shapes, dtypes) and each bucket's shard (its range in its flat layout).
std::string layout_of(const ShardedState& s) {
  std::ostringstream out;
  out << "stage " << s.zero_stage << ", shard " << s.shard_rank << ";";
  for (const auto& p : s.params) out << " " << p.describe();
  for (const auto& b : s.buckets) out << " [" << b.shard.begin << "," << b.shard.end << ")";
  return out.str();
}

// The tensors of the shard's state, in one order on every group.
std::vector<at::Tensor> state_tensors(const ShardedState& s) {
  std::vector<at::Tensor> out;
  for (const auto& b : s.buckets) {
    for (const auto* t : {&b.master, &b.exp_avg, &b.exp_avg_sq}) out.push_back(*t);
  }
  return out;
}

uint64_t checksum_of(const std::vector<at::Tensor>& tensors, const at::Tensor& scalars) {
  std::vector<uint64_t> parts;
  for (const auto& t : tensors) {
    const auto c = t.to(at::kCPU).contiguous();
    parts.push_back(checkpoint::digest_bytes(c.data_ptr(), c.nbytes()));
  }
  parts.push_back(checkpoint::digest_bytes(scalars.data_ptr(), scalars.nbytes()));
  return checkpoint::digest_bytes(parts.data(), parts.size() * sizeof(uint64_t));
}

}  // namespace

HealReport heal(Communicator& across, int source, ShardedOptimizer& opt) {
  TORCH_CHECK_VALUE(source >= 0 && source < across.size(), "heal: source group ", source, " of ", across.size());
  const auto t0 = std::chrono::steady_clock::now();
  const bool sending = across.rank() == source;
  ShardedState s = opt.sharded_state();
  const auto layouts = all_gather_text(across, layout_of(s));
  for (int g = 0; g < across.size(); ++g) {
    TORCH_CHECK(layouts[static_cast<size_t>(g)] == layouts[static_cast<size_t>(source)], "heal: group ", g,
                " holds its state in another layout than the source group ", source, " (", layouts[g].substr(0, 200),
                " against ", layouts[source].substr(0, 200), "): the groups must build the same model, "
                "optimizer and sharding");
  }
  HealReport r;
  const auto tensors = state_tensors(s);
  for (const auto& t : tensors) {
    across.broadcast(t, source)->wait();
    if (!sending) r.bytes += static_cast<int64_t>(t.nbytes());
  }
  // The step counts and the loss scale, as doubles (exact for counts below 2^53).
  auto scalars = torch::empty({static_cast<int64_t>(s.param_steps.size()) + 2}, torch::kDouble);
  for (size_t i = 0; i < s.param_steps.size(); ++i) scalars[static_cast<int64_t>(i)] = static_cast<double>(s.param_steps[i]);
  scalars[static_cast<int64_t>(s.param_steps.size())] = s.loss_scale;
  scalars[static_cast<int64_t>(s.param_steps.size()) + 1] = static_cast<double>(s.loss_scale_clean_steps);
  across.broadcast(scalars, source)->wait();
  if (!sending) r.bytes += static_cast<int64_t>(scalars.nbytes());
  r.checksum = checksum_of(tensors, scalars);
  const auto sums = all_gather_text(across, std::to_string(r.checksum));
  for (int g = 0; g < across.size(); ++g) {
    TORCH_CHECK(sums[static_cast<size_t>(g)] == sums[static_cast<size_t>(source)], "heal: group ", g,
                "'s state differs from the source group ", source, "'s after the transfer (xxh3 ", sums[g], " against ",
                sums[source], "): the transfer was damaged; the group must not train on it");
  }
  if (!sending) {
    std::vector<int64_t> steps(s.param_steps.size());
    for (size_t i = 0; i < steps.size(); ++i) steps[i] = static_cast<int64_t>(scalars[static_cast<int64_t>(i)].item<double>());
    opt.restore_sharded_state(steps, scalars[static_cast<int64_t>(steps.size())].item<double>(),
                              static_cast<int64_t>(scalars[static_cast<int64_t>(steps.size()) + 1].item<double>()));
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace zeroshard::replica
