// save.cpp — rank files, model.h5, the manifest, the commit protocol and retention (snapshot.cpp: what a save takes from the live state).
#include "checkpointer_impl.h"

#include "compat/torch_compat.h"
#include "zeroshard/log.h"
#include "zeroshard/trace.h"

#include <ATen/CPUGeneratorImpl.h>
#include <boost/asio/post.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <unordered_map>

namespace zeroshard {

using namespace ckpt;

std::vector<checkpoint::h5::Extent> ckpt::write_rank_file(const fs::path& path, const Snapshot& snap,
                                                          const std::set<std::string>& skip, bool digests) {
  using checkpoint::h5::Type;
  const auto start = std::chrono::steady_clock::now();
  auto f = checkpoint::h5::File::create(path.string());
  f.digest_datasets(digests);
  f.set_attribute("/", "format", std::string(kFormat));
  f.set_attribute("/", "format_version", static_cast<int64_t>(kFormatVersion));
  f.set_attribute("/", "rank", static_cast<int64_t>(snap.rank));
  f.set_attribute("/", "world_size", static_cast<int64_t>(snap.world));
  f.set_attribute("/", "pp_stage", static_cast<int64_t>(snap.place.pp_stage));
  f.set_attribute("/", "dp_rank", static_cast<int64_t>(snap.place.dp_rank));
  f.set_attribute("/", "step", snap.progress.step);
  for (const auto& o : snap.owned) {
    const std::string& name = snap.names[o.param];
    if (skip.count(name)) continue;
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
  if (snap.writes_replicated) {  // what the group's ranks hold in full: buffers and untrained parameters
    for (const auto& r : snap.replicated) {
      if (skip.count(r.name)) continue;
      std::vector<uint64_t> dims;
      for (auto d : r.value.sizes()) dims.push_back(static_cast<uint64_t>(d));
      if (dims.empty()) dims.push_back(1);
      const std::string ds = "/replicated/" + r.name;
      f.write(ds, storage_type(r.value.scalar_type(), r.name), dims, r.value.data_ptr());
      f.set_attribute(ds, "dtype", std::string(c10::toString(r.value.scalar_type())));
    }
  }
  if (snap.rng.defined()) {
    f.write("/rng/cpu", Type::kUInt8, {static_cast<uint64_t>(snap.rng.numel())}, snap.rng.data_ptr());
  }
  if (snap.device_rng.defined()) {
    f.write("/rng/cuda", Type::kUInt8, {static_cast<uint64_t>(snap.device_rng.numel())}, snap.device_rng.data_ptr());
  }
  const auto c0 = std::chrono::steady_clock::now();
  log_debug("checkpoint: datasets written in " + std::to_string(std::chrono::duration<double>(c0 - start).count()) + " s");
  auto extents = f.extents();
  f.close();
  const auto c1 = std::chrono::steady_clock::now();
  fsync_path(path, false);
  char msg[160];
  std::snprintf(msg, sizeof(msg), "checkpoint: close %.3f s, fsync %.3f s", std::chrono::duration<double>(c1 - c0).count(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - c1).count());
  log_debug(msg);
  return extents;
}

void Checkpointer::Impl::write_model_view(const fs::path& path, const json& m) {
  using checkpoint::h5::Type;
  auto f = checkpoint::h5::File::create(path.string());
  f.set_attribute("/", "format", std::string("zeroshard-checkpoint-view"));
  f.set_attribute("/", "format_version", static_cast<int64_t>(kFormatVersion));
  auto file_name = [&](const json& rank) { return m.at("files").at(rank.get<size_t>()).at("name").get<std::string>(); };
  for (const auto& p : m.at("params")) {
    const auto name = p.at("name").get<std::string>();
    const auto shape = p.at("shape").get<std::vector<uint64_t>>();
    for (const auto& [prefix, kind] : {std::pair<std::string, std::string>{"/", "master"},
                                       {"/optimizer/exp_avg/", "exp_avg"}, {"/optimizer/exp_avg_sq/", "exp_avg_sq"}}) {
      std::vector<checkpoint::h5::File::VirtualPiece> pieces;
      for (const auto& pc : p.at("pieces")) {
        const auto begin = pc.at(1).get<uint64_t>(), end = pc.at(2).get<uint64_t>();
        pieces.push_back({file_name(pc.at(0)), "/" + kind + "/" + name, 0, end - begin, begin, {}});
      }
      f.write_virtual(prefix + name, Type::kFloat32, shape, pieces);
    }
  }
  for (const auto& r : m.at("replicated")) {
    const auto name = r.at("name").get<std::string>();
    const auto dtype = r.at("dtype").get<std::string>();
    std::vector<uint64_t> dims = r.at("shape").get<std::vector<uint64_t>>();
    uint64_t n = 1;
    for (auto d : dims) n *= d;
    if (dims.empty()) dims.push_back(1);  // stored as [1]
    f.write_virtual("/" + name, storage_type(checkpoint::dtype_named(dtype), name), dims,
                    {{file_name(r.at("rank")), "/replicated/" + name, 0, n, 0, dims}});
    f.set_attribute("/" + name, "dtype", dtype);
  }
  f.close();
  fsync_path(path, false);
}

std::vector<fs::path> Checkpointer::Impl::committed() const {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const auto step = step_of_dir_name(e.path().filename().string());  // not step-N.tmp, not other files
    if (!step || !fs::exists(e.path() / "manifest.json")) continue;       // never committed
    found.emplace_back(*step, e.path());
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
  const fs::path uploading = durable ? durable->pinned() : fs::path();  // read by the durable tier's upload
  for (size_t i = keep; i < all.size(); ++i) {
    if (all[i] != keep_dir && all[i] != uploading) fs::remove_all(all[i], ec);
  }
}

void Checkpointer::Impl::start_durable_upload(Communicator& c, const fs::path& step_dir, int64_t step) {
  // One decision on every rank: while some rank's previous upload is in flight, this step
  // is not uploaded anywhere (a step in the store is every rank's files or none). The same
  // all-reduce carries rank 0's draw of the attempt's name (48 bits: exact in a double).
  const double attempt = c.rank() == 0 ? static_cast<double>(std::mt19937_64(std::random_device{}())() >> 16) : 0.0;
  auto agreed = torch::tensor({durable->busy() ? 1.0 : 0.0, attempt}, torch::kDouble);
  if (c.size() > 1) c.all_reduce(agreed, ReduceOp::kMax)->wait();
  if (agreed[0].item<double>() == 0) {
    durable->start_upload(step_dir, step, static_cast<uint64_t>(agreed[1].item<double>()));
  } else if (c.rank() == 0) {
    log_warn("checkpoint: " + step_dir_name(step) + " is not uploaded to the durable tier: the previous step's " +
             "upload is still in flight on some rank (saves come faster than the store takes them)");
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
    trace::Span span("checkpoint", "checkpoint save step " + std::to_string(progress.step));
    if (snap->on_device) snap->copy();  // device shards through pinned host memory
    write(*snap);
    std::lock_guard<std::mutex> lock(last->mu);
    last->times.stall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return step_dir;
  }
  // The writer copies the shards first; the optimizer's next update waits for
  // that copy, so the training loop's stall is only the metadata above.
  auto copied = std::make_shared<std::promise<void>>();
  std::shared_future<void> copied_future = copied->get_future().share();
  if (snap->deferred) {
    fence([last = last, copied_future] {  // not `this`: the Checkpointer may be gone by the next update
      const auto w0 = std::chrono::steady_clock::now();
      copied_future.wait();
      std::lock_guard<std::mutex> lock(last->mu);  // the loop waited here too: part of the stall
      last->times.stall_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    });
  }
  std::packaged_task<std::string()> task([this, snap, copied] {
    try {
      trace::set_thread_name("checkpoint writer");
      trace::Span span("checkpoint", "checkpoint copy step " + std::to_string(snap->progress.step));
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
    std::lock_guard<std::mutex> lock(last->mu);
    last->times.stall_seconds = stall;
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

namespace {

// The step's temporary directory, made empty; returns the failure ("" when none).
std::string make_empty_dir(const fs::path& tmp) {
  try {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    TORCH_CHECK(!ec, "cannot create '", tmp.string(), "': ", ec.message());
  } catch (const std::exception& e) {
    return error_message(e);
  }
  return "";
}

struct WrittenFile {
  checkpoint::FileDigest digest;
  checkpoint::FileDigest index{0, 0};  // with a durable tier: where each dataset lies in the file
};

// Writes this rank's file (and, `with_index`, its dataset index, so that a load
// elsewhere reads only the datasets it needs from the store), fsynced and checksummed.
WrittenFile write_and_digest(const fs::path& file, const Snapshot& snap, const std::set<std::string>& skip,
                             bool with_index) {
  WrittenFile out;
  const auto w0 = std::chrono::steady_clock::now();
  std::vector<checkpoint::h5::Extent> extents;
  {
    trace::Span span("checkpoint", "checkpoint write " + file.filename().string());
    extents = write_rank_file(file, snap, skip, /*digests=*/with_index);
  }
  const auto w1 = std::chrono::steady_clock::now();
  {
    trace::Span span("checkpoint", "checkpoint checksum " + file.filename().string());
    out.digest = checkpoint::digest_file(file.string());
  }
  if (with_index) {
    const std::string text = dataset_index(file.filename().string(), out.digest, extents).dump();
    write_atomically(index_path(file), text);
    out.index = {checkpoint::digest_bytes(text.data(), text.size()), text.size()};
  }
  char msg[160];
  std::snprintf(msg, sizeof(msg), "checkpoint: rank file written and fsynced in %.3f s, checksummed in %.3f s",
                std::chrono::duration<double>(w1 - w0).count(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - w1).count());
  log_debug(msg);
  return out;
}

// Every rank's file digest and index digest, as (bytes, xxh3) pairs in rank order.
std::pair<std::vector<std::pair<int64_t, uint64_t>>, std::vector<std::pair<int64_t, uint64_t>>> all_digests(
    Communicator& c, const WrittenFile& w) {
  const int world = c.size();
  auto d = torch::tensor({static_cast<int64_t>(w.digest.bytes), static_cast<int64_t>(w.digest.xxh3),
                          static_cast<int64_t>(w.index.bytes), static_cast<int64_t>(w.index.xxh3)}, torch::kLong);
  auto all = torch::empty({4 * world}, torch::kLong);
  c.all_gather(all, d)->wait();
  std::vector<std::pair<int64_t, uint64_t>> digests, indexes;
  for (int r = 0; r < world; ++r) {
    digests.emplace_back(all[4 * r].item<int64_t>(), static_cast<uint64_t>(all[4 * r + 1].item<int64_t>()));
    indexes.emplace_back(all[4 * r + 2].item<int64_t>(), static_cast<uint64_t>(all[4 * r + 3].item<int64_t>()));
  }
  return {digests, indexes};
}

}  // namespace

json Checkpointer::Impl::manifest_of(const Snapshot& snap, Contents contents, const fs::path& tmp,
                                     const std::vector<std::pair<int64_t, uint64_t>>& digests,
                                     const std::vector<std::pair<int64_t, uint64_t>>& indexes, double save_seconds) {
  trace::Span span("checkpoint", "checkpoint manifest " + tmp.stem().string());
  json m = build_manifest(snap, std::move(contents), digests);
  m["save_seconds"] = save_seconds;  // writing the rank files, as measured by the slowest rank
  if (lineage.is_null()) lineage = fresh_lineage(new_line_id());  // nothing loaded: a line from the start
  m["lineage"] = lineage;
  for (size_t r = 0; r < digests.size(); ++r) {
    json& f = m["files"][r];
    f["host"] = disks.hosts[r];
    const auto& [bytes, xxh3] = indexes[r];
    if (bytes > 0) f["index"] = {{"bytes", bytes}, {"xxh3", checkpoint::to_hex(xxh3)}};
  }
  if (options.write_model_view) {  // on rank 0's disk: it presents the files where they are brought together
    write_model_view(tmp / "model.h5", m);
    // Its checksum too: readers hand HDF5 no file whose bytes they have not verified.
    const auto view = checkpoint::digest_file((tmp / "model.h5").string());
    m["model_view"] = {{"name", "model.h5"}, {"bytes", view.bytes}, {"xxh3", checkpoint::to_hex(view.xxh3)}};
  }
  return m;
}

std::string Checkpointer::Impl::write(const Snapshot& snap) {
  torch::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();
  Communicator& c = *io_comm;
  const int rank = c.rank(), world = c.size();
  const fs::path final_dir = fs::path(dir) / step_dir_name(snap.progress.step);
  const fs::path tmp = final_dir.string() + ".tmp";
  // Every rank's record, merged the same way everywhere: which names this rank
  // writes, and (rank 0) the manifest's contents.
  auto contents = merge_records(all_gather_text(c, rank_record(snap).dump()), rank, !disks.shared());
  const bool leads = disks.leads(rank);  // makes and commits the step directory on its disk
  std::string err = leads ? make_empty_dir(tmp) : "";
  agree(c, "creating " + tmp.string(), err);
  const fs::path file = tmp / rank_file_name(rank, world);
  WrittenFile written;
  try {
    written = write_and_digest(file, snap, contents.skip, durable != nullptr);
  } catch (const std::exception& e) {
    err = std::string("writing '") + file.string() + "': " + error_message(e);
  }
  agree(c, "writing rank files", err);
  const auto [digests, indexes] = all_digests(c, written);
  auto took = torch::tensor({std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()}, torch::kDouble);
  if (world > 1) c.all_reduce(took, ReduceOp::kMax)->wait();
  json m;
  if (rank == 0) {
    try {
      m = manifest_of(snap, std::move(contents), tmp, digests, indexes, took.item<double>());
    } catch (const std::exception& e) {
      err = error_message(e);
    }
  }
  if (!disks.shared()) {  // every disk gets the same manifest, and commits its own step directory
    agree(c, "writing the manifest of " + final_dir.string(), err);
    const std::string text = broadcast_text(c, rank == 0 ? m.dump() : std::string(), 0);
    if (rank != 0) m = json::parse(text);
  }
  if (leads && err.empty()) {
    try {
      trace::Span span("checkpoint", "checkpoint commit " + final_dir.filename().string());
      commit_step_dir(tmp, final_dir, m);
    } catch (const std::exception& e) {
      err = error_message(e) + (disks.shared() ? "" : " (on host " + disks.hosts[static_cast<size_t>(rank)] + ")");
    }
  }
  // Without a shared filesystem, a crash between two disks' commits leaves one a step
  // ahead: a load takes the newest step every disk holds (each keeps at least 2).
  agree(c, "committing " + final_dir.string(), err);
  newest_saved = snap.progress.step;
  if (durable) start_durable_upload(c, final_dir, snap.progress.step);
  if (leads) retain(final_dir);
  c.barrier();
  report_saved(snap.progress.step, final_dir, digests, std::chrono::steady_clock::now() - t0);
  return final_dir.string();
}

void Checkpointer::Impl::report_saved(int64_t step, const fs::path& final_dir,
                                      const std::vector<std::pair<int64_t, uint64_t>>& digests,
                                      std::chrono::steady_clock::duration took) {
  const double seconds = std::chrono::duration<double>(took).count();
  int64_t bytes = 0;
  for (const auto& dg : digests) bytes += dg.first;
  {
    std::lock_guard<std::mutex> lock(last->mu);
    last->times.write_seconds = seconds;
    last->times.bytes = bytes;
  }
  char msg[200];
  std::snprintf(msg, sizeof(msg), "checkpoint: saved step %lld (%.1f MB in %zu files) in %.2f s",
                static_cast<long long>(step), bytes / 1e6, digests.size(), seconds);
  log_info(std::string(msg) + " to " + final_dir.string());
}

}  // namespace zeroshard
