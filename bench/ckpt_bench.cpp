// ckpt_bench: sharded checkpoint save and load throughput against dd writing
// the same bytes to the same disk with fsync, and the training stall of an
// async save against a synchronous one. Run under zeroshard-run:
//
//   zeroshard-run --nproc-per-node 4 -- bench/ckpt_bench [--dir /path/on/disk] [--layers 24]
//
// The model: `layers` fully sharded 2048x2048 linear layers (24: 100.7M
// parameters, 1.2 GB of fp32 masters and AdamW moments over all ranks).
// Rank 0 prints "ROW |...|" lines.
//
// With --durable s3://BUCKET/PREFIX (bench/durable_bench.sh, against a store the
// AWS_* variables name) it measures the durable tier instead: a save until it is
// committed in the store, the training loop's stall of an async durable save, a
// load on an empty disk (copied from the store, verified, read), and the client's
// raw ceiling: rank 0 putting and getting one object of the checkpoint's size in
// parallel parts.
#include "s3_client.h"

#include <zeroshard/checkpoint.h>
#include <zeroshard/comm.h>
#include <zeroshard/fully_shard.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <unistd.h>

namespace ckpt_bench {

struct StackImpl : torch::nn::Module {
  StackImpl(int layers, int width) {
    for (int i = 0; i < layers; ++i) {
      this->layers.push_back(register_module("layer" + std::to_string(i),
                                             zeroshard::Sharded<torch::nn::Linear>(torch::nn::LinearOptions(width, width).bias(false))));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(l->forward(x));
    return x;
  }
  std::vector<zeroshard::Sharded<torch::nn::Linear>> layers;
};
TORCH_MODULE(Stack);

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The durable tier's rows (see the top of the file).
int durable_rows(const std::string& uri, const std::string& dir, int repeats, zeroshard::Communicator& comm,
                 const std::shared_ptr<zeroshard::Communicator>& comm_ptr, Stack& model,
                 zeroshard::FullyShardedAdamW& opt, int width, int64_t psi) {
  namespace s3 = zeroshard::ckpt::s3;
  const int rank = comm.rank();
  auto slowest = [&](double mine) {
    auto t = torch::tensor({mine}, torch::kDouble);
    comm.all_reduce(t, zeroshard::ReduceOp::kMax)->wait();
    return t.item<double>();
  };
  auto train_step = [&] {
    opt.zero_grad();
    model->forward(torch::randn({2, width})).sum().backward();
    opt.step();
  };
  zeroshard::CheckpointOptions o;
  o.write_model_view = false;
  o.durable_uri = uri + "/zeroshard";
  std::vector<double> durable_s, upload_s, load_s, stall_s;
  int64_t bytes = 0;
  {
    zeroshard::Checkpointer ckpt(dir + "/durable", comm_ptr, o);
    for (int i = 0; i < repeats; ++i) {  // sync local save, then until committed in the store (rank 0 commits)
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      ckpt.save(opt, *model, {i + 1, 0, "{}"});
      ckpt.wait_durable(std::chrono::hours(1));
      durable_s.push_back(seconds_since(t0));
      const auto st = ckpt.durable_status();
      TORCH_CHECK(st.durable_step == i + 1, "ckpt_bench: step ", i + 1, " did not become durable: ", st.last_error);
      upload_s.push_back(st.lag_seconds);
      bytes = ckpt.last_save_times().bytes;
      comm.barrier();
    }
  }
  {  // async local save with the durable tier: what the training loop waits
    zeroshard::CheckpointOptions a = o;
    a.async = true;
    zeroshard::Checkpointer ckpt(dir + "/durable-async", comm_ptr, a);
    for (int i = 0; i < repeats; ++i) {
      comm.barrier();
      ckpt.save(opt, *model, {100 + i, 0, "{}"});
      train_step();
      stall_s.push_back(slowest(ckpt.last_save_times().stall_seconds));
      ckpt.wait();
      ckpt.wait_durable(std::chrono::hours(1));
    }
  }
  for (int i = 0; i < repeats; ++i) {  // an empty disk: copied from the store, verified, read
    const std::string empty = dir + "/empty-" + std::to_string(i) + "-rank" + std::to_string(rank);
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    zeroshard::Checkpointer ckpt(empty, comm_ptr, o);
    ckpt.load(opt, *model);  // the newest durable step (retention keeps the last `keep`)
    load_s.push_back(slowest(seconds_since(t0)));
    std::filesystem::remove_all(empty);
  }
  // The raw ceiling: one object of the same bytes, in parallel parts, by rank 0's client alone.
  std::vector<double> put_s, get_s;
  if (rank == 0) {
    s3::Client client(s3::parse_uri(uri + "/raw"), s3::process_environment());
    const std::string file = dir + "/raw.bin", back = dir + "/raw.back";
    {
      auto t = torch::randint(0, 255, {bytes}, torch::kUInt8);
      std::ofstream(file, std::ios::binary).write(static_cast<const char*>(t.data_ptr()), bytes);
    }
    for (int i = 0; i < repeats; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      client.upload_file("object", file);
      put_s.push_back(seconds_since(t0));
      t0 = std::chrono::steady_clock::now();
      client.download_file("object", back);
      get_s.push_back(seconds_since(t0));
    }
    client.remove_all("");
    std::filesystem::remove(file);
    std::filesystem::remove(back);
  }
  comm.barrier();
  if (rank == 0) {
    const double gb = bytes / 1e9;
    const double put = median(put_s), get = median(get_s);
    std::printf("ckpt_bench --durable: %d ranks, %.1fM parameters, %.2f GB of checkpoint files per save, %s, median of %d\n",
                comm.size(), psi / 1e6, gb, uri.c_str(), repeats);
    std::printf("ROW | raw ceiling: one %.2f GB object PUT in parallel parts (rank 0's client) | %.2f s | %.2f GB/s | 1 |\n",
                gb, put, gb / put);
    std::printf("ROW | raw ceiling: the same object GET in parallel ranges | %.2f s | %.2f GB/s | 1 |\n", get, gb / get);
    std::printf("ROW | zeroshard durable save: local save + upload + commit in the store | %.2f s | %.2f GB/s | - |\n",
                median(durable_s), gb / median(durable_s));
    std::printf("ROW | zeroshard durable save: the upload alone (start to commit, rank 0) | %.2f s | %.2f GB/s | %.2f of PUT |\n",
                median(upload_s), gb / median(upload_s), put / median(upload_s));
    std::printf("ROW | zeroshard durable load: an empty disk (copy from the store, verify, read) | %.2f s | %.2f GB/s | "
                "%.2f of GET |\n", median(load_s), gb / median(load_s), get / median(load_s));
    std::printf("ROW | zeroshard async durable save: training loop stall | %.3f s | - | - |\n", median(stall_s));
  }
  comm.barrier();
  if (rank == 0) std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace ckpt_bench

int ckpt_bench_main(int argc, char** argv) {
  using namespace ckpt_bench;
  std::string dir = "build/ckpt_bench";
  int layers = 24, width = 2048, repeats = 5;
  std::string durable;
  CLI::App app{"sharded checkpoint save/load throughput vs dd, and the async save stall"};
  app.add_option("--dir", dir, "checkpoint directory (on the disk to measure)")->capture_default_str();
  app.add_option("--layers", layers, "2048x2048 layers")->capture_default_str();
  app.add_option("--repeats", repeats, "saves and loads timed (median)")->capture_default_str();
  app.add_option("--durable", durable, "s3://BUCKET/PREFIX: measure the durable tier there instead (bench/durable_bench.sh)");
  CLI11_PARSE(app, argc, argv);

  auto comm = zeroshard::init_communicator();
  const int rank = comm->rank(), world = comm->size();
  torch::manual_seed(0);
  Stack model(layers, width);
  auto sharded = zeroshard::fully_shard(model, comm);
  zeroshard::FullyShardedAdamW opt(sharded, torch::optim::AdamWOptions(1e-4));
  {  // one step, so the moments hold real values
    opt.zero_grad();
    model->forward(torch::randn({2, width})).sum().backward();
    opt.step();
  }
  int64_t psi = 0;
  for (const auto& u : sharded->units()) psi += u.layout.numel;
  if (rank == 0) std::filesystem::remove_all(dir);
  comm->barrier();
  if (!durable.empty()) return durable_rows(durable, dir, repeats, *comm, comm, model, opt, width, psi);

  auto slowest = [&](double mine) {
    auto t = torch::tensor({mine}, torch::kDouble);
    comm->all_reduce(t, zeroshard::ReduceOp::kMax)->wait();
    return t.item<double>();
  };

  // Synchronous saves and loads.
  zeroshard::CheckpointOptions sync_options;
  sync_options.write_model_view = false;  // measured separately below: it adds no data
  zeroshard::Checkpointer ckpt(dir + "/sync", comm, sync_options);
  std::vector<double> save_s, load_s, dd_s;
  int64_t bytes = 0;
  // Saves and the anchor alternate, so both meet the same disk state: every
  // rank's dd writes its share of the same bytes, at once, with fsync.
  int64_t mine_mib = 0;
  // Each timed write starts from a quiet disk (sync(), untimed): otherwise a
  // write pays for the previous one's deferred writeback and discards.
  auto quiet = [&] {
    ::sync();
    comm->barrier();
  };
  for (int i = 0; i < repeats; ++i) {
    quiet();
    const auto t0 = std::chrono::steady_clock::now();
    ckpt.save(opt, *model, {i + 1, 0, "{}"});
    save_s.push_back(slowest(seconds_since(t0)));
    bytes = ckpt.last_save_times().bytes;
    mine_mib = std::max<int64_t>(1, bytes / world / (1 << 20));
    const std::string file = dir + "/dd.rank" + std::to_string(rank);
    const std::string cmd = "dd if=/dev/zero of=" + file + " bs=1M count=" + std::to_string(mine_mib) +
                            " conv=fsync status=none";
    quiet();
    const auto t1 = std::chrono::steady_clock::now();
    const int rc = std::system(cmd.c_str());
    dd_s.push_back(slowest(seconds_since(t1)));
    TORCH_CHECK(rc == 0, "ckpt_bench: '", cmd, "' failed");
    std::filesystem::remove(file);
  }
  for (int i = 0; i < repeats; ++i) {
    comm->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    ckpt.load(opt, *model);
    load_s.push_back(slowest(seconds_since(t0)));
  }
  const double dd_bytes = static_cast<double>(mine_mib) * (1 << 20) * world;

  // Async: what a save adds to a training step (the shards are copied on the
  // writer thread while forward and backward run; the step waits for the copy).
  auto train_step = [&] {
    opt.zero_grad();
    model->forward(torch::randn({2, width})).sum().backward();
    opt.step();
  };
  zeroshard::CheckpointOptions async_options = sync_options;
  async_options.async = true;
  zeroshard::Checkpointer async_ckpt(dir + "/async", comm, async_options);
  std::vector<double> step_s, step_with_save_s, stall_s;
  for (int i = 0; i < repeats; ++i) {
    quiet();
    auto t0 = std::chrono::steady_clock::now();
    train_step();
    step_s.push_back(slowest(seconds_since(t0)));
    quiet();
    t0 = std::chrono::steady_clock::now();
    async_ckpt.save(opt, *model, {i + 1, 0, "{}"});
    train_step();
    step_with_save_s.push_back(slowest(seconds_since(t0)));
    stall_s.push_back(slowest(async_ckpt.last_save_times().stall_seconds));
    async_ckpt.wait();
  }
  // The model.h5 view: its cost on top of a save.
  zeroshard::Checkpointer view_ckpt(dir + "/view", comm);
  quiet();
  auto t0 = std::chrono::steady_clock::now();
  view_ckpt.save(opt, *model, {1, 0, "{}"});
  const double with_view = slowest(seconds_since(t0));

  if (rank == 0) {
    const double gb = bytes / 1e9;
    std::printf("ckpt_bench: %d ranks, %.1fM parameters, %.2f GB of checkpoint files per save, median of %d\n", world,
                psi / 1e6, gb, repeats);
    std::printf("ROW | zeroshard save (sync, fsync) | %.2f s | %.2f GB/s | %.2f of dd |\n", median(save_s), gb / median(save_s),
                (dd_bytes / 1e9 / median(dd_s)) > 0 ? (gb / median(save_s)) / (dd_bytes / 1e9 / median(dd_s)) : 0.0);
    std::printf("ROW | dd, same bytes, conv=fsync, one per rank | %.2f s | %.2f GB/s | 1 |\n", median(dd_s),
                dd_bytes / 1e9 / median(dd_s));
    std::printf("ROW | zeroshard load (verify + read) | %.2f s | %.2f GB/s | - |\n", median(load_s), gb / median(load_s));
    std::printf("ROW | zeroshard async save: training loop stall (in save() + next step() waiting for the copy) | %.3f s | - | "
                "%.3f of the sync save |\n",
                median(stall_s), median(stall_s) / median(save_s));
    std::printf("ROW | zeroshard async save: a training step (%.2f s alone) with the save running beside it | %.2f s | - | "
                "+%.2f s |\n",
                median(step_s), median(step_with_save_s), median(step_with_save_s) - median(step_s));
    std::printf("ROW | zeroshard save with model.h5 | %.2f s | %.2f GB/s | - |\n", with_view, gb / with_view);
  }
  comm->barrier();
  if (rank == 0) std::filesystem::remove_all(dir);
  return 0;
}
