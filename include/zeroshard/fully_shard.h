// zeroshard/fully_shard.h — ZeRO-3: parameters themselves sharded across ranks.
//
// A *unit* is a module whose parameters are sharded together (typically one
// transformer layer). The model declares its units by wrapping their type,
// and stays ordinary LibTorch code:
//
//   struct ModelImpl : torch::nn::Module {
//     std::vector<zeroshard::Sharded<EncoderLayer>> layers;   // was: std::vector<EncoderLayer>
//     ...
//   };
//
// Until fully_shard() is called a Sharded<T> is T (same constructor, members and
// forward), so the same model also trains unsharded. fully_shard(model, comm)
// then shards every unit it finds in the module tree and makes one more unit,
// the root, of the parameters no unit took (embeddings, a tied head, a final
// norm).
//
// Each parameter keeps its tensor identity. While its unit is gathered the
// tensor is a view of the unit's full flat buffer; while resharded it holds no
// elements and only this rank's 1/N slice exists (in the unit's shard). A
// unit's forward gathers it (all-gather), runs, and reshards it afterwards
// (`reshard_after_forward`); a hook on its outputs gathers it again before its
// backward; when all of its gradients are in, they are reduce-scattered into
// this rank's fp32 gradient shard and freed. The root stays gathered.
//
// Train with FullyShardedAdamW, which updates each unit's shard in place.
//
// Thread-safety: use from the training thread; autograd hooks are synchronized
// internally. Collective: every rank must run the same forward/backward calls.
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
  // Free a unit's gathered parameters after its forward (true) or keep them
  // until its backward is done (false: fewer all-gathers, ZeRO-2-like memory).
  // The root unit always stays gathered. Default: true.
  bool reshard_after_forward = true;
  // With reshard_after_forward: the unit that ran last in the recorded forward
  // order keeps its parameters gathered until its backward, which typically
  // comes right after it (its reshard and re-gather would only add an exposed
  // all-gather). Costs one unit's gathered bytes between forward and backward.
  // Applies from the second step on, to forward passes with gradients that
  // follow the recorded order. Default: true.
  bool keep_last_unit_for_backward = true;
  // Gradient reduce-scatters in flight before backward waits for the oldest. Default: 2.
  int max_inflight_reductions = 2;
  // Prefetch: from the second step on, the all-gathers of the next units in
  // execution order (recorded in the first step) are issued while the current
  // one computes. false: every unit is gathered when it is needed. Default: true.
  bool prefetch = true;
  // Units gathered ahead of the current one by prefetching, at most. Default: 2.
  int max_inflight_gathers = 2;
  // dtype gradients are reduce-scattered in: Undefined = the parameters' dtype;
  // BFloat16 (or Half) halves the reduce-scatter bytes of fp32 units (the TCP
  // communicator still accumulates the sum in fp32 and rounds once; NCCL sums
  // in 16 bits); Float reduces 16-bit units' gradients in full precision.
  // Default: Undefined.
  c10::ScalarType reduce_dtype = c10::ScalarType::Undefined;
  // dtype units are all-gathered in: Undefined = the parameters' dtype;
  // BFloat16 (or Half) halves the gather bytes of fp32 units (ZeRO++'s
  // quantized weights, in bf16): each rank gathers its shard rounded to it and
  // widens the gathered parameters back to fp32, so forward and backward see
  // parameters rounded to bf16 while the optimizer updates the fp32 master.
  // Char: block-quantized int8 (ZeRO++'s qwZ), about 1.02 bytes per value:
  // blocks of 256 values, each sent as int8 with an fp32 scale (max|x|/127),
  // so a parameter is off by at most 1/254 of its block's largest magnitude.
  // The root unit, which is never resharded, gathers in its own dtype.
  // Default: Undefined.
  c10::ScalarType gather_dtype = c10::ScalarType::Undefined;
  // Hybrid sharding: units are sharded across groups of this many consecutive
  // ranks and replicated across the groups (FSDP2's HSDP, DeepSpeed's MiCS).
  // A unit is gathered from its shard group only; gradients are
  // reduce-scattered in the group, then each reduced shard is averaged across
  // the groups. 0: every rank (flat ZeRO-3). kShardPerHost: the ranks of one
  // host. N: N ranks (it must divide the ranks). Default: 0.
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
struct ShardedModel;  // src/shard/unit.h
struct ModuleAccess;  // src/shard/module_access.h
}  // namespace shard

// What fully_shard() looks for in the module tree: the base of every
// Sharded<> module, through which its forward gathers and reshards once
// fully_shard() made it a unit (until then it passes through).
class ShardedModule {
 public:
  virtual ~ShardedModule();

 protected:
  bool is_unit() const;
  // Built under DeferredInit and not yet sharded: running it is an error.
  void check_not_deferred() const;
  void before_forward();
  void end_forward();
  // The forward's outputs (tensors, pairs, tuples, vectors of tensors; other
  // values pass through) get the hooks that gather the unit for backward.
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

  // Runs right after a Sharded<> module's own constructor (a member of
  // ShardedImpl): under a DeferredInit it keeps this rank's shard of the
  // unit's parameters and frees them. A copied module was not built under the
  // scope: copying does nothing.
  class ConstructionHook {
   public:
    ConstructionHook(torch::nn::Module& module, ShardedModule& marker);
    ConstructionHook(const ConstructionHook&) {}
    ConstructionHook& operator=(const ConstructionHook&) { return *this; }
  };

 private:
  // fully_shard(), DeferredInit and initialize_parameters() reach the state
  // through shard::ModuleAccess (src/shard/module_access.h).
  friend struct shard::ModuleAccess;
  struct State;                   // the unit once sharded; this rank's shard while deferred
  std::shared_ptr<State> state_;  // null until either exists
};

// A module of type Impl that fully_shard() will make a unit. Same constructors,
// members and forward as Impl.
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

// Sharded<EncoderLayer> for a TORCH_MODULE holder EncoderLayer.
template <typename Holder>
class Sharded : public torch::nn::ModuleHolder<ShardedImpl<typename Holder::ContainedType>> {
 public:
  using torch::nn::ModuleHolder<ShardedImpl<typename Holder::ContainedType>>::ModuleHolder;
};

// Deferred initialization: a model whose units no rank could hold all at once
// (DeepSpeed's zero.Init, FSDP2's meta-device init). While a DeferredInit
// lives on this thread, each Sharded<> unit, as soon as its constructor has
// run, keeps only this rank's shard of its parameters (on the group's device)
// and frees them; fully_shard() then adopts those shards instead of
// broadcasting rank 0's values. Construction holds the shards built so far,
// the parameters outside units (the root), and one unit at a time.
//
//   torch::manual_seed(seed);                  // the same seed on every rank
//   zeroshard::DeferredInit deferred(group, options);
//   Model model(config);                       // units hold only their shards
//   auto sharded = zeroshard::fully_shard(model, group, options);
//
// Values: every rank runs the whole construction, so the shards equal the
// slices of a single-process construction with the same seed, bit for bit;
// fully_shard() checks that the ranks' units hash equal. A model whose
// constructor initializes its weights after building its units goes through
// initialize_parameters() for that. Between construction and fully_shard() a
// unit's parameters hold no values (using one is an error); model->to(device,
// dtype) converts them as fully_shard() adopts them.
// Collective (with kShardPerHost, ranks exchange host names); `options`'
// shard_size must be the one fully_shard() gets. One at a time per thread.
class DeferredInit {
 public:
  explicit DeferredInit(const ProcessGroup& group, const FullyShardOptions& options = {});
  ~DeferredInit();
  DeferredInit(const DeferredInit&) = delete;
  DeferredInit& operator=(const DeferredInit&) = delete;
};

// Calls init(name, parameter) for every parameter under `module`, in
// named_parameters() order, with the parameter's full value to write. A
// parameter of a unit built under DeferredInit is materialized for the call
// alone (one at a time, on the CPU) and its unit keeps this rank's part of
// what init wrote; `init` must write every element of such a parameter (it
// cannot read the values construction gave it: only a shard of them exists).
// Other parameters are passed as they are. Runs without gradient recording.
// Call it before fully_shard(), e.g. from the model's constructor.
void initialize_parameters(torch::nn::Module& module,
                           const std::function<void(const std::string&, at::Tensor&)>& init);

// Shards every Sharded<> unit under `root` and makes a root unit of the
// remaining parameters. Collective: every rank calls it on the same model
// (ranks exchange a hash of every unit's parameter names, shapes and dtypes and
// refuse to start, naming the first difference, when they disagree). Rank 0's
// parameter values are what every rank starts from (units built under a
// DeferredInit: each rank's own shard, checked equal by hash).
// `group`: a CPU communicator (init_communicator), or a device one with its
// CPU control plane (init_nccl, stage_through_host).
// REQUIRES: parameters on the group's device (group.data->device()), Float, BFloat16 or Half (one dtype per unit;
//           16-bit units keep an fp32 master shard, and gather and reduce in
//           their dtype; Half wants loss scaling, on by default in FullyShardedAdamW);
//           a unit's parameters belong to it alone.
// Keep the result: the units live as long as it does (dropping it makes the
// Sharded<> wrappers pass-through again; resharded parameters stay empty, and
// any use of them fails with an error).
[[nodiscard]] std::shared_ptr<FullyShardedModel> fully_shard(const std::shared_ptr<torch::nn::Module>& root,
                                                             ProcessGroup group, FullyShardOptions options = {});
// A module holder (TORCH_MODULE's `Net`, torch::nn::Linear, ...).
template <typename Holder, typename = decltype(std::declval<Holder&>().ptr())>
[[nodiscard]] std::shared_ptr<FullyShardedModel> fully_shard(Holder& root, ProcessGroup group,
                                                             FullyShardOptions options = {}) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(root.ptr()), std::move(group), options);
}

// The sharding state of a model: its units, in registration order (root last).
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
  std::vector<UnitInfo> units() const;
  Communicator& communicator() const;
  FullyShardedMemory memory() const;
  FullyShardedWaits waits() const;
  // Traffic of the gradient reduce-scatters, which run on a communicator of
  // their own (a split of the same ranks); gathers go through the one given.
  CommStats reduction_stats() const;

  // While the returned guard lives every unit is gathered, so each parameter
  // tensor holds its full value (to read, evaluate or export them); they are
  // resharded when it ends. Collective. Not during forward or backward.
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

  // While the returned guard lives every unit stays gathered: one all-gather
  // per unit when it is made, none in the forwards and backwards that run
  // under it, and the units are resharded when it ends. For a pipeline stage,
  // whose microbatches' forwards and backwards interleave within a step
  // (memory: the stage's whole parameters instead of a few units). An update
  // under it re-gathers the updated units. Collective. Not during backward.
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
  explicit FullyShardedModel(std::unique_ptr<shard::ShardedModel> state);
  shard::ShardedModel& state() const { return *state_; }
  std::unique_ptr<shard::ShardedModel> state_;
};

struct FullyShardedAdamWOptions {
  // > 0: step() clips the gradient to this global L2 norm unless
  // clip_grad_norm() was already called this step. Default: 0 (no clipping).
  double max_grad_norm = 0;
  // Dynamic loss scaling; on by default when the model has Half units.
  LossScaleOptions loss_scale;
};

// AdamW over a fully sharded model (ZeRO-3): the fused kernel runs on each
// unit's shard (this rank's 1/N of every parameter), which is where the next
// forward gathers from. step(), clip_grad_norm(), no_sync(), checkpoint state
// and the rest are ShardedOptimizer's. Collective.
//
// Under `auto guard = opt.no_sync();` backward does not communicate: each
// parameter's gradient accumulates in full in p.grad() (memory: the full
// gradient, like unsharded training). The next backward outside the guard,
// or step(), reduces them. Without it, every backward reduce-scatters into
// this rank's fp32 gradient shard (gradient memory stays sharded).
class FullyShardedAdamW : public ShardedOptimizer {
 public:
  // One param group: every trainable parameter, with `defaults`:
  // torch::optim::AdamWOptions, or AdamOptions with weight_decay 0.
  FullyShardedAdamW(std::shared_ptr<FullyShardedModel> model,
                    const torch::optim::OptimizerOptions& defaults = torch::optim::AdamWOptions(),
                    FullyShardedAdamWOptions options = {});
  // Param groups with their own AdamWOptions (lr, betas, eps, weight_decay);
  // groups without options take `defaults`. The groups hold the model's own
  // parameter tensors (as module->parameters() returns them) and together
  // every trainable one, each once. LR schedulers change param_groups() as usual.
  FullyShardedAdamW(std::shared_ptr<FullyShardedModel> model, std::vector<torch::optim::OptimizerParamGroup> groups,
                    const torch::optim::OptimizerOptions& defaults = torch::optim::AdamWOptions(),
                    FullyShardedAdamWOptions options = {});
  ~FullyShardedAdamW() override;

 private:
  std::shared_ptr<FullyShardedModel> model_;
};

}  // namespace zeroshard
