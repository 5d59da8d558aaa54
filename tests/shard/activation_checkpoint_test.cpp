// activation_checkpoint against plain autograd: same gradients, bit for bit,
// with the forward run a second time inside backward (dropout included).
#include "zeroshard/activation_checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace zeroshard {
namespace activation_checkpoint_test {

struct Grads {
  torch::Tensor x, w, b;
};

Grads run(bool checkpoint, int* calls) {
  torch::manual_seed(1);
  torch::nn::Linear fc(6, 4);
  torch::nn::Dropout drop(0.5);
  auto x = torch::randn({5, 6}).requires_grad_(true);
  auto fn = [&](const torch::Tensor& in) {
    ++*calls;
    return drop(torch::tanh(fc(in)));
  };
  torch::manual_seed(2);  // the dropout masks come from here
  auto y = checkpoint ? activation_checkpoint(fn, x) : fn(x);
  torch::manual_seed(3);  // backward must not depend on the RNG state at backward time
  (y * y).sum().backward();
  return {x.grad(), fc->weight.grad(), fc->bias.grad()};
}

TEST(ActivationCheckpoint, SameGradientsAndTheForwardRunsTwice) {
  int plain_calls = 0, ckpt_calls = 0;
  auto plain = run(false, &plain_calls);
  auto ckpt = run(true, &ckpt_calls);
  EXPECT_EQ(plain_calls, 1);
  EXPECT_EQ(ckpt_calls, 2);  // once without a graph, once inside backward
  EXPECT_TRUE(torch::equal(plain.x, ckpt.x));
  EXPECT_TRUE(torch::equal(plain.w, ckpt.w));
  EXPECT_TRUE(torch::equal(plain.b, ckpt.b));
}

TEST(ActivationCheckpoint, InputsWithoutGradRunPlainly) {
  torch::nn::Linear fc(3, 2);
  int calls = 0;
  auto y = activation_checkpoint([&](const torch::Tensor& in) { ++calls; return fc(in); }, torch::randn({4, 3}));
  y.sum().backward();
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(fc->weight.grad().defined());  // the parameters still get their gradients
}

TEST(ActivationCheckpoint, AnInputReturnedAsIsKeepsItsOwnGraph) {
  auto x = torch::randn({3}).requires_grad_(true);
  auto outs = activation_checkpoint([](const TensorList& in) { return TensorList{in[0], in[0] * 2}; }, {x});
  (outs[0].sum() + outs[1].sum()).backward();
  EXPECT_TRUE(torch::equal(x.grad(), torch::full({3}, 3.0f)));
}

}  // namespace activation_checkpoint_test
}  // namespace zeroshard
