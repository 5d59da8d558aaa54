// membership.cpp — the membership key, brought in line with the live groups.
#include "replica/membership.h"

#include "replica/registration.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <thread>

namespace zeroshard::replica {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

std::string names_text(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return "[" + out + "]";
}

}  // namespace

Membership::Membership(std::shared_ptr<Etcd> etcd, std::string job, std::string me, int64_t lease)
    : etcd_(std::move(etcd)), job_(std::move(job)), me_(std::move(me)), lease_(lease) {}

std::string Membership::key() const { return "/zeroshard/" + job_ + "/membership"; }

std::vector<std::string> Membership::live_groups(int64_t* revision, bool* mine) {
  const auto prefix = Registration::groups_prefix(job_);
  std::vector<std::string> names;
  if (mine != nullptr) *mine = false;
  for (const auto& kv : etcd_->list(prefix, revision)) {
    names.push_back(kv.key.substr(prefix.size()));
    if (mine != nullptr && names.back() == me_) *mine = lease_ == 0 || kv.lease == lease_;
  }
  return names;  // in key order: name order
}

MembershipView Membership::agree(std::chrono::milliseconds timeout, int64_t after) {
  const auto deadline = Clock::now() + timeout;
  std::vector<std::string> live, held;
  for (;;) {
    bool mine = false;
    live = live_groups(nullptr, &mine);
    const auto it = std::find(live.begin(), live.end(), me_);
    TORCH_CHECK(it != live.end() && mine, "replica groups: group '", me_, "' is not among the live groups ",
                names_text(live), " of job '", job_, "'", it != live.end() ? " as this process (a group of its name "
                "registered since, on a lease of its own)" : "", " (its lease was lost: it must register again)");
    const auto m = etcd_->get(key());
    held.clear();
    if (m) held = json::parse(m->value).get<std::vector<std::string>>();
    if (m && held == live && m->mod_revision > after) {
      return {m->mod_revision, live, static_cast<int>(it - live.begin())};
    }
    if (Clock::now() > deadline) break;
    // Bring the key in line (or, when it is in line at a generation met already, write it again for
    // a new one); a writer that lost the race reads the winner's value next.
    etcd_->put_if(key(), json(live).dump(), m ? m->mod_revision : 0);
  }
  TORCH_CHECK(false, "replica groups: job '", job_, "' did not agree on its membership within ", timeout.count(),
              " ms (the live groups ", names_text(live), ", the membership ", names_text(held),
              "): groups keep joining or leaving; check their logs");
  return {};
}

void Membership::check_current(const MembershipView& view) {
  const auto m = etcd_->get(key());
  if (!m || m->mod_revision != view.generation) {
    throw MembershipChanged("the membership of generation " + std::to_string(view.generation) + " " +
                            names_text(view.groups) + " was replaced" +
                            (m ? " (generation " + std::to_string(m->mod_revision) + ")" : ""));
  }
  const auto live = live_groups();
  if (live != view.groups) {
    throw MembershipChanged("the live groups are now " + names_text(live) + ", not generation " +
                            std::to_string(view.generation) + "'s " + names_text(view.groups));
  }
}

bool Membership::wait_for_change(const MembershipView& view, std::chrono::milliseconds timeout) {
  try {
    check_current(view);
  } catch (const MembershipChanged&) {
    return true;
  }
  return !etcd_->watch(Registration::groups_prefix(job_), view.generation, timeout).empty();
}

}  // namespace zeroshard::replica
