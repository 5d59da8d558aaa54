// zeroshard/fully_shard.h — ZeRO-3: parameters sharded across ranks. Each rank keeps 1/N of every
// parameter (and its gradient and AdamW state); a unit's full parameters exist only while it runs.
//
//   std::vector<zeroshard::Sharded<EncoderLayer>> layers;   // in the model; was: std::vector<EncoderLayer>
//   auto sharded = zeroshard::fully_shard(model, comm);     // every Sharded<> unit, plus the root
//   zeroshard::FullyShardedAdamW opt(sharded, torch::optim::AdamWOptions(3e-4));
//
// Ownership: the FullyShardedModel that fully_shard() returns owns the sharding; keep it while the
// model trains. Thread-safety: use from the training thread (autograd hooks are synchronized
// internally). Collective: every rank runs the same forward and backward calls.
// How it works: docs/fully-shard.md.
#pragma once

#include "zeroshard/comm.h"
#include "zeroshard/flat_layout.h"
#include "zeroshard/sharded_optimizer.h"

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace zeroshard {

struct FullyShardOptions {
  // true: free a unit's gathered parameters after its forward and gather them again for its
  // backward. false: keep them until its backward is done (fewer all-gathers, ZeRO-2-like
  // parameter memory). The root unit always stays gathered. Default: true.
  bool reshard_after_forward = true;
  // With reshard_after_forward: the unit that ran last in the recorded forward order stays
  // gathered until its backward (saves an exposed all-gather; costs one unit's gathered bytes).
  // From the second step on, for forwards with gradients that follow the recorded order.
  // Default: true.
  bool keep_last_unit_for_backward = true;
  // Gradient reduce-scatters in flight before backward waits for the oldest. Default: 2.
  int max_inflight_reductions = 2;
  // From the second step on, issue the all-gathers of the next units in the execution order
  // recorded in the first step while the current one computes. false: gather each unit when
  // it is needed. Default: true.
  bool prefetch = true;
  // Units gathered ahead of the current one by prefetching, at most. Default: 2.
  int max_inflight_gathers = 2;
  // dtype gradients are reduce-scattered in. Undefined: the parameters'. BFloat16 or Half:
  // half the bytes for fp32 units. Float: 16-bit units reduced in full precision.
  // Default: Undefined.
  c10::ScalarType reduce_dtype = c10::ScalarType::Undefined;
  // dtype units are all-gathered in. Undefined: the parameters'. For fp32 units, BFloat16 or
  // Half: half the bytes, and forward and backward see the parameters rounded to it while the
  // optimizer updates the fp32 master; Char: block-quantized int8 (about 1.02 bytes per value;
  // each value off by at most 1/254 of its block's largest magnitude). The root unit gathers
  // in its own dtype. Default: Undefined.
  c10::ScalarType gather_dtype = c10::ScalarType::Undefined;
  // Hybrid sharding: shard units across groups of this many consecutive ranks and replicate
  // them across the groups. 0: every rank (flat ZeRO-3). kShardPerHost: the ranks of one host.
  // N: N ranks; REQUIRES: N divides the world size. Default: 0.
  int shard_size = 0;
};

class FullyShardedModel;

// Bytes a fully sharded model holds on this rank, from the tensors' storages.
struct FullyShardedMemory {
  int64_t shards = 0;         // units' shards in the parameter dtype: 4Ψ/N (fp32), 2Ψ/N (bf16)
  int64_t master = 0;         // fp32 masters of bf16 shards (root included): 4Ψ/N
  int64_t grad_shards = 0;    // reduced gradient shards (between backward and step): 4Ψ/N
  int64_t root_params = 0;    // the root unit's parameters, gathered (its shard is a slice of them)
  int64_t gathered = 0;       // units' parameters gathered right now
  int64_t peak_gathered = 0;  // most bytes of units gathered at once since fully_shard()
};

// Communication the training thread waited for (CommWaits: gathers, reductions),
// in seconds since fully_shard().
using FullyShardedWaits = CommWaits;

namespace shard {
struct ModuleAccess;  // internal
}  // namespace shard

// The base of every Sharded<> module: what fully_shard() looks for in the module tree. Once
// fully_shard() made the module a unit, its forward gathers and reshards it; until then the
// forward passes through. Used by ShardedImpl; not for direct use.
class ShardedModule {
 public:
  virtual ~ShardedModule();

 protected:
  bool is_unit() const;
  // Throws when the module was built under DeferredInit and is not sharded yet.
  void check_not_deferred() const;
  void before_forward();
  void end_forward();
  // Hooks the forward's tensor outputs (alone, in pairs, tuples or vectors) so that the unit is
  // gathered for its backward; other values pass through.
  at::Tensor after_forward(at::Tensor out);
  std::vector<at::Tensor> after_forward(std::vector<at::Tensor> out);
  template <typename A, typename B>
  std::pair<A, B> after_forward(std::pair<A, B> out) {
    return {after_forward(std::move(out.first)), after_forward(std::move(out.second))};
  }
  template <typename... Ts>
  std::tuple<Ts...> after_forward(std::tuple<Ts...> out) {
    return std::apply([this](auto&&... xs) { return std::tuple<Ts...>(after_forward(std::move(xs))...); },
                      std::move(out));
  }
  template <typename T>
  T after_forward(T out) {
    return out;
  }

  // Runs right after the Sharded<> module's own constructor: under a DeferredInit it keeps
  // this rank's shard of the unit's parameters and frees them. Copying does nothing (a copy
  // was not built under the scope).
  class ConstructionHook {
   public:
    ConstructionHook(torch::nn::Module& module, ShardedModule& marker);
    ConstructionHook(const ConstructionHook&) {}
    ConstructionHook& operator=(const ConstructionHook&) { return *this; }
  };

 private:
  // internal: fully_shard(), DeferredInit and initialize_parameters() reach the state here.
  friend struct shard::ModuleAccess;
  struct State;                   // the unit once sharded; this rank's shard while deferred
  std::shared_ptr<State> state_;  // null until either exists
};

// A module of type Impl that fully_shard() will make a unit: the same constructors, members
// and forward as Impl, which it is until fully_shard() runs (so the model also trains unsharded).
template <typename Impl>
class ShardedImpl : public Impl, public ShardedModule {
 public:
  using Impl::Impl;
  template <typename... Args>
  auto forward(Args&&... args) {
    if (!is_unit()) {
      check_not_deferred();
      return Impl::forward(std::forward<Args>(args)...);
    }
    before_forward();
    auto out = Impl::forward(std::forward<Args>(args)...);
    auto result = after_forward(std::move(out));
    end_forward();
    return result;
  }

 private:
  // Initialized after Impl's constructor has run (inherited constructors too).
  ConstructionHook construction_hook_{static_cast<torch::nn::Module&>(*this), static_cast<ShardedModule&>(*this)};
};

// Sharded<EncoderLayer> for a TORCH_MODULE holder EncoderLayer: declares a unit in the model.
template <typename Holder>
class Sharded : public torch::nn::ModuleHolder<ShardedImpl<typename Holder::ContainedType>> {
 public:
  using torch::nn::ModuleHolder<ShardedImpl<typename Holder::ContainedType>>::ModuleHolder;
};

// While it lives on this thread, each Sharded<> unit built keeps only this rank's shard of its
// parameters (on the group's device), and fully_shard() adopts those shards instead of
// broadcasting rank 0's values: for models no rank can hold whole.
//
//   torch::manual_seed(seed);                  // the same seed on every rank
//   zeroshard::DeferredInit deferred(group, options);
//   Model model(config);                       // units hold only their shards
//   auto sharded = zeroshard::fully_shard(model, group, options);
//
// REQUIRES: every rank runs the same construction with the same seed (fully_shard() checks
// that the units hash equal); `options.shard_size` is the one fully_shard() gets; one
// DeferredInit at a time per thread. Collective with kShardPerHost (ranks exchange host names).
// Until fully_shard(), a unit's parameters hold no values: using them throws; model->to(device,
// dtype) is allowed. Weights initialized after construction go through initialize_parameters().
class DeferredInit {
 public:
  explicit DeferredInit(const ProcessGroup& group, const FullyShardOptions& options = {});
  ~DeferredInit();
  DeferredInit(const DeferredInit&) = delete;
  DeferredInit& operator=(const DeferredInit&) = delete;
};

// Calls init(name, parameter) for every parameter under `module`, in named_parameters() order,
// with the parameter's full value to write, without gradient recording. A parameter of a unit
// built under DeferredInit is materialized (on the CPU) for that call alone, and the unit keeps
// this rank's part of what `init` wrote; other parameters are passed as they are.
// REQUIRES: called before fully_shard(); for a deferred unit's parameter, `init` writes every
// element (it cannot read the constructed values: only a shard of them exists).
void initialize_parameters(torch::nn::Module& module,
                           const std::function<void(const std::string&, at::Tensor&)>& init);

// Shards every Sharded<> unit under `root` and makes one more unit, the root, of the parameters
// no unit took (embeddings, a tied head, a final norm); the root stays gathered. Every rank
// starts from rank 0's values (units built under a DeferredInit: each rank's own shard).
// `group`: a CPU communicator (init_communicator), or a device one with its CPU control plane
// (init_nccl, stage_through_host).
// REQUIRES: parameters on the group's device (group.data->device()); Float, BFloat16 or Half,
//           one dtype per unit (16-bit units keep an fp32 master shard; Half wants loss
//           scaling, on by default in FullyShardedAdamW); each unit has parameters of its own,
//           and none belongs to two units.
// Throws, naming the parameter or unit, when one of these fails, and on every rank when the
// ranks' models differ (compared by a hash of every unit's names, shapes and dtypes before any
// data moves). Collective: every rank calls it on the same model.
// Keep the result: the units live as long as it does. Dropping it makes the Sharded<> wrappers
// pass-through again, with resharded parameters left empty (any use of them throws).
[[nodiscard]] std::shared_ptr<FullyShardedModel> fully_shard(const std::shared_ptr<torch::nn::Module>& root,
                                                             ProcessGroup group, FullyShardOptions options = {});
// A module holder (TORCH_MODULE's `Net`, torch::nn::Linear, ...).
template <typename Holder, typename = decltype(std::declval<Holder&>().ptr())>
[[nodiscard]] std::shared_ptr<FullyShardedModel> fully_shard(Holder& root, ProcessGroup group,
                                                             FullyShardOptions options = {}) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(root.ptr()), std::move(group), options);
}

// The sharding state of a model. Outside its unit's forward and backward a parameter keeps its
// tensor identity but holds no elements; any operator on it throws, naming it.
class FullyShardedModel {
 public:
  ~FullyShardedModel();
  FullyShardedModel(const FullyShardedModel&) = delete;
  FullyShardedModel& operator=(const FullyShardedModel&) = delete;

  struct UnitInfo {
    std::string name;       // module path ("decoder.layers.2"); "" for the root
    FlatLayout layout;      // its parameters and their offsets
    Range shard;            // this rank's elements
    bool gathered = false;  // whether its full parameters are materialized now
  };
  // The units, in registration order, the root last.
  std::vector<UnitInfo> units() const;
  Communicator& communicator() const;
  FullyShardedMemory memory() const;
  FullyShardedWaits waits() const;
  // Traffic of the gradient reduce-scatters, which run on a communicator of their own (a split
  // of the same ranks); the gathers' traffic is in communicator().stats().
  CommStats reduction_stats() const;

  // While the returned guard lives every unit is gathered, so each parameter holds its full
  // value (to read, evaluate or export); they are resharded when it ends.
  // Collective. REQUIRES: not during forward or backward.
  class FullParamsGuard {
   public:
    explicit FullParamsGuard(FullyShardedModel* model);
    ~FullParamsGuard();
    FullParamsGuard(FullParamsGuard&& other) noexcept;
    FullParamsGuard(const FullParamsGuard&) = delete;
    FullParamsGuard& operator=(const FullParamsGuard&) = delete;

   private:
    FullyShardedModel* model_;
  };
  FullParamsGuard summon_full_params();

  // While the returned guard lives every unit stays gathered: one all-gather per unit when it is
  // made, none in the forwards and backwards under it; resharded when it ends. For a pipeline
  // stage, whose microbatches' passes interleave within a step (memory: the whole stage's
  // parameters). An update under it re-gathers the updated units.
  // Collective. REQUIRES: not during backward.
  class KeepGatheredGuard {
   public:
    explicit KeepGatheredGuard(FullyShardedModel* model);
    ~KeepGatheredGuard();
    KeepGatheredGuard(KeepGatheredGuard&& other) noexcept;
    KeepGatheredGuard(const KeepGatheredGuard&) = delete;
    KeepGatheredGuard& operator=(const KeepGatheredGuard&) = delete;

   private:
    FullyShardedModel* model_;
  };
  KeepGatheredGuard keep_gathered();


 private:
  friend std::shared_ptr<FullyShardedModel> fully_shard(const std::shared_ptr<torch::nn::Module>& root,
                                                        ProcessGroup group, FullyShardOptions options);
  friend class FullyShardedAdamW;  // its front-end is the model's state
  struct State;  // the units and their protocol
  explicit FullyShardedModel(std::unique_ptr<State> state);
  State& state() const { return *state_; }
  std::unique_ptr<State> state_;
};

struct FullyShardedAdamWOptions {
  // > 0: step() clips the gradient to this global L2 norm unless
  // clip_grad_norm() was already called this step. Default: 0 (no clipping).
  double max_grad_norm = 0;
  // Dynamic loss scaling. Default: on when the model has Half units.
  LossScaleOptions loss_scale;
};

// AdamW over a fully sharded model: the fused kernel updates each unit's shard in place, where
// the next forward gathers from. Everything else (step(), clip_grad_norm(), no_sync(),
// zero_grad(), checkpoint state, stats()) is ShardedOptimizer's. Without no_sync(), every
// backward reduce-scatters into this rank's fp32 gradient shard; under it, gradients accumulate
// in full in p.grad() until the next backward outside it, or step(). Collective.
class FullyShardedAdamW : public ShardedOptimizer {
 public:
  // One param group: every trainable parameter, with `defaults`:
  // torch::optim::AdamWOptions, or AdamOptions with weight_decay 0.
  FullyShardedAdamW(std::shared_ptr<FullyShardedModel> model,
                    const torch::optim::OptimizerOptions& defaults = torch::optim::AdamWOptions(),
                    FullyShardedAdamWOptions options = {});
  // Param groups with their own AdamWOptions (lr, betas, eps, weight_decay); groups without
  // options take `defaults`. LR schedulers change param_groups() as usual.
  // REQUIRES: the groups hold the model's own parameter tensors (as module->parameters()
  // returns them) and together every trainable one, each once; throws naming the parameter.
  FullyShardedAdamW(std::shared_ptr<FullyShardedModel> model, std::vector<torch::optim::OptimizerParamGroup> groups,
                    const torch::optim::OptimizerOptions& defaults = torch::optim::AdamWOptions(),
                    FullyShardedAdamWOptions options = {});
  ~FullyShardedAdamW() override;

 private:
  std::shared_ptr<FullyShardedModel> model_;
};

}  // namespace zeroshard
