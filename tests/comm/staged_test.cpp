// stage_through_host: device tensors through host memory over the world's CPU
// communicator. Here the staged "device" is the CPU itself (every tensor still
// goes through a host copy); scripts/gpu-check.sh runs the sharding oracles
// through it on cuda. Expected values are closed forms of (rank, index).
#include "test_util.h"

#include <gtest/gtest.h>

#include <chrono>
#include <numeric>
#include <thread>

namespace zeroshard {
namespace staged_test {

using testing::pattern;
using testing::world;
using testing::world_ptr;

Communicator& staged() {
  static ProcessGroup group = stage_through_host(world_ptr(), c10::Device(c10::kCPU));
  return *group.data;
}

// Every operation against its closed form, for each dtype it promises.
TEST(Staged, EveryOperationMatchesTheClosedForm) {
  auto& c = staged();
  const int n = c.size(), r = c.rank();
  EXPECT_EQ(c.rank(), world().rank());
  EXPECT_EQ(c.size(), world().size());
  for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const int64_t count = 1001;
    auto in = pattern(r, count, dt, 1);
    auto out = at::zeros({n * count}, dt);
    c.all_gather(out, in)->wait();
    for (int p = 0; p < n; ++p) {
      EXPECT_TRUE(out.slice(0, p * count, (p + 1) * count).equal(pattern(p, count, dt, 1))) << dt << " rank " << p;
    }
    auto rs_in = pattern(r, n * count, dt, 2);
    auto rs_out = at::zeros({count}, dt);
    c.reduce_scatter(rs_out, rs_in, ReduceOp::kSum)->wait();
    auto want = at::zeros({count}, at::kDouble);
    for (int p = 0; p < n; ++p) want += pattern(p, n * count, at::kDouble, 2).slice(0, r * count, (r + 1) * count);
    EXPECT_TRUE(rs_out.equal(want.to(dt))) << dt;
    auto t = pattern(r, count, dt, 3);
    c.all_reduce(t, ReduceOp::kMax)->wait();
    auto max = pattern(0, count, at::kDouble, 3);
    for (int p = 1; p < n; ++p) max = at::maximum(max, pattern(p, count, at::kDouble, 3));
    EXPECT_TRUE(t.equal(max.to(dt))) << dt;
    auto b = pattern(r, count, dt, 4);
    c.broadcast(b, n - 1)->wait();
    EXPECT_TRUE(b.equal(pattern(n - 1, count, dt, 4))) << dt;
  }
  if (n > 1) {  // a ring of sends and recvs
    auto got = at::zeros({77});
    auto recv = c.recv(got, (r + n - 1) % n);
    auto send = c.send(pattern(r, 77, at::kFloat, 5), (r + 1) % n);
    send->wait();
    recv->wait();
    EXPECT_TRUE(got.equal(pattern((r + n - 1) % n, 77, at::kFloat, 5)));
  }
}

// The output is the device's own memory: it changes when the Work is waited
// on (or blocked on), not while the transport runs, and the input may be
// reused as soon as the operation is issued.
TEST(Staged, TheResultLandsWhenWaitedOn) {
  auto& c = staged();
  const int n = c.size(), r = c.rank();
  auto t = at::full({513}, static_cast<float>(r + 1));
  auto work = c.all_reduce(t, ReduceOp::kSum);
  t.fill_(-1);  // the input was copied when issued
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!work->is_completed() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(work->is_completed());
  EXPECT_TRUE(t.equal(at::full({513}, -1.0f))) << "the result landed before the Work was waited on";
  work->block(c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)));
  EXPECT_TRUE(t.equal(at::full({513}, static_cast<float>(n * (n + 1) / 2))));
  work->wait();  // lands once: a later wait changes nothing
  EXPECT_TRUE(t.equal(at::full({513}, static_cast<float>(n * (n + 1) / 2))));
}

// A split of the staged communicator stages too, over the CPU split's ranks.
TEST(Staged, SplitStagesOverTheSameRanks) {
  auto& c = staged();
  const int n = c.size(), r = c.rank();
  std::vector<int> evens;
  for (int p = 0; p < n; p += 2) evens.push_back(p);
  auto part = c.split(evens);
  ASSERT_EQ(part != nullptr, r % 2 == 0);
  if (!part) return;
  EXPECT_EQ(part->device(), c10::Device(c10::kCPU));
  auto t = at::ones({5});
  part->all_reduce(t, ReduceOp::kSum)->wait();
  EXPECT_TRUE(t.equal(at::full({5}, static_cast<float>(evens.size()))));
}

// A tensor on another device than the communicator's is named, with the fix;
// a process group whose control plane is not a CPU communicator of the same
// ranks is refused.
TEST(Staged, MisuseIsNamed) {
  auto meta = stage_through_host(world_ptr(), c10::Device(c10::kMeta));
  const std::string err = testing::error_of([&] { meta.data->all_reduce(at::ones({3}), ReduceOp::kSum); });
  EXPECT_NE(err.find("staged all_reduce: tensor 't' is on cpu but this communicator moves meta tensors"),
            std::string::npos) << err;
  const std::string ctrl = testing::error_of([&] { ProcessGroup(world_ptr(), meta.data); });
  EXPECT_NE(ctrl.find("the control communicator moves meta tensors"), std::string::npos) << ctrl;
  const std::string null = testing::error_of([&] { ProcessGroup(world_ptr(), nullptr); });
  EXPECT_NE(null.find("the control communicator is null"), std::string::npos) << null;
  const std::string of = testing::error_of([&] { ProcessGroup::of(meta.data); });
  EXPECT_NE(of.find("ProcessGroup{device_comm, cpu_comm}"), std::string::npos) << of;
  auto first = world().split({0});  // collective: rank 0 alone
  if (first && world().size() > 1) {
    const std::string ranks = testing::error_of([&] { ProcessGroup(first, world_ptr()); });
    EXPECT_NE(ranks.find("the data communicator is rank 0 of 1 but the control communicator is rank 0 of " +
                         std::to_string(world().size())), std::string::npos) << ranks;
  }
}

}  // namespace staged_test
}  // namespace zeroshard
