#include "comm/tcp_communicator.h"
#include "zeroshard/log.h"

#include "zeroshard/trace.h"

#include "comm/wire.h"
#include "comm/reduce_kernels.h"
#include "comm/store_wait.h"

#include <c10/util/Exception.h>

#include <exception>
#include <list>
#include <sstream>

namespace zeroshard::comm {
namespace {

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  const char* a1 = a0 + a.numel() * a.element_size();
  const char* b1 = b0 + b.numel() * b.element_size();
  return a0 < b1 && b0 < a1;
}

MeshOptions with_blame(MeshOptions o, std::shared_ptr<std::atomic<int>> blame) {
  o.blame = std::move(blame);
  return o;
}

MeshOptions with_timeouts(MeshOptions o, const CommOptions& options) {
  o.rendezvous_timeout = options.rendezvous_timeout;
  o.liveness = options.liveness;
  return o;
}

std::string format_ranks(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  s << "]";
  return s.str();
}

}  // namespace

TcpCommunicator::TcpCommunicator(int rank, int size, std::vector<int> world_ranks,
                                 std::shared_ptr<c10d::Store> store, std::string prefix, MeshOptions mesh,
                                 CommOptions options, std::shared_ptr<Family> family)
    : rank_(rank), size_(size), world_ranks_(std::move(world_ranks)), store_(std::move(store)),
      prefix_(std::move(prefix)), mesh_options_(std::move(mesh)), options_(options),
      family_(family ? std::move(family) : std::make_shared<Family>(options.timeout)),
      mesh_(std::make_shared<TcpMesh>(rank_, size_, with_timeouts(mesh_options_, options_),
                                      *store_, prefix_ + "mesh/", world_ranks_)),
      send_seq_(size, 0), recv_seq_(size, 0) {
  family_->dog.add(mesh_);
  if (!family_->dog.failure().empty()) mesh_->abort(family_->dog.failure());  // split after the family failed
  worker_ = std::thread([this] { worker_loop(); });
  reaper_ = std::thread([this] { reaper_loop(); });
}

TcpCommunicator::~TcpCommunicator() {
  bool failed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed = !failure_.empty();
  }
  // A failed communicator aborted its mesh already; a healthy one drains what is queued,
  // unless this rank is unwinding from an exception, when no peer may make it wait.
  if (std::uncaught_exceptions() > 0 && !failed) {
    const std::string why = "rank " + std::to_string(world_ranks_[rank_]) +
                            " is unwinding from an exception (its own output says which); its communicators were aborted";
    note_failure(mesh_options_.error_file, why);  // before its peers fail and record theirs
    abort(why);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
  {
    std::lock_guard<std::mutex> lock(reaper_mu_);
    reaper_stopping_ = true;
  }
  reaper_cv_.notify_all();
  reaper_.join();
  family_->dog.forget(mesh_.get());
}

void TcpCommunicator::abort(const std::string& why) {
  // This rank failed first (its peers learn it from the close frames): the launcher puts it first.
  note_failure(mesh_options_.error_file, why);
  set_failure(why);
  family_->dog.fail(why);  // aborts every mesh of the family, this one too
  mesh_->abort(why);       // in case the family had failed already (then fail() does nothing)
}

void TcpCommunicator::check_tensor(const char* op, const char* arg, const at::Tensor& t, bool reduces) const {
  TORCH_CHECK_VALUE(t.defined(), op, ": `", arg, "` is an undefined tensor; pass an allocated tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": `", arg, "` is on ", t.device(),
                    " but this communicator moves CPU tensors over TCP; move the tensor to CPU or use "
                    "the NCCL backend");
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": `", arg, "` (sizes ", t.sizes(),
                    ", strides ", t.strides(), ") is not contiguous; pass t.contiguous()");
  const bool bytes = t.scalar_type() == at::kByte || t.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(is_supported_dtype(t.scalar_type()) || (bytes && !reduces), op, ": `", arg, "` has dtype ",
                    t.scalar_type(), "; supported dtypes are float32, bfloat16, float16, float64, int32, int64",
                    reduces ? "" : ", uint8, int8");
}

void TcpCommunicator::check_peer(const char* op, const char* arg, int peer) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_ && peer != rank_, op, ": ", arg, " ", peer,
                    " must be another rank of this communicator (0..", size_ - 1,
                    ", not this rank ", rank_, ")");
}

std::shared_ptr<OpWork> TcpCommunicator::enqueue(OpKind kind, std::vector<at::Tensor> tensors,
                                                  ReduceOp op, int peer) {
  std::shared_ptr<OpWork> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Queued q;
    uint64_t seq = 0;
    if (kind == OpKind::kSend) {
      seq = q.p2p_seq = send_seq_[peer]++;
    } else if (kind == OpKind::kRecv) {
      seq = q.p2p_seq = recv_seq_[peer]++;
    } else {
      seq = next_seq_++;
    }
    std::ostringstream name;
    name << to_string(kind) << " #" << seq;
    if (kind == OpKind::kSend) name << " to " << rank_label(peer, world_ranks_);
    if (kind == OpKind::kRecv) name << " from " << rank_label(peer, world_ranks_);
    name << " on rank " << rank_ << " of " << size_;
    if (world_ranks_[rank_] != rank_) name << " (world rank " << world_ranks_[rank_] << ")";
    work = std::make_shared<OpWork>(kind, seq, name.str(), std::move(tensors));
    work->reduce_op = op;
    work->peer = peer;
    q.work = work;
    queue_.push_back(std::move(q));
  }
  cv_.notify_one();
  return work;
}

std::shared_ptr<Work> TcpCommunicator::all_gather(at::Tensor out, at::Tensor in) {
  check_tensor("all_gather", "out", out);
  check_tensor("all_gather", "in", in);
  TORCH_CHECK_VALUE(out.scalar_type() == in.scalar_type(), "all_gather: `out` has dtype ",
                    out.scalar_type(), " but `in` has ", in.scalar_type(), "; they must match");
  TORCH_CHECK_VALUE(out.numel() == size_ * in.numel(), "all_gather: out.numel() is ", out.numel(),
                    " but must be size() * in.numel() = ", size_, " * ", in.numel(), " = ",
                    size_ * in.numel());
  const bool in_place = in.numel() > 0 &&
                        static_cast<const char*>(in.data_ptr()) ==
                            static_cast<const char*>(out.data_ptr()) + rank_ * in.numel() * in.element_size();
  TORCH_CHECK_VALUE(in_place || !overlaps(out, in),
                    "all_gather: `in` overlaps `out` but is not out's slice rank() (elements [",
                    rank_ * in.numel(), ", ", (rank_ + 1) * in.numel(),
                    ")); pass separate tensors or exactly that slice");
  return enqueue(OpKind::kAllGather, {out, in}, ReduceOp::kSum, -1);
}

std::shared_ptr<Work> TcpCommunicator::reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op) {
  check_tensor("reduce_scatter", "out", out, true);
  check_tensor("reduce_scatter", "in", in, true);
  TORCH_CHECK_VALUE(out.scalar_type() == in.scalar_type(), "reduce_scatter: `out` has dtype ",
                    out.scalar_type(), " but `in` has ", in.scalar_type(), "; they must match");
  TORCH_CHECK_VALUE(in.numel() == size_ * out.numel(), "reduce_scatter: in.numel() is ", in.numel(),
                    " but must be size() * out.numel() = ", size_, " * ", out.numel(), " = ",
                    size_ * out.numel());
  TORCH_CHECK_VALUE(!overlaps(out, in),
                    "reduce_scatter: `out` overlaps `in`; pass a separate output tensor");
  return enqueue(OpKind::kReduceScatter, {out, in}, op, -1);
}

std::shared_ptr<Work> TcpCommunicator::all_reduce(at::Tensor t, ReduceOp op) {
  check_tensor("all_reduce", "t", t, true);
  return enqueue(OpKind::kAllReduce, {t}, op, -1);
}

std::shared_ptr<Work> TcpCommunicator::broadcast(at::Tensor t, int root) {
  check_tensor("broadcast", "t", t);
  TORCH_CHECK_VALUE(root >= 0 && root < size_, "broadcast: root ", root,
                    " is not a rank of this communicator (size ", size_, ")");
  return enqueue(OpKind::kBroadcast, {t}, ReduceOp::kSum, root);
}

std::shared_ptr<Work> TcpCommunicator::send(at::Tensor t, int dst) {
  check_tensor("send", "t", t);
  check_peer("send", "dst", dst);
  return enqueue(OpKind::kSend, {t}, ReduceOp::kSum, dst);
}

std::shared_ptr<Work> TcpCommunicator::recv(at::Tensor t, int src) {
  check_tensor("recv", "t", t);
  check_peer("recv", "src", src);
  return enqueue(OpKind::kRecv, {t}, ReduceOp::kSum, src);
}

void TcpCommunicator::barrier() { enqueue(OpKind::kBarrier, {}, ReduceOp::kSum, -1)->wait(); }

std::shared_ptr<Communicator> TcpCommunicator::split(const std::vector<int>& ranks) {
  return split_into(ranks, family_, mesh_options_.blame);
}

std::shared_ptr<Communicator> TcpCommunicator::split_new_family(const std::vector<int>& ranks) {
  return split_into(ranks, std::make_shared<Family>(options_.timeout), std::make_shared<std::atomic<int>>(-1));
}

std::shared_ptr<Communicator> TcpCommunicator::split_into(const std::vector<int>& ranks,
                                                          std::shared_ptr<Family> family,
                                                          std::shared_ptr<std::atomic<int>> blame) {
  TORCH_CHECK_VALUE(!ranks.empty(), "split: `ranks` is empty; pass the ranks of the new group");
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK_VALUE(ranks[i] >= 0 && ranks[i] < size_, "split: ranks[", i, "] = ", ranks[i],
                      " is not a rank of this communicator (0..", size_ - 1, ")");
    TORCH_CHECK_VALUE(i == 0 || ranks[i] > ranks[i - 1], "split: ranks ", format_ranks(ranks),
                      " must be strictly ascending (sorted, no duplicates)");
  }
  uint64_t index;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(failure_.empty(), not_run_after(failure_, "split"));
    index = split_count_++;
  }
  // Every rank publishes its list; members compare all of them so a rank
  // that passed a different list is named instead of hanging the group.
  const std::string key = prefix_ + "split/" + std::to_string(index) + "/";
  const std::string mine = format_ranks(ranks);
  store_->set(key + std::to_string(rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
  const bool member = std::find(ranks.begin(), ranks.end(), rank_) != ranks.end();
  if (!member) return nullptr;
  for (int r : ranks) {
    wait_for_keys(*store_, key, {std::to_string(r)}, options_.rendezvous_timeout, "their address",
                  mesh_options_.failed_key);
    auto theirs = store_->get(key + std::to_string(r));
    std::string s(theirs.begin(), theirs.end());
    TORCH_CHECK_VALUE(s == mine, "split #", index, ": ", rank_label(r, world_ranks_), " passed ", s,
                      " but this rank passed ", mine, "; every rank must pass the same list");
  }
  const int new_rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
  std::vector<int> world;
  for (int r : ranks) world.push_back(world_ranks_[r]);
  return std::make_shared<TcpCommunicator>(new_rank, static_cast<int>(ranks.size()), world, store_,
                                            key + "comm/", with_blame(mesh_options_, std::move(blame)), options_,
                                            std::move(family));
}

TcpCommunicator::Meeting TcpCommunicator::meeting_point(const std::string& purpose) {
  uint64_t index;
  {
    std::lock_guard<std::mutex> lock(mu_);
    index = split_count_++;
  }
  return {store_, prefix_ + purpose + "/" + std::to_string(index) + "/", world_ranks_};
}

CommStats TcpCommunicator::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

void TcpCommunicator::record(OpKind kind, const OpStats& s) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.by_kind[kind] += s;
}

void TcpCommunicator::set_failure(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty()) return;
    failure_ = message;
  }
  // Its peers learn now, and the family at the watchdog's next look.
  mesh_->abort(message);
}

void TcpCommunicator::worker_loop() {
  trace::set_thread_name(prefix_.empty() ? "communicator" : "communicator " + prefix_);
  while (true) {
    Queued q;
    std::string failure;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      q = std::move(queue_.front());
      queue_.pop_front();
      failure = failure_;
    }
    OpWork& work = *q.work;
    if (!failure.empty()) {
      work.fail_after(failure);
      continue;
    }
    const auto start = std::chrono::steady_clock::now();
    Exchange ex{*mesh_, rank_, size_, world_ranks_, work, start + options_.timeout,
                options_.timeout, OpStats{}, scratch_, options_.algorithm,
                std::hash<std::string>{}(mesh_options_.host)};
    ex.work.set_progress("running");
    ex.stats.calls = 1;
    bool done = true;
    try {
      switch (work.kind()) {
        case OpKind::kSend:
        case OpKind::kRecv: {
          PostedP2P posted = work.kind() == OpKind::kSend ? post_send(ex, q.work, q.p2p_seq)
                                                          : post_recv(ex, q.work, q.p2p_seq);
          {
            std::lock_guard<std::mutex> lock(reaper_mu_);
            posted_.push_back(std::move(posted));
          }
          reaper_cv_.notify_one();  // the p2p thread may be idle,
          mesh_->signal_event();     // or waiting for the transport
          done = false;  // the p2p thread completes it
          break;
        }
        default:
          run_collective(ex);
      }
    } catch (const std::exception& e) {
      const std::string message = error_message(e);
      set_failure(message);
      work.fail(message);
      done = false;
    }
    ex.stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    record(work.kind(), ex.stats);
    if (trace::enabled()) trace::record(work.name(), "comm", start);
    if (done) work.complete();
  }
}

// Carries every posted send and recv to completion, each on its own: one
// waiting for its peer never holds up another (nor the collectives' thread).
void TcpCommunicator::reaper_loop() {
  std::list<PostedP2P> active;
  while (true) {
    // Read before taking newly posted operations: one posted after this wakes the wait below.
    const uint64_t seen = mesh_->events();
    {
      std::unique_lock<std::mutex> lock(reaper_mu_);
      if (active.empty()) reaper_cv_.wait(lock, [&] { return reaper_stopping_ || !posted_.empty(); });
      while (!posted_.empty()) {
        active.push_back(std::move(posted_.front()));
        posted_.pop_front();
      }
      if (active.empty()) return;  // stopping, and nothing left to finish
    }
    for (auto it = active.begin(); it != active.end();) {
      bool done = false;
      try {
        done = advance(*it, *mesh_, world_ranks_);
        if (done) it->work->complete();
      } catch (const std::exception& e) {
        const std::string message = error_message(e);
        set_failure(message);
        it->work->fail(message);
        done = true;
      }
      it = done ? active.erase(it) : std::next(it);
    }
    // Until the transport moves or more is posted (or a deadline may have passed).
    if (!active.empty()) mesh_->wait_for_events(seen, std::chrono::milliseconds(20));
  }
}

}  // namespace zeroshard::comm
