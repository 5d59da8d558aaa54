// The NCCL communicator on a GPU (scripts/gpu-check.sh; skipped without one).
// Without a GPU: the unique id made by NCCL itself and exchanged through the
// real rendezvous store. With one: every operation against the closed forms,
// at world size 1, or at 2-3 ranks sharing one GPU when ZS_TEST_NCCL_SHARED_GPU=1
// (each process its own NCCL_HOSTID, so NCCL before 2.30 accepts them);
// point-to-point and a missing rank at 2+ ranks. The same checks run in every
// build against a simulated NCCL (nccl_host_test.cpp).
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl_checks.h"
#include "test_util.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

namespace zeroshard::comm::nccl {
namespace nccl_test {

using testing::world;

std::string hex(const UniqueId& id) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (char c : id) {
    s += digits[(static_cast<unsigned char>(c) >> 4) & 15];
    s += digits[static_cast<unsigned char>(c) & 15];
  }
  return s;
}

TcpCommunicator& tcp_world() {
  auto* tcp = dynamic_cast<TcpCommunicator*>(&world());
  if (tcp == nullptr) throw std::runtime_error("the test world is not a TcpCommunicator");
  return *tcp;
}

UniqueId nccl_id() {
  UniqueId id{};
  const Status s = cuda_nccl_api().unique_id(&id);
  if (!s.is_ok()) throw std::runtime_error("ncclGetUniqueId: " + s.what);
  return id;
}

// Every rank ends with rank 0's id, made by ncclGetUniqueId (no GPU needed),
// and two exchanges (two communicators) get two different ids.
TEST(NcclUniqueId, ExchangedThroughTheStoreToEveryRank) {
  auto& tcp = tcp_world();
  const auto m = tcp.meeting_point("nccl-test");
  const UniqueId first = exchange_unique_id(*m.store, m.prefix + "a", tcp.rank(), std::chrono::seconds(30), nccl_id);
  const UniqueId second = exchange_unique_id(*m.store, m.prefix + "b", tcp.rank(), std::chrono::seconds(30), nccl_id);
  EXPECT_NE(hex(first), hex(UniqueId{})) << "ncclGetUniqueId gave an all-zero id";
  EXPECT_NE(hex(first), hex(second)) << "two communicators got the same id";
  const auto all = all_gather_text(tcp, hex(first) + hex(second));
  for (int r = 0; r < tcp.size(); ++r) EXPECT_EQ(all[r], all[0]) << "rank " << r << " holds another id";
}

// Rank 0 never publishes (its id goes under another key): every other rank's
// wait ends with an error naming rank 0 and what it did not publish.
TEST(NcclUniqueId, ARankZeroThatNeverPublishesIsNamed) {
  auto& tcp = tcp_world();
  if (tcp.size() == 1) GTEST_SKIP() << "needs a rank other than 0";
  const auto m = tcp.meeting_point("nccl-test-missing");
  if (tcp.rank() == 0) {
    exchange_unique_id(*m.store, m.prefix + "elsewhere", 0, std::chrono::seconds(1), nccl_id);
  } else {
    const std::string err = testing::error_of(
        [&] { exchange_unique_id(*m.store, m.prefix + "id", tcp.rank(), std::chrono::milliseconds(300), nccl_id); });
    EXPECT_NE(err.find("rank(s) [0] never published the NCCL unique id"), std::string::npos) << err;
  }
  tcp.barrier();
}

bool shared_gpu() {
  const char* v = std::getenv("ZS_TEST_NCCL_SHARED_GPU");
  return v != nullptr && std::string(v) == "1";
}

// This rank's GPU: cuda:(LOCAL_RANK mod GPUs), made current.
c10::Device gpu() {
  const int gpus = static_cast<int>(torch::cuda::device_count());
  const c10::Device d(c10::kCUDA, static_cast<c10::DeviceIndex>(read_dist_env().local_rank % std::max(gpus, 1)));
  c10::cuda::set_device(d.index());
  return d;
}

#define ZS_REQUIRE_GPU()                                                                                    \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";                       \
  if (world().size() > static_cast<int>(torch::cuda::device_count()) && !shared_gpu())                      \
  GTEST_SKIP() << world().size() << " ranks share " << torch::cuda::device_count()                          \
               << " GPU(s): set ZS_TEST_NCCL_SHARED_GPU=1 and a NCCL_HOSTID per process (scripts/gpu-check.sh)"

#define ZS_REQUIRE_PEERS()                                                   \
  ZS_REQUIRE_GPU();                                                          \
  if (world().size() < 2) GTEST_SKIP() << "needs 2 or more ranks"

ProcessGroup& nccl_group() {
  static ProcessGroup group = init_nccl(testing::world_ptr(), gpu(), testing::test_comm_options());
  return group;
}

TEST(NcclCommunicator, EveryOperationEqualsItsClosedForm) {
  ZS_REQUIRE_GPU();
  auto& comm = *nccl_group().data;
  EXPECT_EQ(comm.device(), gpu());
  EXPECT_EQ(nccl_group().control.get(), testing::world_ptr().get());
  testing::check_collectives(comm);
  // 16-bit types: small integers, exact in every dtype whatever the order of the sum.
  const int n = comm.size();
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    std::vector<at::Tensor> each;
    for (int r = 0; r < n; ++r) each.push_back(testing::pattern(r, 1000, dtype));
    auto in = each[comm.rank()].to(comm.device());
    auto out = torch::empty({1000 * n}, in.options());
    comm.all_gather(out, in)->wait();
    EXPECT_TRUE(torch::equal(out.cpu(), torch::cat(each))) << dtype;
    auto big = testing::pattern(comm.rank(), 1000 * n, dtype, 3).to(comm.device());
    auto rs = torch::empty({1000}, in.options());
    comm.reduce_scatter(rs, big, ReduceOp::kSum)->wait();
    auto sum = torch::zeros({1000 * n}, torch::kFloat);
    for (int r = 0; r < n; ++r) sum += testing::pattern(r, 1000 * n, torch::kFloat, 3);
    EXPECT_TRUE(torch::equal(rs.cpu(), sum.slice(0, 1000 * comm.rank(), 1000 * (comm.rank() + 1)).to(dtype))) << dtype;
  }
  comm.barrier();
}

// block(stream) orders a stream after the operation without a host wait: a
// kernel queued on the stream after block() sees the gathered values.
TEST(NcclCommunicator, BlockOrdersAStreamAfterTheOperation) {
  ZS_REQUIRE_GPU();
  auto& comm = *nccl_group().data;
  auto in = torch::full({1 << 20}, 3.0f, torch::TensorOptions().device(comm.device()));
  auto out = torch::zeros({(1 << 20) * comm.size()}, in.options());
  auto work = comm.all_gather(out, in);
  auto stream = c10::cuda::getStreamFromPool(false, comm.device().index());
  work->block(stream);
  at::Tensor sum;
  {
    c10::cuda::CUDAStreamGuard guard(stream);
    sum = out.sum();
  }
  stream.synchronize();
  EXPECT_EQ(sum.item<float>(), 3.0f * (1 << 20) * comm.size());
  work->wait();
}

TEST(NcclCommunicator, SplitAndDupAndTheoryBytes) {
  ZS_REQUIRE_GPU();
  auto& comm = *nccl_group().data;
  const int n = comm.size();
  auto dup = comm.dup();
  ASSERT_NE(dup, nullptr);
  EXPECT_EQ(dup->size(), n);
  auto t = torch::ones({256}, torch::TensorOptions().device(comm.device()));
  const auto before = dup->stats().total();
  dup->all_reduce(t, ReduceOp::kSum)->wait();
  EXPECT_TRUE(torch::equal(t.cpu(), torch::full({256}, static_cast<float>(n))));
  EXPECT_EQ(dup->stats().total().calls, before.calls + 1);
  EXPECT_EQ(dup->stats().total().bytes_sent, 2 * (n - 1) * 256 * 4 / n) << "2(n-1)/n of the buffer";
  if (n > 2) {  // a split with a non-member: ranks 0 and n-1 only
    auto part = comm.split({0, n - 1});
    EXPECT_EQ(part != nullptr, comm.rank() == 0 || comm.rank() == n - 1);
    if (part) {
      auto v = torch::full({8}, static_cast<float>(comm.rank()), t.options());
      part->all_reduce(v, ReduceOp::kSum)->wait();
      EXPECT_TRUE(torch::equal(v.cpu(), torch::full({8}, static_cast<float>(n - 1))));
    }
  }
  comm.barrier();
}

TEST(NcclCommunicator, BadTensorsAreNamed) {
  ZS_REQUIRE_GPU();
  auto& comm = *nccl_group().data;
  const std::string cpu = testing::error_of([&] { comm.all_reduce(torch::ones({4}), ReduceOp::kSum); });
  EXPECT_NE(cpu.find("is on cpu but this NCCL communicator's device is " + comm.device().str()), std::string::npos)
      << cpu;
  auto out = torch::empty({3}, torch::TensorOptions().device(comm.device()));
  auto in = torch::empty({4}, torch::TensorOptions().device(comm.device()));
  const std::string size = testing::error_of([&] { comm.all_gather(out, in); });
  EXPECT_NE(size.find("out must hold size() = " + std::to_string(comm.size()) + " times in"), std::string::npos)
      << size;
}

TEST(NcclPointToPoint, PingPongOfAThousandMixedSizes) {
  ZS_REQUIRE_PEERS();
  auto& comm = *nccl_group().data;
  EXPECT_EQ(testing::ping_pong(comm, 1000), 0) << "replies that differed from twice the message";
  comm.barrier();
}

TEST(NcclPointToPoint, SendsAndRecvsPostedInBothDirectionsAtOnce) {
  ZS_REQUIRE_PEERS();
  auto& comm = *nccl_group().data;
  EXPECT_EQ(testing::exchange_both_ways(comm, 50), 0);
  comm.barrier();
}

// The last rank never issues the second all_reduce: the others' watchdog
// names it within the timeout (10 s here) and aborts the communicator.
// Breaks its communicator: run it alone (gpu-check's "skip" row).
TEST(NcclWatchdog, ARankThatSkipsAnOperationIsNamed) {
  ZS_REQUIRE_PEERS();
  CommOptions options = testing::test_comm_options();
  options.timeout = std::chrono::seconds(10);
  auto group = init_nccl(testing::world_ptr(), gpu(), options);
  const auto start = std::chrono::steady_clock::now();
  const std::string error = testing::skip_an_operation(*group.data);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int last = group.data->size() - 1;
  if (group.data->rank() != last) {
    EXPECT_NE(error.find("did not complete within 10000 ms"), std::string::npos) << error;
    EXPECT_NE(error.find("rank(s) [" + std::to_string(last) + "] never issued it"), std::string::npos) << error;
    EXPECT_LT(seconds, 40.0);
  }
  testing::world().barrier();
}

}  // namespace nccl_test
}  // namespace zeroshard::comm::nccl
