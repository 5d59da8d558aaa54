// deferred_init.cpp — units that keep only their shard from construction on
// (DeferredInit), and initializing their parameters one at a time.
#include "shard/zero3/deferred_init.h"

#include "shard/zero3/module_access.h"

#include "shard/core/resharded_param.h"
#include "shard/core/shard_topology.h"
#include "zeroshard/fully_shard.h"

#include <torch/torch.h>
#include <xxhash.h>

#include <limits>
#include <malloc.h>
#include <memory>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace shard {
namespace {

// The DeferredInit alive on this thread.
struct Scope {
  int shard_size = 1, shard_rank = 0;
  c10::Device device = c10::kCPU;
  std::unordered_set<const c10::TensorImpl*> claimed;  // parameters of units already built (nested units first)
};
thread_local std::unique_ptr<Scope> current_scope;

uint64_t hash_of(const at::Tensor& t) {
  const auto c = t.detach().to(at::kCPU).contiguous();
  return XXH3_64bits(c.data_ptr(), c.nbytes());
}

}  // namespace

void DeferredUnit::keep_shard_of(size_t i, const at::Tensor& full) {
  const auto flat = full.detach().reshape({-1});
  for (const auto& seg : segments) {
    if (seg.param != i) continue;
    const Range local = seg.local(layout, shard_rank);
    values.slice(0, local.begin, local.end).copy_(flat.slice(0, seg.param_offset, seg.param_offset + seg.flat.size()));
  }
  hashes[i] = hash_of(full);
}

uint64_t DeferredUnit::hash() const { return XXH3_64bits(hashes.data(), hashes.size() * sizeof(uint64_t)); }

}  // namespace shard

DeferredInit::DeferredInit(const ProcessGroup& group, const FullyShardOptions& options) {
  TORCH_CHECK_VALUE(shard::current_scope == nullptr, "DeferredInit: another DeferredInit is alive on this thread; "
                    "build each model under one, and let it end before the next");
  TORCH_CHECK_VALUE(group.data != nullptr, "DeferredInit: the communicator is null; pass the group fully_shard() gets");
  auto scope = std::make_unique<shard::Scope>();
  scope->shard_size = shard::resolve_shard_size(group, options.shard_size, "DeferredInit");
  scope->shard_rank = group.data->rank() % scope->shard_size;
  scope->device = group.data->device();
  shard::current_scope = std::move(scope);
}

DeferredInit::~DeferredInit() {
  shard::current_scope.reset();
#if defined(__GLIBC__)
  // Construction allocated and freed each unit's parameters in turn. Once the
  // first of them is freed, glibc serves blocks of their size from its heap
  // instead of mmap, and the shards kept between them leave the freed blocks
  // as holes it keeps resident: measured 1.3 GB more per rank for BART-large
  // at 4 ranks (3.6 GB against 2.3 built whole). Hand the free pages back.
  malloc_trim(0);
#endif
}

ShardedModule::ConstructionHook::ConstructionHook(torch::nn::Module& module, ShardedModule& marker) {
  auto* scope = shard::current_scope.get();
  if (scope == nullptr) return;
  torch::NoGradGuard no_grad;
  std::vector<ParamInfo> infos;
  std::vector<at::Tensor> tensors;
  for (const auto& item : module.named_parameters()) {
    if (scope->claimed.count(item.value().unsafeGetTensorImpl())) continue;  // a nested unit's
    const auto& p = item.value();
    TORCH_CHECK_VALUE(p.is_floating_point(), "DeferredInit: parameter '", item.key(), "' of a ", module.name(),
                      " unit has dtype ", c10::toString(p.scalar_type()), "; units hold Float, BFloat16 or Half "
                      "parameters");
    TORCH_CHECK_VALUE(infos.empty() || p.scalar_type() == infos[0].dtype, "DeferredInit: a ", module.name(),
                      " unit mixes dtypes: '", infos.empty() ? "" : infos[0].name, "' is ",
                      c10::toString(infos[0].dtype), " but '", item.key(), "' is ", c10::toString(p.scalar_type()),
                      "; build the unit in one dtype");
    infos.push_back({item.key(), p.sizes().vec(), p.scalar_type()});
    tensors.push_back(p);
  }
  if (tensors.empty()) return;  // fully_shard() names a unit without parameters of its own
  auto unit = std::make_shared<shard::DeferredUnit>();
  unit->layout = make_flat_layout(infos, scope->shard_size);
  unit->shard_rank = scope->shard_rank;
  unit->segments = shard_segments(unit->layout, scope->shard_rank);
  unit->values = at::zeros({unit->layout.shard_numel()},
                           at::TensorOptions().dtype(unit->layout.dtype).device(scope->device));
  unit->hashes.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    unit->keep_shard_of(i, tensors[i]);
    shard::remember_resharded_param(tensors[i], infos[i].name, module.name(), /*deferred=*/true);
    tensors[i].set_data(shard::make_resharded_placeholder(tensors[i]));  // frees the full values
    scope->claimed.insert(tensors[i].unsafeGetTensorImpl());
  }
  unit->tensors = std::move(tensors);
  shard::ModuleAccess::deferred(marker) = std::move(unit);
}

void ShardedModule::check_not_deferred() const {
  TORCH_CHECK(!state_ || !state_->deferred, "DeferredInit: a unit built under DeferredInit ran its forward before fully_shard(); it holds "
              "only this rank's shard of its parameters until then. Call fully_shard() on the model first");
}

void initialize_parameters(torch::nn::Module& module,
                           const std::function<void(const std::string&, at::Tensor&)>& init) {
  torch::NoGradGuard no_grad;
  // Each parameter of a deferred unit: its unit and index there.
  std::unordered_map<const c10::TensorImpl*, std::pair<shard::DeferredUnit*, size_t>> deferred;
  auto visit = [&](torch::nn::Module& m) {
    auto* marker = dynamic_cast<ShardedModule*>(&m);
    if (marker == nullptr) return;
    TORCH_CHECK_VALUE(!shard::ModuleAccess::unit(*marker), "initialize_parameters: a ", m.name(), " unit is already sharded by "
                      "fully_shard(); initialize the parameters before fully_shard()");
    const auto& unit = shard::ModuleAccess::deferred(*marker);
    if (!unit) return;
    for (size_t i = 0; i < unit->tensors.size(); ++i) {
      deferred[unit->tensors[i].unsafeGetTensorImpl()] = {unit.get(), i};
    }
  };
  visit(module);
  for (const auto& child : module.modules(/*include_self=*/false)) visit(*child);  // no shared_from_this: constructors call this

  for (auto& item : module.named_parameters()) {
    auto& p = item.value();
    const auto it = deferred.find(p.unsafeGetTensorImpl());
    if (it == deferred.end()) {
      init(item.key(), p);
      continue;
    }
    auto* unit = it->second.first;
    const size_t i = it->second.second;
    const auto placeholder_options = p.options();
    // Materialized for this call alone, every element NaN until init writes it.
    p.set_data(at::full(unit->layout.params[i].shape, std::numeric_limits<double>::quiet_NaN(),
                        at::TensorOptions().dtype(unit->layout.dtype)));
    init(item.key(), p);
    const auto written = p.detach();
    TORCH_CHECK_VALUE(written.sizes() == c10::IntArrayRef(unit->layout.params[i].shape) &&
                          written.scalar_type() == unit->layout.dtype,
                      "initialize_parameters: init changed parameter '", item.key(), "' to ", written.sizes(), " ",
                      c10::toString(written.scalar_type()), "; it must keep its shape ",
                      c10::IntArrayRef(unit->layout.params[i].shape), " and dtype ", c10::toString(unit->layout.dtype));
    TORCH_CHECK_VALUE(!written.isnan().any().item<bool>(), "initialize_parameters: parameter '", item.key(),
                      "' holds NaN after init: it belongs to a unit built under DeferredInit, so init got it without "
                      "its values (only this rank's shard of them exists) and must write every element, not read or "
                      "update them");
    unit->keep_shard_of(i, written);
    p.set_data(shard::make_resharded_placeholder(at::empty({0}, placeholder_options)));
  }
}

}  // namespace zeroshard
