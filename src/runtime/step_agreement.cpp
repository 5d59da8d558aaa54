// step_agreement.cpp — the step's slots, summed in one all-reduce.
#include "zeroshard/step_agreement.h"

#include "runtime/rank_agreement.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard {

StepAgreement::StepAgreement(std::shared_ptr<Communicator> comm, StepAgreementOptions options)
    : comm_(std::move(comm)), options_(options) {
  TORCH_CHECK_VALUE(comm_ != nullptr, "StepAgreement: the communicator is null");
  TORCH_CHECK_VALUE(comm_->device().is_cpu(), "StepAgreement: the communicator moves ", comm_->device(),
                    " tensors; the step's agreement is host values on a CPU communicator (a group's control plane)");
}

int64_t StepAgreement::add_slot(std::string name, size_t n, bool per_rank, Fill fill, Read read) {
  TORCH_CHECK_VALUE(n > 0, "StepAgreement: slot '", name, "' has 0 values; give it at least one");
  TORCH_CHECK_VALUE(fill != nullptr, "StepAgreement: slot '", name, "' has no fill function");
  slots_.push_back({next_id_, std::move(name), n, per_rank, std::move(fill), std::move(read)});
  checked_ = false;
  return next_id_++;
}

int64_t StepAgreement::add(std::string name, size_t n, Fill fill, Read read) {
  return add_slot(std::move(name), n, false, std::move(fill), std::move(read));
}

int64_t StepAgreement::add_per_rank(std::string name, size_t n, Fill fill, Read read) {
  return add_slot(std::move(name), n, true, std::move(fill), std::move(read));
}

void StepAgreement::remove(int64_t id) {
  const auto it = std::find_if(slots_.begin(), slots_.end(), [id](const Slot& s) { return s.id == id; });
  if (it == slots_.end()) return;
  slots_.erase(it);
  checked_ = false;
}

size_t StepAgreement::width() const {
  size_t w = 0;
  for (const auto& s : slots_) w += s.per_rank ? s.n * static_cast<size_t>(comm_->size()) : s.n;
  return w;
}

std::vector<std::string> StepAgreement::describe_slots() const {
  std::vector<std::string> entries;
  for (const auto& s : slots_) {
    entries.push_back("'" + s.name + "' (" + std::to_string(s.n) + (s.per_rank ? " values per rank)" : " values)"));
  }
  return entries;
}

// A collective of agree() that failed: the transport's reason, with this rank's slots, so that
// ranks whose slots differ (some added or removed one the others did not) tell it apart.
[[noreturn]] void StepAgreement::collective_failed(const std::string& reason) const {
  std::string slots;
  for (const auto& d : describe_slots()) slots += (slots.empty() ? "" : ", ") + d;
  TORCH_CHECK(false, "StepAgreement::agree on rank ", comm_->rank(), ", holding the slots [", slots, "]: ",
              reason, " (where the ranks' slots differ, add and remove them at the same point of "
              "the program on every rank)");
}

void StepAgreement::agree() {
  if (options_.check_slots && !checked_) {
    try {
      runtime::check_same_on_all_ranks(*comm_, describe_slots(), "StepAgreement slots");
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      if (what.find("StepAgreement slots") != std::string::npos) throw;  // names the difference already
      collective_failed(what);
    }
    checked_ = true;
  }
  auto t = at::zeros({static_cast<int64_t>(width())}, at::kDouble);
  double* v = t.data_ptr<double>();
  const auto rank = static_cast<size_t>(comm_->rank());
  size_t at = 0;
  for (const auto& s : slots_) {
    s.fill(v + at + (s.per_rank ? rank * s.n : 0));
    at += s.per_rank ? s.n * static_cast<size_t>(comm_->size()) : s.n;
  }
  try {
    comm_->all_reduce(t, ReduceOp::kSum)->wait();
  } catch (const c10::Error& e) {
    collective_failed(e.what_without_backtrace());
  }
  at = 0;
  // A read may remove its slot or add others: walk a copy.
  const auto slots = slots_;
  for (const auto& s : slots) {
    if (s.read) s.read(v + at);
    at += s.per_rank ? s.n * static_cast<size_t>(comm_->size()) : s.n;
  }
  ++agreements_;
}

}  // namespace zeroshard
