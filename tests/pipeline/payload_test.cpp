// Stage payloads between two ranks (skipped at one): both directions at once,
// and a message that is not the expected one named on arrival.
#include "pipeline/payload.h"
#include "test_util.h"

#include <gtest/gtest.h>

namespace zeroshard::pipeline {
namespace payload_test {

using testing::world;

Payload activations(int mb, int64_t width = 3) {
  return {{"hidden", testing::pattern(mb, 4 * width, at::kFloat).view({4, width})},
          {"mask", testing::pattern(mb, 4, at::kLong, 1)}};
}
PayloadSpec spec(int64_t width = 3) { return spec_of(activations(0, width)); }

TEST(PipelinePayload, CrossesBothWaysAtOnce) {
  if (world().size() < 2 || world().rank() > 1) GTEST_SKIP() << "needs ranks 0 and 1";
  auto& c = world();
  const int peer = 1 - c.rank();
  if (c.rank() == 0) {  // stage 0: sends microbatches 0 and 1 forward, takes their gradients back
    PayloadRecv grad0(c, peer, parse_action("0RECV_B0"), spec());
    PayloadRecv grad1(c, peer, parse_action("0RECV_B1"), spec());
    auto w0 = send_payload(c, peer, parse_action("0SEND_F0"), activations(0));
    auto w1 = send_payload(c, peer, parse_action("0SEND_F1"), activations(1));
    const auto g0 = grad0.wait(), g1 = grad1.wait();
    for (auto& w : w0) w->wait();
    for (auto& w : w1) w->wait();
    EXPECT_TRUE(g0[0].second.equal(activations(10)[0].second));
    EXPECT_TRUE(g1[1].second.equal(activations(11)[1].second));
  } else {  // stage 1: sends the gradients before taking the activations (posted: no deadlock)
    PayloadRecv in0(c, peer, parse_action("1RECV_F0"), spec());
    PayloadRecv in1(c, peer, parse_action("1RECV_F1"), spec());
    auto w0 = send_payload(c, peer, parse_action("1SEND_B0"), activations(10));
    auto w1 = send_payload(c, peer, parse_action("1SEND_B1"), activations(11));
    const auto a0 = in0.wait(), a1 = in1.wait();
    for (auto& w : w0) w->wait();
    for (auto& w : w1) w->wait();
    EXPECT_EQ(a0[0].first, "hidden");
    EXPECT_TRUE(a0[0].second.equal(activations(0)[0].second));
    EXPECT_TRUE(a1[1].second.equal(activations(1)[1].second));
  }
}

// Every message still matches in size, so the transport delivers them all;
// the payload header tells the receiver they are not what it expected.
TEST(PipelinePayload, AnUnexpectedMessageIsNamed) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (int trial = 0; trial < 2; ++trial) {
    auto c = world().split({0, 1});
    if (!c) continue;
    if (c->rank() == 0) {
      // trial 0: microbatch 1 where 2 is expected; trial 1: the activation as [6, 2], not [4, 3]
      Payload p = activations(1);
      if (trial == 1) p[0].second = p[0].second.reshape({6, 2});
      for (auto& w : send_payload(*c, 1, parse_action(trial == 0 ? "0SEND_F1" : "0SEND_F2"), p)) w->wait();
    } else {
      PayloadRecv in(*c, 0, parse_action("1RECV_F2"), spec());
      const std::string err = testing::error_of([&] { in.wait(); });
      if (trial == 0) {
        EXPECT_NE(err.find("1RECV_F2 (from rank 0) received what 0SEND_F1 sent, not 0SEND_F2"), std::string::npos) << err;
      } else {
        EXPECT_NE(err.find("tensor 0 'hidden' arrived as [6, 2] Float but hidden [4, 3] Float was expected"),
                  std::string::npos) << err;
      }
    }
  }
  world().barrier();
}

TEST(PipelinePayload, CheckNamesTheTensorThatDiffers) {
  const std::string err = testing::error_of([&] { check_payload(activations(0, 5), spec(3), "stage 1's output of microbatch 0"); });
  EXPECT_NE(err.find("stage 1's output of microbatch 0 has hidden [4, 5] Float where hidden [4, 3] Float was expected"),
            std::string::npos) << err;
  Payload short_one{activations(0)[0]};
  EXPECT_NE(testing::error_of([&] { check_payload(short_one, spec(), "x"); }).find("x lacks 'mask'"), std::string::npos);
}

}  // namespace payload_test
}  // namespace zeroshard::pipeline
