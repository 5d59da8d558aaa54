// registration.cpp — a group's key on its lease, checked against the live groups.
#include "replica/registration.h"

#include "zeroshard/log.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <thread>

#include <signal.h>

namespace zeroshard::replica {

using json = nlohmann::json;

std::string to_json(const GroupInfo& g) {
  return json{{"group", g.group}, {"ranks", g.ranks}, {"model", g.model},         {"config", g.config},
              {"host", g.host},   {"pid", g.pid},     {"processes", g.processes}}
      .dump();
}

GroupInfo group_from_json(const std::string& text, const std::string& key) {
  const auto j = json::parse(text, nullptr, false);
  TORCH_CHECK(j.is_object() && j.contains("group") && j.contains("ranks") && j.contains("model"), "replica groups: '",
              key, "' in the coordinator is not a group's registration ('", text.substr(0, 120),
              "'): another program uses this job's prefix; give the job another name");
  GroupInfo g;
  g.group = j.at("group").get<std::string>();
  g.ranks = j.at("ranks").get<int>();
  g.model = j.at("model").get<std::string>();
  g.config = j.value("config", std::string());
  g.host = j.value("host", std::string());
  g.pid = j.value("pid", int64_t{0});
  g.processes = j.value("processes", std::string());
  return g;
}

std::string Registration::groups_prefix(const std::string& job) { return "/zeroshard/" + job + "/groups/"; }

std::string Registration::key() const { return groups_prefix(job_) + me_.group; }

namespace {

void check_name(const std::string& what, const std::string& name) {
  const bool ok = !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
  TORCH_CHECK_VALUE(ok, "replica groups: the ", what, " '", name, "' is not a name: use 1 to 64 of A-Z, a-z, 0-9, "
                    "'.', '_' and '-'");
}

// This boot's id and this process's pid namespace: where a pid names one process.
std::string processes_here() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  std::error_code ec;
  const auto ns = std::filesystem::read_symlink("/proc/self/ns/pid", ec);
  if (boot.empty() || ec) return "";
  return boot + "/" + ns.string();
}

// Whether `held` (a registration of this group's name) was made by a process of this machine
// that is gone: a launcher started the group again.
bool gone_from_here(const GroupInfo& held, const GroupInfo& me) {
  if (held.processes.empty() || held.processes != me.processes || held.pid <= 0) return false;
  return ::kill(static_cast<pid_t>(held.pid), 0) != 0 && errno == ESRCH;
}

std::string where(const GroupInfo& g) {
  return "group '" + g.group + "' (host " + (g.host.empty() ? "?" : g.host) + ", pid " + std::to_string(g.pid) + ")";
}

// Why `me` cannot join beside `other` (a live group of the job), or "".
std::string mismatch(const GroupInfo& me, const GroupInfo& other) {
  if (other.ranks != me.ranks) {
    return where(other) + " has " + std::to_string(other.ranks) + " ranks and this group " + std::to_string(me.ranks) +
           "; every group holds the whole state sharded over the same number of ranks: launch this one with " +
           std::to_string(other.ranks);
  }
  if (other.model != me.model) {
    return where(other) + " trains another model (parameters hash " + other.model + ", this group's " + me.model +
           "): the groups must build the same model, with the same parameter names, shapes and dtypes";
  }
  if (other.config != me.config) {
    return where(other) + " was launched with another configuration (" + other.config + "; this group: " + me.config +
           "): launch every group with the same options";
  }
  return "";
}

}  // namespace

Registration::Registration(Etcd& etcd, std::string job, GroupInfo me, std::chrono::seconds liveness)
    : etcd_(etcd), job_(std::move(job)), me_(std::move(me)), liveness_(liveness) {
  me_.processes = processes_here();
  check_name("job", job_);
  check_name("group", me_.group);
  TORCH_CHECK_VALUE(me_.ranks > 0, "replica groups: group '", me_.group, "' has ", me_.ranks, " ranks");
  TORCH_CHECK_VALUE(liveness_.count() >= 2, "replica groups: a liveness window of ", liveness_.count(),
                    " s is too short for the coordinator's lease (at least 2 s)");
  lease_ = etcd_.grant(liveness_);
  try {
    // A group started again right after it was lost finds its old key until the old lease runs
    // out (within the liveness window): it waits that long. A key still there after it is renewed
    // by a live process of the same name.
    const auto deadline = std::chrono::steady_clock::now() + liveness_ + std::chrono::seconds(1);
    for (bool told = false, revoked = false;;) {
      KeyValue there;
      if (etcd_.create(key(), to_json(me_), lease_, &there)) break;
      const GroupInfo held = group_from_json(there.value, there.key);
      if (!revoked && there.lease != 0 && gone_from_here(held, me_)) {
        revoked = true;
        log_info("replica groups: " + where(held) + " is still registered in job '" + job_ + "' and its process "
                 "is gone (this group started again): its lease revoked");
        try {
          etcd_.revoke(there.lease);
        } catch (const std::exception& e) {  // revoked meanwhile, or the coordinator busy: the next try says
          log_warn(std::string("replica groups: revoking the old lease of group '") + me_.group + "': " + e.what());
        }
        continue;
      }
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "replica groups: ", where(held),
                  " is already registered in job '", job_, "' at ", etcd_.describe(), " and alive: is this group "
                  "launched twice? Give each group its own name (--replica-group), or stop the other first (its key "
                  "goes ", liveness_.count(), " s after it stops)");
      if (!told) {
        log_info("replica groups: " + where(held) + " is still registered in job '" + job_ + "'; waiting up to " +
                 std::to_string(liveness_.count()) + " s for its lease to run out (a group started again after "
                 "it was lost)");
        told = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    for (const auto& other : live()) {
      if (other.group == me_.group) continue;
      const auto why = mismatch(me_, other);
      TORCH_CHECK(why.empty(), "replica groups: ", where(me_), " cannot join job '", job_, "': ", why);
    }
  } catch (...) {
    try {
      etcd_.revoke(lease_);
    } catch (...) {  // the lease expires by itself
    }
    throw;
  }
  renewer_ = std::thread([this] { renew(); });
}

Registration::~Registration() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (renewer_.joinable()) renewer_.join();
  try {
    etcd_.revoke(lease_);
  } catch (const std::exception& e) {
    log_warn(std::string("replica groups: leaving job '") + job_ + "': " + e.what() + " (the group's key goes when "
             "its lease expires)");
  }
}

void Registration::renew() {
  const auto every = std::chrono::duration_cast<std::chrono::milliseconds>(liveness_) / 3;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_ && held_) {
    if (wake_.wait_for(lock, every, [this] { return stopping_; })) break;
    lock.unlock();
    try {
      if (etcd_.keep_alive(lease_).count() == 0) {
        held_ = false;
        log_warn("replica groups: " + where(me_) + " lost its lease in the coordinator (not renewed within " +
                 std::to_string(liveness_.count()) + " s): the other groups count it as lost");
      }
    } catch (const std::exception& e) {  // the coordinator unreachable for now: the next renewal tries again
      log_warn(std::string("replica groups: renewing the lease of group '") + me_.group + "': " + e.what());
    }
    lock.lock();
  }
}

std::vector<GroupInfo> Registration::live(int64_t* revision) {
  std::vector<GroupInfo> out;
  for (const auto& kv : etcd_.list(groups_prefix(job_), revision)) out.push_back(group_from_json(kv.value, kv.key));
  return out;
}

std::vector<WatchEvent> Registration::changes(int64_t revision, std::chrono::milliseconds timeout) {
  return etcd_.watch(groups_prefix(job_), revision, timeout);
}

}  // namespace zeroshard::replica
