// zeroshard/step_agreement.h — a training step's one blocking collective.
//
// The end of a step needs a few numbers agreed by every rank: the optimizer's
// gradient norm and which parameters had gradients, the loss, the preemption
// vote, a pipeline's per-stage flags. Each is a handful of doubles; each in an
// all-reduce of its own is a round trip over the world, and with a GPU model a
// stop of the host. A StepAgreement puts them in one: contributors add slots
// once (a name, a size, how to fill them and what to do with the result), and
// each agree() asks every slot for this rank's values, sums them over the
// ranks in one all-reduce of doubles, and hands every slot its sums.
//
//   auto agreement = std::make_shared<zeroshard::StepAgreement>(comm);
//   opt.join(agreement);                    // norms and flags (ShardedOptimizer)
//   guard.join(agreement);                  // the preemption vote (PreemptionGuard)
//   double loss = 0, mean_loss = 0;
//   agreement->add("loss", 1, [&](double* v) { v[0] = loss; }, [&](const double* s) { mean_loss = s[0] / n; });
//   for (...) {
//     loss = forward_backward();
//     opt.step();                           // runs agreement->agree(): the step's one collective
//     if (guard.should_stop()) ...          // reads the vote agree() took
//   }
//
// Every rank must hold the same slots (names and sizes, in the order added),
// so every rank adds and removes them at the same point of the program (as
// contributors do when they are set up and destroyed). What is checked:
// - the first agree() after this rank's slots changed runs one all-gather of
//   a hash of them before the all-reduce; where every rank changed its slots,
//   as they must, a difference is named (the first slot that differs, with
//   each version);
// - a change on some ranks only: those ranks all-gather while the others
//   all-reduce, and the transport fails that collective on every rank, naming
//   the rank and what each issued ("rank 0 issued all_gather #2 ... where this
//   rank issued all_reduce #2"); each rank's error lists the slots it holds,
//   so the ranks' errors show the difference;
// - an agreement made with check_slots = false (a ShardedOptimizer's own, a
//   PreemptionGuard's own: one slot each, whose size follows from what their
//   construction checked) is never checked.
//
// Ownership and threads: contributors keep the agreement alive (shared_ptr)
// and remove their slots when destroyed. Use it from the training thread
// only; agree() calls the slots' functions on that thread.
#pragma once

#include "zeroshard/comm.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

struct StepAgreementOptions {
  // Check that every rank holds the same slots at the first agree() after
  // they change. Default: true. Off only where the slots follow from what
  // was checked already (an optimizer's own agreement: its parameters).
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
  // Adds a slot of `n` values per rank that every rank reads in full: rank r's
  // at result[r*n .. (r+1)*n). For what a sum cannot say (the earliest time,
  // who voted): the same all-reduce carries it, each rank's values in a place
  // of their own and zeros from the others. Costs n * size() doubles.
  int64_t add_per_rank(std::string name, size_t n, Fill fill, Read read);
  // Drops slot `id` (a contributor going away). Unknown ids are ignored.
  void remove(int64_t id);

  // Fills every slot, sums them in one all-reduce over the ranks, and reads
  // every slot, in the order they were added. Collective; throws what a
  // slot's function threw (before the all-reduce: the other ranks then fail
  // with the communicator's timeout, naming this rank).
  void agree();
  // How many agree() calls completed: a contributor's way to tell whether a
  // step's agreement ran since it last looked.
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
