// replica_groups.cpp — a group's meetings with the others, at step boundaries.
#include "zeroshard/replica_groups.h"

#include "replica/etcd.h"
#include "replica/group_comm.h"
#include "replica/heal.h"
#include "replica/membership.h"
#include "replica/registration.h"

#include "checksum.h"
#include "compat/torch_compat.h"
#include "shard/optimizer/optimizer_access.h"
#include "runtime/host_name.h"
#include "zeroshard/log.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <unistd.h>

namespace zeroshard {

using namespace replica;

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// What the groups' models must share: each parameter's name, shape and dtype, and the sharding.
std::string model_hash(ShardedOptimizer& opt, int ranks) {
  const ShardedState s = opt.sharded_state();
  std::ostringstream out;
  out << "ZeRO-" << s.zero_stage << " over " << ranks << ";";
  for (const auto& p : s.params) out << " " << p.describe();
  const std::string text = out.str();
  return checkpoint::to_hex(checkpoint::digest_bytes(text.data(), text.size()));
}

std::string view_text(const MembershipView& v) {
  return json{{"generation", v.generation}, {"groups", v.groups}, {"index", v.index}}.dump();
}

MembershipView view_of(const std::string& text) {
  const json j = json::parse(text);
  return {j.at("generation").get<int64_t>(), j.at("groups").get<std::vector<std::string>>(), j.at("index").get<int>()};
}

// The CPU generator's state, as a tensor of bytes, and back.
at::Tensor cpu_generator_state() {
  auto gen = compat::default_generator(c10::kCPU);  // a handle on the process's generator
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_generator_state(const at::Tensor& state) {
  auto gen = compat::default_generator(c10::kCPU);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

struct ReplicaGroups::Impl {
  Impl(ProcessGroup g, ShardedOptimizer& o, std::shared_ptr<StepAgreement> a, ReplicaGroupsOptions opts)
      : group_(std::move(g)), opt_(o), agreement_(std::move(a)), options_(std::move(opts)) {}
  ~Impl();
  void start();
  ReplicaTurn before_step(int64_t& step);
  void step_lost(const ReplicaGroupLost& e);
  bool sum_across(std::vector<double>& values);
  void meet(int64_t& step);  // the new membership, its communicator, the heal
  // Alone at `step`: whether to train (a step the job has not passed, or a checkpoint's); else
  // throws or (wait_when_alone) waits a while for the membership to change and says false.
  bool alone_allowed(const MembershipView& view, int64_t step);
  // On the group's first rank, after a meeting at `top` (the live groups' newest step): says so
  // when the job had gone further (every group that held those steps lost: they are taken again
  // from the checkpoints the groups resumed from).
  void say_fallback(int64_t top);
  std::string progress_key() const;  // the job's progress: the step its groups reached
  void watch();              // the first rank's background thread

  ProcessGroup group_;
  ShardedOptimizer& opt_;
  std::shared_ptr<StepAgreement> agreement_;
  int64_t slot_ = -1;
  ReplicaGroupsOptions options_;
  std::function<std::string()> send_;
  std::function<void(const std::string&)> receive_;
  std::shared_ptr<Etcd> etcd_;
  std::unique_ptr<Registration> registration_;  // the first rank's
  std::unique_ptr<Membership> membership_;
  std::shared_ptr<Communicator> across_;
  ReplicaTurn turn_;
  bool met_ = false;
  int64_t met_generation_ = 0;  // the last generation met (a meeting is never held twice)
  bool lost_ = false;     // the step threw ReplicaGroupLost (on every rank of the group): meet again
  // When this rank's sum after a step failed (its communicator across the groups is gone); the
  // group's next step fails on it, on every rank, and the pause counts from here.
  std::optional<std::chrono::steady_clock::time_point> unsummed_since_;
  bool retake_ = false;   // the step in flight was lost
  bool changed_ = false;  // the last agreement said the membership changed
  std::chrono::steady_clock::time_point since_;  // when the change was seen, or the lost step began
  std::chrono::steady_clock::time_point step_began_;  // the last boundary
  std::vector<ReplicaChange> changes_;

  // The watch (first rank only).
  std::mutex mu_;
  MembershipView watched_;
  std::atomic<bool> seen_change_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> step_now_{0};  // the trainer's, at the last boundary
  int64_t progress_put_ = -1;         // the watcher's last write of it
  bool told_alone_ = false;
  int64_t fallback_told_ = -1;  // the step say_fallback() last named
  std::thread watcher_;
};

ReplicaGroups::ReplicaGroups(ProcessGroup group, ShardedOptimizer& opt, std::shared_ptr<StepAgreement> agreement,
                             ReplicaGroupsOptions options)
    : impl_(std::make_unique<Impl>(std::move(group), opt, std::move(agreement), std::move(options))) {
  impl_->start();
}

ReplicaGroups::~ReplicaGroups() = default;

void ReplicaGroups::check_coordinator(const ReplicaGroupsOptions& options) {
  Etcd etcd(EtcdOptions{parse_etcd_endpoints(options.coordinator), std::chrono::seconds(5)});
  (void)etcd.get(Registration::groups_prefix(options.job));  // any read: a member answers, or it throws naming them
}

void ReplicaGroups::on_heal(std::function<std::string()> send, std::function<void(const std::string&)> receive) {
  impl_->send_ = std::move(send);
  impl_->receive_ = std::move(receive);
}

ReplicaTurn ReplicaGroups::before_step(int64_t& step) { return impl_->before_step(step); }
void ReplicaGroups::step_lost(const ReplicaGroupLost& e) { impl_->step_lost(e); }
bool ReplicaGroups::sum_across(std::vector<double>& values) { return impl_->sum_across(values); }
const std::vector<ReplicaChange>& ReplicaGroups::changes() const { return impl_->changes_; }
const ReplicaTurn& ReplicaGroups::turn() const { return impl_->turn_; }

void ReplicaGroups::Impl::start() {
  TORCH_CHECK_VALUE(group_.control != nullptr, "ReplicaGroups: the group's communicator is null");
  TORCH_CHECK_VALUE(!options_.group.empty(), "ReplicaGroups: the group has no name; give each group of the job one "
                    "(the BART trainer: --replica-group NAME)");
  // A member cut off is passed over within a quarter of the lease's time to live: the renewals
  // reach another member before the lease runs out.
  const auto attempt = std::max<std::chrono::milliseconds>(
      std::chrono::milliseconds(250), std::chrono::duration_cast<std::chrono::milliseconds>(options_.liveness) / 4);
  etcd_ = std::make_shared<Etcd>(
      EtcdOptions{parse_etcd_endpoints(options_.coordinator), std::chrono::seconds(5), attempt});
  if (agreement_ == nullptr) agreement_ = std::make_shared<StepAgreement>(group_.control);
  if (shard::OptimizerAccess::agreement(opt_) != agreement_) opt_.join(agreement_);
  // The membership changed, as the group's first rank saw it: every rank meets at the next boundary.
  slot_ = agreement_->add(
      "replica groups (membership changed)", 1, [this](double* v) { v[0] = seen_change_.load() ? 1.0 : 0.0; },
      [this](const double* v) {
        if (v[0] > 0 && !changed_) {
          changed_ = true;
          since_ = Clock::now();
        }
      });
  const int rank = group_.control->rank();
  std::string why;
  if (rank == 0) {
    try {
      const GroupInfo me{options_.group, group_.control->size(), model_hash(opt_, group_.control->size()),
                         options_.config, host_name(), static_cast<int64_t>(::getpid()), ""};
      registration_ = std::make_unique<Registration>(*etcd_, options_.job, me, options_.liveness);
    } catch (const std::exception& e) {
      why = error_message(e);
    }
  }
  why = broadcast_text(*group_.control, why, 0, options_.meet_timeout);
  TORCH_CHECK(why.empty(), why);
  membership_ = std::make_unique<Membership>(etcd_, options_.job, options_.group,
                                             registration_ ? registration_->lease() : 0);
}

ReplicaGroups::Impl::~Impl() {
  stopping_ = true;
  if (watcher_.joinable()) {
    watcher_.join();
    try {  // the job's progress as this group leaves it
      if (step_now_ > progress_put_) etcd_->put(progress_key(), std::to_string(step_now_.load()));
    } catch (const std::exception& e) {
      log_warn("replica groups: recording the job's progress: " + error_message(e));
    }
  }
  if (agreement_ != nullptr && slot_ >= 0) agreement_->remove(slot_);
  try {
    shard::OptimizerAccess::set_replica_groups(opt_, nullptr);
  } catch (const std::exception&) {
    // the optimizer's model is gone or a step is under way: nothing to detach from
  }
}

void ReplicaGroups::Impl::watch() {
  while (!stopping_) {
    MembershipView view;
    {
      std::lock_guard<std::mutex> lock(mu_);
      view = watched_;
    }
    try {
      // The job's progress, for a group that later finds itself alone (meet()).
      const int64_t now = step_now_;
      if (now > progress_put_) {
        etcd_->put(progress_key(), std::to_string(now));
        progress_put_ = now;
      }
      if (!seen_change_ && membership_->wait_for_change(view, std::chrono::seconds(1))) seen_change_ = true;
    } catch (const std::exception& e) {
      log_warn("replica groups: watching the coordinator: " + error_message(e));
      seen_change_ = true;  // meet again: the meeting says what is wrong, or finds it gone
    }
    if (seen_change_) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void ReplicaGroups::Impl::step_lost(const ReplicaGroupLost& e) {
  log_warn("replica groups: group '" + options_.group + "' lost its step: " + e.what() +
           "; meeting the live groups again");
  opt_.discard_gradients();
  if (!lost_ && !changed_) since_ = unsummed_since_.value_or(step_began_);  // the lost step's time counts
  lost_ = true;
  retake_ = true;
}

bool ReplicaGroups::Impl::sum_across(std::vector<double>& values) {
  if (across_ == nullptr || values.empty()) return !lost_;
  auto t = torch::tensor(values, torch::kDouble);
  try {
    across_->all_reduce(t, ReduceOp::kSum)->wait();
  } catch (const std::exception& e) {
    // Lost after the step was applied everywhere it was. This rank alone knows: another rank of
    // the group may have summed on its own communicator (the lost group's value reached it before
    // the loss). So no rank meets at the next boundary on its own; the next step's reductions fail
    // on this rank's broken communicator, and the group's agreement abandons that step on all of
    // its ranks, which then meet.
    log_warn("replica groups: group '" + options_.group + "' could not sum its step's values across the groups: " +
             error_message(e) + "; the group meets the live groups again when its next step fails on it");
    if (!unsummed_since_) unsummed_since_ = Clock::now();
    return false;
  }
  std::copy_n(t.data_ptr<double>(), values.size(), values.begin());
  return true;
}

ReplicaTurn ReplicaGroups::Impl::before_step(int64_t& step) {
  if (!met_ || lost_ || changed_) meet(step);
  step_now_ = step;
  step_began_ = Clock::now();
  return turn_;
}

std::string ReplicaGroups::Impl::progress_key() const { return "/zeroshard/" + options_.job + "/progress"; }

bool ReplicaGroups::Impl::alone_allowed(const MembershipView& view, int64_t step) {
  if (step > 0) return true;  // a checkpoint's state: the meeting says which steps are taken again
  auto& control = *group_.control;
  std::string reached;  // the job's progress, as the coordinator holds it
  if (control.rank() == 0) {
    const auto kv = etcd_->get(progress_key());
    reached = kv ? kv->value : "0";
  }
  const int64_t job_step = std::stoll(broadcast_text(control, reached, 0, options_.meet_timeout));
  if (step >= job_step) return true;
  const std::string why = "replica groups: group '" + options_.group + "' is alone in job '" + options_.job +
                          "' with no state (step 0), but the job reached step " + std::to_string(job_step) +
                          " (" + etcd_->describe() + ", " + progress_key() + "): the groups that trained it are "
                          "lost, and starting over from step 0 would throw their training away";
  TORCH_CHECK(options_.wait_when_alone, why, "; resume from a checkpoint of the job, start a live group first, "
              "or name a new job (a job's record is removed with `etcdctl del ", progress_key(), "`)");
  if (control.rank() == 0 && !told_alone_) {
    log_warn(why + "; waiting for a live group to take the state from");
    told_alone_ = true;
  }
  bool changed = false;
  if (control.rank() == 0) changed = membership_->wait_for_change(view, std::chrono::seconds(5));
  (void)broadcast_text(control, changed ? "1" : "0", 0, options_.meet_timeout);
  return false;
}

void ReplicaGroups::Impl::say_fallback(int64_t top) {
  int64_t job_step = 0;
  try {
    const auto kv = etcd_->get(progress_key());
    job_step = kv ? std::stoll(kv->value) : 0;
  } catch (const std::exception& e) {  // only a message is lost
    log_warn("replica groups: reading the job's progress: " + error_message(e));
    return;
  }
  if (top >= job_step || top == fallback_told_) return;
  fallback_told_ = top;
  log_warn("replica groups: the live groups of job '" + options_.job + "' are at step " + std::to_string(top) +
           " (their newest checkpoint) and the job had reached step " + std::to_string(job_step) + ": every group "
           "that held the steps since was lost, so the job falls back to that checkpoint and takes steps " +
           std::to_string(top + 1) + " to " + std::to_string(job_step) + " again");
}

void ReplicaGroups::Impl::meet(int64_t& step) {
  const auto t0 = met_ ? since_ : Clock::now();
  const bool retaken = retake_;
  // The old communicator goes first: a group still in a step on it fails at once, not at its timeout.
  shard::OptimizerAccess::set_replica_groups(opt_, nullptr);
  across_ = nullptr;
  auto& control = *group_.control;
  const int rank = control.rank();
  GroupCommOptions comm_options;
  comm_options.listen_host = options_.listen_host;
  comm_options.comm.liveness = options_.liveness;
  comm_options.comm.rendezvous_timeout = options_.meet_timeout;
  comm_options.comm.timeout = options_.meet_timeout;
  MembershipView view;
  ReplicaChange change;
  // The group's vote on a step of the meeting each rank took alone: true (logged, to meet again)
  // when it failed on any rank of the group, `why` being this rank's error or "".
  auto failed_in_group = [&](const std::string& why, const std::string& what) {
    if (failed_ranks(control, !why.empty()).empty()) return false;
    log_info("replica groups: " + what + " (" + (why.empty() ? "on another rank of the group" : why) +
             "); meeting again");
    return true;
  };
  for (int attempt = 0;; ++attempt) {
    TORCH_CHECK(attempt < 100, "replica groups: group '", options_.group, "' met the others 100 times without "
                "settling on a membership: groups keep joining or leaving; check their logs");
    // 1. The membership: the first rank agrees it in the coordinator, the others take it from there.
    std::string text, why;
    if (rank == 0) {
      try {
        TORCH_CHECK(registration_->held(), "replica groups: group '", options_.group, "' lost its lease in the "
                    "coordinator (", etcd_->describe(), ") and counts as lost to the others");
        text = view_text(membership_->agree(options_.meet_timeout, met_generation_));
      } catch (const std::exception& e) {
        why = error_message(e);
      }
    }
    why = broadcast_text(control, why, 0, options_.meet_timeout * 2);
    TORCH_CHECK(why.empty(), why);
    view = view_of(broadcast_text(control, text, 0, options_.meet_timeout));
    const int count = static_cast<int>(view.groups.size());
    if (count == 1 && !alone_allowed(view, step)) {  // waited for a group to come (not a failed meeting)
      --attempt;
      continue;
    }
    // 2. This shard position's communicator across the groups, then where each group is.
    std::shared_ptr<Communicator> across;
    std::vector<int64_t> steps(1, step);
    try {
      if (count > 1) {
        across = connect_groups(etcd_, options_.job, view.generation, rank, view.index, count, comm_options,
                                [&] { membership_->check_current(view); });
        steps.clear();
        for (const auto& s : all_gather_text(*across, std::to_string(step))) steps.push_back(std::stoll(s));
      }
    } catch (const std::exception& e) {
      why = error_message(e);
    }
    if (failed_in_group(why, "generation " + std::to_string(view.generation) + " was not met")) continue;
    // 3. A group behind takes the state of the first group ahead: the optimizer's (heal.h), the
    // step and the generators.
    const int64_t top = *std::max_element(steps.begin(), steps.end());
    const int source = static_cast<int>(std::find(steps.begin(), steps.end(), top) - steps.begin());
    const bool behind = std::any_of(steps.begin(), steps.end(), [top](int64_t s) { return s != top; });
    if (behind) {
      try {
        const HealReport r = heal(*across, source, opt_);
        auto rng = cpu_generator_state();
        across->broadcast(rng, source)->wait();
        // The trainer's own state, from the group the state came from.
        const std::string trainer = broadcast_text(*across, send_ && view.index == source ? send_() : "", source,
                                                   options_.meet_timeout);
        if (view.index != source) {
          set_cpu_generator_state(rng);
          if (receive_) receive_(trainer);
          change.heal_bytes = r.bytes + static_cast<int64_t>(rng.nbytes() + trainer.size());
          change.heal_seconds = r.seconds;
          log_info("replica groups: group '" + options_.group + "' took its state from group '" +
                   view.groups[static_cast<size_t>(source)] + "' at step " + std::to_string(top) + " (" +
                   std::to_string(change.heal_bytes) + " bytes on this rank in " + std::to_string(r.seconds) +
                   " s, checksums equal)");
          step = top;
        }
      } catch (const std::exception& e) {
        why = error_message(e);
      }
      if (failed_in_group(why, "the heal at generation " + std::to_string(view.generation) + " failed")) continue;
    }
    across_ = across;
    if (rank == 0) say_fallback(top);
    break;
  }
  met_generation_ = view.generation;
  if (rank == 0 && view.index == 0) {
    try {  // the keys of the meetings before this one (never met again)
      forget_meetings(*etcd_, options_.job, view.generation);
    } catch (const std::exception& e) {
      log_warn("replica groups: removing old meetings' keys: " + error_message(e));
    }
  }
  shard::OptimizerAccess::set_replica_groups(opt_, across_);
  const bool first = !met_;
  turn_ = {view.index, static_cast<int>(view.groups.size()), view.generation};
  met_ = true;
  lost_ = false;
  unsummed_since_.reset();
  retake_ = false;
  changed_ = false;
  if (rank == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    watched_ = view;
    seen_change_ = false;
    if (!watcher_.joinable()) watcher_ = std::thread([this] { watch(); });
  }
  change.step = step;
  change.generation = view.generation;
  change.groups = turn_.count;
  change.pause_seconds = seconds_since(t0);
  change.step_retaken = retaken;
  changes_.push_back(change);
  std::string names;
  for (const auto& g : view.groups) names += (names.empty() ? "" : ", ") + g;
  if (rank == 0) {
    char pause[64];
    std::snprintf(pause, sizeof(pause), "%.2f s", change.pause_seconds);
    log_info("replica groups: group '" + options_.group + "' trains " + (first ? "from" : "again at") + " step " +
             std::to_string(step) + " as " + std::to_string(turn_.index + 1) + " of " + std::to_string(turn_.count) +
             " groups [" + names + "] (generation " + std::to_string(view.generation) + (first ? "" : ", paused " +
             std::string(pause)) + (retaken ? ", the step in flight taken again" : "") + ")");
  }
}

}  // namespace zeroshard
