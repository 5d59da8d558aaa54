// gradient_norms.h — the gradient norms of a step's agreement: one slot that
// the optimizers clipping as one model fill together (a flat run's optimizer
// alone; a pipeline's stages, on every rank of the world), read from their
// devices in one copy.
//
// The slot is [squared norm of the mean gradient, the noise sample's unreduced
// squared norms, reduction rounds, members holding late gradients], unscaled,
// summed over the agreement's ranks. Every member reads the same result: the
// global norm it clips by (and whose overflow skips the step), and the
// gradient noise sample.
//
// Late gradients (ZeRO-0/2: arrivals beyond the count the ranks agreed on, in
// a backward that reuses a parameter more than before) are held by the rank
// that got them until the agreement, since whether any rank got some is known
// only there. When any member on any rank holds some, every member reduces
// its late rounds (Late: the same collectives on every rank, zeros where it
// holds none) and the norms are summed again in a second all-reduce: a step
// with late gradients costs one more collective, every other step none.
//
// With replica groups (replica/), a fifth value counts the members whose
// reductions across the groups failed (a group lost mid-step). When any did,
// on any rank of this group, every member throws ReplicaGroupLost from the
// read, before anything of the step is applied: the group abandons the step
// as one.
#pragma once

#include "optim/grad_norm.h"
#include "zeroshard/sharded_stats.h"
#include "zeroshard/step_agreement.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard::shard {

class GradientNorms {
 public:
  // One member's values on this rank, each sum with what divides it out of
  // its scaling (loss scale², and for the mean gradient the ranks holding the
  // same shard): divided on the host after the one read.
  struct Part {
    struct Term {
      optim::PendingSum sum;
      double divisor = 1;
    };
    std::vector<Term> sumsq;      // of the mean gradient this rank holds (summed over the ranks: the whole)
    std::vector<Term> unreduced;  // reductions × the squared norm of what this rank fed each
    int rounds = 0;               // this rank's most reductions of one shard group this step
    int late = 0;                 // members holding late gradients on this rank
    int replicas_lost = 0;        // members whose reductions across replica groups failed on this rank
    std::string lost_why;         // the first of their errors
  };
  // What every member reads: the same on every rank.
  struct Result {
    double sumsq = 0;            // squared global norm of the mean gradient (inf/NaN: an overflow)
    GradientNoiseSample noise;   // big: `sumsq`; small: the mean over ranks and rounds; rounds: the ranks' mean
  };
  // Adds this rank's part to `part`; false: this member sits the agreement
  // out (adds nothing and is not read).
  using Fill = std::function<bool(Part& part)>;
  using Read = std::function<void(const Result& result)>;
  // Reduces the member's held late gradients into its shards (collective: the
  // same on every rank, whether or not it holds any).
  using Late = std::function<void()>;

  // Adds the slot `name` to `agreement`. `ranks`: the data-parallel ranks
  // each member's gradient is the mean over (the noise sample's ranks).
  GradientNorms(std::shared_ptr<StepAgreement> agreement, std::string name, int ranks);
  ~GradientNorms();  // removes the slot
  GradientNorms(const GradientNorms&) = delete;
  GradientNorms& operator=(const GradientNorms&) = delete;

  // Members fill in the order they joined. Returns the member's id.
  int64_t join(Fill fill, Read read, Late late = {});
  void leave(int64_t id);  // unknown ids are ignored

  const std::shared_ptr<StepAgreement>& agreement() const { return agreement_; }
  int ranks() const { return ranks_; }
  const Result& last() const { return last_; }  // of the last agree()

 private:
  void fill(double* v);
  void read(const double* v);
  void reduce_late(double* v);  // every member's late rounds, then the slot summed again into v
  void check_replicas(const double* v) const;  // throws ReplicaGroupLost when v counts a failure
  static constexpr size_t kWidth = 5;

  struct Member {
    int64_t id;
    Fill fill;
    Read read;
    Late late;
    bool in = false;  // filled the agreement running now
  };
  std::shared_ptr<StepAgreement> agreement_;
  int ranks_;
  int64_t slot_;
  std::vector<Member> members_;
  int64_t next_id_ = 0;
  Result last_;
  std::string lost_why_;  // this rank's, from the last fill
};

}  // namespace zeroshard::shard
