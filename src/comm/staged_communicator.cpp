// staged_communicator.cpp — device tensors through host buffers over a CPU communicator.
#include "comm/staged_communicator.h"

#include "comm/work.h"

#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <optional>

namespace zeroshard::comm {
namespace {

// A host copy of `t` (always a copy: a CPU "device" must not share its memory
// with the transport, or a result would land before the Work is waited on).
at::Tensor to_host(const at::Tensor& t) { return at::empty(t.sizes(), t.options().device(at::kCPU)).copy_(t); }

class StagedWork final : public Work {
 public:
  // `device_out` receives `host_out` when the operation is waited on (undefined: nothing lands).
  StagedWork(std::shared_ptr<Work> inner, at::Tensor device_out, at::Tensor host_out)
      : inner_(std::move(inner)), device_out_(std::move(device_out)), host_out_(std::move(host_out)) {}

  void wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    land(std::nullopt);
  }
  // The operation is finished; its result lands on the device in wait() or block().
  bool is_completed() override { return inner_->is_completed(); }
  void block(c10::Stream stream) override {
    inner_->wait();
    land(stream);
  }

 private:
  void land(std::optional<c10::Stream> stream) {
    std::lock_guard<std::mutex> lock(mu_);
    if (landed_) return;
    if (device_out_.defined()) {
      if (stream && stream->device_type() != c10::DeviceType::CPU) {
        c10::StreamGuard on(*stream);
        device_out_.copy_(host_out_);
      } else {
        device_out_.copy_(host_out_);
      }
    }
    landed_ = true;
    device_out_ = host_out_ = at::Tensor();
  }

  const std::shared_ptr<Work> inner_;
  std::mutex mu_;
  bool landed_ = false;                // guarded by mu_
  at::Tensor device_out_, host_out_;   // guarded by mu_; released once landed
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(std::shared_ptr<Communicator> cpu, c10::Device device)
      : cpu_(std::move(cpu)), device_(device) {}

  int rank() const override { return cpu_->rank(); }
  void abort(const std::string& why) override { cpu_->abort(why); }
  int size() const override { return cpu_->size(); }
  c10::Device device() const override { return device_; }

  std::shared_ptr<Work> all_gather(at::Tensor out, at::Tensor in) override {
    check(out, "all_gather", "out");
    check(in, "all_gather", "in");
    auto host_out = at::empty(out.sizes(), out.options().device(at::kCPU));
    return wrap(cpu_->all_gather(host_out, to_host(in)), out, host_out);
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op) override {
    check(out, "reduce_scatter", "out");
    check(in, "reduce_scatter", "in");
    auto host_out = at::empty(out.sizes(), out.options().device(at::kCPU));
    return wrap(cpu_->reduce_scatter(host_out, to_host(in), op), out, host_out);
  }
  std::shared_ptr<Work> all_reduce(at::Tensor t, ReduceOp op) override {
    check(t, "all_reduce", "t");
    auto host = to_host(t);
    return wrap(cpu_->all_reduce(host, op), t, host);
  }
  std::shared_ptr<Work> broadcast(at::Tensor t, int root) override {
    check(t, "broadcast", "t");
    auto host = to_host(t);
    return wrap(cpu_->broadcast(host, root), t, host);
  }
  std::shared_ptr<Work> send(at::Tensor t, int dst) override {
    check(t, "send", "t");
    return wrap(cpu_->send(to_host(t), dst), at::Tensor(), at::Tensor());
  }
  std::shared_ptr<Work> recv(at::Tensor t, int src) override {
    check(t, "recv", "t");
    auto host = at::empty(t.sizes(), t.options().device(at::kCPU));
    return wrap(cpu_->recv(host, src), t, host);
  }
  void barrier() override { cpu_->barrier(); }
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks) override {
    auto part = cpu_->split(ranks);
    return part ? std::make_shared<StagedCommunicator>(std::move(part), device_) : nullptr;
  }
  CommStats stats() const override { return cpu_->stats(); }

 private:
  void check(const at::Tensor& t, const char* op, const char* arg) const {
    TORCH_CHECK_VALUE(t.device() == device_, "staged ", op, ": tensor '", arg, "' is on ", t.device(),
                      " but this communicator moves ", device_, " tensors; move it to ", device_,
                      " (or use the CPU communicator for host tensors)");
  }
  static std::shared_ptr<Work> wrap(std::shared_ptr<Work> inner, at::Tensor device_out, at::Tensor host_out) {
    return std::make_shared<StagedWork>(std::move(inner), std::move(device_out), std::move(host_out));
  }

  const std::shared_ptr<Communicator> cpu_;
  const c10::Device device_;
};

}  // namespace

std::shared_ptr<Communicator> make_staged_communicator(std::shared_ptr<Communicator> cpu, c10::Device device) {
  TORCH_CHECK_VALUE(cpu != nullptr, "stage_through_host: the CPU communicator is null");
  TORCH_CHECK_VALUE(cpu->device().is_cpu(), "stage_through_host: the communicator to stage over moves ",
                    cpu->device(), " tensors; pass a CPU one (init_communicator)");
  return std::make_shared<StagedCommunicator>(std::move(cpu), device);
}

}  // namespace zeroshard::comm

namespace zeroshard {

ProcessGroup stage_through_host(std::shared_ptr<Communicator> cpu, c10::Device device) {
  auto staged = comm::make_staged_communicator(cpu, device);
  return ProcessGroup{std::move(staged), std::move(cpu)};
}

}  // namespace zeroshard
