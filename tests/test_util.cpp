#include "test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/cuda.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>

namespace zeroshard::testing {

at::Tensor pattern(int rank, int64_t numel, at::ScalarType dtype, int salt) {
  auto i = at::arange(numel, at::kLong);
  auto v = (i * 7 + (rank * 31 + salt * 3)).remainder(17) - 8;
  return v.to(dtype).contiguous();
}

std::shared_ptr<Communicator> world_ptr() {
  static std::shared_ptr<Communicator> comm = [] {
    CommOptions opt;
    opt.timeout = std::chrono::seconds(60);
    return init_communicator(opt);
  }();
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

c10::Device test_device() {
  static const c10::Device device = [] {
    const std::string name = env_or("ZS_TEST_DEVICE", "cpu");
    if (name == "cpu") return c10::Device(c10::kCPU);
    if (name != "cuda") throw std::runtime_error("ZS_TEST_DEVICE is '" + name + "'; use cpu or cuda");
    const int gpus = static_cast<int>(torch::cuda::device_count());
    if (gpus < 1) throw std::runtime_error("ZS_TEST_DEVICE=cuda but no CUDA device is visible");
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(read_dist_env().local_rank % gpus));
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
    if (comm == "staged") return stage_through_host(world_ptr(), test_device());
#ifdef ZS_WITH_CUDA
    if (comm == "nccl") return init_nccl(world_ptr(), test_device());
#endif
    throw std::runtime_error("ZS_TEST_COMM is '" + comm + "'; use tcp, staged or nccl (nccl in a CUDA build)");
  }();
  return group;
}

std::string test_setup() { return test_device().str() + "/" + test_comm(); }

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

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    throw std::runtime_error("free_port: bind failed");
  }
  close(fd);
  return ntohs(a.sin_port);
}

std::string make_temp_dir(const std::string& tag) {
  std::string tmpl = (std::filesystem::temp_directory_path() / ("zs-" + tag + "-XXXXXX")).string();
  if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return tmpl;
}

}  // namespace zeroshard::testing
