// The NCCL communicator. Without a GPU: the unique id made by NCCL itself and
// exchanged through the real rendezvous store. With one: every operation at
// world size 1 (NCCL refuses two ranks on one GPU before 2.30), against the
// closed forms the CPU communicator's tests use; skipped without a GPU.
#include "comm/nccl/nccl_communicator.h"
#include "test_util.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

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

// Every rank ends with rank 0's id, made by ncclGetUniqueId (no GPU needed),
// and two exchanges (two communicators) get two different ids.
TEST(NcclUniqueId, ExchangedThroughTheStoreToEveryRank) {
  auto& tcp = tcp_world();
  const auto m = tcp.meeting_point("nccl-test");
  const UniqueId first = exchange_unique_id(*m.store, m.prefix + "a", tcp.rank(), std::chrono::seconds(30));
  const UniqueId second = exchange_unique_id(*m.store, m.prefix + "b", tcp.rank(), std::chrono::seconds(30));
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
    exchange_unique_id(*m.store, m.prefix + "elsewhere", 0, std::chrono::seconds(1));
  } else {
    const std::string err = testing::error_of(
        [&] { exchange_unique_id(*m.store, m.prefix + "id", tcp.rank(), std::chrono::milliseconds(300)); });
    EXPECT_NE(err.find("rank(s) [0] never published the NCCL unique id"), std::string::npos) << err;
  }
  tcp.barrier();
}

#define ZS_REQUIRE_GPU()                                                                    \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";       \
  if (world().size() != 1) GTEST_SKIP() << "NCCL on one GPU runs at world size 1"

ProcessGroup& nccl_group() {
  static ProcessGroup group = init_nccl(testing::world_ptr(), c10::Device(c10::kCUDA, 0));
  return group;
}

TEST(NcclCommunicator, EveryOperationAtWorldSizeOne) {
  ZS_REQUIRE_GPU();
  auto& comm = *nccl_group().data;
  EXPECT_EQ(comm.device(), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(nccl_group().control.get(), testing::world_ptr().get());
  const auto opts = torch::TensorOptions().device(torch::kCUDA);
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    auto in = torch::arange(1000, opts).to(dtype);
    auto out = torch::empty_like(in);
    comm.all_gather(out, in)->wait();
    EXPECT_TRUE(torch::equal(out, in));
    auto rs = torch::empty_like(in);
    comm.reduce_scatter(rs, in, ReduceOp::kAvg)->wait();
    EXPECT_TRUE(torch::equal(rs, in));
    auto t = in.clone();
    comm.all_reduce(t, ReduceOp::kMax)->wait();
    EXPECT_TRUE(torch::equal(t, in));
    comm.broadcast(t, 0)->wait();
    EXPECT_TRUE(torch::equal(t, in));
  }
  comm.barrier();
}

// block(stream) orders a stream after the operation without a host wait: a
// kernel queued on the stream after block() sees the gathered values.
TEST(NcclCommunicator, BlockOrdersAStreamAfterTheOperation) {
  ZS_REQUIRE_GPU();
  auto& comm = *nccl_group().data;
  auto in = torch::full({1 << 20}, 3.0f, torch::TensorOptions().device(torch::kCUDA));
  auto out = torch::zeros_like(in);
  auto work = comm.all_gather(out, in);
  auto stream = c10::cuda::getStreamFromPool(false, 0);
  work->block(stream);
  at::Tensor sum;
  {
    c10::cuda::CUDAStreamGuard guard(stream);
    sum = out.sum();
  }
  stream.synchronize();
  EXPECT_EQ(sum.item<float>(), 3.0f * (1 << 20));
  work->wait();
}

TEST(NcclCommunicator, SplitAndDupAndTheoryBytes) {
  ZS_REQUIRE_GPU();
  auto& comm = *nccl_group().data;
  auto dup = comm.dup();
  ASSERT_NE(dup, nullptr);
  EXPECT_EQ(dup->size(), 1);
  auto t = torch::ones({256}, torch::TensorOptions().device(torch::kCUDA));
  const auto before = dup->stats().total();
  dup->all_reduce(t, ReduceOp::kSum)->wait();
  EXPECT_TRUE(torch::equal(t, torch::ones_like(t)));
  EXPECT_EQ(dup->stats().total().calls, before.calls + 1);
  EXPECT_EQ(dup->stats().total().bytes_sent, 0) << "one rank sends nothing (2(n-1)/n of the buffer)";
}

TEST(NcclCommunicator, BadTensorsAreNamed) {
  ZS_REQUIRE_GPU();
  auto& comm = *nccl_group().data;
  const std::string cpu = testing::error_of([&] { comm.all_reduce(torch::ones({4}), ReduceOp::kSum); });
  EXPECT_NE(cpu.find("is on cpu but this NCCL communicator's device is cuda:0"), std::string::npos) << cpu;
  auto out = torch::empty({3}, torch::TensorOptions().device(torch::kCUDA));
  auto in = torch::empty({4}, torch::TensorOptions().device(torch::kCUDA));
  const std::string size = testing::error_of([&] { comm.all_gather(out, in); });
  EXPECT_NE(size.find("out must hold size() = 1 times in"), std::string::npos) << size;
}

}  // namespace nccl_test
}  // namespace zeroshard::comm::nccl
