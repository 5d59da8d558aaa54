// zeroshard/step_agreement.h — a training step's one blocking collective: the few numbers
// every rank must agree on at a step's end (gradient norms and flags, the loss, the
// preemption vote) summed in one all-reduce of doubles instead of one each.
//
//   auto agreement = std::make_shared<zeroshard::StepAgreement>(comm);
//   opt.join(agreement);                    // norms and flags (ShardedOptimizer)
//   guard.join(agreement);                  // the preemption vote (PreemptionGuard)
//   agreement->add("loss", 1, [&](double* v) { v[0] = loss; }, [&](const double* s) { mean = s[0] / n; });
//   opt.step();                             // runs agreement->agree(): the step's one collective
//
// REQUIRES: every rank holds the same slots (names and sizes, in the order added), so every
// rank adds and removes them at the same point of the program. Ownership: contributors keep
// the agreement alive (shared_ptr) and remove their slots when destroyed. Thread-safety: use it
// from the training thread only; agree() calls the slots' functions on that thread.
// How it works: docs/communicator.md ("One collective per step").
#pragma once

#include "zeroshard/comm.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

struct StepAgreementOptions {
  // Check that every rank holds the same slots at the first agree() after they change (one
  // all-gather of a hash); a difference throws on every rank, naming the first slot that
  // differs. Off only where the slots follow from what was checked already (an optimizer's own
  // agreement: its parameters). Default: true.
  bool check_slots = true;
};

class StepAgreement {
 public:
  // Writes this rank's values of a slot (zeroed before the call).
  using Fill = std::function<void(double* values)>;
  // Reads a slot's result: the sums over the ranks (for add_per_rank(), every
  // rank's values).
  using Read = std::function<void(const double* result)>;

  // REQUIRES: `comm` non-null and a CPU communicator (a group's control plane):
  // the ranks that agree.
  explicit StepAgreement(std::shared_ptr<Communicator> comm, StepAgreementOptions options = {});
  StepAgreement(const StepAgreement&) = delete;
  StepAgreement& operator=(const StepAgreement&) = delete;

  // Adds a slot of `n` values summed over the ranks. `name` appears in errors
  // and in the check that ranks agree on the slots. Returns the slot's id.
  // REQUIRES: n > 0; `fill` set (`read` may be null).
  int64_t add(std::string name, size_t n, Fill fill, Read read);
  // Adds a slot of `n` values per rank that every rank reads in full: rank r's at
  // result[r*n .. (r+1)*n). For what a sum cannot say (the earliest time, who voted).
  // Costs n * size() doubles of the all-reduce. REQUIRES: as add().
  int64_t add_per_rank(std::string name, size_t n, Fill fill, Read read);
  // Drops slot `id` (a contributor going away). Unknown ids are ignored.
  void remove(int64_t id);

  // Fills every slot, sums them in one all-reduce over the ranks, and reads every slot, in the
  // order they were added. Collective. Throws what a slot's function threw (if before the
  // all-reduce, the other ranks then fail at the communicator's timeout, naming this rank), and
  // when the ranks' slots differ (see StepAgreementOptions::check_slots).
  void agree();
  // How many agree() calls completed: a contributor's way to tell whether a step's agreement
  // ran since it last looked.
  int64_t agreements() const { return agreements_; }
  // The values one agree() sums (per-rank slots counted size() times).
  size_t width() const;

  Communicator& communicator() const { return *comm_; }

 private:
  struct Slot {
    int64_t id;
    std::string name;
    size_t n;
    bool per_rank;
    Fill fill;
    Read read;
  };
  int64_t add_slot(std::string name, size_t n, bool per_rank, Fill fill, Read read);
  std::vector<std::string> describe_slots() const;  // "'name' (n values)", in order
  [[noreturn]] void collective_failed(const std::string& reason) const;  // names this rank's slots

  std::shared_ptr<Communicator> comm_;
  StepAgreementOptions options_;
  std::vector<Slot> slots_;
  int64_t next_id_ = 0;
  int64_t agreements_ = 0;
  bool checked_ = false;  // the ranks' slots compared since the last change
};

}  // namespace zeroshard
