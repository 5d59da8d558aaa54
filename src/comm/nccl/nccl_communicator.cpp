#include "comm/nccl/nccl_communicator.h"

#include "comm/nccl/issue_thread.h"
#include "comm/store_wait.h"
#include "comm/work.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

namespace zeroshard::comm::nccl {
namespace {

using Clock = std::chrono::steady_clock;

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += std::string(" (") + last + ")";
  return s;
}

ncclDataType_t nccl_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kDouble: return ncclFloat64;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    default: TORCH_CHECK_VALUE(false, "NCCL: dtype ", t, " is not supported; use float32, bfloat16, float16, "
                               "float64, int32 or int64");
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

// One NCCL communicator as the watchdog and the issue thread see it.
struct CommState final : WatchedComm {
  CommState(int device_, int rank_, int size_, TcpCommunicator::Meeting meeting_)
      : device(device_), rank(rank_), size(size_), meeting(std::move(meeting_)) {}

  std::string async_error() override {
    ncclComm_t c = comm.load();
    if (c == nullptr || aborted.load()) return "";
    ncclResult_t r = ncclSuccess;
    if (ncclCommGetAsyncError(c, &r) != ncclSuccess) return "";
    return r == ncclSuccess || r == ncclInProgress ? "" : nccl_error(r, c);
  }

  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (failure.empty()) failure = why;
    }
    if (aborted.exchange(true)) return;
    // Abort is an NCCL call: made by the device's thread, after whatever it is doing (never a blocking wait).
    IssueThread::of(device).post([this, keep = self.lock()] {
      if (ncclComm_t c = comm.exchange(nullptr)) ncclCommAbort(c);
      return true;
    });
  }

  void heartbeat() override {
    const uint64_t n = issued.load();
    const auto now = Clock::now();
    if (n == published || now - published_at < std::chrono::seconds(1)) return;
    publish(n);
    published_at = now;
  }

  void publish(uint64_t n) {
    published = n;
    const std::string v = std::to_string(n);
    try {
      meeting.store->set(meeting.prefix + "progress/" + std::to_string(rank), std::vector<uint8_t>(v.begin(), v.end()));
    } catch (const std::exception&) {  // the store is gone: the job is ending; nothing to name
    }
  }

  // Who never issued collective #seq: every rank's last published count.
  std::string missing_ranks(uint64_t seq) {
    publish(issued.load());
    std::vector<std::optional<uint64_t>> counts(size);
    for (int r = 0; r < size; ++r) {
      const std::string key = meeting.prefix + "progress/" + std::to_string(r);
      try {
        if (!meeting.store->check({key})) continue;
        const auto v = meeting.store->get(key);
        counts[r] = std::stoull(std::string(v.begin(), v.end()));
      } catch (const std::exception&) {
      }
    }
    return describe_missing(seq, counts, meeting.world_ranks);
  }

  std::string failed() {
    std::lock_guard<std::mutex> lock(mu);
    return failure;
  }
  void set_failure(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    if (failure.empty()) failure = why;
  }

  // Waits (on the issue thread) until a non-blocking call on this communicator finished.
  ncclResult_t settle(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    ncclResult_t r = ncclInProgress;
    while (!aborted.load()) {
      ncclComm_t c = comm.load();
      if (c == nullptr) return ncclInvalidUsage;
      if (ncclCommGetAsyncError(c, &r) != ncclSuccess || r != ncclInProgress) return r;
      if (Clock::now() > deadline) return ncclInProgress;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return ncclSystemError;
  }

  const int device, rank, size;
  const TcpCommunicator::Meeting meeting;
  std::weak_ptr<CommState> self;
  std::atomic<ncclComm_t> comm{nullptr};  // written by the issue thread
  cudaStream_t stream = nullptr;           // the communicator's stream (owned)
  std::atomic<bool> aborted{false};
  std::atomic<uint64_t> issued{0};         // operations issued on the host
  uint64_t published = UINT64_MAX;         // used by the watchdog's thread only
  Clock::time_point published_at{};
  std::mutex mu;
  std::string failure;                     // guarded by mu
};

// A communicator, its splits and its channels: one watchdog and its thread.
struct Family {
  explicit Family(std::chrono::milliseconds timeout) : dog(timeout) {
    poller = std::thread([this] {
      std::unique_lock<std::mutex> lock(mu);
      while (!stopping) {
        lock.unlock();
        dog.poll();
        lock.lock();
        cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping; });
      }
    });
  }
  ~Family() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    cv.notify_all();
    poller.join();
  }
  Watchdog dog;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;  // guarded by mu
  std::thread poller;     // owned and joined by this object
};

class NcclWork final : public OpWork, public WatchedOp {
 public:
  NcclWork(OpKind kind, uint64_t seq, std::string name, std::vector<at::Tensor> tensors,
           std::function<std::string()> missing)
      : OpWork(kind, seq, std::move(name), std::move(tensors)), missing_(std::move(missing)) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&end_, cudaEventDisableTiming));
  }
  ~NcclWork() override {
    cudaEventDestroy(ready_);  // released once recorded work completes
    cudaEventDestroy(end_);
  }

  cudaEvent_t ready() const { return ready_; }
  cudaEvent_t end() const { return end_; }
  void mark_issued() {
    {
      std::lock_guard<std::mutex> lock(issue_mu_);
      issued_ = true;
    }
    issue_cv_.notify_all();
  }

  // WatchedOp
  const std::string& name() const override { return OpWork::name(); }
  bool finished_on_device() override { return issued() && cudaEventQuery(end_) == cudaSuccess; }
  void complete() override { OpWork::complete(); }
  void fail(const std::string& message) override {
    OpWork::fail(message);
    issue_cv_.notify_all();
  }
  std::string missing_ranks() override { return missing_ ? missing_() : ""; }

  // Work
  bool is_completed() override {
    if (!OpWork::is_completed() && finished_on_device()) complete();
    return OpWork::is_completed();
  }
  void wait(std::chrono::milliseconds timeout) override {
    const auto start = Clock::now();
    auto pause = std::chrono::microseconds(5);
    while (!is_completed()) {
      if (timeout != kDefaultTimeout && Clock::now() - start >= timeout) return OpWork::wait(timeout);
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
    OpWork::wait(std::chrono::milliseconds(0));  // rethrows a failure
  }
  void block(c10::Stream stream) override {
    {
      std::unique_lock<std::mutex> lock(issue_mu_);
      issue_cv_.wait(lock, [&] { return issued_ || OpWork::is_completed(); });
    }
    if (!issued()) return OpWork::wait(std::chrono::milliseconds(0));  // failed before it was issued
    const c10::cuda::CUDAStream cuda(stream);
    C10_CUDA_CHECK(cudaStreamWaitEvent(cuda.stream(), end_, 0));
  }

 private:
  bool issued() {
    std::lock_guard<std::mutex> lock(issue_mu_);
    return issued_;
  }
  const std::function<std::string()> missing_;
  cudaEvent_t ready_ = nullptr, end_ = nullptr;
  std::mutex issue_mu_;
  std::condition_variable issue_cv_;
  bool issued_ = false;  // guarded by issue_mu_: end_ is recorded
};

using IssueFn = std::function<ncclResult_t(ncclComm_t, cudaStream_t)>;

// A posted operation of a channel, issued once the channel is ready.
struct PendingP2P {
  std::shared_ptr<NcclWork> work;
  IssueFn issue;
};

// One direction between two ranks: a 2-rank NCCL communicator made on first use.
struct Channel {
  std::shared_ptr<CommState> state;
  bool sender = false;
  std::string id_key;
  enum class Phase { kNew, kIniting, kReady } phase = Phase::kNew;  // issue thread only
  std::deque<PendingP2P> pending;                                   // issue thread only
  std::atomic<bool> arrived{false};  // the peer published or fetched the id
};

// Issues `issue` on `state`'s stream after the work's ready event; records its end event.
void issue_on(CommState& state, NcclWork& work, const IssueFn& issue, std::chrono::milliseconds timeout) {
  const std::string failed = state.failed();
  if (!failed.empty()) return work.fail(failed);
  cudaStreamWaitEvent(state.stream, work.ready(), 0);
  ncclResult_t r = issue(state.comm.load(), state.stream);
  if (r == ncclInProgress) r = state.settle(timeout);
  if (r != ncclSuccess) {
    const std::string why = work.name() + ": NCCL refused it: " + nccl_error(r, state.comm.load());
    state.set_failure(why);
    return work.fail(why);
  }
  cudaEventRecord(work.end(), state.stream);
  work.mark_issued();
}

// A high-priority stream of its own on `device` (communication never queues behind compute).
cudaStream_t make_stream(const c10::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  int lo = 0, hi = 0;
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t stream = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, hi));
  return stream;
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

class NcclCommunicator final : public Communicator {
 public:
  // Wraps `comm` (made by the caller on the issue thread; may be null to init from `id`).
  NcclCommunicator(int rank, int size, c10::Device device, TcpCommunicator::Meeting meeting, CommOptions options,
                   std::shared_ptr<Family> family, ncclComm_t comm, const UniqueId* id)
      : rank_(rank), size_(size), device_(device), options_(options), family_(std::move(family)),
        issuer_(IssueThread::of(device.index())) {
    state_ = std::make_shared<CommState>(device.index(), rank, size, std::move(meeting));
    state_->self = state_;
    state_->stream = make_stream(device_);
    if (comm != nullptr) {
      state_->comm = comm;
    } else {
      init_from(*id);
    }
    family_->dog.add(state_);
  }

  ~NcclCommunicator() override {
    std::vector<std::shared_ptr<CommState>> states = {state_};
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [key, ch] : channels_) states.push_back(ch->state);
    }
    for (auto& s : states) family_->dog.forget(s.get());
    const auto timeout = options_.timeout;
    issuer_.run([&] {
      for (auto& s : states) {
        if (ncclComm_t c = s->comm.exchange(nullptr)) {
          bool clean = s->failed().empty() && !s->aborted.load();
          if (clean) {
            s->comm = c;
            clean = ncclCommFinalize(c) != ncclSystemError && s->settle(timeout) == ncclSuccess;
            s->comm = nullptr;
          }
          if (clean) {
            ncclCommDestroy(c);
          } else {
            ncclCommAbort(c);
          }
        }
        if (s->stream != nullptr) cudaStreamDestroy(s->stream);
        s->stream = nullptr;
      }
    });
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  c10::Device device() const override { return device_; }

  std::shared_ptr<Work> all_gather(at::Tensor out, at::Tensor in) override {
    check("all_gather", "in", in);
    check("all_gather", "out", out);
    TORCH_CHECK_VALUE(out.numel() == in.numel() * size_ && out.scalar_type() == in.scalar_type(),
                      "all_gather: out has ", out.numel(), " ", out.scalar_type(), " elements, in ", in.numel(), " ",
                      in.scalar_type(), "; out must hold size() = ", size_, " times in, of the same dtype");
    const int64_t bytes = in.numel() * in.element_size() * (size_ - 1);
    return collective(OpKind::kAllGather, {out, in}, bytes, bytes, [=](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), nccl_dtype(in.scalar_type()), c, s);
    });
  }

  std::shared_ptr<Work> reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op) override {
    check("reduce_scatter", "in", in);
    check("reduce_scatter", "out", out);
    TORCH_CHECK_VALUE(in.numel() == out.numel() * size_ && out.scalar_type() == in.scalar_type(),
                      "reduce_scatter: in has ", in.numel(), " ", in.scalar_type(), " elements, out ", out.numel(),
                      " ", out.scalar_type(), "; in must hold size() = ", size_, " times out, of the same dtype");
    const int64_t bytes = out.numel() * out.element_size() * (size_ - 1);
    return collective(OpKind::kReduceScatter, {out, in}, bytes, bytes, [=](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_dtype(in.scalar_type()), nccl_op(op),
                               c, s);
    });
  }

  std::shared_ptr<Work> all_reduce(at::Tensor t, ReduceOp op) override {
    check("all_reduce", "t", t);
    const int64_t bytes = size_ == 1 ? 0 : 2 * (size_ - 1) * t.numel() * t.element_size() / size_;
    return collective(OpKind::kAllReduce, {t}, bytes, bytes, [=](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_dtype(t.scalar_type()), nccl_op(op), c, s);
    });
  }

  std::shared_ptr<Work> broadcast(at::Tensor t, int root) override {
    check("broadcast", "t", t);
    TORCH_CHECK_VALUE(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of this communicator (0..",
                      size_ - 1, ")");
    const int64_t b = t.numel() * t.element_size();
    return collective(OpKind::kBroadcast, {t}, rank_ == root ? b * (size_ - 1) : 0, rank_ == root ? 0 : b,
                      [=](ncclComm_t c, cudaStream_t s) {
                        return ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_dtype(t.scalar_type()), root,
                                             c, s);
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
    ncclUniqueId nid;
    static_assert(sizeof(nid.internal) == sizeof(UniqueId), "ncclUniqueId is 128 bytes");
    std::memcpy(nid.internal, id.data(), id.size());
    const auto timeout = options_.rendezvous_timeout;
    issuer_.run([&] {
      ncclComm_t comm = nullptr;
      ncclConfig_t config = nonblocking_config();
      ncclResult_t r = ncclCommInitRankConfig(&comm, size_, nid, rank_, &config);
      state_->comm = comm;
      if (r == ncclInProgress || r == ncclSuccess) r = state_->settle(timeout);
      if (r != ncclSuccess) {
        state_->comm = nullptr;
        if (comm != nullptr) ncclCommAbort(comm);
        TORCH_CHECK(false, "NCCL communicator (rank ", rank_, " of ", size_, ", ", device_, ") was not created: ",
                    r == ncclInProgress ? "not every rank joined within " + std::to_string(timeout.count()) +
                                              " ms; check that every rank creates it"
                                        : nccl_error(r, nullptr));
      }
    });
  }

  void check(const char* op, const char* arg, const at::Tensor& t) const {
    TORCH_CHECK_VALUE(t.defined(), op, ": `", arg, "` is an undefined tensor; pass an allocated tensor");
    TORCH_CHECK_VALUE(t.device() == device_, op, ": `", arg, "` is on ", t.device(), " but this NCCL communicator's ",
                      "device is ", device_, "; move the tensor there (or use the CPU communicator for host values)");
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": `", arg, "` (sizes ", t.sizes(), ", strides ", t.strides(),
                      ") is not contiguous; pass t.contiguous()");
    nccl_dtype(t.scalar_type());
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
  std::shared_ptr<NcclWork> make_work(OpKind kind, uint64_t seq, std::vector<at::Tensor> tensors,
                                      std::function<std::string()> missing) {
    const std::string failed = state_->failed();
    TORCH_CHECK(failed.empty(), label(kind, seq), ": this communicator failed earlier: ", failed);
    auto work = std::make_shared<NcclWork>(kind, seq, label(kind, seq), std::move(tensors), std::move(missing));
    C10_CUDA_CHECK(cudaEventRecord(work->ready(), c10::cuda::getCurrentCUDAStream(device_.index()).stream()));
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
    issuer_.post([state = state_, work, issue = std::move(issue), timeout = options_.timeout] {
      issue_on(*state, *work, issue, timeout);
      return true;
    });
    record(kind, sent, received);
    return work;
  }

  std::shared_ptr<Channel> channel(bool sender, int peer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& ch = channels_[{sender, peer}];
    if (!ch) {
      ch = std::make_shared<Channel>();
      const int src = sender ? rank_ : peer, dst = sender ? peer : rank_;
      ch->sender = sender;
      ch->id_key = state_->meeting.prefix + "p2p/" + std::to_string(src) + "-" + std::to_string(dst);
      ch->state = std::make_shared<CommState>(device_.index(), sender ? 0 : 1, 2,
                                              TcpCommunicator::Meeting{state_->meeting.store, ch->id_key + "/",
                                                                       {state_->meeting.world_ranks[src],
                                                                        state_->meeting.world_ranks[dst]}});
      ch->state->self = ch->state;
      ch->state->stream = make_stream(device_);
      family_->dog.add(ch->state);
    }
    return ch;
  }

  // Runs on the issue thread: makes the channel's communicator, then issues what is pending.
  static bool advance(Channel& ch, std::chrono::milliseconds timeout) {
    auto fail_all = [&](const std::string& why) {
      ch.state->set_failure(why);
      for (auto& p : ch.pending) p.work->fail(why);
      ch.pending.clear();
      return true;
    };
    const std::string failed = ch.state->failed();
    if (!failed.empty()) return fail_all(failed);
    auto& store = *ch.state->meeting.store;
    if (ch.phase == Channel::Phase::kNew) {
      ncclUniqueId nid;
      if (ch.sender) {
        ncclResult_t r = ncclGetUniqueId(&nid);
        if (r != ncclSuccess) return fail_all("ncclGetUniqueId: " + nccl_error(r, nullptr));
        store.set(ch.id_key, std::vector<uint8_t>(nid.internal, nid.internal + sizeof nid.internal));
      } else {
        if (!store.check({ch.id_key})) return false;  // the sender has not arrived: look again later
        const auto bytes = store.get(ch.id_key);
        std::memcpy(nid.internal, bytes.data(), std::min(bytes.size(), sizeof nid.internal));
      }
      ch.arrived = !ch.sender;
      ncclComm_t comm = nullptr;
      ncclConfig_t config = nonblocking_config();
      ncclResult_t r = ncclCommInitRankConfig(&comm, 2, nid, ch.sender ? 0 : 1, &config);
      ch.state->comm = comm;
      if (r != ncclSuccess && r != ncclInProgress) return fail_all("creating the channel: " + nccl_error(r, nullptr));
      ch.phase = Channel::Phase::kIniting;
    }
    if (ch.phase == Channel::Phase::kIniting) {
      ncclResult_t r = ncclSuccess;
      ncclCommGetAsyncError(ch.state->comm.load(), &r);
      if (r == ncclInProgress) return false;  // the peer is joining
      if (r != ncclSuccess) return fail_all("creating the channel: " + nccl_error(r, ch.state->comm.load()));
      ch.arrived = true;
      ch.phase = Channel::Phase::kReady;
    }
    while (!ch.pending.empty()) {
      PendingP2P p = std::move(ch.pending.front());
      ch.pending.pop_front();
      issue_on(*ch.state, *p.work, p.issue, timeout);
    }
    return true;
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
    IssueFn issue = [=](ncclComm_t c, cudaStream_t s) {
      return sender ? ncclSend(t.data_ptr(), t.numel(), nccl_dtype(t.scalar_type()), channel_peer, c, s)
                    : ncclRecv(t.data_ptr(), t.numel(), nccl_dtype(t.scalar_type()), channel_peer, c, s);
    };
    issuer_.post([ch, work, issue = std::move(issue), timeout = options_.timeout] {
      if (work) ch->pending.push_back({work, issue});
      return advance(*ch, timeout);
    });
    const int64_t b = t.numel() * t.element_size();
    record(kind, sender ? b : 0, sender ? 0 : b);
    return work;
  }

  const int rank_, size_;
  const c10::Device device_;
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
  ncclComm_t child = nullptr;
  const auto timeout = options_.rendezvous_timeout;
  issuer_.run([&] {
    ncclConfig_t config = nonblocking_config();
    ncclResult_t r = ncclCommSplit(state_->comm.load(), member ? 0 : NCCL_SPLIT_NOCOLOR, rank_, &child, &config);
    if (r == ncclSuccess || r == ncclInProgress) r = state_->settle(timeout);
    if (r == ncclSuccess && child != nullptr) {
      ncclResult_t c = ncclInProgress;
      const auto deadline = Clock::now() + timeout;
      while (ncclCommGetAsyncError(child, &c) == ncclSuccess && c == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      r = c;
    }
    TORCH_CHECK(r == ncclSuccess, "split #", index, " (ncclCommSplit) failed on rank ", rank_, ": ",
                r == ncclInProgress ? "not every rank joined within " + std::to_string(timeout.count()) + " ms"
                                    : nccl_error(r, state_->comm.load()));
  });
  if (!member) return nullptr;
  std::vector<int> world;
  for (int r : ranks) world.push_back(m.world_ranks[r]);
  const int new_rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
  return std::make_shared<NcclCommunicator>(new_rank, static_cast<int>(ranks.size()), device_,
                                            TcpCommunicator::Meeting{m.store, key + "comm/", world}, options_,
                                            family_, child, nullptr);
}

}  // namespace

UniqueId exchange_unique_id(c10d::Store& store, const std::string& key, int rank, std::chrono::milliseconds timeout,
                            const std::function<UniqueId()>& make_id) {
  UniqueId id{};
  if (rank == 0) {
    if (make_id) {
      id = make_id();
    } else {
      ncclUniqueId nid;
      const ncclResult_t r = ncclGetUniqueId(&nid);
      TORCH_CHECK(r == ncclSuccess, "ncclGetUniqueId failed: ", nccl_error(r, nullptr));
      std::memcpy(id.data(), nid.internal, id.size());
    }
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

std::shared_ptr<Communicator> make_nccl_communicator(TcpCommunicator& cpu, c10::Device device,
                                                     const CommOptions& options) {
  TORCH_CHECK_VALUE(device.is_cuda() && device.has_index(), "init_nccl: device ", device,
                    " is not a CUDA device with an index; pass c10::Device(c10::kCUDA, local_rank)");
  auto meeting = cpu.meeting_point("nccl");
  const UniqueId id = exchange_unique_id(*meeting.store, meeting.prefix + "id", cpu.rank(), options.rendezvous_timeout);
  auto family = std::make_shared<Family>(options.timeout);
  return std::make_shared<NcclCommunicator>(cpu.rank(), cpu.size(), device, std::move(meeting), options,
                                            std::move(family), nullptr, &id);
}

}  // namespace zeroshard::comm::nccl

namespace zeroshard {

ProcessGroup init_nccl(std::shared_ptr<Communicator> cpu, c10::Device device, const CommOptions& options) {
  auto* tcp = dynamic_cast<comm::TcpCommunicator*>(cpu.get());
  TORCH_CHECK_VALUE(tcp != nullptr, "init_nccl: `cpu` must be a communicator made by init_communicator (or a split "
                    "or dup of one): the NCCL unique id travels through its rendezvous store");
  return ProcessGroup{comm::nccl::make_nccl_communicator(*tcp, device, options), std::move(cpu)};
}

}  // namespace zeroshard
