#include "comm/work.h"

#include <c10/util/Exception.h>

#ifdef ZS_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace zeroshard::comm {

OpWork::OpWork(OpKind kind, uint64_t seq, std::string name, std::vector<at::Tensor> tensors)
    : kind_(kind), seq_(seq), name_(std::move(name)), tensors_(std::move(tensors)),
      progress_("queued") {}

void OpWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout == kDefaultTimeout) {
    cv_.wait(lock, [&] { return done_; });
  } else if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
    TORCH_CHECK(false, name_, " did not complete within ", timeout.count(), " ms (", progress_, ")");
  }
  if (!error_.empty()) TORCH_CHECK(false, error_);
}

bool OpWork::is_completed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void OpWork::complete() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    progress_ = "completed";
    tensors_.clear();
  }
  cv_.notify_all();
}

void OpWork::fail(const std::string& message) {
  set_failed(message.rfind(name_, 0) == 0 ? message : name_ + ": " + message);
}

std::string not_run_after(const std::string& earlier, const std::string& what) {
  return earlier + " [" + what + " not run: the communicator had failed]";
}

void OpWork::fail_after(const std::string& earlier) { set_failed(not_run_after(earlier, name_)); }

void OpWork::set_failed(std::string error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    error_ = std::move(error);
    progress_ = "failed";
    tensors_.clear();
  }
  cv_.notify_all();
}

void OpWork::set_progress(std::string progress) {
  std::lock_guard<std::mutex> lock(mu_);
  progress_ = std::move(progress);
}

c10::Stream current_stream(c10::Device device) {
  if (device.is_cuda()) {
#ifdef ZS_WITH_CUDA
    return c10::cuda::getCurrentCUDAStream(device.index());
#else
    TORCH_CHECK(false, "current_stream: ", device, " needs a zeroshard built against a CUDA LibTorch");
#endif
  }
  return c10::Stream(c10::Stream::DEFAULT, device);
}

void block_current(Work& work, c10::Device device) { work.block(current_stream(device)); }

}  // namespace zeroshard::comm
