// nccl_checks.h — checks of an NCCL communicator that run the same against
// the simulated NCCL (nccl_host_test.cpp, every build, ranks as threads) and
// against NCCL on a GPU (nccl_test.cpp, scripts/gpu-check.sh, ranks as
// processes): closed forms from testing::pattern, point-to-point traffic, and
// a rank that never issues an operation.
#pragma once

#include "test_util.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace zeroshard::testing {

// all_reduce (sum, max), all_gather, reduce_scatter (sum) and broadcast of
// 1,000 float32 elements, each against its closed form; then barrier().
inline void check_collectives(Communicator& comm) {
  const int n = comm.size(), me = comm.rank();
  const auto dev = comm.device();
  const int64_t numel = 1000;
  auto sum = at::zeros({numel}, at::kFloat), max = at::full({numel}, -1e9, at::kFloat);
  std::vector<at::Tensor> each;
  for (int r = 0; r < n; ++r) {
    each.push_back(pattern(r, numel, at::kFloat));
    sum += each.back();
    max = at::maximum(max, each.back());
  }
  auto t = pattern(me, numel, at::kFloat).to(dev);
  comm.all_reduce(t, ReduceOp::kSum)->wait();
  EXPECT_TRUE(at::equal(t.cpu(), sum)) << "all_reduce sum on rank " << me;
  t = pattern(me, numel, at::kFloat).to(dev);
  comm.all_reduce(t, ReduceOp::kMax)->wait();
  EXPECT_TRUE(at::equal(t.cpu(), max)) << "all_reduce max on rank " << me;
  auto gathered = at::empty({numel * n}, at::TensorOptions().dtype(at::kFloat).device(dev));
  comm.all_gather(gathered, pattern(me, numel, at::kFloat).to(dev))->wait();
  EXPECT_TRUE(at::equal(gathered.cpu(), at::cat(each))) << "all_gather on rank " << me;
  auto out = at::empty({10}, at::TensorOptions().dtype(at::kFloat).device(dev));
  auto in = pattern(me, 10 * n, at::kFloat, 1).to(dev);
  comm.reduce_scatter(out, in, ReduceOp::kSum)->wait();
  auto expected = at::zeros({10 * n}, at::kFloat);
  for (int r = 0; r < n; ++r) expected += pattern(r, 10 * n, at::kFloat, 1);
  EXPECT_TRUE(at::equal(out.cpu(), expected.slice(0, 10 * me, 10 * (me + 1)))) << "reduce_scatter on rank " << me;
  auto b = pattern(me, numel, at::kFloat, 2).to(dev);
  comm.broadcast(b, n - 1)->wait();
  EXPECT_TRUE(at::equal(b.cpu(), pattern(n - 1, numel, at::kFloat, 2))) << "broadcast from rank " << n - 1;
  comm.barrier();
}

// The size of message i: mixed, from one element to 64 Ki.
inline int64_t message_numel(int i) {
  static const int64_t sizes[] = {1, 3, 1000, 64, 4097, 17, 65536, 255};
  return sizes[i % 8];
}

// Ranks 0 and 1: rank 0 sends message i (i + arange), rank 1 receives it and
// sends back twice its value; rank 0 checks every reply. Returns the number of
// replies that differed.
inline int ping_pong(Communicator& comm, int messages) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(comm.device());
  int wrong = 0;
  for (int i = 0; i < messages; ++i) {
    const int64_t numel = message_numel(i);
    if (comm.rank() == 0) {
      auto msg = at::arange(numel, opts) + i;
      comm.send(msg, 1)->wait();
      auto reply = at::empty({numel}, opts);
      comm.recv(reply, 1)->wait();
      if (!at::equal(reply.cpu(), (msg * 2).cpu())) ++wrong;
    } else if (comm.rank() == 1) {
      auto got = at::empty({numel}, opts);
      comm.recv(got, 0)->wait();
      comm.send(got * 2, 0)->wait();
    }
  }
  return wrong;
}

// Ranks 0 and 1 each post a send to the other and a recv from it before
// waiting for either, `rounds` times; returns the number of wrong messages.
inline int exchange_both_ways(Communicator& comm, int rounds) {
  if (comm.rank() > 1) return 0;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(comm.device());
  const int peer = 1 - comm.rank();
  int wrong = 0;
  for (int i = 0; i < rounds; ++i) {
    const int64_t numel = message_numel(i);
    auto out = at::full({numel}, static_cast<float>(comm.rank() * 1000 + i), opts);
    auto in = at::empty({numel}, opts);
    auto s = comm.send(out, peer);
    auto r = comm.recv(in, peer);
    s->wait();
    r->wait();
    if (!at::equal(in.cpu(), at::full({numel}, static_cast<float>(peer * 1000 + i), at::kFloat))) ++wrong;
  }
  return wrong;
}

// Every rank runs one all_reduce; then every rank but the last runs a second
// one, which the last rank never issues. Returns the error each waiting rank
// got ("" on the last rank).
inline std::string skip_an_operation(Communicator& comm) {
  auto t = at::ones({8}, at::TensorOptions().dtype(at::kFloat).device(comm.device()));
  comm.all_reduce(t, ReduceOp::kSum)->wait();
  if (comm.rank() == comm.size() - 1) return "";
  return error_of([&] { comm.all_reduce(t, ReduceOp::kSum)->wait(); });
}

}  // namespace zeroshard::testing
