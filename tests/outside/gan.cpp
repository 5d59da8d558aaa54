// A GAN that learns a ring of 8 Gaussians in the plane, trained as LibTorch's
// DCGAN example trains: torch's data loader over the real samples, a
// generator and a discriminator with an Adam optimizer each.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>

// 2048 points around 8 centres on a circle of radius 2.
class Ring : public torch::data::datasets::Dataset<Ring> {
 public:
  Ring() {
    torch::manual_seed(1);
    auto angle = torch::randint(8, {2048}).to(torch::kFloat) * (2 * M_PI / 8);
    points_ = torch::stack({torch::cos(angle), torch::sin(angle)}, 1) * 2 + torch::randn({2048, 2}) * 0.05;
  }
  torch::data::Example<> get(size_t index) override { return {points_[index], torch::ones({1})}; }
  torch::optional<size_t> size() const override { return points_.size(0); }

 private:
  torch::Tensor points_;
};

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : ".";
  const int64_t noise_size = 8, batch_size = 128, epochs = 2;
  torch::manual_seed(0);
  torch::nn::Sequential generator(torch::nn::Linear(noise_size, 128), torch::nn::ReLU(), torch::nn::Linear(128, 128),
                                  torch::nn::ReLU(), torch::nn::Linear(128, 2));
  torch::nn::Sequential discriminator(
      torch::nn::Linear(2, 128), torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Linear(128, 128), torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Linear(128, 1));

  auto dataset = Ring().map(torch::data::transforms::Stack<>());
  const size_t dataset_size = dataset.size().value();
  auto loader = torch::data::make_data_loader(std::move(dataset), batch_size);
  torch::optim::Adam generator_optimizer(generator->parameters(), torch::optim::AdamOptions(1e-3).betas({0.5, 0.999}));
  torch::optim::Adam discriminator_optimizer(discriminator->parameters(),
                                             torch::optim::AdamOptions(1e-3).betas({0.5, 0.999}));
  std::printf("%zu real points, %lld per batch\n", dataset_size, static_cast<long long>(batch_size));

  int64_t step = 0;
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    for (auto& batch : *loader) {
      // The discriminator: real points are 1, generated ones 0.
      discriminator->zero_grad();
      auto real_output = discriminator->forward(batch.data);
      auto d_loss_real = torch::binary_cross_entropy_with_logits(real_output, torch::ones_like(real_output));
      d_loss_real.backward();
      auto noise = torch::randn({batch_size, noise_size});
      auto fake = generator->forward(noise);
      auto fake_output = discriminator->forward(fake.detach());
      auto d_loss_fake = torch::binary_cross_entropy_with_logits(fake_output, torch::zeros_like(fake_output));
      d_loss_fake.backward();
      discriminator_optimizer.step();

      // The generator: its points should pass for real.
      generator->zero_grad();
      fake_output = discriminator->forward(fake);
      auto g_loss = torch::binary_cross_entropy_with_logits(fake_output, torch::ones_like(fake_output));
      g_loss.backward();
      generator_optimizer.step();

      std::printf("epoch %lld step %lld d_loss %.9g g_loss %.9g\n", static_cast<long long>(epoch),
                  static_cast<long long>(step++), (d_loss_real + d_loss_fake).item<double>(), g_loss.item<double>());
    }
  }
  torch::save(generator, out + "/generator.pt");
  torch::save(generator_optimizer, out + "/generator-optimizer.pt");
  torch::save(discriminator, out + "/discriminator.pt");
  torch::save(discriminator_optimizer, out + "/discriminator-optimizer.pt");
}
