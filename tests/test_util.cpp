#include "test_util.h"

#include "runtime/free_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <stdexcept>

namespace zeroshard::testing {

at::Tensor pattern(int rank, int64_t numel, at::ScalarType dtype, int salt) {
  auto i = at::arange(numel, at::kLong);
  auto v = (i * 7 + (rank * 31 + salt * 3)).remainder(17) - 8;
  return v.to(dtype).contiguous();
}

CommOptions test_comm_options() {
  CommOptions opt;
  opt.timeout = std::chrono::seconds(60);
  if (const char* s = std::getenv("ZS_TEST_TIMEOUT_S"); s != nullptr && *s != '\0') {
    const int seconds = std::atoi(s);
    if (seconds <= 0) throw std::runtime_error(std::string("ZS_TEST_TIMEOUT_S is '") + s + "'; use whole seconds > 0");
    opt.timeout = std::chrono::seconds(seconds);
  }
  // The large operations' algorithm (CommOptions::algorithm): ctest runs the 3-rank collectives as rings.
  if (const char* a = std::getenv("ZS_TEST_ALGORITHM"); a != nullptr && *a != '\0') {
    const std::string s = a;
    if (s == "ring") opt.algorithm = CommOptions::Algorithm::kRing;
    else if (s == "pairwise") opt.algorithm = CommOptions::Algorithm::kPairwise;
    else if (s != "auto") throw std::runtime_error("ZS_TEST_ALGORITHM is '" + s + "'; use auto, ring or pairwise");
  }
  return opt;
}

std::shared_ptr<Communicator> world_ptr() {
  static std::shared_ptr<Communicator> comm = init_communicator(test_comm_options());
  return comm;
}

Communicator& world() { return *world_ptr(); }

namespace {
std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : fallback;
}
std::string test_comm() { return env_or("ZS_TEST_COMM", test_device().is_cpu() ? "tcp" : "nccl"); }
}  // namespace

// The data plane of ZS_TEST_COMM=staged: the staged communicator, refusing
// what only the control plane may carry (int64 and float64 host values:
// agreements, hashes, norms). With the CPU as the staged device, this is what
// tells a control value sent on the data plane from one sent on the control
// plane; on a GPU the device communicator itself would refuse the CPU tensor.
class DataPlaneOnly final : public Communicator {
 public:
  explicit DataPlaneOnly(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  void abort(const std::string& why) override { inner_->abort(why); }
  int size() const override { return inner_->size(); }
  c10::Device device() const override { return inner_->device(); }
  std::shared_ptr<Work> all_gather(at::Tensor out, at::Tensor in) override {
    return inner_->all_gather(check(out, "all_gather"), in);
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op) override {
    return inner_->reduce_scatter(check(out, "reduce_scatter"), in, op);
  }
  std::shared_ptr<Work> all_reduce(at::Tensor t, ReduceOp op) override {
    return inner_->all_reduce(check(t, "all_reduce"), op);
  }
  std::shared_ptr<Work> broadcast(at::Tensor t, int root) override { return inner_->broadcast(check(t, "broadcast"), root); }
  std::shared_ptr<Work> send(at::Tensor t, int dst) override { return inner_->send(check(t, "send"), dst); }
  std::shared_ptr<Work> recv(at::Tensor t, int src) override { return inner_->recv(check(t, "recv"), src); }
  void barrier() override { inner_->barrier(); }
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks) override {
    auto part = inner_->split(ranks);
    return part ? std::make_shared<DataPlaneOnly>(std::move(part)) : nullptr;
  }
  CommStats stats() const override { return inner_->stats(); }

 private:
  static at::Tensor check(const at::Tensor& t, const char* op) {
    const auto dt = t.scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "test data plane: ", op, " of a ",
                c10::toString(dt), " tensor; host values (agreements, hashes, norms) belong on the control plane");
    return t;
  }
  const std::shared_ptr<Communicator> inner_;
};

c10::Device test_device() {
  static const c10::Device device = [] {
    const std::string name = env_or("ZS_TEST_DEVICE", "cpu");
    if (name == "cpu") return c10::Device(c10::kCPU);
    if (name != "cuda") throw std::runtime_error("ZS_TEST_DEVICE is '" + name + "'; use cpu or cuda");
    const int gpus = static_cast<int>(torch::cuda::device_count());
    if (gpus < 1) throw std::runtime_error("ZS_TEST_DEVICE=cuda but no CUDA device is visible");
    const c10::Device cuda(c10::kCUDA, static_cast<c10::DeviceIndex>(read_dist_env().local_rank % gpus));
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(cuda);  // this rank's GPU is the current one
    return cuda;
  }();
  return device;
}

ProcessGroup& test_group() {
  static ProcessGroup group = []() -> ProcessGroup {
    const std::string comm = test_comm();
    if (comm == "tcp") {
      if (!test_device().is_cpu()) throw std::runtime_error("ZS_TEST_COMM=tcp moves CPU tensors only");
      return world_ptr();
    }
    if (comm == "staged") {
      return ProcessGroup{std::make_shared<DataPlaneOnly>(stage_through_host(world_ptr(), test_device()).data),
                          world_ptr()};
    }
#ifdef ZS_WITH_CUDA
    if (comm == "nccl") return init_nccl(world_ptr(), test_device(), test_comm_options());
#endif
    throw std::runtime_error("ZS_TEST_COMM is '" + comm + "'; use tcp, staged or nccl (nccl in a CUDA build)");
  }();
  return group;
}

std::string test_setup() { return test_device().str() + "/" + test_comm(); }

double relative_displacement_error(const at::Tensor& got, const at::Tensor& want, const at::Tensor& init) {
  const auto g = got.to(at::kDouble), w = want.to(at::kDouble), i = init.to(at::kDouble);
  return (g - w).norm().item<double>() / (w - i).norm().item<double>();
}

std::string build_dir() {
  auto exe = std::filesystem::read_symlink("/proc/self/exe");
  return exe.parent_path().parent_path().string();  // build/tests/zs_tests -> build
}

CommandResult run_command(const std::string& command) {
  CommandResult r;
  const auto start = std::chrono::steady_clock::now();
  FILE* p = popen(("(" + command + ") 2>&1").c_str(), "r");
  if (p == nullptr) throw std::runtime_error("popen failed for: " + command);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

int free_port() { return pick_server_port("127.0.0.1"); }

DistEnv thread_env(int rank, int world, int port) {
  DistEnv e;
  e.rank = rank;
  e.world_size = world;
  e.local_rank = rank;
  e.local_world_size = world;
  e.master_addr = "127.0.0.1";
  e.master_port = port;
  e.source = "test";
  return e;
}

std::vector<std::string> run_ranks(int world, const std::function<void(int)>& body) {
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const c10::Error& e) {
        errors[static_cast<size_t>(r)] = e.what_without_backtrace();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

std::string make_temp_dir(const std::string& tag) {
  std::string tmpl = (std::filesystem::temp_directory_path() / ("zs-" + tag + "-XXXXXX")).string();
  if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return tmpl;
}

}  // namespace zeroshard::testing
