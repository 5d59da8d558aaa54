// checkpoint.cpp — the Checkpointer (include/zeroshard/checkpoint.h).
#include "checkpointer_impl.h"

#include "runtime/host_name.h"
#include "zeroshard/log.h"

#include <cstdio>
#include <fstream>
#include <random>

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
  impl_->disks = Impl::find_disks(*impl_->comm, impl_->dir);
  impl_->io_comm = impl_->comm->dup();
  if (!options.durable_uri.empty()) {
    std::string err;
    try {
      ckpt::DurableOptions d;
      d.keep = options.keep;
      d.upload_timeout = options.durable_upload_timeout;
      d.client.max_retry_time = options.durable_retry_time;
      impl_->durable = std::make_unique<ckpt::DurableTier>(ckpt::s3::parse_uri(options.durable_uri),
                                                           ckpt::s3::process_environment(), impl_->comm->rank(),
                                                           impl_->comm->size(), d);
      impl_->durable->check_access();  // a wrong key, bucket or endpoint: here, before the first step
    } catch (const std::exception& e) {
      err = error_message(e);
    }
    Impl::agree(*impl_->comm, "opening the durable tier " + options.durable_uri, err);
    if (impl_->comm->rank() == 0) log_info("checkpoint: durable tier " + impl_->durable->describe());
  }
}

bool Checkpointer::wait_durable(std::chrono::milliseconds timeout) {
  return !impl_->durable || impl_->durable->wait(timeout);
}

bool Checkpointer::make_durable(std::chrono::milliseconds timeout) {
  if (!impl_->durable) return true;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(0), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                      deadline - std::chrono::steady_clock::now()));
  };
  impl_->wait_pending();  // a background save commits first (and starts its upload)
  impl_->durable->wait(left());
  const int64_t newest = impl_->newest_saved;
  if (newest < 0) return true;
  // Every rank's view: an upload still in flight; the newest step not durable here.
  auto v = torch::tensor({impl_->durable->busy() ? 1.0 : 0.0,
                          impl_->durable->status().durable_step == newest ? 0.0 : 1.0}, torch::kDouble);
  if (impl_->io_comm->size() > 1) impl_->io_comm->all_reduce(v, ReduceOp::kMax)->wait();
  if (v[0].item<double>() > 0) return false;  // the upload before it outlasted `timeout`
  if (v[1].item<double>() > 0) {
    impl_->start_durable_upload(*impl_->io_comm, fs::path(impl_->dir) / ckpt::step_dir_name(newest), newest);
    impl_->durable->wait(left());
  }
  return impl_->durable->status().durable_step == newest;
}

DurableStatus Checkpointer::durable_status() const { return impl_->durable ? impl_->durable->status() : DurableStatus{}; }

std::vector<int> ckpt::Disks::members(int rank) const {
  std::vector<int> out;
  for (size_t r = 0; r < leader.size(); ++r) {
    if (leader[r] == leader[static_cast<size_t>(rank)]) out.push_back(static_cast<int>(r));
  }
  return out;
}

ckpt::Disks Checkpointer::Impl::find_disks(Communicator& c, const fs::path& dir) {
  const int rank = c.rank(), n = c.size();
  Disks d;
  d.hosts = all_gather_text(c, host_name());
  std::string token;
  if (rank == 0) {
    std::random_device rd;
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%08x%08x", rd(), rd());
    token = buf;
  }
  token = broadcast_text(c, token, 0);
  const auto probe = [&](int r) { return dir / (".probe-" + token + "-" + std::to_string(r)); };
  std::string err;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    err = "cannot create the run directory '" + dir.string() + "' on host " + host_name() + ": " + ec.message();
  } else if (n > 1) {
    std::ofstream(probe(rank)) << "a rank of this job looks for its peers' files here; removed at once\n";
    if (!fs::exists(probe(rank), ec)) {
      err = "cannot write in the run directory '" + dir.string() + "' on host " + host_name();
    }
  }
  agree(c, "opening the run directory", err);
  int mine = n == 1 ? 0 : -1;
  auto candidate = torch::empty({1}, torch::kLong);
  while (n > 1) {
    candidate.fill_(mine < 0 ? rank : n);
    c.all_reduce(candidate, ReduceOp::kMin)->wait();
    const int k = static_cast<int>(candidate.item<int64_t>());
    if (k == n) break;  // every rank placed; every look is done, so the probes can go
    if (mine < 0 && (k == rank || fs::exists(probe(k), ec))) mine = k;
  }
  if (n > 1) fs::remove(probe(rank), ec);
  auto leaders = torch::empty({n}, torch::kLong);
  if (n > 1) {
    c.all_gather(leaders, torch::tensor({static_cast<int64_t>(mine)}, torch::kLong))->wait();
  } else {
    leaders.fill_(0);
  }
  for (int r = 0; r < n; ++r) d.leader.push_back(static_cast<int>(leaders[r].item<int64_t>()));
  if (rank == 0 && !d.shared()) {
    std::string where;
    for (int r = 0; r < n; ++r) {
      if (d.leads(r)) where += (where.empty() ? "" : ", ") + std::string("host ") + d.hosts[static_cast<size_t>(r)];
    }
    log_info("checkpoint: '" + dir.string() + "' is a different directory on " + where +
             " (no shared filesystem): each host keeps its own ranks' files, and every host the manifest and `latest`");
  }
  return d;
}

Checkpointer::~Checkpointer() {
  try {
    impl_->wait_pending();
  } catch (const std::exception& e) {
    log_error(std::string("checkpoint: the last background save failed: ") + error_message(e));
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

namespace {

// Every part's optimizer state as one: parameters, steps and flags
// concatenated, the buckets' parameter indices shifted past the parts before.
ShardedState merged_state(const std::vector<Checkpointer::Part>& parts, std::vector<size_t>* params_per_part,
                          std::vector<size_t>* buckets_per_part) {
  ShardedState out;
  for (size_t i = 0; i < parts.size(); ++i) {
    TORCH_CHECK_VALUE(parts[i].optimizer != nullptr && parts[i].model != nullptr, "checkpoint: part ", i,
                      " has no optimizer or no module");
    ShardedState s = parts[i].optimizer->sharded_state();
    if (i == 0) {
      out.rank = s.rank;
      out.world_size = s.world_size;
      out.zero_stage = s.zero_stage;
      out.shard_rank = s.shard_rank;
      out.num_replicas = s.num_replicas;
      out.replica_rank = s.replica_rank;
      out.loss_scale = s.loss_scale;
      out.loss_scale_clean_steps = s.loss_scale_clean_steps;
    }
    TORCH_CHECK_VALUE(s.rank == out.rank && s.world_size == out.world_size && s.zero_stage == out.zero_stage,
                      "checkpoint: part ", i, "'s optimizer is rank ", s.rank, " of ", s.world_size, " at ZeRO stage ",
                      s.zero_stage, ", part 0's rank ", out.rank, " of ", out.world_size, " at ZeRO stage ",
                      out.zero_stage, "; a rank's stages shard over one group at one ZeRO stage");
    TORCH_CHECK_VALUE(s.num_replicas == out.num_replicas, "checkpoint: part ", i, "'s optimizer has ", s.num_replicas,
                      " replicas of its shards, part 0's ", out.num_replicas, "; give every part the same shard_size");
    const size_t offset = out.params.size();
    for (auto& b : s.buckets) {
      for (auto& p : b.params) p += offset;
      out.buckets.push_back(std::move(b));
    }
    out.params.insert(out.params.end(), s.params.begin(), s.params.end());
    out.param_tensors.insert(out.param_tensors.end(), s.param_tensors.begin(), s.param_tensors.end());
    out.param_steps.insert(out.param_steps.end(), s.param_steps.begin(), s.param_steps.end());
    out.had_grad.insert(out.had_grad.end(), s.had_grad.begin(), s.had_grad.end());
    out.local_gradients_pending = out.local_gradients_pending || s.local_gradients_pending;
    params_per_part->push_back(s.params.size());
    buckets_per_part->push_back(s.buckets.size());
  }
  return out;
}

// One module presenting every part's parameters and buffers under their own
// names: the same tensors, registered along their dotted paths.
std::shared_ptr<torch::nn::Module> merged_module(const std::vector<Checkpointer::Part>& parts) {
  auto root = std::make_shared<torch::nn::Module>();
  auto place = [&](const std::string& name, const at::Tensor& t, bool buffer) {
    torch::nn::Module* m = root.get();
    size_t from = 0;
    for (size_t dot = name.find('.'); dot != std::string::npos; from = dot + 1, dot = name.find('.', from)) {
      const std::string key = name.substr(from, dot - from);
      const auto children = m->named_children();
      const auto* child = children.find(key);
      m = child != nullptr ? child->get() : m->register_module(key, std::make_shared<torch::nn::Module>()).get();
    }
    const std::string leaf = name.substr(from);
    TORCH_CHECK_VALUE(m->named_parameters(false).find(leaf) == nullptr && m->named_buffers(false).find(leaf) == nullptr,
                      "checkpoint: two stages on this rank both hold '", name, "'; a rank's stages must hold "
                      "different tensors");
    if (buffer) {
      m->register_buffer(leaf, t);
    } else {
      m->register_parameter(leaf, t, t.requires_grad());
    }
  };
  for (const auto& part : parts) {
    for (const auto& item : part.model->named_parameters()) place(item.key(), item.value(), false);
    for (const auto& item : part.model->named_buffers()) place(item.key(), item.value(), true);
  }
  return root;
}

}  // namespace

std::string Checkpointer::save(const std::vector<Part>& parts, const TrainingProgress& progress) {
  TORCH_CHECK_VALUE(!parts.empty(), "checkpoint: save() with no parts");
  if (parts.size() == 1) return save(*parts[0].optimizer, *parts[0].model, progress);
  std::vector<size_t> params, buckets;
  const ShardedState state = merged_state(parts, &params, &buckets);
  const auto model = merged_module(parts);
  return impl_->save(state, *model, progress, [&parts](std::function<void()> fn) {
    for (const auto& p : parts) p.optimizer->call_before_next_update(fn);  // the first update waits; the rest find it done
  });
}

std::optional<TrainingProgress> Checkpointer::load(const std::vector<Part>& parts, std::optional<int64_t> step) {
  TORCH_CHECK_VALUE(!parts.empty(), "checkpoint: load() with no parts");
  if (parts.size() == 1) return load(*parts[0].optimizer, *parts[0].model, step);
  std::vector<size_t> params, buckets;
  const ShardedState state = merged_state(parts, &params, &buckets);
  const auto model = merged_module(parts);
  return impl_->load(state, *model, step,
                     [&](const std::vector<int64_t>& s, double scale, int64_t clean, const std::vector<at::Tensor>& grads,
                         const std::vector<char>& had) {
                       size_t p0 = 0, b0 = 0;
                       for (size_t i = 0; i < parts.size(); ++i) {
                         const auto p1 = p0 + params[i], b1 = b0 + buckets[i];
                         const auto slice = [](const auto& v, size_t from, size_t to) {
                           using V = std::decay_t<decltype(v)>;
                           return v.empty() ? V{} : V(v.begin() + static_cast<std::ptrdiff_t>(from),
                                                      v.begin() + static_cast<std::ptrdiff_t>(to));
                         };
                         parts[i].optimizer->restore_sharded_state(slice(s, p0, p1), scale, clean, slice(grads, b0, b1),
                                                                   slice(had, p0, p1));
                         p0 = p1;
                         b0 = b1;
                       }
                     });
}

}  // namespace zeroshard
