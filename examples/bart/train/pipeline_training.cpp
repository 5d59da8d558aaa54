// pipeline_training.cpp — BART's pipeline stages, their optimizers and executors.
#include "train/pipeline_training.h"

#include <zeroshard/fully_shard.h>
#include <zeroshard/sharded_adamw.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <optional>

namespace bart {

namespace F = torch::nn::functional;
using namespace zeroshard::pipeline;

namespace {

// bart_blocks() with each block's cost in microseconds instead of its
// parameters: one block of each kind (E, e, d, L) built alone and run forward
// and backward on a microbatch of o.timing_rows sequences of
// o.timing_length tokens (the best of 3), averaged over the world's ranks so
// that every rank partitions alike. Collective over `world`.
std::vector<Block> timed_blocks(const BartConfig& c, const PipelineOptions& o, const zeroshard::ProcessGroup& world) {
  auto blocks = bart_blocks(c);
  TORCH_CHECK_VALUE(c.encoder_layers >= 1 && c.decoder_layers >= 1, "--partition timed: BART needs an encoder and a "
                    "decoder layer to time");
  const size_t kinds[4] = {0, 1, static_cast<size_t>(1 + c.encoder_layers), blocks.size() - 1};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);  // not the default generator: training's
  const auto ids = [&] {
    return torch::randint(4, c.vocab_size, {o.timing_rows, o.timing_length}, gen, torch::kLong).to(o.device);
  };
  StageBatch batch;
  batch.input_ids = ids();
  batch.decoder_input_ids = ids();
  auto seconds = torch::zeros({4}, torch::kDouble);
  const c10::impl::VirtualGuardImpl guard(o.device.type());
  for (int k = 0; k < 4; ++k) {
    BartStage stage(c, std::vector<size_t>{kinds[k]}, o.seed);
    stage->to(o.device, o.dtype);
    Payload in;
    if (k > 0) {
      for (const auto& t : BartStageImpl::input_spec(c, batch, o.dtype)) {
        in.emplace_back(t.name, torch::randn(t.shape, gen, torch::kFloat).to(o.device, o.dtype).requires_grad_(true));
      }
    }
    double best = 1e30;
    for (int r = 0; r < 3; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto out = stage->forward(in, batch);
      torch::Tensor loss;
      if (k == 3) {  // the head's stage also takes the loss
        loss = summed_cross_entropy(out.at(0).second.reshape({-1, c.vocab_size}), batch.decoder_input_ids.reshape(-1),
                                    /*ignore_index=*/-100);
      } else {
        loss = torch::zeros({}, torch::TensorOptions(torch::kFloat).device(o.device));
        for (const auto& [name, t] : out) loss = loss + t.to(torch::kFloat).sum();
      }
      loss.backward();
      guard.getStream(o.device).synchronize();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    seconds[k] = best;
  }
  world.control->all_reduce(seconds, zeroshard::ReduceOp::kSum)->wait();
  for (size_t b = 0; b < blocks.size(); ++b) {
    const int k = b == 0 ? 0 : b + 1 == blocks.size() ? 3 : static_cast<int64_t>(b) <= c.encoder_layers ? 1 : 2;
    blocks[b].params = std::max<int64_t>(1, static_cast<int64_t>(1e6 * seconds[k].item<double>() / world.control->size()));
  }
  return blocks;
}

Partition make_partition(const BartConfig& c, const PipelineOptions& o, const zeroshard::ProcessGroup& world,
                         std::vector<Block>* timed) {
  const std::string& how = o.partition;
  const int stages = o.pp * o.chunks;
  const auto blocks = bart_blocks(c);
  TORCH_CHECK_VALUE(stages <= static_cast<int>(blocks.size()), "--pp x chunks = ", stages, " stages, but BART ",
                    "has ", blocks.size(), " blocks (E, ", c.encoder_layers, " e, ", c.decoder_layers,
                    " d, L): use fewer stages");
  if (how == "uniform") return partition_uniform(blocks, stages);
  if (how == "balanced") return partition_balanced(blocks, stages);
  if (how == "timed") {
    *timed = timed_blocks(c, o, world);
    return partition_balanced(*timed, stages);
  }
  Partition p = partition_by_layout(blocks, how);
  TORCH_CHECK_VALUE(static_cast<int>(p.stages.size()) == stages, "--partition '", how, "' has ", p.stages.size(),
                    " stages; the pipeline has ", stages, " (--pp x chunks); give one '|'-separated group per stage");
  return p;
}

}  // namespace

struct PipelinedBart::Impl {
  BartConfig config;
  PipelineOptions options;
  std::unique_ptr<PipelineGrid> grid;
  Partition partition;
  std::vector<Stage> stages;
  std::vector<Block> timed;  // --partition timed: the blocks with their measured costs
  std::map<int, BartStage> by_index;
  std::unique_ptr<PipelineExecutor> train;
  std::map<int, std::unique_ptr<PipelineExecutor>> eval;  // by microbatch count
  std::vector<Microbatch> micro;  // the step's (the executors' callbacks read them)
  std::vector<double> weight;     // each microbatch's loss factor

  StageFunctions functions() {
    StageFunctions f;
    f.forward = [this](int stage, int mb, const Payload& in) {
      return by_index.at(stage)->forward(in, micro.at(static_cast<size_t>(mb)).batch);
    };
    f.input_spec = [this](int, int mb) {
      return BartStageImpl::input_spec(config, micro.at(static_cast<size_t>(mb)).batch, options.dtype);
    };
    f.loss = [this](int mb, const Payload& out) {
      const auto& m = micro.at(static_cast<size_t>(mb));
      const auto ce = summed_cross_entropy(out.at(0).second.reshape({-1, config.vocab_size}), m.labels.reshape(-1),
                                           config.pad_token_id);
      return ce * weight.at(static_cast<size_t>(mb));
    };
    return f;
  }

  void set_micro(std::vector<Microbatch> m, const char* what) {
    TORCH_CHECK_VALUE(!m.empty(), "PipelinedBart::", what, ": no microbatches");
    micro = std::move(m);
  }
};

PipelinedBart::PipelinedBart(zeroshard::ProcessGroup world, const BartConfig& config, const PipelineOptions& o)
    : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  I.config = config;
  I.options = o;
  TORCH_CHECK_VALUE(o.pp >= 2, "--pp ", o.pp, ": a pipeline has at least 2 stages (--pp 1 trains the whole model)");
  TORCH_CHECK_VALUE(world.data->size() % o.pp == 0, "--pp ", o.pp, " must divide the ", world.data->size(),
                    " ranks (each stage gets world / pp of them)");
  const ScheduleKind kind = parse_schedule_kind(o.schedule);
  TORCH_CHECK_VALUE(kind != ScheduleKind::kForward, "--schedule-pp forward only evaluates; train with gpipe, 1f1b "
                    "or interleaved-1f1b");
  TORCH_CHECK_VALUE(kind == ScheduleKind::kInterleaved1F1B ? o.chunks >= 2 : o.chunks == 1, "--schedule-pp ",
                    o.schedule, " with ", o.chunks, " stage(s) per rank: interleaved-1f1b takes 2 or more (--chunks), ",
                    "gpipe and 1f1b one");
  TORCH_CHECK_VALUE(o.zero_stage >= 0 && o.zero_stage <= 3, "ZeRO stage ", o.zero_stage, ": 0, 1, 2 or 3");
  const int total = o.pp * o.chunks;
  I.partition = make_partition(config, o, world, &I.timed);
  GridOptions go;
  go.stages = o.pp;
  go.ties = {{0, o.pp - 1}};  // the embedding (stage 0, on rank 0) and the head's copy (the last, on rank pp-1)
  I.grid = std::make_unique<PipelineGrid>(std::move(world), go);
  LoweringOptions lo;
  lo.unshard = o.zero_stage == 3 && o.unshard_per_step;
  ExecutorOptions eo;
  eo.max_grad_norm = o.max_grad_norm;
  eo.memory_probe = o.memory_probe;
  I.train = std::make_unique<PipelineExecutor>(*I.grid, make_schedule(kind, o.pp, o.micro_batches, o.chunks, lo),
                                               I.functions(), eo);
  for (int s = I.grid->stage(); s < total; s += o.pp) {
    Stage st;
    st.index = s;
    const auto& dp = I.grid->dp_group();
    zeroshard::FullyShardOptions fo;
    fo.shard_size = o.shard_size;
    fo.gather_dtype = o.gather_dtype;
    {
      // ZeRO-3: each layer keeps only this rank's shard as soon as it is built.
      std::optional<zeroshard::DeferredInit> deferred;
      if (o.zero_stage == 3) deferred.emplace(dp, fo);
      st.module = BartStage(config, I.partition.stages[static_cast<size_t>(s)], o.seed);
    }
    st.module->to(o.device, o.dtype);
    if (o.zero_stage == 3) {
      st.sharded = zeroshard::fully_shard(st.module, dp, fo);
      st.optimizer = std::make_shared<zeroshard::FullyShardedAdamW>(st.sharded, o.adamw);
    } else {  // the tied weight in a group of its own: the same shard on every stage (PipelineExecutor::tie)
      const auto tied = st.module->tied_weight();
      std::vector<torch::Tensor> rest;
      for (const auto& p : st.module->parameters()) {
        if (!tied.defined() || !p.is_same(tied)) rest.push_back(p);
      }
      std::vector<torch::optim::OptimizerParamGroup> groups;
      if (!rest.empty()) groups.emplace_back(rest);
      if (tied.defined()) groups.emplace_back(std::vector<torch::Tensor>{tied});
      zeroshard::ShardedAdamWOptions so;
      so.zero_stage = o.zero_stage;
      so.shard_size = o.shard_size;
      st.optimizer = std::make_shared<zeroshard::ShardedAdamW>(groups, dp, o.adamw, so);
    }
    I.train->shard_stage(s, StageShards{st.optimizer, st.sharded});
    if (st.module->tied_weight().defined()) I.train->tie(0, s, st.module->tied_weight());
    I.by_index.emplace(s, st.module);
    I.stages.push_back(std::move(st));
  }
}

PipelinedBart::~PipelinedBart() = default;

StepResult PipelinedBart::train_step(std::vector<Microbatch> micro, double global_tokens) {
  auto& I = *impl_;
  TORCH_CHECK_VALUE(static_cast<int>(micro.size()) == I.options.micro_batches, "PipelinedBart::train_step: ",
                    micro.size(), " microbatches; the schedule has ", I.options.micro_batches);
  TORCH_CHECK_VALUE(global_tokens > 0, "PipelinedBart::train_step: the global batch has no target tokens");
  I.set_micro(std::move(micro), "train_step");
  I.weight.assign(I.micro.size(), I.grid->dp() / global_tokens);
  return I.train->run_step();
}

double PipelinedBart::evaluate(std::vector<Microbatch> micro, const std::vector<double>& weights) {
  auto& I = *impl_;
  TORCH_CHECK_VALUE(weights.size() == micro.size(), "PipelinedBart::evaluate: ", weights.size(), " weights for ",
                    micro.size(), " microbatches");
  const int m = static_cast<int>(micro.size());
  I.set_micro(std::move(micro), "evaluate");
  // The executor averages over data-parallel ranks; the weights make it a sum.
  I.weight.clear();
  for (double w : weights) I.weight.push_back(w * I.grid->dp());
  auto& ex = I.eval[m];
  if (!ex) {
    ex = std::make_unique<PipelineExecutor>(
        *I.grid, make_schedule(ScheduleKind::kForward, I.options.pp, m, I.options.chunks), I.functions());
  }
  for (auto& s : I.stages) s.module->eval();
  const auto r = ex->run_step();
  for (auto& s : I.stages) s.module->train();
  return r.loss;
}

std::shared_ptr<zeroshard::StepAgreement> PipelinedBart::agreement() const { return impl_->train->agreement(); }

const BartConfig& PipelinedBart::config() const { return impl_->config; }
const PipelineGrid& PipelinedBart::grid() const { return *impl_->grid; }
const Partition& PipelinedBart::partition() const { return impl_->partition; }
const std::vector<Block>& PipelinedBart::timed_blocks() const { return impl_->timed; }
const Schedule& PipelinedBart::schedule() const { return impl_->train->schedule(); }
const std::vector<PipelinedBart::Stage>& PipelinedBart::stages() const { return impl_->stages; }

int64_t PipelinedBart::bytes_sent() const {
  const auto& g = *impl_->grid;
  int64_t b = g.pp_group().data->stats().total().bytes_sent;
  for (size_t k = 0; k < g.options().ties.size(); ++k) {
    if (g.tie_group(k).data) b += g.tie_group(k).data->stats().total().bytes_sent;
  }
  return b;
}

zeroshard::CheckpointOptions PipelinedBart::checkpoint_options(zeroshard::CheckpointOptions base) const {
  base.pp_stages = impl_->options.pp;
  base.pp_stage = impl_->grid->stage();
  base.saved_names["lm_head.weight"] = "model.shared.weight";
  return base;
}

std::vector<zeroshard::Checkpointer::Part> PipelinedBart::checkpoint_parts() const {
  std::vector<zeroshard::Checkpointer::Part> parts;
  for (const auto& st : impl_->stages) parts.push_back({st.optimizer.get(), st.module.ptr().get()});
  return parts;
}

}  // namespace bart
