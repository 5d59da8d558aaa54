// payload.cpp — payload specs, their checks, and their messages.
#include "pipeline/payload.h"

#include <c10/util/Exception.h>
#include <xxhash.h>

#include <algorithm>

namespace zeroshard::pipeline {
namespace {

// The header: magic, the send action (stage, op, microbatch), the tensor
// count, a hash of the whole spec, then for the first kDescribed tensors
// their dtype, rank and up to kDims sizes (the rest only in the hash).
constexpr int64_t kMagic = 0x7a73706c;  // "zspl"
constexpr int kDescribed = 8, kDims = 6, kFixed = 6, kPerTensor = 2 + kDims;
constexpr int64_t kHeaderWords = kFixed + kDescribed * kPerTensor;

int64_t hash_of(const PayloadSpec& spec) {
  const std::string text = describe(spec);
  return static_cast<int64_t>(XXH3_64bits(text.data(), text.size()));
}

at::Tensor header_of(const Action& send, const PayloadSpec& spec) {
  auto h = at::zeros({kHeaderWords}, at::kLong);
  auto* w = h.data_ptr<int64_t>();
  w[0] = kMagic;
  w[1] = send.stage;
  w[2] = static_cast<int64_t>(send.op);
  w[3] = send.microbatch;
  w[4] = static_cast<int64_t>(spec.size());
  w[5] = hash_of(spec);
  for (size_t i = 0; i < spec.size() && i < static_cast<size_t>(kDescribed); ++i) {
    int64_t* t = w + kFixed + i * kPerTensor;
    t[0] = static_cast<int64_t>(spec[i].dtype);
    t[1] = static_cast<int64_t>(spec[i].shape.size());
    for (size_t d = 0; d < spec[i].shape.size() && d < static_cast<size_t>(kDims); ++d) t[2 + d] = spec[i].shape[d];
  }
  return h;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::string TensorSpec::describe() const { return name + " " + shape_text(shape) + " " + c10::toString(dtype); }

PayloadSpec spec_of(const Payload& payload) {
  PayloadSpec spec;
  for (const auto& [name, t] : payload) spec.push_back({name, t.sizes().vec(), t.scalar_type()});
  return spec;
}

std::string describe(const PayloadSpec& spec) {
  std::string s = "{";
  for (size_t i = 0; i < spec.size(); ++i) s += (i ? ", " : "") + spec[i].describe();
  return s + "}";
}

void check_payload(const Payload& payload, const PayloadSpec& expected, const std::string& what) {
  const PayloadSpec got = spec_of(payload);
  for (size_t i = 0; i < std::max(got.size(), expected.size()); ++i) {
    TORCH_CHECK_VALUE(i < got.size(), what, " lacks '", expected[i].name, "' (expected ", describe(expected), ")");
    TORCH_CHECK_VALUE(i < expected.size(), what, " has '", got[i].name, "' that the next stage does not take (expected ",
                      describe(expected), ")");
    TORCH_CHECK_VALUE(got[i] == expected[i], what, " has ", got[i].describe(), " where ", expected[i].describe(),
                      " was expected (", describe(expected), "); the stage must return the shapes and dtypes "
                      "the next stage's input is allocated for");
  }
}

std::vector<std::shared_ptr<Work>> send_payload(Communicator& comm, int dst, const Action& send, const Payload& payload) {
  TORCH_CHECK(send.op == Op::kSendF || send.op == Op::kSendB, "send_payload: ", to_string(send), " is not a send");
  std::vector<std::shared_ptr<Work>> works{comm.send(header_of(send, spec_of(payload)).to(comm.device()), dst)};
  for (const auto& [name, t] : payload) works.push_back(comm.send(t.contiguous(), dst));
  return works;
}

PayloadRecv::PayloadRecv(Communicator& comm, int src, const Action& recv, PayloadSpec expected)
    : recv_(recv), expected_(std::move(expected)), src_(src) {
  TORCH_CHECK(recv.op == Op::kRecvF || recv.op == Op::kRecvB, "PayloadRecv: ", to_string(recv), " is not a receive");
  header_ = at::empty({kHeaderWords}, at::TensorOptions().dtype(at::kLong).device(comm.device()));
  header_work_ = comm.recv(header_, src);
  for (const auto& s : expected_) {
    tensors_.emplace_back(s.name, at::empty(s.shape, at::TensorOptions().dtype(s.dtype).device(comm.device())));
    works_.push_back(comm.recv(tensors_.back().second, src));
  }
}

Payload PayloadRecv::wait() {
  header_work_->wait();
  const at::Tensor host = header_.cpu();
  const auto* w = host.data_ptr<int64_t>();
  const std::string what = to_string(recv_) + " (from rank " + std::to_string(src_) + ")";
  TORCH_CHECK(w[0] == kMagic, what, ": the message is not a stage payload (its header is not one)");
  const Action want = send_for(recv_);
  const Action sent{static_cast<int>(w[1]), static_cast<Op>(w[2]), static_cast<int>(w[3])};
  TORCH_CHECK(sent == want, what, " received what ", to_string(sent), " sent, not ", to_string(want),
              ": the sender's and the receiver's schedules disagree on this channel's order");
  const int64_t n = w[4];
  for (int64_t i = 0; i < std::min<int64_t>(n, kDescribed); ++i) {
    if (static_cast<size_t>(i) >= expected_.size()) break;
    const int64_t* t = w + kFixed + i * kPerTensor;
    const auto& e = expected_[static_cast<size_t>(i)];
    std::vector<int64_t> shape(t + 2, t + 2 + std::min<int64_t>(t[1], kDims));
    const auto dtype = static_cast<c10::ScalarType>(t[0]);
    const bool same = dtype == e.dtype && t[1] == static_cast<int64_t>(e.shape.size()) &&
                      std::equal(shape.begin(), shape.end(), e.shape.begin());
    TORCH_CHECK(same, what, ": tensor ", i, " '", e.name, "' arrived as ", shape_text(shape), " ",
                c10::toString(dtype), " but ", e.describe(), " was expected");
  }
  TORCH_CHECK(n == static_cast<int64_t>(expected_.size()) && w[5] == hash_of(expected_), what, ": ", n,
              " tensor(s) arrived whose names, shapes or dtypes differ from the expected ", describe(expected_));
  for (auto& work : works_) work->wait();
  return std::move(tensors_);
}

}  // namespace zeroshard::pipeline
