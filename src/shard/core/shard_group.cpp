// shard_group.cpp — a shard group's gradient accumulation and its update.
#include "shard/core/shard_group.h"

#include "comm/work.h"
#include "optim/grad_norm.h"
#include "zeroshard/log.h"
#include "zeroshard/trace.h"

#ifdef ZS_WITH_CUDA
#include "optim/cuda/fused_adamw_cuda.h"
#endif

#include <c10/util/Exception.h>

#include <chrono>
#include <limits>

namespace zeroshard::shard {

void ShardGroup::ensure_moments() {
  if (!exp_avg.defined()) exp_avg = at::zeros({shard.size()}, master.options());
  if (!exp_avg_sq.defined()) exp_avg_sq = at::zeros({shard.size()}, master.options());
}

void ShardGroup::accumulate_gradient(const at::Tensor& reduced) {
  if (!grad_shard.defined()) {
    grad_shard = reduced;  // adopt: no copy (16-bit when reduced in 16 bits)
    return;
  }
  if (grad_shard.scalar_type() != at::kFloat) grad_shard = grad_shard.to(at::kFloat);
  grad_shard.add_(reduced);
}

void ShardGroup::note_unreduced(const at::Tensor& in) {
  ++reductions;
  if (in.device().is_cpu()) {
    unreduced_host_sumsq += optim::sum_of_squares(in.contiguous().data_ptr(), in.scalar_type(), in.numel());
    return;
  }
  const auto sq = at::linalg_vector_norm(in, 2, c10::nullopt, false, at::kFloat).to(at::kDouble).square();
  unreduced_device_sumsq = unreduced_device_sumsq.defined() ? unreduced_device_sumsq + sq : sq;
}

optim::PendingSum ShardGroup::unreduced_sumsq() const {
  optim::PendingSum s;
  s.host = late_round ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(reductions) * unreduced_host_sumsq;
  if (unreduced_device_sumsq.defined()) s.device.push_back(unreduced_device_sumsq * static_cast<double>(reductions));
  return s;
}

void ShardGroup::clear_gradient() {
  grad_shard = at::Tensor();
  std::fill(had_grad.begin(), had_grad.end(), 0);
  reductions = 0;
  late_round = false;
  unreduced_host_sumsq = 0;
  unreduced_device_sumsq = at::Tensor();
}

void update_shard(ShardGroup& group, const EntryCoefficients& coeffs) {
  TORCH_INTERNAL_ASSERT(coeffs.size() == group.layout.params.size());
  bool any = false;
  for (const auto& c : coeffs) any = any || c.has_value();
  if (!any) return;
  TORCH_INTERNAL_ASSERT(group.grad_shard.defined(), "update_shard: no reduced gradient");
  group.ensure_moments();
  const bool low = group.values.scalar_type() != at::kFloat;  // 16-bit: write the rounded copy gathers send
  if (group.master.is_cuda()) {
#ifdef ZS_WITH_CUDA
    std::vector<optim::AdamWPiece> pieces;
    for (const auto& seg : group.segments) {
      if (const auto& c = coeffs[seg.param]) pieces.push_back({seg.flat.begin - group.shard.begin, seg.flat.size(), *c});
    }
    optim::fused_adamw_cuda(pieces, group.master, group.grad_shard, group.exp_avg, group.exp_avg_sq,
                            low ? group.values : at::Tensor());
    return;
#else
    TORCH_CHECK(false, "update_shard: this zeroshard was built without CUDA (ZS_WITH_CUDA=OFF or a CPU LibTorch) "
                "but the optimizer's state is on ", group.master.device(), "; rebuild against a CUDA LibTorch");
#endif
  }
  TORCH_CHECK(group.master.device().is_cpu(), "update_shard: no AdamW kernel for ", group.master.device(),
              " tensors; keep the optimizer's state on the CPU or a CUDA device");
  const auto gdt = group.grad_shard.scalar_type();
  const size_t gsize = group.grad_shard.element_size();
  const size_t vsize = group.values.element_size();
  for (const auto& seg : group.segments) {
    const auto& c = coeffs[seg.param];
    if (!c) continue;
    const int64_t begin = seg.flat.begin - group.shard.begin, n = seg.flat.size();
    optim::fused_adamw(*c, group.master.data_ptr<float>() + begin,
                       static_cast<const char*>(group.grad_shard.data_ptr()) + begin * gsize, gdt,
                       group.exp_avg.data_ptr<float>() + begin, group.exp_avg_sq.data_ptr<float>() + begin, n,
                       low ? static_cast<char*>(group.values.data_ptr()) + begin * vsize : nullptr,
                       group.values.scalar_type());
  }
}

const ReductionQueue::Entry& ReductionQueue::launch(Communicator& comm, ShardGroup& group, at::Tensor in,
                                                    bool in_is_scratch, std::string label, Input kind) {
  Entry e;
  e.group = &group;
  e.in = std::move(in);
  if (kind == Input::kPart) group.note_unreduced(e.in);
  if (kind == Input::kLate) group.note_late();
  if (comm.size() == 1) {  // the mean over one rank is the input itself: nothing to wait for
    e.out = in_is_scratch ? e.in : e.in.clone();
  } else if (group.layout.world_size == 1) {  // replicated: the whole mean on every rank
    e.out = in_is_scratch ? e.in : e.in.clone();
    e.work = comm.all_reduce(e.out, ReduceOp::kAvg);
  } else {
    e.out = at::empty({group.layout.shard_numel()}, e.in.options());
    e.work = comm.reduce_scatter(e.out, e.in, ReduceOp::kAvg);
  }
  e.across_replicas = replicas_ != nullptr && replicas_lost_.empty() &&
                      (replicas_kind_ == Replicas::kGroups || group.layout.world_size == comm.size());
  e.label = kind == Input::kLate ? std::move(label) + " (late)" : std::move(label);
  inflight_.push_back(std::move(e));
  start_replica_reductions();
  return inflight_.back();
}

void ReductionQueue::start_replica_reductions() {
  for (auto& e : inflight_) {
    if (!e.across_replicas || e.replica_work) continue;
    if (e.work && e.out.device().is_cpu() && !e.work->is_completed()) return;  // later ones start after it
    if (e.work) comm::block_current(*e.work, e.out.device());  // done on the CPU; on a device, ordered on the stream
    if (replicas_kind_ == Replicas::kHybrid) {
      e.replica_work = replicas_->all_reduce(e.out, ReduceOp::kAvg);
      continue;
    }
    try {
      e.replica_work = replicas_->all_reduce(e.out, ReduceOp::kAvg);
    } catch (const std::exception& err) {
      lose_replicas(err);
      return;
    }
  }
}

void ReductionQueue::lose_replicas(const std::exception& e) {
  if (replicas_lost_.empty()) replicas_lost_ = error_message(e);
  for (auto& other : inflight_) {
    if (!other.replica_work) other.across_replicas = false;  // the groups' communicator is gone: no more
  }
}

void ReductionQueue::wait_for(Work& work, const at::Tensor& out, const std::string& what) {
  const auto t0 = std::chrono::steady_clock::now();
  comm::block_current(work, out.device());  // on a device: orders the stream, no host wait
  waited_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (trace::enabled()) trace::record(what, "wait", t0);
}

ReductionQueue::Entry ReductionQueue::drain_oldest() {
  Entry& front = inflight_.front();
  if (front.across_replicas && !front.replica_work) {
    if (front.work) wait_for(*front.work, front.out, "wait for reduction of " + front.label);
    front.work.reset();
    start_replica_reductions();  // this one, and those behind it that are done
  }
  Entry e = std::move(front);
  inflight_.pop_front();
  if (e.replica_work && replicas_kind_ == Replicas::kGroups) {
    try {
      wait_for(*e.replica_work, e.out, "wait for the replica groups' reduction of " + e.label);
    } catch (const std::exception& err) {
      lose_replicas(err);  // `out` is this group's mean only: the step is abandoned
    }
  } else if (e.replica_work) {
    wait_for(*e.replica_work, e.out, "wait for the replicas' reduction of " + e.label);
  } else if (e.work) {
    wait_for(*e.work, e.out, "wait for reduction of " + e.label);
  }
  e.group->accumulate_gradient(e.out);
  return e;
}

void ReductionQueue::drain_to(size_t max_inflight, const std::function<void(const Entry&)>& drained) {
  while (inflight_.size() > max_inflight) {
    const Entry e = drain_oldest();
    if (drained) drained(e);
  }
}

}  // namespace zeroshard::shard
