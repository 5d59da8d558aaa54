// group_comm.cpp — the cross-group communicator's meeting place and its formation.
#include "replica/group_comm.h"

#include "comm/tcp_communicator.h"

#include <c10/util/Exception.h>

#include <numeric>
#include <random>
#include <thread>

namespace zeroshard::replica {

using Clock = std::chrono::steady_clock;

namespace {

std::string text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::string meetings_prefix(const std::string& job) { return "/zeroshard/" + job + "/meet/"; }

// Generations as fixed-width decimals, so that their keys sort as the numbers do.
std::string generation_name(int64_t generation) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%020lld", static_cast<long long>(generation));
  return buf;
}

}  // namespace

EtcdStore::EtcdStore(std::shared_ptr<Etcd> etcd, std::string prefix, std::chrono::milliseconds timeout,
                     std::function<void()> still_valid)
    : etcd_(std::move(etcd)), prefix_(std::move(prefix)), still_valid_(std::move(still_valid)) {
  setTimeout(timeout);
}

#if TORCH_VERSION_MAJOR >= 2
c10::intrusive_ptr<c10d::Store> EtcdStore::clone() {
  return c10::make_intrusive<EtcdStore>(etcd_, prefix_, getTimeout(), still_valid_);
}
#endif

void EtcdStore::set(const std::string& key, const std::vector<uint8_t>& value) { etcd_->put(prefix_ + key, text(value)); }

std::vector<uint8_t> EtcdStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                           const std::vector<uint8_t>& desired) {
  // c10d's rule: set `desired` when the key holds `expected` (or is absent and `expected` is
  // empty); answer what the key then holds (absent: `expected`).
  for (;;) {
    const auto now = etcd_->get(prefix_ + key);
    if (!now) {
      if (!expected.empty()) return expected;
      if (etcd_->put_if(prefix_ + key, text(desired), 0)) return desired;
      continue;
    }
    if (now->value != text(expected)) return bytes(now->value);
    if (etcd_->put_if(prefix_ + key, text(desired), now->mod_revision)) return desired;
  }
}

std::vector<uint8_t> EtcdStore::get(const std::string& key) {
  wait({key});
  const auto kv = etcd_->get(prefix_ + key);
  TORCH_CHECK(kv.has_value(), "EtcdStore: '", prefix_ + key, "' went away as it was read");
  return bytes(kv->value);
}

int64_t EtcdStore::add(const std::string& key, int64_t value) {
  for (;;) {
    const auto now = etcd_->get(prefix_ + key);
    const int64_t was = now ? std::stoll(now->value) : 0;
    if (etcd_->put_if(prefix_ + key, std::to_string(was + value), now ? now->mod_revision : 0)) return was + value;
  }
}

bool EtcdStore::deleteKey(const std::string& key) { return etcd_->remove(prefix_ + key); }

bool EtcdStore::check(const std::vector<std::string>& keys) {
  if (still_valid_) still_valid_();
  for (const auto& k : keys) {
    if (!etcd_->get(prefix_ + k)) return false;
  }
  return true;
}

int64_t EtcdStore::getNumKeys() { return static_cast<int64_t>(etcd_->list(prefix_).size()); }

void EtcdStore::wait(const std::vector<std::string>& keys) { wait(keys, getTimeout()); }

void EtcdStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  const auto deadline = Clock::now() + timeout;
  for (auto pause = std::chrono::milliseconds(5); !check(keys); pause = std::min(pause * 2, std::chrono::milliseconds(200))) {
    if (Clock::now() >= deadline) {
      std::string names;
      for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k;
      TORCH_CHECK(false, "EtcdStore: waited ", timeout.count(), " ms for [", names, "] under '", prefix_,
                  "' in ", etcd_->describe());
    }
    std::this_thread::sleep_for(pause);
  }
}

std::shared_ptr<Communicator> connect_groups(const std::shared_ptr<Etcd>& etcd, const std::string& job,
                                             int64_t generation, int position, int index, int count,
                                             const GroupCommOptions& options,
                                             const std::function<void()>& still_current) {
  TORCH_CHECK_VALUE(count > 0 && index >= 0 && index < count && position >= 0, "connect_groups: group ", index, " of ",
                    count, " at shard position ", position);
  const std::string prefix = meetings_prefix(job) + generation_name(generation) + "/" + std::to_string(position) + "/";
  auto store = std::make_shared<EtcdStore>(etcd, prefix, options.comm.rendezvous_timeout, still_current);
  comm::MeshOptions mesh;
  mesh.host = options.listen_host;
  mesh.rendezvous_timeout = options.comm.rendezvous_timeout;
  mesh.liveness = options.comm.liveness;
  mesh.failed_key = "failed";
  mesh.note_links = false;  // its ranks are the groups' indices, not the job's world ranks
  // The token every hello of this meeting carries: drawn by the first group.
  if (index == 0) {
    std::random_device entropy;
    mesh.token = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
    store->set("token", bytes(std::to_string(mesh.token)));
  } else {
    mesh.token = std::stoull(text(store->get("token")));
  }
  std::vector<int> ranks(static_cast<size_t>(count));
  std::iota(ranks.begin(), ranks.end(), 0);
  return std::make_shared<comm::TcpCommunicator>(index, count, ranks, store, "", mesh, options.comm);
}

void forget_meetings(Etcd& etcd, const std::string& job, int64_t generation) {
  for (const auto& kv : etcd.list(meetings_prefix(job))) {
    const auto rest = kv.key.substr(meetings_prefix(job).size());
    if (rest.substr(0, 20) < generation_name(generation)) etcd.remove(kv.key);
  }
}

}  // namespace zeroshard::replica
