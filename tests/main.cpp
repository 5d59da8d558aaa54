// The test executable: GoogleTest, plus helper programs that multi-process
// tests start through zeroshard-run (`zs_tests --helper NAME`).
#include "test_util.h"
#ifdef ZS_WITH_CUDA
#include "comm/nccl/nccl_api.h"
#endif
#include "checksum.h"
#include "replica/group_comm.h"
#include "replica/heal.h"
#include "replica/membership.h"
#include "replica/registration.h"
#include "zeroshard/log.h"
#include "zeroshard/metrics.h"
#include "zeroshard/replica_groups.h"
#include "zeroshard/fully_shard.h"
#include "zeroshard/sharded_adamw.h"

#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <random>
#include <thread>
#include <unistd.h>

int soak_train_main(int argc, char** argv);  // soak/soak_train.cpp

namespace {

// Every rank all-reduces 16 MiB repeatedly; rank 2 SIGKILLs itself while one is
// in flight. Survivors ignore SIGTERM so they report their own error and exit 1.
int kill_mid_collective() {
  std::signal(SIGTERM, SIG_IGN);
  zeroshard::CommOptions opt;
  opt.timeout = std::chrono::seconds(15);
  auto c = zeroshard::init_communicator(opt);
  auto t = at::ones({4 << 20});
  try {
    for (int i = 0; i < 1000; ++i) {
      auto w = c->all_reduce(t, zeroshard::ReduceOp::kMax);
      if (c->rank() == 2 && i == 3) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        std::raise(SIGKILL);
      }
      w->wait();
    }
  } catch (const std::exception& e) {  // as a trainer reports it: one line, and the launcher told why
    const std::string message = zeroshard::error_message(e);
    std::cerr << "survivor error: " << message << std::endl;
    zeroshard::record_error(zeroshard::read_dist_env(), message);
    return 1;
  }
  std::cerr << "no error although rank 2 died" << std::endl;
  return 0;
}

// Runs a helper as a trainer runs: an error ends it with one line and exit 1,
// recorded for the launcher's last line, the stack unwound (so its communicator
// aborts and tells its peers which rank broke it, rather than dying of an
// uncaught exception that closes its sockets with no reason).
template <typename F>
int reported(F&& helper) {
  try {
    return helper();
  } catch (const std::exception& e) {
    const std::string message = zeroshard::error_message(e);
    std::cerr << "error: " << message << std::endl;
    zeroshard::record_error(zeroshard::read_dist_env(), message);
    return 1;
  }
}

// The failure helpers: every rank all-reduces once, then rank 1 fails (`fail`)
// and the others wait for a second all_reduce, reporting what they learn.
int rank1_fails_after_one_all_reduce(const std::function<int(zeroshard::Communicator&)>& fail) {
  zeroshard::CommOptions opt;
  opt.timeout = std::chrono::seconds(15);
  auto c = zeroshard::init_communicator(opt);
  auto t = at::ones({16});
  c->all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
  if (c->rank() == 1) return fail(*c);
  c->all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
  return 0;
}

// Rank 1 fails with a named error (its communicator aborts as the error unwinds the stack).
int fail_with_error() {
  return rank1_fails_after_one_all_reduce([](zeroshard::Communicator&) -> int {
    TORCH_CHECK_VALUE(false, "rank 1 of this test fails on purpose (step 7, file 'x.h5')");
    return 1;
  });
}

// Rank 1 throws and catches nothing (std::terminate).
int fail_uncaught() {
  return rank1_fails_after_one_all_reduce([](zeroshard::Communicator&) {
    std::thread([] { throw std::runtime_error("rank 1 of this test throws on purpose, caught by no one"); }).join();
    return 0;
  });
}

// Rank 1 aborts its communicator and lives on for 8 s (what a rank does after its
// communicator failed is its own business).
int abort_and_linger() {
  return rank1_fails_after_one_all_reduce([](zeroshard::Communicator& c) {
    c.abort("rank 1 of this test aborts on purpose");
    std::this_thread::sleep_for(std::chrono::seconds(8));
    return 3;
  });
}

// Three splits of the world, destroyed in one order on even ranks and the
// reverse on odd ones; prints how long the destruction took on this rank.
int destroy_in_any_order() {
  auto c = zeroshard::init_communicator();
  std::vector<int> all(c->size());
  for (int r = 0; r < c->size(); ++r) all[r] = r;
  std::vector<std::shared_ptr<zeroshard::Communicator>> splits;
  for (int k = 0; k < 3; ++k) splits.push_back(c->split(all));
  auto t = at::ones({16});
  for (auto& s : splits) s->all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
  const auto start = std::chrono::steady_clock::now();
  if (c->rank() % 2 == 1) std::reverse(splits.begin(), splits.end());
  while (!splits.empty()) splits.pop_back();
  std::cout << "destroyed 3 splits in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s" << std::endl;
  return 0;
}

// Logs one line at each level after init_logging(rank, world) from the env.
int log_lines() {
  const auto env = zeroshard::read_dist_env();
  zeroshard::init_logging(env.rank, env.world_size);
  zeroshard::log_debug("debug line");
  zeroshard::log_info("info line");
  zeroshard::log_warn("warn line");
  return 0;
}

// The replica helpers' coordinator: the etcd members the test names in ZS_TEST_ETCD; each checks
// that the test named its group (ZS_TEST_GROUP) too.
std::shared_ptr<zeroshard::replica::Etcd> coordinator_from_env() {
  const char* endpoints = std::getenv("ZS_TEST_ETCD");
  TORCH_CHECK_VALUE(endpoints != nullptr && std::getenv("ZS_TEST_GROUP") != nullptr,
                    "the replica helpers need ZS_TEST_ETCD and ZS_TEST_GROUP");
  return std::make_shared<zeroshard::replica::Etcd>(
      zeroshard::replica::EtcdOptions{zeroshard::replica::parse_etcd_endpoints(endpoints), std::chrono::seconds(5)});
}

// A replica group (ZS_TEST_GROUP) that registers in the coordinator (ZS_TEST_ETCD) with a liveness
// window of 2 s, says so on stdout, and waits to be killed.
int replica_group() {
  auto etcd = coordinator_from_env();
  const zeroshard::replica::GroupInfo me{std::getenv("ZS_TEST_GROUP"), 2, "model-a", "config-a", "test-host",
                                         static_cast<int64_t>(::getpid()), ""};
  const char* liveness = std::getenv("ZS_TEST_LIVENESS");
  zeroshard::replica::Registration registration(*etcd, "job", me, std::chrono::seconds(liveness ? std::atoi(liveness) : 2));
  std::cout << "registered" << std::endl;
  std::this_thread::sleep_for(std::chrono::seconds(120));
  return 0;
}

// A replica group of one rank (ZS_TEST_GROUP) in job "pair": registers, waits for ZS_TEST_GROUPS
// live groups, forms the communicator across them through the coordinator and all-reduces its index
// + 1; group "b" then waits to be killed. Group "a" watches for a group lost, finds its old
// communicator failed, forms a new one among the live groups (in this process) and all-reduces again.
int replica_pair() {
  using namespace zeroshard::replica;
  auto etcd = coordinator_from_env();
  const std::string group = std::getenv("ZS_TEST_GROUP");
  const int expected = std::atoi(std::getenv("ZS_TEST_GROUPS"));
  Registration registration(*etcd, "pair", {group, 1, "m", "c", "test-host", static_cast<int64_t>(::getpid()), ""},
                            std::chrono::seconds(2));
  const auto prefix = Registration::groups_prefix("pair");
  std::vector<KeyValue> live;
  for (int k = 0; k < 600 && static_cast<int>(live.size()) < expected; ++k) {
    live = etcd->list(prefix);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  TORCH_CHECK(static_cast<int>(live.size()) == expected, "replica_pair: ", live.size(), " groups registered");
  int64_t generation = 0;
  int index = 0;
  for (size_t k = 0; k < live.size(); ++k) {
    generation = std::max(generation, live[k].create_revision);
    if (live[k].key == prefix + group) index = static_cast<int>(k);
  }
  GroupCommOptions options;
  options.comm.liveness = std::chrono::seconds(3);
  options.comm.rendezvous_timeout = std::chrono::seconds(20);
  auto across = connect_groups(etcd, "pair", generation, 0, index, expected, options);
  auto t = at::full({4}, static_cast<double>(index + 1), at::kDouble);
  across->all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
  std::cout << "generation " << generation << " size " << across->size() << " sum " << t[0].item<double>() << std::endl;
  if (group != "a") {
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  int64_t at_revision = generation;
  std::vector<WatchEvent> lost;
  while (lost.empty()) {
    for (const auto& e : registration.changes(at_revision, std::chrono::seconds(30))) {
      at_revision = e.kv.mod_revision;
      if (e.deleted) lost.push_back(e);
    }
  }
  std::cout << "lost " << lost.back().kv.key.substr(prefix.size()) << " at revision " << lost.back().kv.mod_revision
            << std::endl;
  try {
    across->all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
    std::cout << "the old communicator still works" << std::endl;
  } catch (const std::exception& e) {
    std::cout << "old communicator failed: " << zeroshard::error_message(e) << std::endl;
  }
  live = etcd->list(prefix);
  index = 0;
  for (size_t k = 0; k < live.size(); ++k) {
    if (live[k].key == prefix + group) index = static_cast<int>(k);
  }
  auto again = connect_groups(etcd, "pair", lost.back().kv.mod_revision, 0, index, static_cast<int>(live.size()), options);
  t.fill_(static_cast<double>(index + 1));
  again->all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
  std::cout << "generation " << lost.back().kv.mod_revision << " size " << again->size() << " sum " << t[0].item<double>()
            << std::endl;
  forget_meetings(*etcd, "pair", lost.back().kv.mod_revision);
  return 0;
}

// A replica group of one rank (ZS_TEST_GROUP) in job "members" that trains in whatever membership
// the live groups agree on: at each generation it meets the others, all-reduces its place + 1 and
// prints the generation, the size and the sum; then waits for the membership to change. Runs until
// killed.
int replica_member() {
  using namespace zeroshard::replica;
  auto etcd = coordinator_from_env();
  const std::string group = std::getenv("ZS_TEST_GROUP");
  Registration registration(*etcd, "members", {group, 1, "m", "c", "test-host", static_cast<int64_t>(::getpid()), ""},
                            std::chrono::seconds(2));
  Membership membership(etcd, "members", group);
  GroupCommOptions options;
  options.comm.liveness = std::chrono::seconds(3);
  options.comm.rendezvous_timeout = std::chrono::seconds(20);
  for (;;) {
    const MembershipView view = membership.agree(std::chrono::seconds(30));
    try {
      auto across = connect_groups(etcd, "members", view.generation, 0, view.index, static_cast<int>(view.groups.size()),
                                   options, [&] { membership.check_current(view); });
      auto t = at::full({4}, static_cast<double>(view.index + 1), at::kDouble);
      across->all_reduce(t, zeroshard::ReduceOp::kSum)->wait();
      std::cout << "generation " << view.generation << " size " << view.groups.size() << " sum " << t[0].item<double>()
                << std::endl;
      forget_meetings(*etcd, "members", view.generation);
    } catch (const std::exception& e) {
      try {
        membership.check_current(view);
      } catch (const MembershipChanged&) {
        std::cout << "generation " << view.generation << " abandoned: " << zeroshard::error_message(e) << std::endl;
        continue;
      }
      throw;
    }
    while (!membership.wait_for_change(view, std::chrono::seconds(30))) {
    }
  }
}

// A replica group of one rank (ZS_TEST_GROUP: "a" or "b") in job "heal", training a small model with
// ShardedAdamW (ZeRO-2): "a" trains 3 steps alone first; "b" starts from another initialisation.
// Once both are live they meet, "b" heals from "a", and both train 2 more steps on the same data,
// printing what the heal moved and a digest of their parameters at the end.
int replica_heal() {
  using namespace zeroshard::replica;
  auto etcd = coordinator_from_env();
  const std::string group = std::getenv("ZS_TEST_GROUP");
  torch::manual_seed(group == "a" ? 1 : 2);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
  zeroshard::ShardedAdamWOptions o;
  o.zero_stage = 2;
  o.bucket_bytes = 256;  // a few buckets
  zeroshard::ShardedAdamW opt(model->named_parameters(), zeroshard::ProcessGroup::of(zeroshard::init_communicator()),
                              torch::optim::AdamWOptions(1e-2).weight_decay(0.01), o);
  auto train = [&](int step) {
    torch::manual_seed(100 + step);
    auto x = torch::randn({32, 8}), y = torch::randn({32, 4});
    opt.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    opt.step();
  };
  if (group == "a") {
    for (int s = 0; s < 3; ++s) train(s);
  }
  Registration registration(*etcd, "heal", {group, 1, "m", "c", "test-host", static_cast<int64_t>(::getpid()), ""},
                            std::chrono::seconds(2));
  Membership membership(etcd, "heal", group);
  MembershipView view;
  for (;;) {  // until both groups train together
    view = membership.agree(std::chrono::seconds(30));
    if (view.groups.size() == 2) break;
    membership.wait_for_change(view, std::chrono::seconds(30));
  }
  GroupCommOptions options;
  options.comm.rendezvous_timeout = std::chrono::seconds(20);
  auto across = connect_groups(etcd, "heal", view.generation, 0, view.index, 2, options,
                               [&] { membership.check_current(view); });
  const auto source = static_cast<int>(std::find(view.groups.begin(), view.groups.end(), "a") - view.groups.begin());
  const auto report = heal(*across, source, opt);
  std::cout << "healed " << report.bytes << " bytes, checksum " << report.checksum << std::endl;
  for (int s = 3; s < 5; ++s) train(s);
  std::vector<at::Tensor> flat;
  for (const auto& p : model->parameters()) flat.push_back(p.detach().reshape(-1));
  const auto all = at::cat(flat).contiguous();
  std::cout << "final " << zeroshard::checkpoint::digest_bytes(all.data_ptr(), all.nbytes()) << std::endl;
  return 0;
}

// A replica group (ZS_TEST_GROUP) of the ranks zeroshard-run started, in job "train": a small model
// (initialised with ZS_TEST_SEED) trained with ZeRO-ZS_TEST_ZERO for ZS_TEST_STEPS steps of a global
// batch of 8 rows, this group's share of it chosen by its place among the live groups at each step.
// A lost step is taken again; while it trains alone it holds after each step as long as the file
// ZS_TEST_HOLD exists. Prints "pid P rank R" first, "registered" once in the coordinator, "step S group I of N" per step, and at
// the end writes its parameters (as float32) to ZS_TEST_OUT.<group>.<rank>.
int replica_train() {
  using zeroshard::ReplicaGroups, zeroshard::ReplicaGroupsOptions, zeroshard::ReplicaTurn;
  const std::string group = std::getenv("ZS_TEST_GROUP");
  const int zero = std::atoi(std::getenv("ZS_TEST_ZERO"));
  const int64_t steps = std::atoll(std::getenv("ZS_TEST_STEPS"));
  auto comm = zeroshard::init_communicator();
  std::cout << "pid " << ::getpid() << " rank " << comm->rank() << std::endl;
  torch::manual_seed(std::atoi(std::getenv("ZS_TEST_SEED")));
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
  std::shared_ptr<zeroshard::FullyShardedModel> sharded;
  std::unique_ptr<zeroshard::ShardedOptimizer> opt_ptr;
  if (zero == 3) {
    sharded = zeroshard::fully_shard(model.ptr(), zeroshard::ProcessGroup::of(comm));
    opt_ptr = std::make_unique<zeroshard::FullyShardedAdamW>(sharded, adamw);
  } else {
    zeroshard::ShardedAdamWOptions o;
    o.zero_stage = zero;
    o.bucket_bytes = 256;  // a few buckets
    opt_ptr = std::make_unique<zeroshard::ShardedAdamW>(model->named_parameters(), zeroshard::ProcessGroup::of(comm),
                                                        adamw, o);
  }
  auto& opt = *opt_ptr;
  ReplicaGroupsOptions ro;
  ro.coordinator = std::getenv("ZS_TEST_ETCD");
  ro.job = "train";
  ro.group = group;
  ro.liveness = std::chrono::seconds(2);
  ro.meet_timeout = std::chrono::seconds(30);
  ro.config = "global batch 8";
  ReplicaGroups groups(zeroshard::ProcessGroup::of(comm), opt, nullptr, ro);
  std::cout << "registered" << std::endl;
  torch::manual_seed(7);
  const auto x = torch::randn({steps * 8, 8}), y = torch::randn({steps * 8, 4});
  for (int64_t step = 0; step < steps;) {
    const ReplicaTurn turn = groups.before_step(step);
    if (step >= steps) break;
    const int64_t share = 8 / (turn.count * comm->size());
    const int64_t first = step * 8 + (turn.index * comm->size() + comm->rank()) * share;
    opt.zero_grad();
    const auto loss = torch::mse_loss(model->forward(x.slice(0, first, first + share)), y.slice(0, first, first + share));
    loss.backward();
    try {
      opt.step();
    } catch (const zeroshard::ReplicaGroupLost& e) {
      groups.step_lost(e);
      continue;
    }
    // ZS_TEST_DIE_BEFORE_SUM=GROUP:STEP: that group's rank 1 dies after applying that step, before
    // the sum across the groups, which the other groups' rank 0 then completes and their rank 1 not.
    const char* die = std::getenv("ZS_TEST_DIE_BEFORE_SUM");
    if (die != nullptr && comm->rank() == 1 && group + ":" + std::to_string(step) == die) ::raise(SIGKILL);
    std::vector<double> summed{loss.item<double>()};
    const bool whole = groups.sum_across(summed);
    std::cout << "step " << step << " group " << turn.index << " of " << turn.count << " loss "
              << (whole ? std::to_string(summed[0]) : "unsummed") << std::endl;
    ++step;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    // The test holds a group training alone here (while the file ZS_TEST_HOLD exists) until the
    // group it lost is back, so that it cannot finish before.
    const char* hold = std::getenv("ZS_TEST_HOLD");
    while (turn.count == 1 && hold != nullptr && std::filesystem::exists(hold)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::optional<zeroshard::FullyShardedModel::FullParamsGuard> whole;
  if (sharded) whole.emplace(sharded->summon_full_params());
  std::vector<at::Tensor> flat;
  for (const auto& p : model->parameters()) flat.push_back(p.detach().reshape(-1));
  const auto all = at::cat(flat).contiguous();
  const std::string out = std::string(std::getenv("ZS_TEST_OUT")) + "." + group + "." + std::to_string(comm->rank());
  std::ofstream(out, std::ios::binary).write(static_cast<const char*>(all.data_ptr()), static_cast<std::streamsize>(all.nbytes()));
  for (const auto& c : groups.changes()) {
    std::cout << "change at step " << c.step << ": " << c.groups << " groups, paused " << c.pause_seconds
              << " s, healed " << c.heal_bytes << " bytes" << (c.step_retaken ? ", step retaken" : "") << std::endl;
  }
  return 0;
}

// A run's metrics with TensorBoard's files beside them (tests/runtime/check_tensorboard.py):
// `--helper tensorboard_run DIR RESUME LAST SEED [SLEEP_US]` writes DIR/metrics.jsonl and
// DIR/tensorboard for steps RESUME+1..LAST (LAST < 0: until killed), each step's numbers drawn
// from SEED: every StepMetrics field, an extra object and number every fifth step, a
// "checkpoint" event every tenth, and the configuration as text.
int tensorboard_run(int argc, char** argv) {
  if (argc < 6) {
    std::cerr << "usage: --helper tensorboard_run DIR RESUME LAST SEED [SLEEP_US]" << std::endl;
    return 2;
  }
  const std::string dir = argv[2];
  const int64_t resume = std::atoll(argv[3]), last = std::atoll(argv[4]);
  const int seed = std::atoi(argv[5]);
  const int sleep_us = argc > 6 ? std::atoi(argv[6]) : 0;
  zeroshard::MetricsOptions options;
  options.tensorboard_dir = dir + "/tensorboard";
  zeroshard::MetricsLog log(dir + "/metrics.jsonl", resume, options);
  log.write_text("config", resume, "# the run\nseed " + std::to_string(seed) + ", resumed after step " +
                                       std::to_string(resume));
  std::cout << log.tensorboard_path() << std::endl;
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  std::uniform_real_distribution<double> u(0.0, 10.0);
  for (int64_t step = resume + 1; last < 0 || step <= last; ++step) {
    zeroshard::StepMetrics m;
    m.step = step;
    m.loss = u(rng);
    m.lr = u(rng) * 1e-4;
    m.grad_norm = step % 7 == 0 ? std::numeric_limits<double>::quiet_NaN() : u(rng);  // NaN: null, no scalar
    m.tokens = static_cast<int64_t>(u(rng) * 1000);
    m.seconds = u(rng);
    m.compute_seconds = u(rng);
    m.exposed_comm_seconds = u(rng);
    m.optimizer_seconds = u(rng);
    m.other_seconds = u(rng);
    m.peak_rss_bytes = static_cast<int64_t>(u(rng) * 1e9);
    m.bytes_sent = static_cast<int64_t>(u(rng) * 1e8);
    m.loss_scale = 65536;
    m.skipped = step % 11 == 0;
    if (step % 5 == 0) {
      m.extra_json = "{\"val_loss\": {\"wiki\": " + std::to_string(u(rng)) + ", \"books\": " + std::to_string(u(rng)) +
                     "}, \"goodput\": " + std::to_string(u(rng) / 10) + ", \"note\": \"text is not a scalar\"}";
    }
    log.write(m);
    if (step % 10 == 0) {
      log.write_event("checkpoint", step, "{\"seconds\": " + std::to_string(u(rng)) + ", \"path\": \"ckpt\"}");
    }
    if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::strcmp(argv[1], "--helper") == 0) {
    if (std::strcmp(argv[2], "kill_mid_collective") == 0) return kill_mid_collective();
    if (std::strcmp(argv[2], "log_lines") == 0) return log_lines();
    if (std::strcmp(argv[2], "replica_group") == 0) return reported(replica_group);
    if (std::strcmp(argv[2], "replica_pair") == 0) return reported(replica_pair);
    if (std::strcmp(argv[2], "replica_member") == 0) return reported(replica_member);
    if (std::strcmp(argv[2], "replica_heal") == 0) return reported(replica_heal);
    if (std::strcmp(argv[2], "replica_train") == 0) return reported(replica_train);
    if (std::strcmp(argv[2], "tensorboard_run") == 0) {
      return reported([&] { return tensorboard_run(argc - 1, argv + 1); });
    }
    if (std::strcmp(argv[2], "fail_with_error") == 0) return reported(fail_with_error);
    if (std::strcmp(argv[2], "fail_uncaught") == 0) return reported(fail_uncaught);
    if (std::strcmp(argv[2], "abort_and_linger") == 0) return reported(abort_and_linger);
    if (std::strcmp(argv[2], "destroy_in_any_order") == 0) return reported(destroy_in_any_order);
    if (std::strcmp(argv[2], "soak_train") == 0) return reported([&] { return soak_train_main(argc - 2, argv + 2); });
    std::cerr << "unknown helper " << argv[2] << std::endl;
    return 2;
  }
  // The memory tests count the heap's mappings, and MKL's fast memory manager (in
  // the LibTorch 2.x wheel) keeps its matmul buffers mapped between calls (1.1 MB
  // after a 512x512 layer's backward). Off for the tests, unless set.
  setenv("MKL_DISABLE_FAST_MM", "1", 0);
  ::testing::InitGoogleTest(&argc, argv);
  const int status = RUN_ALL_TESTS();
#ifdef ZS_WITH_CUDA
  // What the GPU run counts per row (scripts/gpu-check.sh): a row of NCCL tests
  // that issued nothing through NCCL proved nothing about it.
  const auto issued = zeroshard::comm::nccl::cuda_nccl_issued();
  std::cout << "zs-test: NCCL operations issued: " << issued.collectives + issued.point_to_point << " (collectives "
            << issued.collectives << ", point-to-point " << issued.point_to_point << ")" << std::endl;
#endif
  return status;
}
