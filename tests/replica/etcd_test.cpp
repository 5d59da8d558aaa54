// The coordinator's etcd client against real etcd members (Debian's etcd-server,
// started here on 127.0.0.1 and stopped after): leases as liveness, keys created
// once, revisions, watches, and a cluster of three that goes on with a member
// killed. Oracles: etcd's own answers (what a second client reads back), and the
// closed forms of the gateway's encodings (keys with every byte value).
#include "replica/etcd.h"
#include "replica/group_comm.h"
#include "replica/registration.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <csignal>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <future>
#include <string>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace zeroshard::replica {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Starts `args` (argv[0] looked up in PATH) with `env` added, its output into `log`; the child dies
// with this process. Returns its pid.
pid_t spawn(std::vector<std::string> args, const std::string& log, const std::vector<std::string>& env = {}) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a test that dies takes its children with it
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

void kill_and_reap(pid_t& pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  pid = 0;
}

// Members of one etcd cluster on 127.0.0.1, each a process of its own (killed and reaped at the end).
class EtcdCluster {
 public:
  explicit EtcdCluster(int members) : dir_(testing::make_temp_dir("etcd")) {
    std::string initial;
    for (int m = 0; m < members; ++m) {
      client_.push_back("http://127.0.0.1:" + std::to_string(testing::free_port()));
      peer_.push_back("http://127.0.0.1:" + std::to_string(testing::free_port()));
      initial += (m ? "," : "") + name(m) + "=" + peer_.back();
    }
    for (int m = 0; m < members; ++m) start(m, initial);
    // Ready when every member answers (a read through it alone).
    for (int m = 0; m < members; ++m) {
      Etcd one({{client_[static_cast<size_t>(m)]}, 2000ms});
      const auto deadline = Clock::now() + 30s;
      for (;;) {
        try {
          one.get("ready");
          break;
        } catch (const c10::Error& e) {
          if (Clock::now() > deadline) ADD_FAILURE() << "etcd member " << m << " not ready in 30 s: " << e.what();
          if (Clock::now() > deadline) break;
          std::this_thread::sleep_for(100ms);
        }
      }
    }
  }
  ~EtcdCluster() {
    for (size_t m = 0; m < pids_.size(); ++m) kill(static_cast<int>(m));
    std::filesystem::remove_all(dir_);
  }
  void kill(int m) { kill_and_reap(pids_[static_cast<size_t>(m)]); }
  const std::string& dir() const { return dir_; }
  const std::vector<std::string>& endpoints() const { return client_; }
  // The members' URLs as a coordinator's address (ZS_TEST_ETCD for the helper groups).
  std::string address() const {
    std::string out;
    for (const auto& e : client_) out += (out.empty() ? "" : ",") + e;
    return out;
  }
  // What a process started with its log in this cluster's directory wrote there so far.
  std::string log(const std::string& name) const {
    std::ifstream in(dir_ + "/" + name + ".log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  EtcdOptions options(std::chrono::milliseconds timeout = 5000ms) const { return {client_, timeout}; }

 private:
  static std::string name(int m) { return "m" + std::to_string(m); }
  void start(int m, const std::string& initial) {
    const auto k = static_cast<size_t>(m);
    std::vector<std::string> args = {"etcd", "--name", name(m), "--data-dir", dir_ + "/" + name(m),
                                     "--listen-client-urls", client_[k], "--advertise-client-urls", client_[k],
                                     "--listen-peer-urls", peer_[k], "--initial-advertise-peer-urls", peer_[k],
                                     "--initial-cluster", initial, "--initial-cluster-state", "new",
                                     "--heartbeat-interval", "50", "--election-timeout", "500"};
    const pid_t pid = spawn(args, dir_ + "/" + name(m) + ".log");
    ASSERT_GT(pid, 0);
    pids_.push_back(pid);
    // A member that cannot start (no etcd installed) exits at once: say so, not "not ready".
    std::this_thread::sleep_for(50ms);
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      pids_.back() = 0;
      FAIL() << "etcd did not start (exit " << WEXITSTATUS(status)
             << "): install etcd-server (scripts/install-deps.sh installs it)";
    }
  }

  std::string dir_;
  std::vector<std::string> client_, peer_;
  std::vector<pid_t> pids_;
};

TEST(EtcdCoordinator, ParsesTheCoordinatorsAddress) {
  EXPECT_EQ(parse_etcd_endpoints("etcd://10.0.0.5:2379"), std::vector<std::string>{"http://10.0.0.5:2379"});
  EXPECT_EQ(parse_etcd_endpoints("etcd://a:1,b:2/"), (std::vector<std::string>{"http://a:1", "http://b:2"}));
  EXPECT_EQ(parse_etcd_endpoints("http://a:1,https://b:2"), (std::vector<std::string>{"http://a:1", "https://b:2"}));
  for (const char* bad : {"etcd://", "etcd://host", "host:2379", "etcd://a:1,,b:2", "etcd://http://a:1", "etcd://a:1/x"}) {
    const auto m = testing::error_of([&] { parse_etcd_endpoints(bad); });
    EXPECT_NE(m.find("is not a member's address"), std::string::npos) << bad << ": " << m;
    EXPECT_NE(m.find("etcd://HOST:PORT"), std::string::npos) << m;
  }
}

// Keys with every byte value go through the gateway's base64 both ways; a key exists once
// (create); revisions grow by one per change; a prefix lists in key order and is removed whole.
TEST(EtcdCoordinator, KeysRevisionsAndCreateOnce) {
  EtcdCluster cluster(1);
  Etcd etcd(cluster.options()), other(cluster.options());
  std::string bytes;
  for (int b = 0; b < 256; ++b) bytes += static_cast<char>(b);
  const int64_t r1 = etcd.put("/job/bytes", bytes);
  int64_t read_at = 0;
  const auto kv = other.get("/job/bytes", &read_at);
  ASSERT_TRUE(kv.has_value());
  EXPECT_EQ(kv->value, bytes);
  EXPECT_EQ(kv->create_revision, r1);
  EXPECT_EQ(read_at, r1);
  EXPECT_EQ(etcd.put("/job/bytes", "again"), r1 + 1);
  EXPECT_EQ(other.get("/job/bytes")->version, 2);
  EXPECT_FALSE(other.get("/job/none").has_value());

  EXPECT_TRUE(etcd.create("/job/group/0", "first"));
  KeyValue held;
  EXPECT_FALSE(other.create("/job/group/0", "second", 0, &held));
  EXPECT_EQ(held.value, "first");
  EXPECT_EQ(etcd.get("/job/group/0")->value, "first");
  for (const char* k : {"/job/group/2", "/job/group/1"}) etcd.put(k, k);
  etcd.put("/job/groupx", "not under /job/group/");
  const auto listed = other.list("/job/group/");
  ASSERT_EQ(listed.size(), 3u);
  EXPECT_EQ(listed[0].key, "/job/group/0");
  EXPECT_EQ(listed[2].key, "/job/group/2");
  EXPECT_EQ(etcd.remove_prefix("/job/group/"), 3);
  EXPECT_TRUE(other.list("/job/group/").empty());
  EXPECT_TRUE(other.get("/job/groupx").has_value());
}

// A lease is a group's liveness: its key stays while it is renewed, goes within the TTL (and
// the next second) once renewal stops, and at once when the lease is revoked; a watch from the
// revision it was read at sees the put and then the deletion, in order.
TEST(EtcdCoordinator, ALeaseThatIsNotRenewedTakesItsKeysAndAWatchSeesIt) {
  EtcdCluster cluster(1);
  Etcd etcd(cluster.options()), watcher(cluster.options());
  int64_t at = 0;
  watcher.list("/live/", &at);
  const int64_t lease = etcd.grant(2s);
  etcd.put("/live/g0", "alive", lease);
  const auto first = watcher.watch("/live/", at, 5s);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_FALSE(first[0].deleted);
  EXPECT_EQ(first[0].kv.key, "/live/g0");
  EXPECT_EQ(first[0].kv.lease, lease);
  for (int k = 0; k < 5; ++k) {  // 3.5 s of renewals: longer than the TTL
    EXPECT_EQ(etcd.keep_alive(lease), 2s);
    std::this_thread::sleep_for(700ms);
  }
  EXPECT_TRUE(watcher.get("/live/g0").has_value()) << "a renewed lease lost its key";
  const auto stopped = Clock::now();
  const auto gone = watcher.watch("/live/", first[0].kv.mod_revision, 10s);
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_TRUE(gone[0].deleted);
  EXPECT_EQ(gone[0].kv.key, "/live/g0");
  EXPECT_LT(Clock::now() - stopped, 4s) << "the key outlived its lease's TTL (2 s) by more than 2 s";
  EXPECT_EQ(etcd.keep_alive(lease), 0s);  // expired

  const int64_t second = etcd.grant(30s);
  const int64_t put_at = etcd.put("/live/g1", "alive", second);
  etcd.revoke(second);
  const auto revoked = watcher.watch("/live/", put_at, 5s);
  ASSERT_EQ(revoked.size(), 1u);
  EXPECT_TRUE(revoked[0].deleted);
  // Nothing more: the watch ends at its timeout, empty.
  EXPECT_TRUE(watcher.watch("/live/", revoked[0].kv.mod_revision, 300ms).empty());
  // A watch another thread cancels ends early, empty.
  std::atomic<bool> stop{false};
  auto waiting = std::async(std::launch::async, [&] {
    return watcher.watch("/live/", revoked[0].kv.mod_revision, 60s, [&] { return stop.load(); });
  });
  std::this_thread::sleep_for(200ms);
  stop = true;
  ASSERT_EQ(waiting.wait_for(5s), std::future_status::ready) << "a cancelled watch did not end";
  EXPECT_TRUE(waiting.get().empty());
}

// Three members, one killed (the first the clients try): every call still succeeds on the others,
// and what was written before is read after; a coordinator nobody serves fails in one line naming
// the members and the fix, within the request timeout.
TEST(EtcdCoordinator, AClusterOfThreeGoesOnWithAMemberKilled) {
  EtcdCluster cluster(3);
  Etcd etcd(cluster.options());
  etcd.put("/job/before", "kept");
  const int64_t lease = etcd.grant(10s);
  ASSERT_TRUE(etcd.create("/job/member/g0", "a", lease));
  cluster.kill(0);
  int64_t at = 0;
  EXPECT_EQ(etcd.get("/job/before", &at)->value, "kept");
  EXPECT_EQ(etcd.keep_alive(lease), 10s);
  EXPECT_FALSE(etcd.create("/job/member/g0", "b", lease));
  Etcd fresh(cluster.options());  // a client that starts at the dead member
  EXPECT_GT(fresh.put("/job/after", "x"), at);
  std::thread later([&] {
    std::this_thread::sleep_for(200ms);
    etcd.put("/job/member/g1", "c");
  });
  const auto events = fresh.watch("/job/member/", at, 10s);
  later.join();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kv.key, "/job/member/g1");

  Etcd nobody({{"http://127.0.0.1:" + std::to_string(testing::free_port())}, 1500ms});
  const auto t0 = Clock::now();
  const auto m = testing::error_of([&] { nobody.put("k", "v"); });
  EXPECT_LT(Clock::now() - t0, 3s);
  EXPECT_NE(m.find("no member of etcd at http://127.0.0.1:"), std::string::npos) << m;
  EXPECT_NE(m.find("fix: start etcd there"), std::string::npos) << m;
}

// Registering: a group joins beside live groups of the same model, ranks per group and
// configuration; another of each is refused by name and leaves no key; the same group twice
// (a duplicate launch) is refused naming the live one; leaving takes the key at once; a
// coordinator nobody serves fails in one line.
TEST(EtcdCoordinator, AGroupRegistersBesideItsLikeAndIsRefusedOtherwise) {
  EtcdCluster cluster(1);
  Etcd etcd(cluster.options());
  // (Its pid this process's: a registration whose process is gone from this machine is revoked by
  // the group's next one.)
  const GroupInfo a{"0", 2, "m1", "batch=32", "host-a", ::getpid(), ""};
  Registration first(etcd, "job", a, 3s);
  struct Bad {
    GroupInfo g;
    const char* says;
  };
  for (const auto& [g, says] : std::vector<Bad>{
           {{"0", 2, "m1", "batch=32", "host-b", 202, ""}, "is already registered"},
           {{"1", 3, "m1", "batch=32", "host-b", 202, ""}, "has 2 ranks and this group 3"},
           {{"1", 2, "m2", "batch=32", "host-b", 202, ""}, "trains another model (parameters hash m1, this group's m2)"},
           {{"1", 2, "m1", "batch=64", "host-b", 202, ""}, "another configuration (batch=32; this group: batch=64)"},
           {{"a/b", 2, "m1", "batch=32", "host-b", 202, ""}, "the group 'a/b' is not a name"}}) {
    const auto m = testing::error_of([&] { Registration r(etcd, "job", g, 3s); });
    EXPECT_NE(m.find(says), std::string::npos) << m;
  }
  int64_t at = 0;
  auto live = first.live(&at);
  ASSERT_EQ(live.size(), 1u) << "a refused group left its key";
  EXPECT_EQ(live[0].host, "host-a");
  {
    Registration second(etcd, "job", {"1", 2, "m1", "batch=32", "host-b", 202, ""}, 3s);
    live = first.live();
    ASSERT_EQ(live.size(), 2u);
    EXPECT_EQ(live[1].group, "1");
    EXPECT_EQ(live[1].pid, 202);
    EXPECT_EQ(second.key(), "/zeroshard/job/groups/1");
  }
  const auto left = first.changes(at, 5s);  // the join, then (the lease revoked) the leave
  ASSERT_FALSE(left.empty());
  EXPECT_FALSE(left[0].deleted);
  EXPECT_EQ(first.live().size(), 1u) << "a group that left kept its key";
  EXPECT_TRUE(first.held());

  Etcd nobody({{"http://127.0.0.1:" + std::to_string(testing::free_port())}, 1000ms});
  const auto m = testing::error_of([&] { Registration r(nobody, "job", a, 3s); });
  EXPECT_NE(m.find("no member of etcd at"), std::string::npos) << m;
  EXPECT_EQ(std::count(m.begin(), m.end(), '\n'), 0) << m;
}

// A group's process killed (SIGKILL: nothing revokes its lease) is gone from the coordinator
// within its liveness window (2 s) and the lease check's period, and a watching group sees it go.
TEST(EtcdCoordinator, AGroupWhoseProcessIsKilledIsSeenGone) {
  EtcdCluster cluster(1);
  Etcd etcd(cluster.options());
  Registration me(etcd, "job", {"a", 2, "model-a", "config-a", "test-host", 1, ""}, 3s);
  const std::string endpoints = cluster.address();
  pid_t child = spawn({testing::build_dir() + "/tests/zs_tests", "--helper", "replica_group"},
                      cluster.dir() + "/group-b.log", {"ZS_TEST_ETCD=" + endpoints, "ZS_TEST_GROUP=b"});
  ASSERT_GT(child, 0);
  int64_t at = 0;
  const auto deadline = Clock::now() + 30s;
  while (me.live(&at).size() < 2 && Clock::now() < deadline) std::this_thread::sleep_for(50ms);
  ASSERT_EQ(me.live(&at).size(), 2u) << "the helper group did not register (its log: " << cluster.dir() << "/group-b.log)";
  std::this_thread::sleep_for(2500ms);  // it renews its lease meanwhile: still there
  ASSERT_EQ(me.live(&at).size(), 2u) << "a group that renews its lease lost its key";
  const auto killed = Clock::now();
  kill_and_reap(child);
  const auto events = me.changes(at, 10s);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(events[0].deleted);
  EXPECT_EQ(events[0].kv.key, "/zeroshard/job/groups/b");
  EXPECT_LT(Clock::now() - killed, 4s) << "the killed group outlived its liveness window (2 s) by more than 2 s";
  EXPECT_EQ(me.live().size(), 1u);
}

// A group started again on its machine (its launcher's restart) finds its old registration there,
// on a lease that would live 30 s more, made by a process that is gone: it revokes that lease and
// registers at once (without, it would wait out its own liveness window, 3 s, and be refused as a
// duplicate launch).
TEST(EtcdCoordinator, AGroupStartedAgainOnItsMachineRevokesItsGoneProcesssLease) {
  EtcdCluster cluster(1);
  Etcd etcd(cluster.options());
  pid_t child = spawn({testing::build_dir() + "/tests/zs_tests", "--helper", "replica_group"},
                      cluster.dir() + "/group-b.log",
                      {"ZS_TEST_ETCD=" + cluster.address(), "ZS_TEST_GROUP=b", "ZS_TEST_LIVENESS=30"});
  ASSERT_GT(child, 0);
  const std::string key = Registration::groups_prefix("job") + "b";
  const auto deadline = Clock::now() + 30s;
  while (!etcd.get(key) && Clock::now() < deadline) std::this_thread::sleep_for(50ms);
  const auto old = etcd.get(key);
  ASSERT_TRUE(old) << "the helper group did not register (its log: " << cluster.dir() << "/group-b.log)";
  kill_and_reap(child);
  Registration again(etcd, "job", {"b", 2, "model-a", "config-a", "test-host", ::getpid(), ""}, 3s);
  const auto now = etcd.get(key);
  ASSERT_TRUE(now);
  EXPECT_EQ(now->lease, again.lease());
  EXPECT_EQ(etcd.keep_alive(old->lease).count(), 0) << "the old lease lives on";
  EXPECT_EQ(group_from_json(now->value, key).pid, ::getpid());
}

// The communicator across groups, formed in process through the coordinator: two groups (a
// process each) meet under their membership's generation and all-reduce (1 + 2 = 3); group b is
// SIGKILLed; group a sees it gone, finds its old communicator failed (naming the lost peer), forms
// a new one of the live groups under the new generation in the same process, and all-reduces alone.
TEST(EtcdCoordinator, TheGroupsCommunicatorIsFormedAgainInProcessWhenAGroupIsLost) {
  EtcdCluster cluster(1);
  const std::string endpoints = cluster.address();
  const std::string exe = testing::build_dir() + "/tests/zs_tests";
  std::map<std::string, pid_t> pids;
  for (const char* g : {"a", "b"}) {
    pids[g] = spawn({exe, "--helper", "replica_pair"}, cluster.dir() + "/" + g + ".log",
                    {"ZS_TEST_ETCD=" + endpoints, std::string("ZS_TEST_GROUP=") + g, "ZS_TEST_GROUPS=2"});
  }
  auto log_of = [&](const std::string& g) { return cluster.log(g); };
  auto wait_for = [&](const std::string& g, const std::string& text, std::chrono::seconds within) {
    const auto deadline = Clock::now() + within;
    while (log_of(g).find(text) == std::string::npos && Clock::now() < deadline) std::this_thread::sleep_for(50ms);
    return log_of(g).find(text) != std::string::npos;
  };
  ASSERT_TRUE(wait_for("a", "size 2 sum 3", 60s)) << log_of("a");
  ASSERT_TRUE(wait_for("b", "size 2 sum 3", 10s)) << log_of("b");
  const pid_t a = pids["a"];
  kill_and_reap(pids["b"]);
  ASSERT_TRUE(wait_for("a", "size 1 sum 1", 30s)) << log_of("a");
  int status = 0;
  ASSERT_EQ(::waitpid(a, &status, 0), a);  // the same process throughout, which then exits 0
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log_of("a");
  const auto out = log_of("a");
  EXPECT_NE(out.find("lost b at revision"), std::string::npos) << out;
  EXPECT_NE(out.find("old communicator failed:"), std::string::npos) << out;
  EXPECT_EQ(out.find("the old communicator still works"), std::string::npos) << out;
  std::printf("group a's output:\n%s", out.c_str());
  // The meetings of earlier generations are forgotten: only the last one's keys are left.
  const auto at = out.rfind("generation ");
  ASSERT_NE(at, std::string::npos);
  const int64_t last = std::stoll(out.substr(at + 11));
  Etcd etcd(cluster.options());
  const auto keys = etcd.list("/zeroshard/pair/meet/");
  EXPECT_FALSE(keys.empty());
  for (const auto& kv : keys) {
    EXPECT_EQ(std::stoll(kv.key.substr(std::string("/zeroshard/pair/meet/").size(), 20)), last) << kv.key;
  }
}

// Groups agree on one membership whoever writes it: three groups started together settle on
// one generation of all three (1 + 2 + 3 = 6); one SIGKILLed, and with it one of the coordinator's
// three members, the two others settle on the same new generation of the two (1 + 2); a fourth
// that starts joins them (a, b, d: 6 again), all in the processes that started (the survivors'
// pids are those of the start).
TEST(EtcdCoordinator, GroupsAgreeOnOneMembershipAsGroupsComeAndGo) {
  EtcdCluster cluster(3);
  const std::string endpoints = cluster.address();
  const std::string exe = testing::build_dir() + "/tests/zs_tests";
  std::map<std::string, pid_t> pids;
  auto start = [&](const std::string& g) {
    pids[g] = spawn({exe, "--helper", "replica_member"}, cluster.dir() + "/" + g + ".log",
                    {"ZS_TEST_ETCD=" + endpoints, "ZS_TEST_GROUP=" + g});
  };
  auto log_of = [&](const std::string& g) { return cluster.log(g); };
  // The generation of the last line of `g`'s log that reads "size N sum S", once there is one of a
  // generation past `after` (-1 if none comes in time).
  auto settled = [&](const std::string& g, const std::string& size_sum, std::chrono::seconds within,
                     int64_t after = 0) -> int64_t {
    const auto deadline = Clock::now() + within;
    for (;;) {
      const auto out = log_of(g);
      const auto at = out.rfind(size_sum);
      if (at != std::string::npos) {
        const int64_t generation = std::stoll(out.substr(out.rfind("generation ", at) + 11));
        if (generation > after) return generation;
      }
      if (Clock::now() > deadline) return -1;
      std::this_thread::sleep_for(50ms);
    }
  };
  for (const char* g : {"a", "b", "c"}) start(g);
  const int64_t all3 = settled("a", "size 3 sum 6", 60s);
  ASSERT_GT(all3, 0) << log_of("a");
  EXPECT_EQ(settled("b", "size 3 sum 6", 20s), all3) << log_of("b");
  EXPECT_EQ(settled("c", "size 3 sum 6", 20s), all3) << log_of("c");
  const pid_t a = pids["a"], b = pids["b"];
  kill_and_reap(pids["c"]);
  cluster.kill(0);  // the member every client tries first
  const int64_t two = settled("a", "size 2 sum 3", 30s, all3);
  ASSERT_GT(two, all3) << log_of("a");
  EXPECT_EQ(settled("b", "size 2 sum 3", 20s, all3), two) << log_of("b");
  start("d");
  // a and b printed "size 3 sum 6" before: the lines that count are those past `two`.
  const int64_t again = settled("d", "size 3 sum 6", 60s, two);
  ASSERT_GT(again, two) << log_of("d");
  EXPECT_EQ(settled("a", "size 3 sum 6", 20s, two), again) << log_of("a");
  EXPECT_EQ(settled("b", "size 3 sum 6", 20s, two), again) << log_of("b");
  EXPECT_EQ(::kill(a, 0), 0) << "group a's process is gone";
  EXPECT_EQ(::kill(b, 0), 0) << "group b's process is gone";
  std::printf("generations: a, b, c at %lld; a, b at %lld after c was killed; a, b, d at %lld after d started\n",
              static_cast<long long>(all3), static_cast<long long>(two), static_cast<long long>(again));
  for (auto& [g, pid] : pids) kill_and_reap(pid);
}

// A group heals from a live one: group a trains 3 steps alone, group b starts from another
// initialisation; once both are live, b takes a's state (masters, moments, step counts, loss
// scale) over the communicator across groups, verified by checksums, and both train 2 more steps
// on the same data. Their parameters then agree to the bit: without the moments or the step
// counts, b's updates would differ from a's.
TEST(EtcdCoordinator, AGroupHealsFromALiveGroupAndTrainsAsItDoes) {
  EtcdCluster cluster(1);
  const std::string exe = testing::build_dir() + "/tests/zs_tests";
  std::map<std::string, pid_t> pids;
  for (const char* g : {"a", "b"}) {
    pids[g] = spawn({exe, "--helper", "replica_heal"}, cluster.dir() + "/" + g + ".log",
                    {"ZS_TEST_ETCD=" + cluster.address(), std::string("ZS_TEST_GROUP=") + g});
  }
  for (auto& [g, pid] : pids) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << g << ": " << cluster.log(g);
    pid = 0;
  }
  auto value = [&](const std::string& g, const std::string& what) {
    const auto out = cluster.log(g);
    const auto at = out.find(what);
    EXPECT_NE(at, std::string::npos) << g << ": " << out;
    return at == std::string::npos ? std::string() : out.substr(at + what.size(), out.find_first_of(" ,\n", at + what.size()) - at - what.size());
  };
  EXPECT_EQ(value("a", "healed "), "0") << "the source group received state";
  EXPECT_GT(std::stoll(value("b", "healed ")), 0);
  EXPECT_EQ(value("a", "checksum "), value("b", "checksum "));
  EXPECT_EQ(value("a", "final "), value("b", "final ")) << cluster.log("a") << cluster.log("b");
  std::printf("group b healed %s bytes from group a (checksum %s); after 2 more steps both hold parameters %s\n",
              value("b", "healed ").c_str(), value("b", "checksum ").c_str(), value("b", "final ").c_str());
}

// Replica groups of 2 ranks each (zeroshard-run per group, ZeRO-0 to 3 inside) train a small
// model on a global batch of 8 rows per step, split over the live groups. A rank of group "b" is
// SIGKILLed mid-run: group "a" abandons the step in flight, goes on alone in the same processes
// with the whole batch, and b, started again from another initialisation, takes a's state at a
// step boundary and trains beside it to the end. The oracle: torch::optim::AdamW on the whole
// batch of every step, in this process: every sample trained exactly once, so the final
// parameters of both groups equal it.
//
// With `dies_before_sum`, b's rank 1 kills itself after applying step 20 and before the loss's
// sum across the groups: a's rank 0 sums with b's rank 0 and a's rank 1 cannot. A decision one
// rank of a takes alone (meet now, or train on) would split the group; it must abandon its next
// step on both ranks and meet as one.
struct ReplicaLoss {
  int zero;
  bool dies_before_sum;
};

void PrintTo(const ReplicaLoss& p, std::ostream* os) {
  *os << "ZeRO-" << p.zero << (p.dies_before_sum ? ", b lost before the sum" : "");
}

class ReplicaGroupsTrain : public ::testing::TestWithParam<ReplicaLoss> {};

TEST_P(ReplicaGroupsTrain, TrainOnWhenAGroupIsLostAndHealItWhenItReturns) {
  const int zero = GetParam().zero;
  const bool dies_before_sum = GetParam().dies_before_sum;
  const int64_t steps = 40;
  EtcdCluster cluster(1);
  const std::string run = testing::build_dir() + "/zeroshard-run", exe = testing::build_dir() + "/tests/zs_tests";
  const std::string out = cluster.dir() + "/params", hold = cluster.dir() + "/hold";
  auto start = [&](const std::string& g, const std::string& log, int seed, const std::string& die = "") {
    return spawn({run, "--nproc-per-node", "2", "--", exe, "--helper", "replica_train"}, cluster.dir() + "/" + log + ".log",
                 {"ZS_TEST_ETCD=" + cluster.address(), "ZS_TEST_GROUP=" + g, "ZS_TEST_ZERO=" + std::to_string(zero),
                  "ZS_TEST_STEPS=" + std::to_string(steps), "ZS_TEST_SEED=" + std::to_string(seed), "ZS_TEST_OUT=" + out,
                  "ZS_TEST_HOLD=" + hold, "ZS_TEST_DIE_BEFORE_SUM=" + die});
  };
  // Waits until `log` holds `what` `times` times (after `after`, when given), at most 60 s.
  auto wait_for = [&](const std::string& log, const std::string& what, const std::string& after = "", int times = 1) {
    const auto deadline = Clock::now() + 60s;
    auto found = [&] {
      const std::string text = cluster.log(log);
      auto at = after.empty() ? 0 : text.find(after);
      for (int k = 0; k < times && at != std::string::npos; ++k) {
        at = text.find(what, at);
        if (at != std::string::npos) ++at;
      }
      return at != std::string::npos;
    };
    while (!found()) {
      if (Clock::now() > deadline) return false;
      std::this_thread::sleep_for(20ms);
    }
    return true;
  };
  pid_t a = start("a", "a", 1), b = start("b", "b", 1, dies_before_sum ? "b:20" : "");
  // Both groups train together (b is the second in name order), for a few steps.
  ASSERT_TRUE(wait_for("b", "group 1 of 2", "", 6)) << cluster.log("a") << cluster.log("b");
  std::ofstream(hold).put('\n');  // a, once alone, waits for b's return before its next step
  if (!dies_before_sum) {  // rank 1 of group b, by the pid it printed
    const std::string text = cluster.log("b");
    const std::string mark = "[rank1]: pid ";
    const auto at = text.find(mark);
    ASSERT_NE(at, std::string::npos) << text;
    ASSERT_EQ(::kill(static_cast<pid_t>(std::stol(text.substr(at + mark.size()))), SIGKILL), 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(b, &status, 0), b);
  b = 0;
  ASSERT_TRUE(wait_for("a", "group 0 of 1", "the step in flight taken again")) << cluster.log("a");
  const pid_t back = start("b", "b-again", 2);
  ASSERT_TRUE(wait_for("b-again", "[rank0]: registered")) << cluster.log("b-again");
  std::filesystem::remove(hold);  // a trains again; its next step learns that b is back
  ASSERT_TRUE(wait_for("b-again", "took its state from group 'a'")) << cluster.log("a") << cluster.log("b-again");
  for (pid_t pid : {a, back}) {
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << cluster.log("a") << cluster.log("b-again");
  }
  // a went on alone, taking the step in flight again. (It may first meet b once more, as 1 of 2 with
  // the step taken again, when b's surviving rank meets before it learns that its group is broken.)
  const std::string log_a = cluster.log("a");
  size_t retaken = std::string::npos;
  for (size_t at = log_a.find("the step in flight taken again"); at != std::string::npos;
       at = log_a.find("the step in flight taken again", at + 1)) {
    const size_t begin = log_a.rfind('\n', at) + 1;
    if (log_a.substr(begin, at - begin).find("as 1 of 1 groups [a]") != std::string::npos) {
      retaken = at;
      break;
    }
  }
  ASSERT_NE(retaken, std::string::npos) << "a did not go on alone, taking the step in flight again: " << log_a;
  EXPECT_NE(log_a.find("as 1 of 2 groups", retaken), std::string::npos) << "a never met b again: " << log_a;

  // The oracle: the whole batch of every step, one process.
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
  torch::optim::AdamW ref(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  torch::manual_seed(7);
  const auto x = torch::randn({steps * 8, 8}), y = torch::randn({steps * 8, 4});
  for (int64_t s = 0; s < steps; ++s) {
    ref.zero_grad();
    torch::mse_loss(model->forward(x.slice(0, s * 8, s * 8 + 8)), y.slice(0, s * 8, s * 8 + 8)).backward();
    ref.step();
  }
  std::vector<at::Tensor> flat;
  for (const auto& p : model->parameters()) flat.push_back(p.detach().reshape(-1));
  const auto want = at::cat(flat);
  for (const std::string g : {"a", "b"}) {
    for (int r = 0; r < 2; ++r) {
      std::ifstream in(out + "." + g + "." + std::to_string(r), std::ios::binary);
      ASSERT_TRUE(in) << "group " << g << " rank " << r << " wrote no parameters";
      auto got = at::empty_like(want);
      in.read(static_cast<char*>(got.data_ptr()), static_cast<std::streamsize>(got.nbytes()));
      const double err = ((got - want).abs().max() / want.abs().max()).item<double>();
      EXPECT_LT(err, 1e-5) << "group " << g << " rank " << r;
    }
  }
  if (dies_before_sum) {  // a's rank 0 summed step 20's loss with b, its rank 1 could not
    EXPECT_NE(log_a.find("[rank0]: step 20 group 0 of 2 loss "), std::string::npos) << log_a;
    EXPECT_NE(log_a.find("[rank1]: step 20 group 0 of 2 loss unsummed"), std::string::npos) << log_a;
  }
  std::printf("ZeRO-%d: group a went on alone%s and met b again; both end at torch::optim::AdamW's parameters\n",
              zero, dies_before_sum ? " (b lost between its update and the loss's sum)" : "");
  for (const std::string& line : {log_a, cluster.log("b-again")}) {
    std::istringstream lines(line);
    for (std::string l; std::getline(lines, l);) {
      if (l.find("[rank0]: change at step") != std::string::npos || l.find("replica groups:") != std::string::npos) {
        std::printf("  %s\n", l.c_str());
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, ReplicaGroupsTrain,
                         ::testing::Values(ReplicaLoss{0, false}, ReplicaLoss{1, false}, ReplicaLoss{2, false},
                                           ReplicaLoss{3, false}, ReplicaLoss{2, true}, ReplicaLoss{3, true}),
                         [](const auto& info) {
                           return "ZeRO" + std::to_string(info.param.zero) +
                                  (info.param.dies_before_sum ? "LostBeforeTheSum" : "");
                         });

// EtcdStore answers as LibTorch's own c10d::HashStore does (the oracle), call for call: set, get,
// compareSet (absent with an empty and a non-empty expectation, a match, a mismatch), add (new and
// existing keys, from several threads at once: no lost update), check, deleteKey, getNumKeys, and
// wait (which throws when a key does not come in time).
TEST(EtcdCoordinator, EtcdStoreAnswersAsLibTorchsHashStore) {
  EtcdCluster cluster(1);
  auto etcd = std::make_shared<Etcd>(cluster.options());
  EtcdStore ours(etcd, "/store-test/", 2000ms);
  c10d::HashStore theirs;
  theirs.setTimeout(2000ms);
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  auto both = [&](const std::function<std::string(c10d::Store&)>& op) {
    const auto a = op(ours), b = op(theirs);
    EXPECT_EQ(a, b);
    return a;
  };
  auto text = [](const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); };
  both([&](c10d::Store& s) { s.set("k", bytes("v1")); return text(s.get("k")); });
  both([&](c10d::Store& s) { return text(s.compareSet("k", bytes("nope"), bytes("x"))); });  // mismatch: the value
  both([&](c10d::Store& s) { return text(s.compareSet("k", bytes("v1"), bytes("v2"))); });   // match: the new value
  both([&](c10d::Store& s) { return text(s.get("k")); });
  both([&](c10d::Store& s) { return text(s.compareSet("absent", bytes("e"), bytes("d"))); });  // absent, expected e
  both([&](c10d::Store& s) { return std::to_string(s.check({"absent"})); });
  both([&](c10d::Store& s) { return text(s.compareSet("absent", {}, bytes("d"))); });          // absent, expected none
  both([&](c10d::Store& s) { return std::to_string(s.add("n", 5)) + " " + std::to_string(s.add("n", -2)); });
  both([&](c10d::Store& s) { return std::to_string(s.check({"k", "n"})) + std::to_string(s.check({"k", "zz"})); });
  both([&](c10d::Store& s) { return std::to_string(s.deleteKey("k")) + std::to_string(s.deleteKey("k")); });
  both([&](c10d::Store& s) { return std::to_string(s.getNumKeys()); });
  for (c10d::Store* store : {static_cast<c10d::Store*>(&ours), static_cast<c10d::Store*>(&theirs)}) {
    EXPECT_THROW(store->wait({"never"}, 300ms), c10::Error);
  }
  // Concurrent adds from 4 threads, 25 each, on its own client: every one counted.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      EtcdStore mine(std::make_shared<Etcd>(cluster.options()), "/store-test/", 2000ms);
      for (int k = 0; k < 25; ++k) mine.add("counter", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ours.add("counter", 0), 100);
}

}  // namespace
}  // namespace zeroshard::replica
