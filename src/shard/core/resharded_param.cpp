// resharded_param.cpp — the dispatch fallback behind resharded parameters.
#include "shard/core/resharded_param.h"

#include "compat/torch_compat.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard::shard {
namespace {

struct Names {
  std::string param, unit;
  bool deferred = false;
};

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}
std::unordered_map<const c10::TensorImpl*, Names>& registry() {
  static std::unordered_map<const c10::TensorImpl*, Names> r;
  return r;
}

// Reduced-gradient markers, by storage (a detached copy has its own TensorImpl).
struct GradMarker {
  std::string owner, param;
};
std::unordered_map<const c10::StorageImpl*, GradMarker>& grad_markers() {
  static std::unordered_map<const c10::StorageImpl*, GradMarker> r;
  return r;
}

const GradMarker* find_marker(const at::Tensor& t) {
  if (!t.defined() || !t.key_set().has(compat::kReshardedParamKey) || !t.has_storage()) return nullptr;
  auto it = grad_markers().find(t.storage().unsafeGetStorageImpl());
  return it == grad_markers().end() ? nullptr : &it->second;
}

// What clearing a gradient calls on it (Module::zero_grad, Optimizer::zero_grad).
bool clears_a_gradient(const std::string& op) {
  return op == "aten::zero_" || op == "aten::fill_" || op == "aten::detach_" || op == "aten::detach";
}

// Operators that only read or replace metadata: what sharding, autograd and
// module bookkeeping call on a parameter while its unit is resharded.
bool passes_through(const std::string& op) {
  static const std::unordered_set<std::string> ok{
      "aten::set_data", "aten::_has_compatible_shallow_copy_type", "aten::requires_grad_", "aten::retain_grad",
      "aten::retains_grad", "aten::is_leaf", "aten::output_nr", "aten::_version", "aten::detach", "aten::size",
      "aten::numel", "aten::dim", "aten::sym_size", "aten::sym_numel"};
  return ok.count(op) > 0;
}

// Conversions Module::to applies to every parameter.
bool converts(const std::string& op) { return op == "aten::to" || op == "aten::_to_copy"; }

const Names* find_named(const torch::jit::Stack& args) {
  auto check = [](const at::Tensor& t) -> const Names* {
    if (!t.defined() || !t.key_set().has(compat::kReshardedParamKey)) return nullptr;
    auto it = registry().find(t.unsafeGetTensorImpl());
    return it == registry().end() ? nullptr : &it->second;
  };
  for (const auto& v : args) {
    if (v.isTensor()) {
      if (const auto* n = check(v.toTensor())) return n;
    } else if (v.isTensorList()) {
      const auto list = v.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        if (const auto* n = check(list.get(i))) return n;
      }
    }
  }
  return nullptr;
}

void resharded_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const std::string& name = op.schema().name();
  if (passes_through(name)) {
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, compat::kReshardedParamKey), stack);
    return;
  }
  const size_t n = op.schema().arguments().size();
  const torch::jit::Stack args(stack->end() - static_cast<std::ptrdiff_t>(std::min(n, stack->size())), stack->end());
  std::unique_lock<std::mutex> lock(registry_mutex());
  const GradMarker* marker = nullptr;
  for (const auto& v : args) {
    if (v.isTensor() && (marker = find_marker(v.toTensor())) != nullptr) break;
  }
  if (marker != nullptr) {
    if (clears_a_gradient(name)) {  // on no elements: nothing to do
      lock.unlock();
      op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, compat::kReshardedParamKey),
                         stack);
      return;
    }
    TORCH_CHECK(false, marker->owner, ": the gradient of '", marker->param, "' was reduced into the optimizer's "
                "shards (each rank keeps its part), so p.grad() holds no values, only this stand-in (", name,
                " was called on it). torch::nn::utils::clip_grad_norm_ cannot see a sharded gradient: call "
                "opt.clip_grad_norm(max_norm) between backward and step(); it returns the global norm. To read "
                "gradients in full, run that backward under opt.no_sync() (docs/drop-in.md)");
  }
  const Names* names = find_named(args);
  if (names != nullptr && names->deferred) {
    if (converts(name) && n > 0) {
      // Module::to on a deferred unit: the same conversion of an unmarked
      // empty tensor, marked again. fully_shard() converts the kept shard.
      lock.unlock();
      auto& self = *(stack->end() - static_cast<std::ptrdiff_t>(n));
      self = at::empty({0}, self.toTensor().options());
      op.callBoxed(stack);
      stack->back() = make_resharded_placeholder(stack->back().toTensor());
      return;
    }
    TORCH_CHECK(false, "DeferredInit: parameter '", names->param, "' of a ", names->unit, " unit built under "
                "DeferredInit was used (", name, ") before fully_shard(): until then the unit holds only this rank's "
                "shard of it. Write initial values through zeroshard::initialize_parameters(), and call fully_shard() "
                "before using the model");
  }
  const std::string what = names != nullptr
                               ? "parameter '" + names->param + "' of unit '" + names->unit + "'"
                               : std::string("a parameter of a fully_shard unit (or a tensor detached from one)");
  TORCH_CHECK(false, "fully_shard: ", what, " was used (", name,
              ") outside the unit's forward and backward, where it is resharded and holds no values. Use it inside "
              "that module's forward, leave its module unwrapped so the root keeps it gathered, or read it under "
              "summon_full_params()");
}

void register_fallback_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Kept alive for the process: the registration lasts as long as the Library.
    static auto* lib = new torch::Library(torch::Library::IMPL, "_", compat::kReshardedParamKey, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&resharded_fallback>());
  });
}

}  // namespace

at::Tensor make_resharded_placeholder(const at::Tensor& like) {
  register_fallback_once();
  auto empty = at::empty({0}, like.options());
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(empty.storage()),
                                                   empty.key_set().add(compat::kReshardedParamKey), empty.dtype());
  return at::Tensor(std::move(impl));
}

at::Tensor make_reduced_grad_marker(const at::Tensor& param, std::string owner, std::string param_name) {
  auto marker = make_resharded_placeholder(param);
  std::lock_guard<std::mutex> lock(registry_mutex());
  grad_markers()[marker.storage().unsafeGetStorageImpl()] = {std::move(owner), std::move(param_name)};
  return marker;
}

void forget_reduced_grad_marker(const at::Tensor& marker) {
  if (!marker.defined()) return;
  std::lock_guard<std::mutex> lock(registry_mutex());
  grad_markers().erase(marker.storage().unsafeGetStorageImpl());
}

bool is_reduced_grad_marker(const at::Tensor& t) {
  if (!t.defined() || !t.key_set().has(compat::kReshardedParamKey)) return false;
  std::lock_guard<std::mutex> lock(registry_mutex());
  return find_marker(t) != nullptr;
}

void remember_resharded_param(const at::Tensor& p, std::string param, std::string unit, bool deferred) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[p.unsafeGetTensorImpl()] = {std::move(param), std::move(unit), deferred};
}

void forget_resharded_param(const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(p.unsafeGetTensorImpl());
}

}  // namespace zeroshard::shard
