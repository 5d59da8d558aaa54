// executor.cpp — one rank's actions of a pipeline schedule.
#include "zeroshard/pipeline_executor.h"

#include "pipeline/payload.h"
#include "shard/rank_agreement.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <map>
#include <optional>

namespace zeroshard::pipeline {

struct PipelineExecutor::Impl {
  const PipelineGrid& grid;
  Schedule schedule;
  StageFunctions fns;
  Communicator& pipe;  // the pipeline group's data plane: rank i is stage i mod pp

  using Key = std::pair<int, int>;  // (stage, microbatch)
  std::map<Key, PayloadRecv> inputs, output_grads;  // posted receives
  struct Live {                                      // a forward awaiting its backward
    Payload input;                                   // its float tensors collect the input's gradient
    Payload output;
    at::Tensor loss;                                 // the last stage's
  };
  std::map<Key, Live> live;
  std::map<Key, Payload> to_send;                    // results whose SEND comes next
  std::vector<std::shared_ptr<Work>> sends;
  double loss_sum = 0;

  Impl(const PipelineGrid& g, Schedule s, StageFunctions f)
      : grid(g), schedule(std::move(s)), fns(std::move(f)), pipe(*g.pp_group().data) {}

  int last_stage() const { return schedule.stages - 1; }
  std::string name(int stage, int mb) const {
    return "stage " + std::to_string(stage) + " (microbatch " + std::to_string(mb) + ")";
  }

  void forward(const Action& a) {
    const Key key{a.stage, a.microbatch};
    Payload input;
    if (a.stage > 0) {
      auto it = inputs.find(key);
      TORCH_INTERNAL_ASSERT(it != inputs.end(), "no posted receive for ", to_string(a));
      input = it->second.wait();
      inputs.erase(it);
      for (auto& [n, t] : input) {
        if (at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
      }
    }
    Live l;
    l.output = fns.forward(a.stage, a.microbatch, input);
    l.input = std::move(input);
    if (a.stage == last_stage()) {
      l.loss = fns.loss(a.microbatch, l.output);
      TORCH_CHECK_VALUE(l.loss.defined() && l.loss.numel() == 1, "pipeline: the loss of microbatch ", a.microbatch,
                        " is not a scalar");
      loss_sum += l.loss.item<double>();
    } else {
      check_payload(l.output, fns.input_spec(a.stage + 1, a.microbatch), name(a.stage, a.microbatch) + "'s output");
      Payload out;
      for (const auto& [n, t] : l.output) out.emplace_back(n, t.detach());
      to_send[key] = std::move(out);
    }
    live.emplace(key, std::move(l));
  }

  void backward(const Action& a) {
    const Key key{a.stage, a.microbatch};
    auto it = live.find(key);
    TORCH_INTERNAL_ASSERT(it != live.end(), "no forward for ", to_string(a));
    Live l = std::move(it->second);
    live.erase(it);
    if (a.stage == last_stage()) {
      l.loss.backward();
    } else {
      auto g = output_grads.find(key);
      TORCH_INTERNAL_ASSERT(g != output_grads.end(), "no posted receive for ", to_string(a));
      const Payload grads = g->second.wait();
      output_grads.erase(g);
      std::vector<at::Tensor> outs, gs;
      for (size_t i = 0; i < l.output.size(); ++i) {
        if (l.output[i].second.requires_grad()) {
          outs.push_back(l.output[i].second);
          gs.push_back(grads[i].second);
        }
      }
      if (!outs.empty()) torch::autograd::backward(outs, gs);
    }
    if (a.stage > 0) {
      Payload input_grads;  // what stage a.stage - 1's output gets: zeros where no gradient reached
      for (const auto& [n, t] : l.input) {
        if (!at::isFloatingType(t.scalar_type())) continue;
        input_grads.emplace_back(n, t.grad().defined() ? t.grad() : at::zeros_like(t));
      }
      to_send[key] = std::move(input_grads);
    }
  }

  void run(const Action& a) {
    const int rank = pipe.rank();
    switch (a.op) {
      case Op::kRecvF:
        inputs.emplace(std::piecewise_construct, std::forward_as_tuple(a.stage, a.microbatch),
                       std::forward_as_tuple(pipe, schedule.rank_of(a.stage - 1), a, fns.input_spec(a.stage, a.microbatch)));
        break;
      case Op::kRecvB: {
        PayloadSpec spec;  // the gradient of this stage's output: its float tensors
        for (const auto& t : fns.input_spec(a.stage + 1, a.microbatch)) {
          if (at::isFloatingType(t.dtype)) spec.push_back(t);
        }
        output_grads.emplace(std::piecewise_construct, std::forward_as_tuple(a.stage, a.microbatch),
                             std::forward_as_tuple(pipe, schedule.rank_of(a.stage + 1), a, std::move(spec)));
        break;
      }
      case Op::kForward: forward(a); break;
      case Op::kBackward: backward(a); break;
      case Op::kSendF:
      case Op::kSendB: {
        auto it = to_send.find({a.stage, a.microbatch});
        TORCH_INTERNAL_ASSERT(it != to_send.end(), "nothing to send for ", to_string(a), " on rank ", rank);
        const int dst = schedule.rank_of(a.op == Op::kSendF ? a.stage + 1 : a.stage - 1);
        for (auto& w : send_payload(pipe, dst, a, it->second)) sends.push_back(std::move(w));
        to_send.erase(it);
        break;
      }
      case Op::kUnshard:
      case Op::kReshard:
      case Op::kReduceGrad:
        if (fns.stage_hook) fns.stage_hook(a.op, a.stage);
        break;
    }
  }
};

PipelineExecutor::PipelineExecutor(const PipelineGrid& grid, Schedule schedule, StageFunctions functions) {
  TORCH_CHECK_VALUE(schedule.ranks == grid.pp(), "PipelineExecutor: the schedule has ", schedule.ranks,
                    " ranks but the pipeline has ", grid.pp(), " stages' ranks");
  TORCH_CHECK_VALUE(functions.forward && functions.input_spec && functions.loss,
                    "PipelineExecutor: StageFunctions needs forward, input_spec and loss");
  validate(schedule);
  shard::check_same_on_all_ranks(*grid.pp_group().control, {to_text(schedule)}, "pipeline schedules");
  impl_ = std::make_unique<Impl>(grid, std::move(schedule), std::move(functions));
}

PipelineExecutor::~PipelineExecutor() = default;

const Schedule& PipelineExecutor::schedule() const { return impl_->schedule; }

double PipelineExecutor::run_step() {
  auto& im = *impl_;
  im.loss_sum = 0;
  for (const auto& a : im.schedule.actions[static_cast<size_t>(im.pipe.rank())]) im.run(a);
  for (auto& w : im.sends) w->wait();
  im.sends.clear();
  TORCH_INTERNAL_ASSERT(im.live.empty() && im.to_send.empty() && im.inputs.empty() && im.output_grads.empty(),
                        "pipeline: the step left work behind");
  return im.loss_sum;
}

}  // namespace zeroshard::pipeline
