// checkpoint.cpp — saving, committing, verifying and loading sharded checkpoints.
#include "zeroshard/checkpoint.h"

#include "checksum.h"
#include "h5.h"
#include "reader.h"
#include "zeroshard/log.h"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <xxhash.h>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace fs = std::filesystem;
using nlohmann::json;

namespace zeroshard {
namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kFormat = "zeroshard-checkpoint";

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string rank_file_name(int rank, int world) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "rank-%05d-of-%05d.h5", rank, world);
  return buf;
}

// fsync a file or directory by path.
void fsync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot open '", path.string(), "' to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "checkpoint: fsync of '", path.string(), "' failed: ", std::strerror(err));
}

// Writes `content` to `path` so that a crash leaves either the old file or the
// new one: a temporary file, fsync, rename, fsync of the directory.
void write_atomically(const fs::path& path, const std::string& content) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "checkpoint: cannot create '", tmp.string(), "': ", std::strerror(errno));
    out << content;
    out.flush();
    TORCH_CHECK(out, "checkpoint: writing '", tmp.string(), "' failed (disk full?): ", std::strerror(errno));
  }
  fsync_path(tmp, false);
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TORCH_CHECK(!ec, "checkpoint: cannot rename '", tmp.string(), "' to '", path.string(), "': ", ec.message());
  fsync_path(path.parent_path(), true);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "checkpoint: cannot read '", path.string(), "': ", std::strerror(errno));
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// How a tensor dtype is stored: HDF5 1.10 has no 16-bit float types, so
// bf16/fp16 are stored as their bits in uint16 with a "dtype" attribute.
checkpoint::h5::Type storage_type(c10::ScalarType t, const std::string& name) {
  switch (t) {
    case at::kFloat: return checkpoint::h5::Type::kFloat32;
    case at::kDouble: return checkpoint::h5::Type::kFloat64;
    case at::kLong: return checkpoint::h5::Type::kInt64;
    case at::kInt: return checkpoint::h5::Type::kInt32;
    case at::kByte:
    case at::kBool: return checkpoint::h5::Type::kUInt8;
    case at::kBFloat16:
    case at::kHalf: return checkpoint::h5::Type::kUInt16;
    default: break;
  }
  TORCH_CHECK_VALUE(false, "checkpoint: tensor '", name, "' has dtype ", c10::toString(t),
                    ", which checkpoints do not store (Float, Double, Long, Int, Byte, Bool, BFloat16, Half)");
}


// Model identity: every parameter's and buffer's name, shape and dtype, in
// module order. Shapes of the optimizer's parameters come from its state: a
// resharded fully_shard parameter holds no elements.
std::string model_description(torch::nn::Module& model, const ShardedState& state,
                              const std::vector<std::string>& names) {
  std::unordered_map<std::string, const ParamInfo*> info;
  for (size_t i = 0; i < names.size(); ++i) info[names[i]] = &state.params[i];
  std::string d;
  for (const auto& item : model.named_parameters()) {
    auto it = info.find(item.key());
    const ParamInfo p = it != info.end() ? ParamInfo{item.key(), it->second->shape, it->second->dtype}
                                         : ParamInfo{item.key(), item.value().sizes().vec(), item.value().scalar_type()};
    d += "param " + p.describe() + "\n";
  }
  for (const auto& item : model.named_buffers()) {
    d += "buffer " + ParamInfo{item.key(), item.value().sizes().vec(), item.value().scalar_type()}.describe() + "\n";
  }
  return d;
}

std::string hash_hex(const std::string& s) { return checkpoint::to_hex(XXH3_64bits(s.data(), s.size())); }

// Names of the state's parameters as the module calls them.
std::vector<std::string> module_names(const ShardedState& state, torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::string> by_impl;
  for (const auto& item : model.named_parameters()) by_impl.emplace(item.value().unsafeGetTensorImpl(), item.key());
  std::vector<std::string> names;
  for (size_t i = 0; i < state.params.size(); ++i) {
    auto it = i < state.param_tensors.size() ? by_impl.find(state.param_tensors[i].unsafeGetTensorImpl()) : by_impl.end();
    TORCH_CHECK_VALUE(it != by_impl.end(), "checkpoint: the optimizer's parameter '", state.params[i].name,
                      "' is not a parameter of the module given; pass the module the optimizer trains");
    names.push_back(it->second);
  }
  return names;
}

std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

struct Piece {
  int rank;
  int64_t begin, end;  // elements of the flattened parameter
};

// Everything one save writes, copied out of the live model and optimizer so
// that training can go on while a background thread writes it.
struct Snapshot {
  TrainingProgress progress;
  int rank = 0, world = 1, stage = 2;
  std::vector<ParamInfo> params;    // the optimizer's, as the module names them
  std::vector<std::string> names;
  std::vector<int64_t> steps;
  double loss_scale = 1;
  int64_t loss_scale_clean_steps = 0;
  struct Group {
    FlatLayout layout;
    std::vector<size_t> params;     // index into `params` per layout entry
  };
  std::vector<Group> groups;        // the flat layout (every rank's pieces follow from it)
  struct Owned {                    // this rank's piece of one parameter
    size_t param;
    int64_t begin;                  // first element of the flattened parameter
    at::Tensor master, exp_avg, exp_avg_sq;  // fp32 copies
    at::Tensor grad;                // fp32 copy of the reduced gradient so far (when `gradients`)
  };
  bool gradients = false;           // saved in the middle of a step's accumulation
  std::vector<char> had_grad;       // per parameter, any rank (when `gradients`)
  std::vector<Owned> owned;         // copies, or (deferred) views of the live tensors until copy() runs
  bool deferred = false;
  // Replaces the views by copies (the writer thread does it for an async save,
  // while the training thread runs the next forward and backward).
  void copy() {
    if (!deferred) return;
    for (auto& o : owned) {
      o.master = o.master.clone();
      o.exp_avg = o.exp_avg.clone();
      o.exp_avg_sq = o.exp_avg_sq.clone();
    }
    deferred = false;
  }
  struct Replicated {
    std::string name, kind;
    at::Tensor value;               // a copy (rank 0 only; others keep just the names)
  };
  std::vector<Replicated> replicated;
  at::Tensor rng;
  std::string model_hash;
  double save_seconds = 0;          // writing the rank files, as measured by the slowest rank
  int64_t bytes = 0;                // host memory the copies take
};

}  // namespace

struct Checkpointer::Impl {
  std::string dir;
  std::shared_ptr<Communicator> comm;     // the training thread's
  std::shared_ptr<Communicator> io_comm;  // the writer's: a split of the same ranks, so a background
                                          // save's collectives never interleave with training's
  CheckpointOptions options;
  boost::asio::thread_pool pool{1};
  std::future<std::string> pending;       // the save being written in the background
  mutable std::mutex last_mu;             // `last` is written by the writer thread too
  SaveTimes last;

  // Every rank learns whether every rank succeeded at a phase; throws on all
  // of them if not, with this rank's own error or the failing ranks' numbers.
  static void agree(Communicator& c, const std::string& phase, const std::string& my_error) {
    auto flags = torch::zeros({c.size()}, torch::kDouble);
    if (!my_error.empty()) flags[c.rank()] = 1.0;
    if (c.size() > 1) c.all_reduce(flags, ReduceOp::kMax)->wait();
    std::vector<int> failed;
    for (int r = 0; r < c.size(); ++r) {
      if (flags[r].item<double>() > 0) failed.push_back(r);
    }
    if (failed.empty()) return;
    std::string who;
    for (int r : failed) who += (who.empty() ? "" : ", ") + std::to_string(r);
    TORCH_CHECK(false, "checkpoint: ", phase, " failed on rank(s) ", who,
                my_error.empty() ? std::string(" (their logs say why)") : ": " + my_error);
  }

  // fence: registers a function the optimizer runs before its next update.
  std::string save(const ShardedState& state, torch::nn::Module& model, const TrainingProgress& progress,
                   const std::function<void(std::function<void()>)>& fence);
  // Blocks until the background save (if any) is committed; rethrows its error.
  void wait_pending();
  using Restore = std::function<void(const std::vector<int64_t>& steps, double scale, int64_t clean,
                                     const std::vector<at::Tensor>& grad_shards, const std::vector<char>& had_grad)>;
  std::optional<TrainingProgress> load(ShardedState state, torch::nn::Module& model, std::optional<int64_t> step,
                                       const Restore& restore);
  // defer_copies: keep views of the live master/moments (the caller copies
  // before the optimizer's next update); otherwise copy now.
  Snapshot snapshot(const ShardedState& state, torch::nn::Module& model, const TrainingProgress& progress,
                    bool defer_copies = false);
  // Writes, verifies and commits a snapshot (collective on io_comm); returns the step directory.
  std::string write(const Snapshot& snap);
  void write_rank_file(const fs::path& path, const Snapshot& snap);
  json manifest(const Snapshot& snap, const std::vector<std::pair<int64_t, uint64_t>>& digests);
  void write_model_view(const fs::path& path, const Snapshot& snap);
  void commit(const fs::path& tmp, const fs::path& final_dir, const json& manifest);
  void retain(const fs::path& keep_dir);
  // Committed checkpoints, newest first.
  std::vector<fs::path> committed() const;
  // Why this committed checkpoint cannot be trusted ("" when it can): the
  // files this rank checks (every world-th one) against the manifest.
  std::string verify_share(const fs::path& step_dir, const json& m) const;
};

Snapshot Checkpointer::Impl::snapshot(const ShardedState& state, torch::nn::Module& model,
                                      const TrainingProgress& progress, bool defer_copies) {
  torch::NoGradGuard no_grad;
  // Gradients of an accumulation in progress: reduced ones (in the shards) are
  // saved; unreduced ones (in p.grad()) cannot be resharded, so that is refused.
  bool snapshot_gradients = false;
  std::vector<char> snapshot_had_grad;
  {
    std::vector<double> flags{state.local_gradients_pending ? 1.0 : 0.0};
    double any = 0;
    for (char h : state.had_grad) any = std::max(any, h ? 1.0 : 0.0);
    for (const auto& b : state.buckets) any = std::max(any, b.grad_shard.defined() ? 1.0 : 0.0);
    flags.push_back(any);
    for (char h : state.had_grad) flags.push_back(h ? 1.0 : 0.0);
    auto t = torch::tensor(flags, torch::kDouble);
    if (comm->size() > 1) comm->all_reduce(t, ReduceOp::kMax)->wait();
    TORCH_CHECK_VALUE(t[0].item<double>() == 0, "checkpoint: this step's gradients are still in p.grad() on some rank "
                      "(stage 1, no_sync() or reduce_every_backward=false), unreduced: a checkpoint cannot hold "
                      "them. Save after step(), or accumulate with reduced backwards (the default)");
    snapshot_gradients = t[1].item<double>() > 0;
    snapshot_had_grad.assign(state.had_grad.size(), 0);
    for (size_t i = 0; i < state.had_grad.size(); ++i) snapshot_had_grad[i] = t[2 + static_cast<int64_t>(i)].item<double>() > 0;
  }
  Snapshot snap;
  snap.gradients = snapshot_gradients;
  snap.had_grad = snapshot_had_grad;
  snap.progress = progress;
  snap.rank = state.rank;
  snap.world = state.world_size;
  snap.stage = state.stage;
  snap.names = module_names(state, model);
  snap.params = state.params;
  for (size_t i = 0; i < snap.params.size(); ++i) snap.params[i].name = snap.names[i];
  snap.steps = state.param_steps;
  snap.loss_scale = state.loss_scale;
  snap.loss_scale_clean_steps = state.loss_scale_clean_steps;
  snap.model_hash = hash_hex(model_description(model, state, snap.names));
  for (const auto& b : state.buckets) {
    snap.groups.push_back({b.layout, b.params});
    for (const auto& seg : shard_segments(b.layout, state.rank)) {
      const Range local = seg.local(b.layout, state.rank);
      // Gradients are always copied now: the next backward adds into them.
      const bool defer = defer_copies && !snap.gradients;
      auto copy = [&](const at::Tensor& t) {
        auto v = t.slice(0, local.begin, local.end);
        return defer ? v : v.clone();
      };
      snap.deferred = defer;
      at::Tensor grad;
      if (snap.gradients) {
        grad = b.grad_shard.defined() ? b.grad_shard.slice(0, local.begin, local.end).to(at::kFloat).clone()
                                      : at::zeros({local.size()}, at::kFloat);
      }
      snap.owned.push_back({b.params[seg.param], seg.param_offset, copy(b.master), copy(b.exp_avg), copy(b.exp_avg_sq), grad});
      snap.bytes += (snap.gradients ? 16 : 12) * local.size();
    }
  }
  std::unordered_map<std::string, bool> trained;
  for (const auto& n : snap.names) trained[n] = true;
  auto add = [&](const std::string& name, const char* kind, const at::Tensor& t) {
    storage_type(t.scalar_type(), name);  // refuse unsupported dtypes now, on every rank
    Snapshot::Replicated r{name, kind, at::Tensor()};
    if (state.rank == 0) {
      r.value = t.detach().clone().contiguous();
      snap.bytes += static_cast<int64_t>(r.value.nbytes());
    } else {
      r.value = torch::empty({0}, t.options());  // rank 0 writes these
    }
    snap.replicated.push_back(std::move(r));
  };
  for (const auto& item : model.named_parameters()) {
    if (!trained.count(item.key())) add(item.key(), "parameter", item.value());
  }
  for (const auto& item : model.named_buffers()) add(item.key(), "buffer", item.value());
  auto gen = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    snap.rng = gen.get_state();
  }
  return snap;
}

void Checkpointer::Impl::write_rank_file(const fs::path& path, const Snapshot& snap) {
  using checkpoint::h5::Type;
  const auto start = std::chrono::steady_clock::now();
  auto f = checkpoint::h5::File::create(path.string());
  f.set_attribute("/", "format", std::string(kFormat));
  f.set_attribute("/", "format_version", static_cast<int64_t>(kFormatVersion));
  f.set_attribute("/", "rank", static_cast<int64_t>(snap.rank));
  f.set_attribute("/", "world_size", static_cast<int64_t>(snap.world));
  f.set_attribute("/", "step", snap.progress.step);
  for (const auto& o : snap.owned) {
    const std::string& name = snap.names[o.param];
    const std::vector<uint64_t> dims{static_cast<uint64_t>(o.master.numel())};
    for (const auto& [kind, t] : {std::pair<const char*, const at::Tensor&>{"master", o.master},
                                  {"exp_avg", o.exp_avg}, {"exp_avg_sq", o.exp_avg_sq}}) {
      const std::string ds = std::string("/") + kind + "/" + name;
      f.write(ds, Type::kFloat32, dims, t.data_ptr<float>());
      f.set_attribute(ds, "begin", o.begin);
    }
    if (snap.gradients) {
      const std::string ds = "/grad/" + name;
      f.write(ds, Type::kFloat32, dims, o.grad.data_ptr<float>());
      f.set_attribute(ds, "begin", o.begin);
    }
  }
  if (snap.rank == 0) {  // what every rank holds in full: buffers and untrained parameters
    for (const auto& r : snap.replicated) {
      std::vector<uint64_t> dims;
      for (auto d : r.value.sizes()) dims.push_back(static_cast<uint64_t>(d));
      if (dims.empty()) dims.push_back(1);
      const std::string ds = "/replicated/" + r.name;
      f.write(ds, storage_type(r.value.scalar_type(), r.name), dims, r.value.data_ptr());
      f.set_attribute(ds, "dtype", std::string(c10::toString(r.value.scalar_type())));
    }
  }
  f.write("/rng/cpu", Type::kUInt8, {static_cast<uint64_t>(snap.rng.numel())}, snap.rng.data_ptr());
  const auto c0 = std::chrono::steady_clock::now();
  log_debug("checkpoint: datasets written in " + std::to_string(std::chrono::duration<double>(c0 - start).count()) + " s");
  f.close();
  const auto c1 = std::chrono::steady_clock::now();
  fsync_path(path, false);
  char msg[160];
  std::snprintf(msg, sizeof(msg), "checkpoint: close %.3f s, fsync %.3f s", std::chrono::duration<double>(c1 - c0).count(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - c1).count());
  log_debug(msg);
}

void Checkpointer::Impl::write_model_view(const fs::path& path, const Snapshot& snap) {
  using checkpoint::h5::Type;
  auto f = checkpoint::h5::File::create(path.string());
  f.set_attribute("/", "format", std::string("zeroshard-checkpoint-view"));
  f.set_attribute("/", "format_version", static_cast<int64_t>(kFormatVersion));
  std::vector<std::vector<checkpoint::h5::File::VirtualPiece>> pieces(snap.params.size());
  for (const auto& g : snap.groups) {
    for (int r = 0; r < snap.world; ++r) {
      for (const auto& seg : shard_segments(g.layout, r)) {
        const size_t pi = g.params[seg.param];
        pieces[pi].push_back({rank_file_name(r, snap.world), "", 0, static_cast<uint64_t>(seg.flat.size()),
                              static_cast<uint64_t>(seg.param_offset)});
      }
    }
  }
  for (size_t i = 0; i < snap.params.size(); ++i) {
    std::vector<uint64_t> dims(snap.params[i].shape.begin(), snap.params[i].shape.end());
    for (const auto& [prefix, kind] : {std::pair<std::string, std::string>{"/", "master"},
                                       {"/optimizer/exp_avg/", "exp_avg"}, {"/optimizer/exp_avg_sq/", "exp_avg_sq"}}) {
      auto ps = pieces[i];
      for (auto& p : ps) p.dataset = "/" + kind + "/" + snap.names[i];
      f.write_virtual(prefix + snap.names[i], Type::kFloat32, dims, ps);
    }
  }
  for (const auto& r : snap.replicated) {
    std::vector<uint64_t> dims;
    for (auto d : r.value.sizes()) dims.push_back(static_cast<uint64_t>(d));
    uint64_t n = 1;
    for (auto d : dims) n *= d;
    if (dims.empty()) dims.push_back(1);  // stored as [1]
    f.write_virtual("/" + r.name, storage_type(r.value.scalar_type(), r.name), dims,
                    {{rank_file_name(0, snap.world), "/replicated/" + r.name, 0, n, 0, dims}});
    f.set_attribute("/" + r.name, "dtype", std::string(c10::toString(r.value.scalar_type())));
  }
  f.close();
  fsync_path(path, false);
}

json Checkpointer::Impl::manifest(const Snapshot& snap, const std::vector<std::pair<int64_t, uint64_t>>& digests) {
  const int world = snap.world;
  std::vector<std::vector<Piece>> pieces(snap.params.size());
  for (const auto& g : snap.groups) {
    for (int r = 0; r < world; ++r) {
      for (const auto& seg : shard_segments(g.layout, r)) {
        pieces[g.params[seg.param]].push_back({r, seg.param_offset, seg.param_offset + seg.flat.size()});
      }
    }
  }
  json m;
  m["format"] = kFormat;
  m["format_version"] = kFormatVersion;
  m["step"] = snap.progress.step;
  m["epoch"] = snap.progress.epoch;
  m["extra"] = json::parse(snap.progress.extra_json);
  m["world_size"] = world;
  m["stage"] = snap.stage;
  m["model_hash"] = snap.model_hash;
  m["save_seconds"] = snap.save_seconds;
  m["gradients"] = snap.gradients;
  m["loss_scale"] = snap.loss_scale;
  m["loss_scale_clean_steps"] = snap.loss_scale_clean_steps;
  m["params"] = json::array();
  for (size_t i = 0; i < snap.params.size(); ++i) {
    json p;
    p["name"] = snap.names[i];
    p["shape"] = snap.params[i].shape;
    p["dtype"] = c10::toString(snap.params[i].dtype);
    p["step"] = snap.steps[i];
    if (snap.gradients) p["had_grad"] = snap.had_grad[i] != 0;
    p["pieces"] = json::array();
    for (const auto& pc : pieces[i]) p["pieces"].push_back({pc.rank, pc.begin, pc.end});
    m["params"].push_back(std::move(p));
  }
  m["replicated"] = json::array();
  for (const auto& r : snap.replicated) {
    m["replicated"].push_back({{"name", r.name}, {"kind", r.kind}, {"shape", r.value.sizes().vec()},
                               {"dtype", c10::toString(r.value.scalar_type())}});
  }
  m["groups"] = json::array();  // the saving run's flat layout (buckets or units), for tools
  for (const auto& g : snap.groups) {
    json j;
    j["params"] = json::array();
    for (size_t k = 0; k < g.params.size(); ++k) j["params"].push_back(snap.names[g.params[k]]);
    j["offsets"] = g.layout.offsets;
    j["padded_numel"] = g.layout.padded_numel;
    j["dtype"] = c10::toString(g.layout.dtype);
    m["groups"].push_back(std::move(j));
  }
  m["files"] = json::array();
  for (int r = 0; r < world; ++r) {
    m["files"].push_back({{"name", rank_file_name(r, world)},
                          {"bytes", digests[static_cast<size_t>(r)].first},
                          {"xxh3", checkpoint::to_hex(digests[static_cast<size_t>(r)].second)}});
  }
  return m;
}

void Checkpointer::Impl::commit(const fs::path& tmp, const fs::path& final_dir, const json& manifest) {
  write_atomically(tmp / "manifest.json", manifest.dump(1));
  std::error_code ec;
  fs::path replaced;
  if (fs::exists(final_dir)) {  // the same step saved again (e.g. after a resume)
    replaced = final_dir.string() + ".replaced.tmp";
    fs::remove_all(replaced, ec);
    fs::rename(final_dir, replaced, ec);
    TORCH_CHECK(!ec, "checkpoint: cannot move the old '", final_dir.string(), "' aside: ", ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  TORCH_CHECK(!ec, "checkpoint: cannot rename '", tmp.string(), "' to '", final_dir.string(), "': ", ec.message());
  fsync_path(final_dir.parent_path(), true);
  write_atomically(final_dir.parent_path() / "latest", final_dir.filename().string() + "\n");
  if (!replaced.empty()) fs::remove_all(replaced, ec);
}

std::vector<fs::path> Checkpointer::Impl::committed() const {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step-", 0) != 0 || n.find(".tmp") != std::string::npos) continue;
    if (!fs::exists(e.path() / "manifest.json")) continue;  // never committed
    try {
      found.emplace_back(std::stoll(n.substr(5)), e.path());
    } catch (const std::exception&) {
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

void Checkpointer::Impl::retain(const fs::path& keep_dir) {
  std::error_code ec;
  // Directories a crash left behind: never committed, never loaded.
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    const bool leftover = n.rfind("step-", 0) == 0 &&
                          (n.find(".tmp") != std::string::npos || !fs::exists(e.path() / "manifest.json"));
    if (leftover && e.path() != keep_dir) fs::remove_all(e.path(), ec);
  }
  auto all = committed();
  const size_t keep = static_cast<size_t>(std::max(options.keep, 2));
  for (size_t i = keep; i < all.size(); ++i) {
    if (all[i] != keep_dir) fs::remove_all(all[i], ec);
  }
}

std::string Checkpointer::Impl::save(const ShardedState& state, torch::nn::Module& model,
                                     const TrainingProgress& progress,
                                     const std::function<void(std::function<void()>)>& fence) {
  TORCH_CHECK_VALUE(json::accept(progress.extra_json), "checkpoint: TrainingProgress::extra_json is not valid JSON: ",
                    progress.extra_json.substr(0, 80));
  const auto t0 = std::chrono::steady_clock::now();
  wait_pending();  // one save at a time; a failed background save throws here, on every rank
  // Views of the live shards: a synchronous save writes them while the caller
  // waits; an async one copies them on the writer thread (below).
  auto snap = std::make_shared<Snapshot>(snapshot(state, model, progress, /*defer_copies=*/true));
  const std::string step_dir = (fs::path(dir) / step_dir_name(progress.step)).string();
  if (!options.async) {
    write(*snap);
    std::lock_guard<std::mutex> lock(last_mu);
    last.stall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return step_dir;
  }
  // The writer copies the shards first; the optimizer's next update waits for
  // that copy, so the training loop's stall is only the metadata above.
  auto copied = std::make_shared<std::promise<void>>();
  std::shared_future<void> copied_future = copied->get_future().share();
  if (snap->deferred) {
    fence([this, copied_future] {
      const auto w0 = std::chrono::steady_clock::now();
      copied_future.wait();
      std::lock_guard<std::mutex> lock(last_mu);  // the loop waited here too: part of the stall
      last.stall_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    });
  }
  std::packaged_task<std::string()> task([this, snap, copied] {
    try {
      snap->copy();
    } catch (...) {
      copied->set_value();  // never leave the optimizer waiting; the error surfaces at wait()
      throw;
    }
    copied->set_value();
    return write(*snap);
  });
  pending = task.get_future();
  boost::asio::post(pool, std::move(task));
  const double stall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(last_mu);
    last.stall_seconds = stall;
  }
  char msg[200];
  std::snprintf(msg, sizeof(msg),
                "checkpoint: step %lld (%.1f MB) saving in the background (the caller waited %.3f s; the next "
                "step() waits until the shards are copied)",
                static_cast<long long>(progress.step), snap->bytes / 1e6, stall);
  log_info(msg);
  return step_dir;
}

void Checkpointer::Impl::wait_pending() {
  if (!pending.valid()) return;
  auto f = std::move(pending);
  f.get();
}

std::string Checkpointer::Impl::write(const Snapshot& snap) {
  torch::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();
  Communicator& c = *io_comm;
  const int rank = c.rank(), world = c.size();
  const fs::path final_dir = fs::path(dir) / step_dir_name(snap.progress.step);
  const fs::path tmp = final_dir.string() + ".tmp";
  std::string err;
  if (rank == 0) {
    try {
      std::error_code ec;
      fs::remove_all(tmp, ec);
      fs::create_directories(tmp, ec);
      TORCH_CHECK(!ec, "cannot create '", tmp.string(), "': ", ec.message());
    } catch (const std::exception& e) {
      err = message_of(e);
    }
  }
  agree(c, "creating " + tmp.string(), err);
  const fs::path file = tmp / rank_file_name(rank, world);
  checkpoint::FileDigest digest;
  try {
    const auto w0 = std::chrono::steady_clock::now();
    write_rank_file(file, snap);
    const auto w1 = std::chrono::steady_clock::now();
    digest = checkpoint::digest_file(file.string());
    char msg[160];
    std::snprintf(msg, sizeof(msg), "checkpoint: rank file written and fsynced in %.3f s, checksummed in %.3f s",
                  std::chrono::duration<double>(w1 - w0).count(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - w1).count());
    log_debug(msg);
  } catch (const std::exception& e) {
    err = std::string("writing '") + file.string() + "': " + message_of(e);
  }
  agree(c, "writing rank files", err);
  auto d = torch::tensor({static_cast<int64_t>(digest.bytes), static_cast<int64_t>(digest.xxh3)}, torch::kLong);
  auto all = torch::empty({2 * world}, torch::kLong);
  c.all_gather(all, d)->wait();
  std::vector<std::pair<int64_t, uint64_t>> digests;
  for (int r = 0; r < world; ++r) {
    digests.emplace_back(all[2 * r].item<int64_t>(), static_cast<uint64_t>(all[2 * r + 1].item<int64_t>()));
  }
  auto took = torch::tensor({std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()}, torch::kDouble);
  if (world > 1) c.all_reduce(took, ReduceOp::kMax)->wait();
  if (rank == 0) {
    try {
      Snapshot timed = snap;  // a shallow copy: tensors are shared
      timed.save_seconds = took.item<double>();
      if (options.write_model_view) write_model_view(tmp / "model.h5", snap);
      commit(tmp, final_dir, manifest(timed, digests));
    } catch (const std::exception& e) {
      err = message_of(e);
    }
  }
  agree(c, "committing " + final_dir.string(), err);
  if (rank == 0) retain(final_dir);
  c.barrier();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t bytes = 0;
  for (const auto& dg : digests) bytes += dg.first;
  {
    std::lock_guard<std::mutex> lock(last_mu);
    last.write_seconds = seconds;
    last.bytes = bytes;
  }
  char msg[200];
  std::snprintf(msg, sizeof(msg), "checkpoint: saved step %lld (%.1f MB in %d files) in %.2f s",
                static_cast<long long>(snap.progress.step), bytes / 1e6, world, seconds);
  log_info(std::string(msg) + " to " + final_dir.string());
  return final_dir.string();
}

std::string Checkpointer::Impl::verify_share(const fs::path& step_dir, const json& m) const {
  const auto& files = m.at("files");
  for (size_t j = static_cast<size_t>(comm->rank()); j < files.size(); j += static_cast<size_t>(comm->size())) {
    const fs::path p = step_dir / files[j].at("name").get<std::string>();
    std::error_code ec;
    if (!fs::exists(p, ec)) return "'" + p.string() + "' is missing";
    const auto size = fs::file_size(p, ec);
    const auto want = files[j].at("bytes").get<int64_t>();
    if (ec || static_cast<int64_t>(size) != want) {
      return "'" + p.string() + "' has " + std::to_string(size) + " bytes, the manifest says " + std::to_string(want) +
             " (truncated?)";
    }
    const auto digest = checkpoint::digest_file(p.string());
    if (checkpoint::to_hex(digest.xxh3) != files[j].at("xxh3").get<std::string>()) {
      return "'" + p.string() + "' fails its checksum (xxh3 " + checkpoint::to_hex(digest.xxh3) +
             ", the manifest says " + files[j].at("xxh3").get<std::string>() + "): the file is corrupt";
    }
  }
  return "";
}

std::optional<TrainingProgress> Checkpointer::Impl::load(
    ShardedState state, torch::nn::Module& model, std::optional<int64_t> step,
    const Restore& restore) {
  wait_pending();
  torch::NoGradGuard no_grad;
  const int rank = comm->rank();
  const auto names = module_names(state, model);
  // Candidates: the one asked for, or what `latest` names; then older committed ones.
  std::vector<fs::path> candidates;
  const fs::path root(dir);
  if (step) {
    candidates.push_back(root / step_dir_name(*step));
  } else if (fs::exists(root / "latest")) {
    std::string name = read_text(root / "latest");
    name.erase(name.find_last_not_of(" \n\r\t") + 1);
    candidates.push_back(root / name);
  }
  for (const auto& c : committed()) {
    if (std::find(candidates.begin(), candidates.end(), c) == candidates.end()) candidates.push_back(c);
  }
  if (candidates.empty()) return std::nullopt;
  const std::string mine = model_description(model, state, names);
  for (const auto& cand : candidates) {
    // 1. manifest and files, checked by every rank (each a share of the files)
    std::string why;
    json m;
    try {
      if (!fs::exists(cand / "manifest.json")) {
        why = "'" + cand.string() + "' has no manifest.json (never committed)";
      } else {
        m = json::parse(read_text(cand / "manifest.json"));
        TORCH_CHECK(m.at("format") == kFormat && m.at("format_version").get<int>() == kFormatVersion,
                    "unknown format");
        why = verify_share(cand, m);
      }
    } catch (const std::exception& e) {
      why = "'" + (cand / "manifest.json").string() + "' cannot be used: " +
            message_of(e);
    }
    auto bad = torch::tensor({why.empty() ? 0.0 : 1.0}, torch::kDouble);
    if (comm->size() > 1) comm->all_reduce(bad, ReduceOp::kMax)->wait();
    if (bad.item<double>() > 0) {
      log_warn("checkpoint: not loading " + cand.string() + ": " +
               (why.empty() ? std::string("another rank found a bad file (its log says which)") : why) +
               "; trying the previous committed checkpoint");
      if (step) {
        TORCH_CHECK(false, "checkpoint: step ", *step, " in '", dir, "' cannot be loaded: ",
                    why.empty() ? std::string("another rank found a bad file (its log says which)") : why);
      }
      continue;
    }
    // 2. the same model (a different one is an error, not a reason to fall back)
    const bool imported = m.at("model_hash").get<std::string>().empty();  // zeroshard-ckpt import: no hash
    if (!imported && m.at("model_hash").get<std::string>() != hash_hex(mine)) {
      std::unordered_map<std::string, json> saved;
      for (const auto& p : m.at("params")) saved[p.at("name").get<std::string>()] = p;
      std::string first;
      for (size_t i = 0; i < names.size() && first.empty(); ++i) {
        auto it = saved.find(names[i]);
        if (it == saved.end()) {
          first = "parameter '" + names[i] + "' is not in the checkpoint";
        } else if (it->second.at("shape").get<std::vector<int64_t>>() != state.params[i].shape) {
          first = "parameter '" + names[i] + "' has shape " + c10::str(c10::IntArrayRef(state.params[i].shape)) +
                  " here and " + it->second.at("shape").dump() + " in the checkpoint";
        }
      }
      TORCH_CHECK(false, "checkpoint: '", cand.string(), "' was saved from a different model (",
                  first.empty() ? std::string("parameter or buffer names, shapes or dtypes differ") : first,
                  "); load it into the model it was saved from");
    }
    // 3. this rank's pieces, from whichever old files hold them
    try {
      std::unordered_map<std::string, const json*> saved;
      for (const auto& p : m.at("params")) saved[p.at("name").get<std::string>()] = &p;
      std::map<int, checkpoint::h5::File> open;
      auto file = [&](int r) -> checkpoint::h5::File& {
        auto it = open.find(r);
        if (it == open.end()) {
          it = open.emplace(r, checkpoint::h5::File::open_read(
                                   (cand / m.at("files")[static_cast<size_t>(r)].at("name").get<std::string>()).string()))
                   .first;
        }
        return it->second;
      };
      std::unordered_map<std::string, const json*> replicated;
      for (const auto& r : m.at("replicated")) replicated[r.at("name").get<std::string>()] = &r;
      // A parameter saved in full (untrained at save time, e.g. frozen at stage 2), as fp32.
      auto read_replicated = [&](const std::string& name, const std::vector<int64_t>& shape) {
        const auto dtype = checkpoint::dtype_named(replicated.at(name)->at("dtype").get<std::string>());
        auto t = torch::empty(shape, torch::TensorOptions().dtype(dtype));
        file(0).read_all("/replicated/" + name, storage_type(dtype, name), t.data_ptr());
        return t;
      };
      // Elements [a, e) of a parameter's fp32 master, from the pieces of whichever ranks saved them.
      auto read_master = [&](const std::string& name, const char* kind, int64_t a, int64_t e, float* out) {
        for (const auto& pc : saved.at(name)->at("pieces")) {
          const int r = pc[0].get<int>();
          const int64_t pb = pc[1].get<int64_t>(), pe = pc[2].get<int64_t>();
          const int64_t lo = std::max(a, pb), hi = std::min(e, pe);
          if (lo >= hi) continue;
          file(r).read(std::string("/") + kind + "/" + name, checkpoint::h5::Type::kFloat32,
                       static_cast<uint64_t>(lo - pb), static_cast<uint64_t>(hi - lo), out + (lo - a));
        }
      };
      std::vector<int64_t> steps(state.params.size(), 0);
      for (size_t i = 0; i < names.size(); ++i) {
        auto it = saved.find(names[i]);
        if (it != saved.end()) {
          TORCH_CHECK(it->second->at("shape").get<std::vector<int64_t>>() == state.params[i].shape, "parameter '",
                      names[i], "' has shape ", c10::IntArrayRef(state.params[i].shape), " here and ",
                      it->second->at("shape").dump(), " in the checkpoint");
          steps[i] = it->second->at("step").get<int64_t>();
        } else {
          TORCH_CHECK(replicated.count(names[i]), "parameter '", names[i], "' is not in the checkpoint");
        }
      }
      std::unordered_map<std::string, at::Tensor> full_replicated;  // read once per parameter
      for (const auto& b : state.buckets) {
        for (const auto& seg : shard_segments(b.layout, rank)) {
          const size_t pi = b.params[seg.param];
          const std::string& name = names[pi];
          const Range local = seg.local(b.layout, rank);
          const int64_t a = seg.param_offset, e = seg.param_offset + local.size();
          if (saved.count(name)) {
            read_master(name, "master", a, e, b.master.data_ptr<float>() + local.begin);
            read_master(name, "exp_avg", a, e, b.exp_avg.data_ptr<float>() + local.begin);
            read_master(name, "exp_avg_sq", a, e, b.exp_avg_sq.data_ptr<float>() + local.begin);
          } else {  // saved in full and untrained: no moments
            auto& full = full_replicated[name];
            if (!full.defined()) full = read_replicated(name, state.params[pi].shape).to(at::kFloat).reshape(-1);
            b.master.slice(0, local.begin, local.end).copy_(full.slice(0, a, e));
            b.exp_avg.slice(0, local.begin, local.end).zero_();
            b.exp_avg_sq.slice(0, local.begin, local.end).zero_();
          }
        }
      }
      // The module's parameters the optimizer does not hold, and its buffers.
      std::unordered_map<std::string, bool> in_state;
      for (const auto& n : names) in_state[n] = true;
      auto restore_full = [&](const std::string& name, const at::Tensor& target) {
        if (imported && !replicated.count(name) && !saved.count(name)) {
          log_info("checkpoint: '" + name + "' is not in the imported checkpoint; it keeps its value");
          return;
        }
        if (replicated.count(name)) {
          target.detach().copy_(read_replicated(name, target.sizes().vec()));
        } else {
          TORCH_CHECK(saved.count(name), "'", name, "' is not in the checkpoint");
          auto full = torch::empty({target.numel()}, at::kFloat);
          read_master(name, "master", 0, target.numel(), full.data_ptr<float>());
          target.detach().copy_(full.view(target.sizes()));
        }
      };
      for (const auto& item : model.named_parameters()) {
        if (!in_state.count(item.key())) restore_full(item.key(), item.value());
      }
      for (const auto& item : model.named_buffers()) restore_full(item.key(), item.value());
      if (m.at("world_size").get<int>() == comm->size() && file(rank).has("/rng/cpu")) {  // each resumes its own RNG stream
        const auto dims = file(rank).dims("/rng/cpu");
        auto rng = torch::empty({static_cast<int64_t>(dims.at(0))}, torch::kUInt8);
        file(rank).read_all("/rng/cpu", checkpoint::h5::Type::kUInt8, rng.data_ptr());
        auto gen = at::detail::getDefaultCPUGenerator();  // a handle on the process's generator
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(rng);
      }
      // An accumulation in progress: the reduced gradients so far, in this layout.
      std::vector<at::Tensor> grad_shards;
      std::vector<char> had_grad;
      if (m.value("gradients", false)) {
        for (const auto& b : state.buckets) {
          auto g = at::zeros({b.shard.size()}, at::kFloat);
          for (const auto& seg : shard_segments(b.layout, rank)) {
            const std::string& name = names[b.params[seg.param]];
            if (!saved.count(name)) continue;  // untrained when saved: no gradient
            const Range local = seg.local(b.layout, rank);
            read_master(name, "grad", seg.param_offset, seg.param_offset + local.size(), g.data_ptr<float>() + local.begin);
          }
          grad_shards.push_back(g);
        }
        for (const auto& n : names) had_grad.push_back(saved.count(n) && saved.at(n)->value("had_grad", false) ? 1 : 0);
      }
      why.clear();
      restore(steps, m.at("loss_scale").get<double>(), m.at("loss_scale_clean_steps").get<int64_t>(), grad_shards,
              had_grad);
    } catch (const std::exception& e) {
      why = message_of(e);
    }
    agree(*comm, "loading " + cand.string(), why);
    TrainingProgress progress;
    progress.step = m.at("step").get<int64_t>();
    progress.epoch = m.at("epoch").get<int64_t>();
    progress.extra_json = m.at("extra").dump();
    progress.save_seconds = m.value("save_seconds", 0.0);
    log_info("checkpoint: loaded step " + std::to_string(progress.step) + " from " + cand.string() + " (saved by " +
             std::to_string(m.at("world_size").get<int>()) + " ranks, stage " + std::to_string(m.at("stage").get<int>()) +
             ")");
    return progress;
  }
  TORCH_CHECK(false, "checkpoint: no checkpoint in '", dir, "' can be loaded (each was skipped above, with the reason)");
}

Checkpointer::Checkpointer(std::string dir, std::shared_ptr<Communicator> comm, CheckpointOptions options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK_VALUE(comm != nullptr, "Checkpointer: the communicator is null");
  TORCH_CHECK_VALUE(options.keep >= 2, "Checkpointer: keep is ", options.keep,
                    "; at least 2 committed checkpoints are kept (a crash while replacing one leaves the other)");
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
  std::vector<int> all(static_cast<size_t>(impl_->comm->size()));
  for (int r = 0; r < impl_->comm->size(); ++r) all[static_cast<size_t>(r)] = r;
  impl_->io_comm = impl_->comm->split(all);
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
  std::lock_guard<std::mutex> lock(impl_->last_mu);
  return impl_->last;
}

const std::string& Checkpointer::dir() const { return impl_->dir; }

namespace {

// Both optimizers expose the same checkpoint hooks.
template <typename Opt>
std::string save_with(Checkpointer::Impl& impl, Opt& opt, torch::nn::Module& model, const TrainingProgress& progress) {
  return impl.save(opt.sharded_state(), model, progress,
                   [&opt](std::function<void()> fn) { opt.call_before_next_update(std::move(fn)); });
}

template <typename Opt>
std::optional<TrainingProgress> load_with(Checkpointer::Impl& impl, Opt& opt, torch::nn::Module& model,
                                          std::optional<int64_t> step) {
  return impl.load(opt.sharded_state(), model, step,
                   [&opt](const std::vector<int64_t>& s, double scale, int64_t clean,
                          const std::vector<at::Tensor>& grads, const std::vector<char>& had) {
                     opt.restore_sharded_state(s, scale, clean, grads, had);
                   });
}

}  // namespace

std::string Checkpointer::save(ShardedAdamW& opt, torch::nn::Module& model, const TrainingProgress& progress) {
  return save_with(*impl_, opt, model, progress);
}

std::string Checkpointer::save(FullyShardedAdamW& opt, torch::nn::Module& model, const TrainingProgress& progress) {
  return save_with(*impl_, opt, model, progress);
}

std::optional<TrainingProgress> Checkpointer::load(ShardedAdamW& opt, torch::nn::Module& model,
                                                   std::optional<int64_t> step) {
  return load_with(*impl_, opt, model, step);
}

std::optional<TrainingProgress> Checkpointer::load(FullyShardedAdamW& opt, torch::nn::Module& model,
                                                   std::optional<int64_t> step) {
  return load_with(*impl_, opt, model, step);
}

}  // namespace zeroshard
