#include "comm/nccl/nccl_communicator.h"

#include "comm/nccl/comm_state.h"
#include "comm/store_wait.h"
#include "comm/work.h"
#include "zeroshard/log.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <future>
#include <map>
#include <set>

namespace zeroshard::comm::nccl {
namespace {

void check_dtype(at::ScalarType t) {
  TORCH_CHECK_VALUE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble || t == at::kInt ||
                        t == at::kLong,
                    "NCCL: dtype ", t, " is not supported; use float32, bfloat16, float16, float64, int32 or int64");
}

class NcclCommunicator final : public Communicator {
 public:
  // Wraps `comm` (made by the caller on the issue thread; null: joins the communicator of `id`).
  NcclCommunicator(NcclApi& api, int rank, int size, c10::Device device, int device_index,
                   TcpCommunicator::Meeting meeting, CommOptions options, std::shared_ptr<Family> family,
                   CommHandle comm, const UniqueId* id)
      : api_(api), rank_(rank), size_(size), device_(device), index_(device_index), options_(options),
        family_(std::move(family)), issuer_(IssueThread::of(api, device_index)) {
    state_ = std::make_shared<CommState>(api_, issuer_, index_, rank, size, std::move(meeting));
    if (comm != nullptr) {
      issuer_.run([&] { state_->comm = comm; });
    } else {
      init_from(*id);
    }
    family_->dog.add(state_);
  }

  // Flushes and destroys every NCCL communicator of this one (its channels
  // too) on the issue thread; the operations still in flight keep their
  // tensors until that is done, then complete, or fail if they never finished.
  ~NcclCommunicator() override {
    std::vector<std::pair<std::shared_ptr<CommState>, std::function<bool()>>> states;
    states.emplace_back(state_, [s = state_] { return s->pump(); });
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [key, ch] : channels_) states.emplace_back(ch->state, [ch = ch] { return ch->pump(); });
    }
    std::vector<std::shared_ptr<WatchedOp>> in_flight;
    for (auto& [s, pump] : states) {
      auto ops = family_->dog.forget(s.get());
      in_flight.insert(in_flight.end(), ops.begin(), ops.end());
    }
    // One task closes them in turn, each within the timeout. It says "not yet" while a flush is under
    // way, so other communicators' launches on this device go on meanwhile.
    auto closed = std::make_shared<std::promise<bool>>();
    auto result = closed->get_future();
    issuer_.post([states, closed, timeout = options_.timeout, next = size_t{0}, all_clean = true,
                  deadline = Clock::time_point{}]() mutable {
      try {
        for (; next < states.size(); ++next, deadline = Clock::time_point{}) {
          if (deadline == Clock::time_point{}) deadline = Clock::now() + timeout;
          bool clean = false;
          if (!states[next].first->close_step(deadline, states[next].second, clean)) return false;
          all_clean = clean && all_clean;
        }
        closed->set_value(all_clean);
      } catch (...) {
        closed->set_exception(std::current_exception());
      }
      return true;
    });
    bool clean = false;
    try {
      clean = result.get();
    } catch (const std::exception& e) {
      log_error(std::string("NCCL communicator: closing it failed: ") + error_message(e));
    }
    for (auto& op : in_flight) {
      if (clean && op->finished_on_device()) {
        op->complete();
      } else {
        op->fail(op->name() + ": the communicator was destroyed (aborted) before it finished");
      }
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  c10::Device device() const override { return device_; }
  // The family's watchdog aborts every NCCL communicator of the family (ncclCommAbort
  // on the issue thread) and fails their work in flight.
  void abort(const std::string& why) override { family_->dog.fail(why); }

  std::shared_ptr<Work> all_gather(at::Tensor out, at::Tensor in) override {
    check("all_gather", "in", in);
    check("all_gather", "out", out);
    TORCH_CHECK_VALUE(out.numel() == in.numel() * size_ && out.scalar_type() == in.scalar_type(),
                      "all_gather: out has ", out.numel(), " ", out.scalar_type(), " elements, in ", in.numel(), " ",
                      in.scalar_type(), "; out must hold size() = ", size_, " times in, of the same dtype");
    const int64_t bytes = in.numel() * in.element_size() * (size_ - 1);
    NcclApi& api = api_;
    return collective(OpKind::kAllGather, {out, in}, bytes, bytes, [=, &api](CommHandle c, StreamHandle s) {
      return api.all_gather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()), in.scalar_type(), c, s);
    });
  }

  std::shared_ptr<Work> reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op) override {
    check("reduce_scatter", "in", in);
    check("reduce_scatter", "out", out);
    TORCH_CHECK_VALUE(in.numel() == out.numel() * size_ && out.scalar_type() == in.scalar_type(),
                      "reduce_scatter: in has ", in.numel(), " ", in.scalar_type(), " elements, out ", out.numel(),
                      " ", out.scalar_type(), "; in must hold size() = ", size_, " times out, of the same dtype");
    const int64_t bytes = out.numel() * out.element_size() * (size_ - 1);
    NcclApi& api = api_;
    return collective(OpKind::kReduceScatter, {out, in}, bytes, bytes, [=, &api](CommHandle c, StreamHandle s) {
      return api.reduce_scatter(in.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()), in.scalar_type(), op,
                                c, s);
    });
  }

  std::shared_ptr<Work> all_reduce(at::Tensor t, ReduceOp op) override {
    check("all_reduce", "t", t);
    const int64_t bytes = size_ == 1 ? 0 : 2 * (size_ - 1) * t.numel() * t.element_size() / size_;
    NcclApi& api = api_;
    return collective(OpKind::kAllReduce, {t}, bytes, bytes, [=, &api](CommHandle c, StreamHandle s) {
      return api.all_reduce(t.data_ptr(), static_cast<size_t>(t.numel()), t.scalar_type(), op, c, s);
    });
  }

  std::shared_ptr<Work> broadcast(at::Tensor t, int root) override {
    check("broadcast", "t", t);
    TORCH_CHECK_VALUE(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of this communicator (0..",
                      size_ - 1, ")");
    const int64_t b = t.numel() * t.element_size();
    NcclApi& api = api_;
    return collective(OpKind::kBroadcast, {t}, rank_ == root ? b * (size_ - 1) : 0, rank_ == root ? 0 : b,
                      [=, &api](CommHandle c, StreamHandle s) {
                        return api.broadcast(t.data_ptr(), static_cast<size_t>(t.numel()), t.scalar_type(), root, c, s);
                      });
  }

  std::shared_ptr<Work> send(at::Tensor t, int dst) override {
    check("send", "t", t);
    check_peer("send", "dst", dst);
    return p2p(OpKind::kSend, t, dst);
  }
  std::shared_ptr<Work> recv(at::Tensor t, int src) override {
    check("recv", "t", t);
    check_peer("recv", "src", src);
    return p2p(OpKind::kRecv, t, src);
  }

  void barrier() override {
    auto one = at::ones({1}, at::TensorOptions().device(device_));
    all_reduce(one, ReduceOp::kSum)->wait();
  }

  std::shared_ptr<Communicator> split(const std::vector<int>& ranks) override;

  CommStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  void init_from(const UniqueId& id) {
    const auto timeout = options_.rendezvous_timeout;
    issuer_.run([&] {
      CommHandle comm = nullptr;
      Status s = api_.init_rank(&comm, size_, id, rank_, index_);
      state_->comm = comm;
      if (s.code == Status::kInProgress || (s.is_ok() && comm != nullptr)) s = state_->settle(timeout);
      if (!s.is_ok()) {
        if (comm != nullptr) api_.abort(comm);
        state_->comm = nullptr;
        TORCH_CHECK(false, "NCCL communicator (rank ", rank_, " of ", size_, ", ", device_, ") was not created: ",
                    s.code == Status::kInProgress ? "not every rank joined within " + std::to_string(timeout.count()) +
                                                        " ms; check that every rank creates it"
                                                  : s.what);
      }
    });
  }

  void check(const char* op, const char* arg, const at::Tensor& t) const {
    TORCH_CHECK_VALUE(t.defined(), op, ": `", arg, "` is an undefined tensor; pass an allocated tensor");
    TORCH_CHECK_VALUE(t.device() == device_, op, ": `", arg, "` is on ", t.device(), " but this NCCL communicator's ",
                      "device is ", device_, "; move the tensor there (or use the CPU communicator for host values)");
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": `", arg, "` (sizes ", t.sizes(), ", strides ", t.strides(),
                      ") is not contiguous; pass t.contiguous()");
    check_dtype(t.scalar_type());
  }
  void check_peer(const char* op, const char* arg, int peer) const {
    TORCH_CHECK_VALUE(peer >= 0 && peer < size_ && peer != rank_, op, ": ", arg, " ", peer,
                      " must be another rank of this communicator (0..", size_ - 1, ", not this rank ", rank_, ")");
  }
  std::string label(OpKind kind, uint64_t seq) const {
    return to_string(kind) + " #" + std::to_string(seq) + " on rank " + std::to_string(rank_) + " of " +
           std::to_string(size_) + " (NCCL, " + device_.str() + ")";
  }
  void record(OpKind kind, int64_t sent, int64_t received) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = stats_.by_kind[kind];
    ++s.calls;
    s.bytes_sent += sent;
    s.bytes_received += received;
  }
  // A new operation's work, its ready event recorded on the caller's current stream.
  std::shared_ptr<NcclWork> make_work(OpKind kind, uint64_t seq, std::vector<at::Tensor> tensors,
                                      std::function<std::string()> missing) {
    const std::string failed = state_->failed();
    TORCH_CHECK(failed.empty(), not_run_after(failed, label(kind, seq)));
    auto work = std::make_shared<NcclWork>(api_, index_, kind, seq, label(kind, seq), std::move(tensors),
                                           std::move(missing));
    const Status s = api_.record(work->ready(), api_.current_stream(index_), index_);
    TORCH_CHECK(s.is_ok(), label(kind, seq), ": cannot record where its inputs are ready: ", s.what);
    return work;
  }

  std::shared_ptr<Work> collective(OpKind kind, std::vector<at::Tensor> tensors, int64_t sent, int64_t received,
                                   IssueFn issue) {
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seq = next_seq_++;
    }
    std::weak_ptr<CommState> weak = state_;
    auto work = make_work(kind, seq, std::move(tensors), [weak, seq] {
      auto s = weak.lock();
      return s ? s->missing_ranks(seq) : std::string();
    });
    state_->issued.fetch_add(1);
    family_->dog.watch(state_.get(), work);
    post_op(state_, PendingOp{work, std::move(issue)}, [s = state_] { return s->pump(); });
    record(kind, sent, received);
    return work;
  }

  std::shared_ptr<Channel> channel(bool sender, int peer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& ch = channels_[{sender, peer}];
    if (!ch) {
      ch = std::make_shared<Channel>();
      const int src = sender ? rank_ : peer, dst = sender ? peer : rank_;
      const auto& m = state_->meeting;
      ch->sender = sender;
      ch->id_key = m.prefix + "p2p/" + std::to_string(src) + "-" + std::to_string(dst);
      ch->state = std::make_shared<CommState>(
          api_, issuer_, index_, sender ? 0 : 1, 2,
          TcpCommunicator::Meeting{m.store, ch->id_key + "/", {m.world_ranks[src], m.world_ranks[dst]}});
      family_->dog.add(ch->state);
    }
    return ch;
  }

  std::shared_ptr<Work> p2p(OpKind kind, at::Tensor t, int peer) {
    const bool sender = kind == OpKind::kSend;
    auto ch = channel(sender, peer);
    const uint64_t seq = ch->state->issued.fetch_add(1);
    const int peer_world = state_->meeting.world_ranks[peer];
    std::weak_ptr<Channel> weak = ch;
    auto work = make_work(kind, seq, {t}, [weak, peer_world, sender] {
      auto c = weak.lock();
      if (c && c->arrived.load()) return std::string();
      return "rank " + std::to_string(peer_world) + " never posted the matching " + (sender ? "recv" : "send");
    });
    family_->dog.watch(ch->state.get(), work);
    const int channel_peer = sender ? 1 : 0;
    NcclApi& api = api_;
    IssueFn issue = [=, &api](CommHandle c, StreamHandle s) {
      const auto n = static_cast<size_t>(t.numel());
      return sender ? api.send(t.data_ptr(), n, t.scalar_type(), channel_peer, c, s)
                    : api.recv(t.data_ptr(), n, t.scalar_type(), channel_peer, c, s);
    };
    post_op(ch->state, PendingOp{work, std::move(issue)}, [ch] { return ch->pump(); });
    const int64_t b = t.numel() * t.element_size();
    record(kind, sender ? b : 0, sender ? 0 : b);
    return work;
  }

  NcclApi& api_;
  const int rank_, size_;
  const c10::Device device_;
  const int index_;  // the device as api_ numbers it
  const CommOptions options_;
  const std::shared_ptr<Family> family_;
  IssueThread& issuer_;
  std::shared_ptr<CommState> state_;
  mutable std::mutex mu_;
  uint64_t next_seq_ = 0;                                          // guarded by mu_
  uint64_t split_count_ = 0;                                       // guarded by mu_
  std::map<std::pair<bool, int>, std::shared_ptr<Channel>> channels_;  // guarded by mu_
  CommStats stats_;                                                // guarded by mu_
};

std::shared_ptr<Communicator> NcclCommunicator::split(const std::vector<int>& ranks) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK_VALUE(ranks[i] >= 0 && ranks[i] < size_ && (i == 0 || ranks[i] > ranks[i - 1]), "split: ranks[", i,
                      "] = ", ranks[i], " must be a rank of this communicator (0..", size_ - 1,
                      "), the list strictly ascending");
  }
  uint64_t index;
  {
    std::lock_guard<std::mutex> lock(mu_);
    index = split_count_++;
  }
  // Every rank publishes its list; members compare them (a different list is named, not a hang).
  const auto& m = state_->meeting;
  const std::string key = m.prefix + "split/" + std::to_string(index) + "/";
  std::string mine;
  for (int r : ranks) mine += std::to_string(r) + ",";
  m.store->set(key + std::to_string(rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
  const bool member = std::find(ranks.begin(), ranks.end(), rank_) != ranks.end();
  if (member) {
    for (int r : ranks) {
      wait_for_keys(*m.store, key, {std::to_string(r)}, options_.rendezvous_timeout, "their split list");
      const auto theirs = m.store->get(key + std::to_string(r));
      TORCH_CHECK_VALUE(std::string(theirs.begin(), theirs.end()) == mine, "split #", index, ": rank ",
                        m.world_ranks[r], " passed [", std::string(theirs.begin(), theirs.end()),
                        "] but this rank passed [", mine, "]; every rank must pass the same list");
    }
  }
  CommHandle child = nullptr;
  // NCCL writes the child's handle through this pointer from its own thread when the split
  // completes, after ncclCommSplit returned "in progress": the slot must outlive the call.
  auto slot = std::make_unique<CommHandle>(nullptr);
  const auto timeout = options_.rendezvous_timeout;
  issuer_.run([&] {
    // The parent's queue first: ncclCommSplit is a call on it, after what was issued before.
    const auto deadline = Clock::now() + timeout;
    while (!state_->pump() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::microseconds(50));
    TORCH_CHECK(state_->comm != nullptr,
                not_run_after(state_->failed(), "split #" + std::to_string(index) + " on rank " + std::to_string(rank_)));
    Status s = api_.split(state_->comm, member, rank_, slot.get());
    if (s.code == Status::kInProgress || s.is_ok()) s = state_->settle(timeout);
    if (s.code != Status::kInProgress) child = __atomic_load_n(slot.get(), __ATOMIC_ACQUIRE);
    TORCH_CHECK(!s.is_ok() || !member || child != nullptr, "split #", index, " on rank ", rank_,
                ": ncclCommSplit completed without a communicator for this member");
    if (s.is_ok() && child != nullptr) {
      do {
        s = api_.async_error(child);
        if (s.code != Status::kInProgress) break;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } while (Clock::now() < deadline);
    }
    if (!s.is_ok()) {
      const std::string why = "split #" + std::to_string(index) + " (ncclCommSplit) failed on rank " +
                              std::to_string(rank_) + ": " +
                              (s.code == Status::kInProgress
                                   ? "not every rank joined within " + std::to_string(timeout.count()) + " ms"
                                   : s.what);
      if (child != nullptr) api_.abort(child);
      child = nullptr;
      slot.release();  // a split that did not end may still write to it: leaked, 8 bytes
      state_->abort_now(why);  // a split that never ended leaves the parent mid-call
      TORCH_CHECK(false, why);
    }
  });
  if (!member) return nullptr;
  std::vector<int> world;
  for (int r : ranks) world.push_back(m.world_ranks[r]);
  const int new_rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
  return std::make_shared<NcclCommunicator>(api_, new_rank, static_cast<int>(ranks.size()), device_, index_,
                                            TcpCommunicator::Meeting{m.store, key + "comm/", world}, options_,
                                            family_, child, nullptr);
}

}  // namespace

std::string version_string(int code) {
  // NCCL_VERSION_CODE is major*10000 + minor*100 + patch since 2.9 (major*1000 + minor*100 + patch before).
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code / 100 % 100 : code / 100 % 10;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

std::string version_mismatch(int runtime_version, int header_version) {
  const std::string runtime = version_string(runtime_version), headers = version_string(header_version);
  const auto major_minor = [](const std::string& v) { return v.substr(0, v.rfind('.')); };
  if (major_minor(runtime) == major_minor(headers)) return "";
  return "NCCL " + runtime + " is loaded, but zeroshard was compiled against NCCL " + headers +
         "'s headers: another libnccl.so.2 (LD_LIBRARY_PATH, /usr/local/cuda/lib64) shadows the one beside "
         "LibTorch. Make the loaded library the one built against (ZS_NCCL_ROOT), or expect NCCL's behaviour "
         "of " + runtime;
}

UniqueId exchange_unique_id(c10d::Store& store, const std::string& key, int rank, std::chrono::milliseconds timeout,
                            const std::function<UniqueId()>& make_id) {
  UniqueId id{};
  if (rank == 0) {
    id = make_id();
    store.set(key + "/0", std::vector<uint8_t>(id.begin(), id.end()));
    return id;
  }
  wait_for_keys(store, key + "/", {"0"}, timeout, "the NCCL unique id");
  const auto bytes = store.get(key + "/0");
  TORCH_CHECK(bytes.size() == id.size(), "the NCCL unique id under '", key, "' has ", bytes.size(),
              " bytes, not ", id.size());
  std::copy(bytes.begin(), bytes.end(), id.begin());
  return id;
}

std::shared_ptr<Communicator> make_nccl_communicator(NcclApi& api, TcpCommunicator& cpu, c10::Device device,
                                                     int device_index, const CommOptions& options) {
  {
    static std::mutex mu;
    static std::set<NcclApi*> logged;
    std::lock_guard<std::mutex> lock(mu);
    if (logged.insert(&api).second) {
      const int runtime = api.runtime_version(), headers = api.header_version();
      const std::string mismatch = version_mismatch(runtime, headers);
      if (mismatch.empty()) {
        log_info("NCCL " + version_string(runtime) + " (compiled against " + version_string(headers) + ")");
      } else {
        log_warn(mismatch);
      }
    }
  }
  auto meeting = cpu.meeting_point("nccl");
  const UniqueId id = exchange_unique_id(*meeting.store, meeting.prefix + "id", cpu.rank(), options.rendezvous_timeout,
                                         [&api] {
                                           UniqueId made{};
                                           const Status s = api.unique_id(&made);
                                           TORCH_CHECK(s.is_ok(), "ncclGetUniqueId failed: ", s.what);
                                           return made;
                                         });
  auto family = std::make_shared<Family>(options.timeout);
  return std::make_shared<NcclCommunicator>(api, cpu.rank(), cpu.size(), device, device_index, std::move(meeting),
                                            options, std::move(family), nullptr, &id);
}

}  // namespace zeroshard::comm::nccl
