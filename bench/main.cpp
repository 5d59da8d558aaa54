// zs_bench: every benchmark in one program, so LibTorch's headers are compiled
// once for all of them. build/bench/<name> are links to it; it runs the
// benchmark its name says, or the one its first argument names:
//
//   build/bench/comm_bench --min-kib 4      (the same as: build/bench/zs_bench comm_bench --min-kib 4)
#include <cstdio>
#include <string>

int comm_bench_main(int argc, char** argv);
int optim_bench_main(int argc, char** argv);
int zero_vs_ddp_main(int argc, char** argv);
int zero3_bench_main(int argc, char** argv);
int ckpt_bench_main(int argc, char** argv);
int bart_bench_main(int argc, char** argv);
int pipe_bench_main(int argc, char** argv);
int bart_pipe_bench_main(int argc, char** argv);
int watch_bench_main(int argc, char** argv);

namespace {

struct Benchmark {
  const char* name;
  int (*run)(int, char**);
};

constexpr Benchmark kBenchmarks[] = {
    {"comm_bench", comm_bench_main},   {"optim_bench", optim_bench_main}, {"zero_vs_ddp", zero_vs_ddp_main},
    {"zero3_bench", zero3_bench_main}, {"ckpt_bench", ckpt_bench_main},   {"bart_bench", bart_bench_main},
    {"pipe_bench", pipe_bench_main},   {"bart_pipe_bench", bart_pipe_bench_main},
    {"watch_bench", watch_bench_main},
};

}  // namespace

int main(int argc, char** argv) {
  const std::string self = argv[0];
  const std::string name = self.substr(self.find_last_of('/') + 1);
  for (const auto& b : kBenchmarks) {
    if (name == b.name) return b.run(argc, argv);
  }
  if (argc > 1) {
    for (const auto& b : kBenchmarks) {
      if (std::string(argv[1]) == b.name) return b.run(argc - 1, argv + 1);
    }
  }
  std::fprintf(stderr, "zs_bench: name a benchmark, as build/bench/<name> [args] or zs_bench <name> [args]; one of:");
  for (const auto& b : kBenchmarks) std::fprintf(stderr, " %s", b.name);
  std::fprintf(stderr, "\n");
  return 2;
}
