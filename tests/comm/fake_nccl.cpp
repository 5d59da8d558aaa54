#include "comm/fake_nccl.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace zeroshard::testing {
namespace {

thread_local int current_device = 0;

at::Tensor view(const void* p, size_t count, at::ScalarType dtype) {
  return at::from_blob(const_cast<void*>(p), {static_cast<int64_t>(count)}, at::TensorOptions().dtype(dtype));
}

at::Tensor combine(const at::Tensor& a, const at::Tensor& b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax: return at::maximum(a, b);
    case ReduceOp::kMin: return at::minimum(a, b);
    default: return a + b;
  }
}

}  // namespace

std::vector<std::string> FakeNccl::violations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return violations_;
}

int64_t FakeNccl::aborts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return aborts_;
}

int64_t FakeNccl::launches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return launches_;
}

void FakeNccl::on_teardown(std::function<void(const std::string&)> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  on_teardown_ = std::move(hook);
}

void FakeNccl::violation(std::string what) { violations_.push_back(std::move(what)); }

FakeNccl::Comm* FakeNccl::comm_of(CommHandle handle, const char* call) {
  auto it = std::find_if(comms_.begin(), comms_.end(), [&](const auto& c) { return c.get() == handle; });
  if (it == comms_.end()) {
    violation(std::string(call) + " on a handle that is no communicator");
    throw std::runtime_error(std::string("fake NCCL: ") + call + " on a handle that is no communicator");
  }
  Comm* c = it->get();
  if (c->owner != std::this_thread::get_id()) {
    violation(std::string(call) + " on communicator rank " + std::to_string(c->rank) +
              " from a thread other than the one that made it");
  }
  if (c->dead) violation(std::string(call) + " on communicator rank " + std::to_string(c->rank) + " after destroy/abort");
  return c;
}

FakeNccl::Stream* FakeNccl::stream_of_handle(StreamHandle handle, int device, const char* call) {
  auto* s = static_cast<Stream*>(handle);
  if (s->dead) violation(std::string(call) + " on a destroyed stream");
  if (s->device != device) {
    violation(std::string(call) + ": a stream of device " + std::to_string(s->device) + " used as device " +
              std::to_string(device) + "'s");
  }
  return s;
}

FakeNccl::Event* FakeNccl::event_of_handle(EventHandle handle, int device, const char* call) {
  auto* e = static_cast<Event*>(handle);
  if (e->dead) violation(std::string(call) + " on a destroyed event");
  if (e->device != device) {
    violation(std::string(call) + ": an event of device " + std::to_string(e->device) + " used as device " +
              std::to_string(device) + "'s");
  }
  return e;
}

FakeNccl::Status FakeNccl::unique_id(UniqueId* id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.unique_ids_before_throw >= 0 && unique_ids_ >= options_.unique_ids_before_throw) {
    throw std::runtime_error("fake NCCL: unique_id failed (simulated)");
  }
  id->fill(0);
  const std::string s = "fake-nccl-id-" + std::to_string(unique_ids_++) + "-" +
                        std::to_string(reinterpret_cast<uintptr_t>(this));
  std::memcpy(id->data(), s.data(), std::min(s.size(), id->size()));
  return Status::ok();
}

FakeNccl::Status FakeNccl::init_rank(CommHandle* comm, int nranks, const UniqueId& id, int rank, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& group = groups_[std::string(id.data(), id.size())];
  if (!group) {
    group = std::make_unique<Group>();
    group->nranks = nranks;
    group->members.assign(static_cast<size_t>(nranks), nullptr);
  }
  if (group->nranks != nranks || rank < 0 || rank >= nranks || group->members[static_cast<size_t>(rank)] != nullptr) {
    violation("init_rank: rank " + std::to_string(rank) + " of " + std::to_string(nranks) + " does not fit its group");
    return Status::error("invalid usage (simulated)");
  }
  auto c = std::make_unique<Comm>();
  c->group = group.get();
  c->rank = rank;
  c->device = device;
  c->owner = std::this_thread::get_id();
  group->members[static_cast<size_t>(rank)] = c.get();
  *comm = c.get();
  comms_.push_back(std::move(c));
  return Status::in_progress();
}

FakeNccl::Status FakeNccl::split(CommHandle parent, bool member, int key, CommHandle* child) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm* p = comm_of(parent, "split");
  const uint64_t s = p->splits++;
  p->pending_split = static_cast<int64_t>(s);
  Comm* made = nullptr;
  if (member) {
    auto c = std::make_unique<Comm>();
    c->device = p->device;
    c->owner = std::this_thread::get_id();
    made = c.get();
    comms_.push_back(std::move(c));
  }
  // NCCL leaves *child null and writes it when the split completes (see async_error).
  *child = nullptr;
  p->split_out = child;
  p->split_child = made;
  auto& calls = p->group->splits[s];
  calls.push_back({p->rank, member, key, made});
  if (static_cast<int>(calls.size()) == p->group->nranks) {  // the last rank: the children's group
    std::vector<Group::SplitCall> members;
    for (const auto& call : calls) {
      if (call.member) members.push_back(call);
    }
    std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
    auto& g = groups_["split-" + std::to_string(reinterpret_cast<uintptr_t>(p->group)) + "-" + std::to_string(s)];
    g = std::make_unique<Group>();
    g->nranks = static_cast<int>(members.size());
    for (size_t i = 0; i < members.size(); ++i) {
      members[i].child->group = g.get();
      members[i].child->rank = static_cast<int>(i);
      members[i].child->initialized = true;
      g->members.push_back(members[i].child);
    }
  }
  return Status::in_progress();
}

FakeNccl::Status FakeNccl::async_error(CommHandle comm) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm* c = comm_of(comm, "async_error");
  progress();
  if (c->group == nullptr) return Status::in_progress();  // a split child before every rank split
  if (!c->initialized) {
    if (std::find(c->group->members.begin(), c->group->members.end(), nullptr) != c->group->members.end()) {
      return Status::in_progress();
    }
    c->initialized = true;
  }
  if (c->pending_split >= 0) {
    if (static_cast<int>(c->group->splits[static_cast<uint64_t>(c->pending_split)].size()) < c->group->nranks) {
      return Status::in_progress();
    }
    c->pending_split = -1;
    *c->split_out = c->split_child;
    c->split_out = nullptr;
  }
  if (c->finalizing) {
    for (const auto& s : streams_) {
      for (const auto& op : s->ops) {
        if (op->comm == c) return Status::in_progress();
      }
    }
  }
  if (c->waits_for_peer) {
    const Comm* peer = c->group->members[static_cast<size_t>(1 - c->rank)];
    if (peer == nullptr || peer->launched == 0) return Status::in_progress();
    c->waits_for_peer = false;
  }
  if (c->polls_left > 0) {
    if (!options_.launches_never_end) --c->polls_left;
    return Status::in_progress();
  }
  return Status::ok();
}

FakeNccl::Status FakeNccl::finalize(CommHandle comm) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Comm* c = comm_of(comm, "finalize");
    c->finalizing = true;
  }
  teardown("finalize");
  return Status::in_progress();
}

void FakeNccl::destroy(CommHandle comm) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    comm_of(comm, "destroy")->dead = true;
  }
  teardown("destroy");
}

void FakeNccl::abort(CommHandle comm) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Comm* c = comm_of(comm, "abort");
    c->dead = true;
    ++aborts_;
    for (const auto& s : streams_) {  // its operations never run; the streams go on
      s->ops.erase(std::remove_if(s->ops.begin(), s->ops.end(), [&](const auto& op) { return op->comm == c; }),
                   s->ops.end());
    }
    progress();
  }
  teardown("abort");
}

void FakeNccl::teardown(const std::string& call) {
  std::function<void(const std::string&)> hook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hook = on_teardown_;
  }
  if (hook) hook(call);
}

FakeNccl::Status FakeNccl::launch(Comm* c, Stream* s, std::shared_ptr<Op> op, const char* call) {
  if (!c->initialized || c->polls_left > 0 || c->waits_for_peer || c->pending_split >= 0) {
    violation(std::string(call) + " on communicator rank " + std::to_string(c->rank) +
              " while its previous call is still in progress");
  }
  if (s->device != c->device) violation(std::string(call) + " on a stream of another device than its communicator's");
  op->stream = s;
  op->comm = c;
  s->ops.push_back(std::move(op));
  ++c->launched;
  ++launches_;
  c->polls_left = options_.launch_polls + (options_.launches_never_end ? 1 : 0);
  if (options_.lazy_connect && c->group->nranks == 2 && c->launched == 1) c->waits_for_peer = true;
  progress();
  return c->polls_left > 0 || c->waits_for_peer ? Status::in_progress() : Status::ok();
}

FakeNccl::Status FakeNccl::collective(const char* call, CommHandle comm, StreamHandle stream,
                                      std::function<void(const std::vector<std::shared_ptr<Op>>&)> run,
                                      const void* in, void* out) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm* c = comm_of(comm, call);
  Stream* s = static_cast<Stream*>(stream);
  auto op = std::make_shared<Op>();
  op->kind = Op::kCollective;
  op->run = std::move(run);
  op->in = in;
  op->out = out;
  op->generation = c->collectives++;
  auto& slot = c->group->collectives[op->generation];
  slot.resize(static_cast<size_t>(c->group->nranks));
  slot[static_cast<size_t>(c->rank)] = op;
  return launch(c, s, std::move(op), call);
}

FakeNccl::Status FakeNccl::all_gather(const void* in, void* out, size_t count, at::ScalarType dtype, CommHandle comm,
                                      StreamHandle stream) {
  return collective("all_gather", comm, stream, [count, dtype](const std::vector<std::shared_ptr<Op>>& all) {
    std::vector<at::Tensor> ins;
    for (const auto& op : all) ins.push_back(view(op->in, count, dtype).clone());
    const auto gathered = at::cat(ins);
    for (const auto& op : all) view(op->out, count * all.size(), dtype).copy_(gathered);
  }, in, out);
}

FakeNccl::Status FakeNccl::reduce_scatter(const void* in, void* out, size_t count, at::ScalarType dtype, ReduceOp op,
                                          CommHandle comm, StreamHandle stream) {
  return collective("reduce_scatter", comm, stream, [count, dtype, op](const std::vector<std::shared_ptr<Op>>& all) {
    const size_t n = all.size();
    at::Tensor acc = view(all[0]->in, count * n, dtype).clone();
    for (size_t r = 1; r < n; ++r) acc = combine(acc, view(all[r]->in, count * n, dtype), op);
    if (op == ReduceOp::kAvg) acc = acc / static_cast<double>(n);
    for (size_t r = 0; r < n; ++r) {
      view(all[r]->out, count, dtype).copy_(acc.slice(0, static_cast<int64_t>(r * count),
                                                      static_cast<int64_t>((r + 1) * count)));
    }
  }, in, out);
}

FakeNccl::Status FakeNccl::all_reduce(void* data, size_t count, at::ScalarType dtype, ReduceOp op, CommHandle comm,
                                      StreamHandle stream) {
  return collective("all_reduce", comm, stream, [count, dtype, op](const std::vector<std::shared_ptr<Op>>& all) {
    at::Tensor acc = view(all[0]->out, count, dtype).clone();
    for (size_t r = 1; r < all.size(); ++r) acc = combine(acc, view(all[r]->out, count, dtype), op);
    if (op == ReduceOp::kAvg) acc = acc / static_cast<double>(all.size());
    for (const auto& o : all) view(o->out, count, dtype).copy_(acc);
  }, data, data);
}

FakeNccl::Status FakeNccl::broadcast(void* data, size_t count, at::ScalarType dtype, int root, CommHandle comm,
                                     StreamHandle stream) {
  return collective("broadcast", comm, stream, [count, dtype, root](const std::vector<std::shared_ptr<Op>>& all) {
    const at::Tensor value = view(all[static_cast<size_t>(root)]->out, count, dtype).clone();
    for (const auto& o : all) view(o->out, count, dtype).copy_(value);
  }, data, data);
}

FakeNccl::Status FakeNccl::p2p(bool is_send, const void* data, size_t bytes, int peer, CommHandle comm,
                               StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mu_);
  const char* call = is_send ? "send" : "recv";
  Comm* c = comm_of(comm, call);
  auto op = std::make_shared<Op>();
  op->kind = is_send ? Op::kSend : Op::kRecv;
  op->in = data;
  op->out = const_cast<void*>(data);
  op->bytes = bytes;
  const int src = is_send ? c->rank : peer, dst = is_send ? peer : c->rank;
  op->generation = is_send ? c->sends[peer]++ : c->recvs[peer]++;
  auto& pair = c->group->p2p[{src, dst, op->generation}];
  (is_send ? pair.first : pair.second) = op;
  return launch(c, static_cast<Stream*>(stream), std::move(op), call);
}

FakeNccl::Status FakeNccl::send(const void* data, size_t count, at::ScalarType dtype, int peer, CommHandle comm,
                                StreamHandle stream) {
  return p2p(true, data, count * c10::elementSize(dtype), peer, comm, stream);
}

FakeNccl::Status FakeNccl::recv(void* data, size_t count, at::ScalarType dtype, int peer, CommHandle comm,
                                StreamHandle stream) {
  return p2p(false, data, count * c10::elementSize(dtype), peer, comm, stream);
}

bool FakeNccl::runnable(const std::shared_ptr<Op>& op) {
  const auto at_head = [](const std::shared_ptr<Op>& o) { return o && !o->stream->ops.empty() && o->stream->ops.front() == o; };
  switch (op->kind) {
    case Op::kRecord: return true;
    case Op::kWait: return op->event->reached >= op->generation;
    case Op::kCollective: {
      const auto& all = op->comm->group->collectives[op->generation];
      return std::all_of(all.begin(), all.end(), at_head) && static_cast<int>(all.size()) == op->comm->group->nranks;
    }
    case Op::kSend:
    case Op::kRecv: {
      const int me = op->comm->rank, other = 1 - me;
      const auto key = op->kind == Op::kSend ? std::make_tuple(me, other, op->generation)
                                             : std::make_tuple(other, me, op->generation);
      const auto& pair = op->comm->group->p2p[key];
      return at_head(pair.first) && at_head(pair.second);
    }
  }
  return false;
}

void FakeNccl::progress() {
  bool changed = true;
  while (changed) {
    changed = false;
    for (const auto& s : streams_) {
      while (!s->ops.empty() && runnable(s->ops.front())) {
        const std::shared_ptr<Op> op = s->ops.front();
        changed = true;
        switch (op->kind) {
          case Op::kRecord: op->event->reached = std::max(op->event->reached, op->generation); break;
          case Op::kWait: break;
          case Op::kCollective: {
            auto& groups = op->comm->group->collectives;
            const auto all = groups[op->generation];
            op->run(all);
            for (const auto& o : all) {
              if (o != op) o->stream->ops.pop_front();
            }
            groups.erase(op->generation);
            break;
          }
          case Op::kSend:
          case Op::kRecv: {
            const int me = op->comm->rank, other = 1 - me;
            const auto key = op->kind == Op::kSend ? std::make_tuple(me, other, op->generation)
                                                   : std::make_tuple(other, me, op->generation);
            auto pair = op->comm->group->p2p[key];
            if (pair.first->bytes != pair.second->bytes) {
              violation("recv of " + std::to_string(pair.second->bytes) + " bytes matched a send of " +
                        std::to_string(pair.first->bytes));
            }
            std::memcpy(pair.second->out, pair.first->in, std::min(pair.first->bytes, pair.second->bytes));
            (op == pair.first ? pair.second : pair.first)->stream->ops.pop_front();
            op->comm->group->p2p.erase(key);
            break;
          }
        }
        s->ops.pop_front();
      }
    }
  }
}

void FakeNccl::set_device(int device) { current_device = device; }

FakeNccl::StreamHandle FakeNccl::create_stream(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto s = std::make_unique<Stream>();
  s->device = device;
  streams_.push_back(std::move(s));
  return streams_.back().get();
}

void FakeNccl::destroy_stream(StreamHandle stream, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  stream_of_handle(stream, device, "destroy_stream")->dead = true;
}

FakeNccl::StreamHandle FakeNccl::current_stream(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  Stream*& s = user_streams_[device];
  if (s == nullptr) {
    auto made = std::make_unique<Stream>();
    made->device = device;
    s = made.get();
    streams_.push_back(std::move(made));
  }
  return s;
}

FakeNccl::StreamHandle FakeNccl::stream_of(const c10::Stream&, int device) { return current_stream(device); }

FakeNccl::EventHandle FakeNccl::create_event(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto e = std::make_unique<Event>();
  e->device = device;
  events_.push_back(std::move(e));
  return events_.back().get();
}

void FakeNccl::destroy_event(EventHandle event, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  event_of_handle(event, device, "destroy_event")->dead = true;
}

FakeNccl::Status FakeNccl::record(EventHandle event, StreamHandle stream, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  Event* e = event_of_handle(event, device, "record");
  Stream* s = stream_of_handle(stream, device, "record");
  auto op = std::make_shared<Op>();
  op->kind = Op::kRecord;
  op->stream = s;
  op->event = e;
  op->generation = ++e->recorded;
  s->ops.push_back(std::move(op));
  progress();
  return Status::ok();
}

FakeNccl::Status FakeNccl::wait_event(StreamHandle stream, EventHandle event, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  Event* e = event_of_handle(event, device, "wait_event");
  Stream* s = stream_of_handle(stream, device, "wait_event");
  auto op = std::make_shared<Op>();
  op->kind = Op::kWait;
  op->stream = s;
  op->event = e;
  op->generation = e->recorded;
  s->ops.push_back(std::move(op));
  progress();
  return Status::ok();
}

FakeNccl::Status FakeNccl::query(EventHandle event, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  Event* e = event_of_handle(event, device, "query");
  progress();
  return e->reached >= e->recorded ? Status::ok() : Status::in_progress();
}

}  // namespace zeroshard::testing
