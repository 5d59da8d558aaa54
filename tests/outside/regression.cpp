// Fits a small MLP to a synthetic regression task: a torch::data dataset,
// torch's data loader, Adam, gradient clipping, and the model and optimizer
// saved at the end.
#include <torch/torch.h>

#include <cstdio>
#include <string>

// y = sin(x . w) + x_0 / 10 for a fixed w: 1024 examples of 16 features.
class Waves : public torch::data::datasets::Dataset<Waves> {
 public:
  Waves() {
    torch::manual_seed(1);
    inputs_ = torch::randn({1024, 16});
    auto w = torch::randn({16, 1}) / 4;
    targets_ = torch::sin(inputs_.matmul(w)) + inputs_.narrow(1, 0, 1) / 10;
  }
  torch::data::Example<> get(size_t index) override { return {inputs_[index], targets_[index]}; }
  torch::optional<size_t> size() const override { return inputs_.size(0); }

 private:
  torch::Tensor inputs_, targets_;
};

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 256));
    fc3 = register_module("fc3", torch::nn::Linear(256, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1->forward(x));
    x = torch::relu(fc2->forward(x));
    return fc3->forward(x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : ".";
  const int64_t batch_size = 64, epochs = 2;
  torch::manual_seed(0);
  auto model = std::make_shared<Net>();

  auto dataset = Waves().map(torch::data::transforms::Stack<>());
  const size_t dataset_size = dataset.size().value();
  auto loader = torch::data::make_data_loader(std::move(dataset), batch_size);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));
  std::printf("%zu examples, %lld per batch\n", dataset_size, static_cast<long long>(batch_size));

  int64_t step = 0;
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model->forward(batch.data), batch.target);
      loss.backward();
      const double norm = torch::nn::utils::clip_grad_norm_(model->parameters(), 0.5);
      optimizer.step();
      std::printf("epoch %lld step %lld loss %.9g grad_norm %.9g\n", static_cast<long long>(epoch),
                  static_cast<long long>(step++), loss.item<double>(), norm);
    }
  }
  torch::save(model, out + "/model.pt");
  torch::save(optimizer, out + "/optimizer.pt");
}
