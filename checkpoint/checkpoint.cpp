// checkpoint.cpp — the Checkpointer (include/zeroshard/checkpoint.h).
#include "checkpointer_impl.h"

#include "zeroshard/log.h"

namespace zeroshard {

using namespace ckpt;

Checkpointer::Checkpointer(std::string dir, std::shared_ptr<Communicator> comm, CheckpointOptions options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK_VALUE(comm != nullptr, "Checkpointer: the communicator is null");
  TORCH_CHECK_VALUE(options.keep >= 2, "Checkpointer: keep is ", options.keep,
                    "; at least 2 committed checkpoints are kept (a crash while replacing one leaves the other)");
  TORCH_CHECK_VALUE(options.pp_stages >= 1 && options.pp_stage >= 0 && options.pp_stage < options.pp_stages,
                    "Checkpointer: pp_stage ", options.pp_stage, " of pp_stages ", options.pp_stages,
                    "; the stages are numbered 0 to pp_stages - 1");
  TORCH_CHECK_VALUE(comm->size() % options.pp_stages == 0, "Checkpointer: ", options.pp_stages,
                    " pipeline stages do not divide the communicator's ", comm->size(),
                    " ranks; pass the communicator of every rank of every stage");
  impl_->dir = std::move(dir);
  impl_->comm = std::move(comm);
  impl_->options = options;
  std::string err;
  if (impl_->comm->rank() == 0) {
    std::error_code ec;
    fs::create_directories(impl_->dir, ec);
    if (ec) err = "cannot create the run directory '" + impl_->dir + "': " + ec.message();
  }
  Impl::agree(*impl_->comm, "opening the run directory", err);
  impl_->io_comm = impl_->comm->dup();
}

Checkpointer::~Checkpointer() {
  try {
    impl_->wait_pending();
  } catch (const std::exception& e) {
    log_error(std::string("checkpoint: the last background save failed: ") + message_of(e));
  }
}

void Checkpointer::wait() { impl_->wait_pending(); }

SaveTimes Checkpointer::last_save_times() const {
  std::lock_guard<std::mutex> lock(impl_->last->mu);
  return impl_->last->times;
}

const std::string& Checkpointer::dir() const { return impl_->dir; }

std::string Checkpointer::save(ShardedOptimizer& opt, torch::nn::Module& model, const TrainingProgress& progress) {
  return impl_->save(opt.sharded_state(), model, progress,
                     [&opt](std::function<void()> fn) { opt.call_before_next_update(std::move(fn)); });
}

std::optional<TrainingProgress> Checkpointer::load(ShardedOptimizer& opt, torch::nn::Module& model,
                                                   std::optional<int64_t> step) {
  return impl_->load(opt.sharded_state(), model, step,
                     [&opt](const std::vector<int64_t>& s, double scale, int64_t clean,
                            const std::vector<at::Tensor>& grads, const std::vector<char>& had) {
                       opt.restore_sharded_state(s, scale, clean, grads, had);
                     });
}

}  // namespace zeroshard
