// gradient_norms.cpp — the norms slot of a step's agreement.
#include "shard/optimizer/gradient_norms.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace zeroshard::shard {

GradientNorms::GradientNorms(std::shared_ptr<StepAgreement> agreement, std::string name, int ranks)
    : agreement_(std::move(agreement)), ranks_(ranks) {
  TORCH_CHECK_VALUE(agreement_ != nullptr, "GradientNorms: the agreement is null");
  TORCH_CHECK_VALUE(ranks_ > 0, "GradientNorms: ", ranks_, " data-parallel ranks");
  slot_ = agreement_->add(std::move(name), kWidth, [this](double* v) { fill(v); }, [this](const double* v) { read(v); });
}

GradientNorms::~GradientNorms() { agreement_->remove(slot_); }

int64_t GradientNorms::join(Fill fill, Read read, Late late) {
  members_.push_back({next_id_, std::move(fill), std::move(read), std::move(late)});
  return next_id_++;
}

void GradientNorms::leave(int64_t id) {
  members_.erase(std::remove_if(members_.begin(), members_.end(), [id](const Member& m) { return m.id == id; }),
                 members_.end());
}

void GradientNorms::fill(double* v) {
  Part part;
  for (auto& m : members_) m.in = m.fill(part);
  // The step's one read of the devices: every member's sums in one copy per device.
  std::vector<optim::PendingSum> pending;
  for (const auto* terms : {&part.sumsq, &part.unreduced}) {
    for (const auto& t : *terms) pending.push_back(t.sum);
  }
  const auto sums = optim::read_sums(pending);
  size_t i = 0;
  for (const auto& t : part.sumsq) v[0] += sums[i++] / t.divisor;
  for (const auto& t : part.unreduced) v[1] += sums[i++] / t.divisor;
  v[2] = part.rounds;
  v[3] = part.late;
  v[4] = part.replicas_lost;
  lost_why_ = part.lost_why;
}

void GradientNorms::check_replicas(const double* v) const {
  if (v[4] == 0) return;
  throw ReplicaGroupLost(lost_why_.empty()
                             ? "the step's reductions across replica groups failed on another rank of this group "
                               "(its log says why); the step was abandoned on every rank of the group"
                             : "the step's reductions across replica groups failed: " + lost_why_ +
                                   "; the step was abandoned on every rank of the group");
}

void GradientNorms::reduce_late(double* v) {
  for (const auto& m : members_) {
    if (m.in && m.late) m.late();
  }
  auto t = at::zeros({static_cast<int64_t>(kWidth)}, at::kDouble);
  fill(t.data_ptr<double>());  // the same members fill: the gradients are reduced and frozen already
  agreement_->communicator().all_reduce(t, ReduceOp::kSum)->wait();
  std::copy_n(t.data_ptr<double>(), kWidth, v);
  check_replicas(v);  // a late round's reductions across the groups failed
  TORCH_CHECK(v[3] == 0, "GradientNorms: late gradients are still held after their rounds (a bug)");
}

void GradientNorms::read(const double* given) {
  double again[kWidth];
  const double* v = given;
  check_replicas(given);
  if (given[3] > 0) {
    reduce_late(again);
    v = again;
  }
  last_.sumsq = v[0];
  last_.noise.ranks = ranks_;
  last_.noise.rounds = static_cast<int>(std::lround(v[2] / agreement_->communicator().size()));
  last_.noise.big_sumsq = v[0];
  last_.noise.small_sumsq = v[1] / ranks_;
  // A read may leave (a member's optimizer joining another agreement): walk a copy.
  const auto members = members_;
  for (const auto& m : members) {
    if (m.in && m.read) m.read(last_);
  }
}

}  // namespace zeroshard::shard
