// preemption.cpp — PreemptionGuard: signals caught on a Boost.Asio thread,
// agreed across ranks at step boundaries.
#include "zeroshard/preemption.h"

#include "zeroshard/log.h"

#include <ATen/ATen.h>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>

#include <cstdio>
#include <filesystem>
#include <thread>

namespace zeroshard {

struct PreemptionGuard::Impl {
  boost::asio::io_context io;
  boost::asio::signal_set signals{io};
  std::thread thread;

  void arm(std::atomic<int>* seen) {
    signals.async_wait([this, seen](const boost::system::error_code& ec, int sig) {
      if (ec) return;  // cancelled: the guard is going away
      seen->store(sig);
      arm(seen);  // later signals are absorbed too
    });
  }
};

PreemptionGuard::PreemptionGuard(std::shared_ptr<Communicator> comm, PreemptionOptions options)
    : comm_(std::move(comm)), options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  TORCH_CHECK_VALUE(comm_ != nullptr, "PreemptionGuard: the communicator is null");
  TORCH_CHECK_VALUE(options_.grace_period_s > 0, "PreemptionGuard: grace_period_s is ", options_.grace_period_s,
                    "; it must be positive");
  for (int sig : options_.signals) {
    boost::system::error_code ec;
    impl_->signals.add(sig, ec);
    TORCH_CHECK_VALUE(!ec, "PreemptionGuard: cannot handle signal ", sig, ": ", ec.message());
  }
  impl_->arm(&signal_);
  impl_->thread = std::thread([this] { impl_->io.run(); });
}

PreemptionGuard::~PreemptionGuard() {
  boost::system::error_code ec;
  impl_->signals.cancel(ec);
  impl_->signals.clear(ec);  // default dispositions again
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

bool PreemptionGuard::should_stop() {
  if (stopped_) return true;
  const int sig = signal_.load();
  const bool notice = !options_.notice_file.empty() && std::filesystem::exists(options_.notice_file);
  auto flag = at::tensor({(sig != 0 || notice) ? 1.0 : 0.0}, at::kDouble);
  if (comm_->size() > 1) comm_->all_reduce(flag, ReduceOp::kMax)->wait();
  if (flag.item<double>() == 0) return false;
  stopped_ = true;
  std::string why = sig != 0 ? "got signal " + std::to_string(sig) + " (" + strsignal(sig) + ")"
                             : notice ? "found the notice file '" + options_.notice_file + "'" : "";
  log_warn("preemption: " + (why.empty() ? std::string("another rank was told to stop") : "this rank " + why) +
           "; every rank stops after this step");
  return true;
}

bool PreemptionGuard::check_save_fits(double save_seconds) const {
  if (save_seconds <= options_.grace_period_s) return true;
  char msg[200];
  std::snprintf(msg, sizeof(msg),
                "preemption: the last checkpoint save took %.1f s, longer than the %.1f s grace period; a save "
                "after a notice may not finish (save more often, or give the job a longer grace period)",
                save_seconds, options_.grace_period_s);
  log_warn(msg);
  return false;
}

}  // namespace zeroshard
