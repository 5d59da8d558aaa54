// resharded_param.cpp — the dispatch fallback behind resharded parameters.
#include "shard/resharded_param.h"

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

void remember_resharded_param(const at::Tensor& p, std::string param, std::string unit, bool deferred) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[p.unsafeGetTensorImpl()] = {std::move(param), std::move(unit), deferred};
}

void forget_resharded_param(const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(p.unsafeGetTensorImpl());
}

}  // namespace zeroshard::shard
