// A small trainer that links zeroshard from outside its tree (tests/package/check_package.py):
// an MLP on a synthetic regression, ZeRO-2 (ShardedAdamW), a checkpoint at the end. Every rank
// takes its share of the same global batch, so 1 and N ranks train the same model.
//
// Prints, on rank 0, what the check compares: the versions of the headers and of the library,
// every step's loss, the optimizer state this rank holds, and the libc10 the process loaded.
#include <zeroshard/checkpoint.h>
#include <zeroshard/comm.h>
#include <zeroshard/sharded_adamw.h>
#include <zeroshard/version.h>

#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <string>

namespace {

// Every shared object named libc10*.so* in this process's mappings: one LibTorch, one path.
std::set<std::string> loaded_c10() {
  std::set<std::string> paths;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const auto base = path.substr(path.rfind('/') + 1);
    if (base.rfind("libc10.so", 0) == 0) paths.insert(path);
  }
  return paths;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string run_dir = argc > 1 ? argv[1] : "";
  const int steps = 8, global_batch = 64;
  auto comm = zeroshard::init_communicator();
  const int rank = comm->rank(), world = comm->size();

  torch::manual_seed(7);
  torch::nn::Sequential model(torch::nn::Linear(8, 512), torch::nn::Tanh(), torch::nn::Linear(512, 1));
  zeroshard::ShardedAdamWOptions sharding;
  sharding.zero_stage = 2;
  zeroshard::ShardedAdamW opt(model->named_parameters(), comm, torch::optim::AdamWOptions(3e-3), sharding);

  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(1000 + step);
    auto x = torch::randn({global_batch, 8});
    auto y = torch::sin(x.sum(1, true));
    const int local = global_batch / world;
    auto loss = torch::mse_loss(model->forward(x.slice(0, rank * local, (rank + 1) * local)),
                                y.slice(0, rank * local, (rank + 1) * local));
    opt.zero_grad();
    loss.backward();
    opt.step();
    auto mean = loss.detach().reshape({1}).clone();
    comm->all_reduce(mean, zeroshard::ReduceOp::kAvg)->wait();
    if (rank == 0) std::printf("step %d loss %.9g\n", step, mean.item<double>());
  }
  if (!run_dir.empty()) {
    zeroshard::Checkpointer ckpt(run_dir, comm);
    zeroshard::TrainingProgress progress;
    progress.step = steps;
    const auto saved = ckpt.save(opt, *model, progress);
    if (rank == 0) std::printf("saved %s\n", saved.c_str());
  }
  if (rank == 0) {
    std::printf("ranks %d\n", world);
    std::printf("version headers %d library %s\n", ZEROSHARD_VERSION, zeroshard::version());
    std::printf("optimizer state bytes %lld\n", static_cast<long long>(opt.stats().memory.moments));
    for (const auto& path : loaded_c10()) std::printf("libc10 %s\n", path.c_str());
  }
  comm->barrier();
  return 0;
}
