#include "comm/nccl/comm_state.h"
#include "zeroshard/log.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard::comm::nccl {

// --- NcclWork

NcclWork::NcclWork(NcclApi& api, int device, OpKind kind, uint64_t seq, std::string name,
                   std::vector<at::Tensor> tensors, std::function<std::string()> missing)
    : OpWork(kind, seq, std::move(name), std::move(tensors)), api_(api), device_(device), missing_(std::move(missing)) {
  ready_ = api_.create_event(device_);
  try {
    end_ = api_.create_event(device_);
  } catch (...) {
    api_.destroy_event(ready_, device_);
    throw;
  }
}

NcclWork::~NcclWork() {
  api_.destroy_event(ready_, device_);
  api_.destroy_event(end_, device_);
}

void NcclWork::mark_issued() {
  {
    std::lock_guard<std::mutex> lock(issue_mu_);
    issued_ = true;
  }
  issue_cv_.notify_all();
}

bool NcclWork::finished_on_device() {
  {
    std::lock_guard<std::mutex> lock(issue_mu_);
    if (!issued_) return false;
    if (!device_error_.empty()) return true;
  }
  const Status s = api_.query(end_, device_);
  if (s.code == Status::kInProgress) return false;
  if (s.code == Status::kError) {
    std::lock_guard<std::mutex> lock(issue_mu_);
    device_error_ = s.what;
  }
  return true;
}

void NcclWork::complete() {
  std::lock_guard<std::mutex> lock(complete_mu_);
  if (!doomed_) complete_locked();
}

void NcclWork::complete_locked() {
  std::string error;
  {
    std::lock_guard<std::mutex> lock(issue_mu_);
    error = device_error_;
  }
  if (error.empty()) return OpWork::complete();
  fail("the device reported an error: " + error);
}

void NcclWork::doom() {
  std::lock_guard<std::mutex> lock(complete_mu_);
  doomed_ = true;
}

void NcclWork::fail(const std::string& message) {
  OpWork::fail(message);
  {
    // Under the mutex block() waits with: a waiter between its check and its
    // wait cannot miss this.
    std::lock_guard<std::mutex> lock(issue_mu_);
    failed_ = true;
  }
  issue_cv_.notify_all();
}

bool NcclWork::is_completed() {
  if (!OpWork::is_completed()) {
    std::lock_guard<std::mutex> lock(complete_mu_);
    if (!doomed_ && finished_on_device()) complete_locked();
  }
  return OpWork::is_completed();
}

void NcclWork::wait(std::chrono::milliseconds timeout) {
  const auto start = Clock::now();
  auto pause = std::chrono::microseconds(5);
  while (!is_completed()) {
    if (timeout != kDefaultTimeout && Clock::now() - start >= timeout) return OpWork::wait(timeout);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  OpWork::wait(std::chrono::milliseconds(0));  // rethrows a failure
}

void NcclWork::block(c10::Stream stream) {
  {
    std::unique_lock<std::mutex> lock(issue_mu_);
    issue_cv_.wait(lock, [&] { return issued_ || failed_; });
  }
  if (OpWork::is_completed()) return OpWork::wait(std::chrono::milliseconds(0));  // done, or rethrows its failure
  const Status s = api_.wait_event(api_.stream_of(stream, device_), end_, device_);
  TORCH_CHECK(s.is_ok(), name(), ": cannot make the stream wait for it: ", s.what);
}

// --- CommState

CommState::CommState(NcclApi& api_, IssueThread& issuer_, int device_, int rank_, int size_,
                     TcpCommunicator::Meeting meeting_)
    : api(api_), issuer(issuer_), device(device_), rank(rank_), size(size_), meeting(std::move(meeting_)) {
  stream = api.create_stream(device);
}

CommState::~CommState() {
  if (stream != nullptr) api.destroy_stream(stream, device);
}

std::string CommState::async_error() {
  if (!probing_.exchange(true)) {
    issuer.post([weak = weak_from_this()] {
      if (auto s = weak.lock()) s->probe();
      return true;
    });
  }
  std::lock_guard<std::mutex> lock(mu_);
  return async_failure_;
}

void CommState::probe() {
  probing_ = false;
  if (comm == nullptr || aborted.load()) return;
  const Status s = api.async_error(comm);
  if (s.code != Status::kError) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (async_failure_.empty()) async_failure_ = s.what;
}

void CommState::abort(const std::string& why) {
  set_failure(why);
  if (aborted.exchange(true)) return;
  // An NCCL call: made by the device's thread, after what it is doing.
  issuer.post([keep = shared_from_this(), why] {
    keep->abort_now(why);
    return true;
  });
}

void CommState::abort_now(const std::string& why) {
  set_failure(why);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (async_failure_.empty()) async_failure_ = why;  // the watchdog fails the family with it
  }
  aborted = true;
  if (comm != nullptr) api.abort(comm);
  comm = nullptr;
  fail_queue(failed());
}

void CommState::heartbeat() {
  const uint64_t n = issued.load();
  const auto now = Clock::now();
  if (n == published_ || now - published_at_ < std::chrono::seconds(1)) return;
  publish(n);
  published_at_ = now;
}

void CommState::publish(uint64_t n) {
  published_ = n;
  const std::string v = std::to_string(n);
  try {
    meeting.store->set(meeting.prefix + "progress/" + std::to_string(rank), std::vector<uint8_t>(v.begin(), v.end()));
  } catch (const std::exception&) {  // the store is gone: the job is ending; nothing to name
  }
}

std::string CommState::missing_ranks(uint64_t seq) {
  publish(issued.load());
  // The ranks that did issue it time out too, and publish their counts as they
  // do (heartbeats are a second apart): a second to hear from them.
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  std::vector<std::optional<uint64_t>> counts(static_cast<size_t>(size));
  while (true) {
    counts[static_cast<size_t>(rank)] = issued.load();  // this rank's own count needs no store
    bool all = true;
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      const std::string key = meeting.prefix + "progress/" + std::to_string(r);
      try {
        if (meeting.store->check({key})) {
          const auto v = meeting.store->get(key);
          counts[static_cast<size_t>(r)] = std::stoull(std::string(v.begin(), v.end()));
        }
      } catch (const std::exception&) {  // the store is gone (its host exited): what was read stands
      }
      all = all && counts[static_cast<size_t>(r)] && *counts[static_cast<size_t>(r)] > seq;
    }
    if (all || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return describe_missing(seq, counts, meeting.world_ranks);
}

std::string CommState::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void CommState::set_failure(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.empty()) failure_ = why;
}

void CommState::fail_queue(const std::string& why) {
  if (launching_.work) launching_.work->fail(why);
  launching_ = PendingOp{};
  for (auto& op : queue) op.work->fail(why);
  queue.clear();
}

void CommState::launched(PendingOp& op) {
  const Status s = api.record(op.work->end(), stream, device);
  if (!s.is_ok()) {
    const std::string why = op.work->name() + ": its end event was not recorded: " + s.what;
    op.work->fail(why);
    return abort_now(why);
  }
  op.work->mark_issued();
}

bool CommState::pump() {
  if (closed) {
    fail_queue("the communicator was destroyed before the operation was launched");
    return true;
  }
  while (true) {
    if (launching_.work) {
      if (comm == nullptr) {
        fail_queue(failed());
        return true;
      }
      const Status s = api.async_error(comm);
      if (s.code == Status::kInProgress) return false;  // NCCL is still launching it (e.g. connecting to a peer)
      PendingOp op = std::move(launching_);
      launching_ = PendingOp{};
      if (s.code == Status::kError) {
        const std::string why = op.work->name() + ": NCCL failed while launching it: " + s.what;
        op.work->fail(why);
        abort_now(why);
        return true;
      }
      launched(op);
      continue;
    }
    if (queue.empty()) return true;
    PendingOp op = std::move(queue.front());
    queue.pop_front();
    const std::string failure = failed();
    if (!failure.empty() || comm == nullptr) {
      op.work->fail(failure.empty() ? "the communicator is closed" : failure);
      continue;
    }
    Status s = api.wait_event(stream, op.work->ready(), device);
    if (s.is_ok()) s = op.issue(comm, stream);
    if (s.code == Status::kInProgress) {
      launching_ = std::move(op);
      continue;
    }
    if (s.code == Status::kError) {
      const std::string why = op.work->name() + ": NCCL refused it: " + s.what;
      op.work->fail(why);
      abort_now(why);
      return true;
    }
    launched(op);
  }
}

Status CommState::settle(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    if (comm == nullptr) return Status::error("the communicator was aborted");
    const Status s = api.async_error(comm);
    if (s.code != Status::kInProgress || Clock::now() > deadline) return s;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

bool CommState::close_step(Clock::time_point deadline, const std::function<bool()>& pump, bool& clean) {
  if (comm != nullptr && closing_ == Closing::kLaunching) {
    // Launch what is still queued, so that finalize flushes it (peers may wait for it).
    if (failed().empty() && !pump() && Clock::now() < deadline) return false;
    if (failed().empty() && !aborted.load() && !launching_.work && queue.empty()) {
      const Status s = api.finalize(comm);
      if (s.code == Status::kInProgress) {
        closing_ = Closing::kFlushing;
        return false;
      }
      if (s.is_ok()) {
        api.destroy(comm);
        comm = nullptr;
        clean = true;
      }
    }
  } else if (comm != nullptr) {  // flushing
    const Status s = api.async_error(comm);
    if (s.code == Status::kInProgress && Clock::now() <= deadline) return false;
    if (s.is_ok()) {
      api.destroy(comm);
      comm = nullptr;
      clean = true;
    }
  }
  if (comm != nullptr) {  // it failed, or did not flush in time
    api.abort(comm);
    comm = nullptr;
    clean = false;
  }
  closed = true;
  fail_queue("the communicator was destroyed before the operation was launched");
  if (stream != nullptr) api.destroy_stream(stream, device);
  stream = nullptr;
  return true;
}

void post_op(const std::shared_ptr<CommState>& state, PendingOp op, std::function<bool()> pump) {
  state->issuer.post([state, op = std::move(op), pump = std::move(pump)]() mutable {
    if (op.work) {  // queued once, however often this task runs again
      state->queue.push_back(std::move(op));
      op = PendingOp{};
      if (state->pumping) return true;  // the scheduled pump launches it
      state->pumping = true;
    }
    bool done = true;
    std::string error;
    try {
      done = pump();
    } catch (const std::exception& e) {
      error = error_message(e);
    }
    if (!error.empty()) {
      state->abort_now("NCCL communicator (rank " + std::to_string(state->rank) + " of " +
                       std::to_string(state->size) + "): " + error);
    }
    if (done) state->pumping = false;
    return done;
  });
}

// --- Channel

Status Channel::connect() {
  if (phase == Phase::kReady) return Status::ok();
  NcclApi& api = state->api;
  if (phase == Phase::kNew) {
    auto& store = *state->meeting.store;
    UniqueId id{};
    if (sender) {
      const Status s = api.unique_id(&id);
      if (!s.is_ok()) return Status::error("ncclGetUniqueId: " + s.what);
      store.set(id_key, std::vector<uint8_t>(id.begin(), id.end()));
    } else {
      if (!store.check({id_key})) return Status::in_progress();  // the sender has not arrived: look again later
      const auto bytes = store.get(id_key);
      if (bytes.size() != id.size()) {
        return Status::error("the channel's unique id under '" + id_key + "' has " + std::to_string(bytes.size()) +
                             " bytes, not " + std::to_string(id.size()));
      }
      std::copy(bytes.begin(), bytes.end(), id.begin());
    }
    arrived = !sender;
    CommHandle c = nullptr;
    const Status s = api.init_rank(&c, 2, id, sender ? 0 : 1, state->device);
    state->comm = c;
    if (s.code == Status::kError) return Status::error("creating the channel: " + s.what);
    phase = Phase::kIniting;
  }
  const Status s = api.async_error(state->comm);
  if (s.code == Status::kInProgress) return s;  // the peer is joining
  if (s.code == Status::kError) return Status::error("creating the channel: " + s.what);
  arrived = true;
  phase = Phase::kReady;
  return Status::ok();
}

bool Channel::pump() {
  if (state->closed) return state->pump();  // fails what is queued
  const std::string failure = state->failed();
  if (!failure.empty()) {
    state->fail_queue(failure);
    return true;
  }
  const Status s = connect();
  if (s.code == Status::kInProgress) return false;
  if (s.code == Status::kError) {
    state->abort_now(s.what);
    return true;
  }
  return state->pump();
}

}  // namespace zeroshard::comm::nccl
