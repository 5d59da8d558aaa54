// fully_shard.cpp — fully_shard(): finding units in the module tree, checking
// them, and laying out each unit's shard (sharded_model.cpp: what the units do
// in a pass).
#include "shard/zero3/unit.h"

#include "shard/zero3/module_access.h"

#include "comm/work.h"
#include "compat/autograd_hooks.h"
#include "compat/torch_compat.h"
#include "runtime/rank_agreement.h"
#include "zeroshard/log.h"


#include <unordered_map>
#include <unordered_set>

namespace zeroshard {

namespace {

void check_options(const FullyShardOptions& options, const std::shared_ptr<Communicator>& comm) {
  TORCH_CHECK_VALUE(comm != nullptr, "fully_shard: the communicator is null; pass zeroshard::init_communicator()");
  TORCH_CHECK_VALUE(options.max_inflight_reductions >= 1, "fully_shard: max_inflight_reductions is ",
                    options.max_inflight_reductions, "; it must be >= 1 (Default: 2)");
  TORCH_CHECK_VALUE(options.max_inflight_gathers >= 1, "fully_shard: max_inflight_gathers is ",
                    options.max_inflight_gathers, "; it must be >= 1 (Default: 2)");
  const auto rd = options.reduce_dtype;
  TORCH_CHECK_VALUE(rd == at::ScalarType::Undefined || rd == at::kFloat || rd == at::kBFloat16 || rd == at::kHalf,
                    "fully_shard: reduce_dtype is ", c10::toString(rd),
                    "; use Float, BFloat16, Half or Undefined (the parameters' dtype)");
  const auto gd = options.gather_dtype;
  TORCH_CHECK_VALUE(gd == at::ScalarType::Undefined || gd == at::kBFloat16 || gd == at::kHalf || gd == at::kChar,
                    "fully_shard: gather_dtype is ", c10::toString(gd),
                    "; use BFloat16, Half, Char (block-quantized int8) or Undefined (the parameters' dtype)");
}

// The units of a model: each Sharded<> module, in pre-order, with the parameters
// under it that no deeper unit claims; the root's are the parameters no unit claims.
struct UnitsFound {
  struct Found {
    std::string path;
    std::shared_ptr<torch::nn::Module> module;
    ShardedModule* marker;
    const shard::DeferredUnit* deferred;  // what DeferredInit built, or null
  };
  std::vector<Found> found;
  std::vector<std::vector<std::string>> names;
  std::vector<std::vector<at::Tensor>> params;
  std::vector<std::string> root_names;
  std::vector<at::Tensor> root_params;
  // Units built under DeferredInit bring this rank's shard; their parameters hold placeholders.
  std::vector<const shard::DeferredUnit*> deferred;
};

// `found`: the Sharded<> modules in pre-order.
UnitsFound claim_parameters(const std::shared_ptr<torch::nn::Module>& root, std::vector<UnitsFound::Found> found) {
  UnitsFound u;
  u.found = std::move(found);
  std::unordered_map<const void*, std::string> claimed;  // parameter -> unit path
  u.names.resize(u.found.size());
  u.params.resize(u.found.size());
  for (size_t k = u.found.size(); k-- > 0;) {
    for (const auto& item : u.found[k].module->named_parameters()) {
      const void* key = item.value().unsafeGetTensorImpl();
      if (claimed.count(key)) continue;
      claimed.emplace(key, u.found[k].path);
      u.names[k].push_back(u.found[k].path.empty() ? item.key() : u.found[k].path + "." + item.key());
      u.params[k].push_back(item.value());
    }
  }
  for (const auto& item : root->named_parameters()) {
    const void* key = item.value().unsafeGetTensorImpl();
    if (claimed.count(key)) continue;
    claimed.emplace(key, "");
    u.root_names.push_back(item.key());
    u.root_params.push_back(item.value());
  }
  u.deferred.assign(u.found.size(), nullptr);
  for (size_t k = 0; k < u.found.size(); ++k) {
    const auto* d = u.found[k].deferred;
    if (d == nullptr) continue;
    bool same = d->tensors.size() == u.params[k].size();
    for (size_t i = 0; same && i < d->tensors.size(); ++i) same = d->tensors[i].is_same(u.params[k][i]);
    TORCH_CHECK_VALUE(same, "fully_shard: unit '", u.found[k].path, "' was built under DeferredInit with ",
                      d->tensors.size(), " parameters of its own but now has ", u.params[k].size(),
                      " (or others); do not add, replace or move parameters between DeferredInit and fully_shard");
    u.deferred[k] = d;
  }
  return u;
}

// Each parameter's device, dtype and leafness, each unit's one dtype, then agreement
// across ranks (every rank found the same units, parameters and options) before any data moves.
void check_units(const UnitsFound& u, const FullyShardOptions& options, const ProcessGroup& group) {
  const auto& comm = group.data;
  std::vector<std::string> entries;
  const shard::DeferredUnit* checking = nullptr;  // the unit check_param is looking at, when deferred
  size_t checking_index = 0;
  auto check_param = [&](const std::string& unit, const std::string& name, const at::Tensor& p) {
    TORCH_CHECK_VALUE(p.device() == comm->device(), "fully_shard: parameter '", name, "' is on ", p.device(),
                      " but the communicator moves ", comm->device(), " tensors; move the model to ", comm->device(),
                      " before fully_shard, or pass a communicator of ", p.device(), " (init_nccl for CUDA)");
    TORCH_CHECK_VALUE(p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf,
                      "fully_shard: parameter '", name, "' has dtype ", c10::toString(p.scalar_type()),
                      "; fully_shard shards Float, BFloat16 and Half parameters (16-bit ones keep an fp32 master)");
    TORCH_CHECK_VALUE(p.is_leaf(), "fully_shard: parameter '", name, "' is not a leaf tensor");
    const auto shape = checking ? checking->layout.params[checking_index++].shape : p.sizes().vec();
    entries.push_back("unit '" + unit + "' " + ParamInfo{name, shape, p.scalar_type()}.describe());
  };
  auto check_one_dtype = [](const std::string& unit, const std::vector<std::string>& names,
                            const std::vector<at::Tensor>& ps) {
    for (size_t i = 1; i < ps.size(); ++i) {
      TORCH_CHECK_VALUE(ps[i].scalar_type() == ps[0].scalar_type(), "fully_shard: unit '", unit, "' mixes dtypes: '",
                        names[0], "' is ", c10::toString(ps[0].scalar_type()), " but '", names[i], "' is ",
                        c10::toString(ps[i].scalar_type()), "; convert the module to one dtype");
    }
  };
  for (size_t k = 0; k < u.found.size(); ++k) {
    TORCH_CHECK_VALUE(!u.params[k].empty(), "fully_shard: unit '", u.found[k].path,
                      "' has no parameters of its own (nested units took them all); drop its Sharded<> wrapper");
    check_one_dtype(u.found[k].path, u.names[k], u.params[k]);
    checking = u.deferred[k];
    checking_index = 0;
    for (size_t i = 0; i < u.params[k].size(); ++i) check_param(u.found[k].path, u.names[k][i], u.params[k][i]);
    checking = nullptr;
    if (u.deferred[k] != nullptr) {
      // Each rank keeps its own shard of what it built: the values must be the same everywhere.
      entries.push_back("unit '" + u.found[k].path + "' built under DeferredInit: values hash " +
                        std::to_string(u.deferred[k]->hash()) + " (ranks differ when their generators were seeded "
                        "differently: call torch::manual_seed with the same seed on every rank before building)");
    }
  }
  for (size_t i = 0; i < u.root_params.size(); ++i) check_param("(root)", u.root_names[i], u.root_params[i]);
  if (!u.root_params.empty()) check_one_dtype("(root)", u.root_names, u.root_params);
  entries.push_back("options: reshard_after_forward=" + std::to_string(options.reshard_after_forward) +
                    " max_inflight_reductions=" + std::to_string(options.max_inflight_reductions) +
                    " prefetch=" + std::to_string(options.prefetch) +
                    " max_inflight_gathers=" + std::to_string(options.max_inflight_gathers) +
                    " keep_last_unit_for_backward=" + std::to_string(options.keep_last_unit_for_backward) +
                    " reduce_dtype=" + c10::toString(options.reduce_dtype) +
                    " shard_size=" + std::to_string(options.shard_size) +
                    " gather_dtype=" + c10::toString(options.gather_dtype));
  runtime::check_same_on_all_ranks(*group.control, entries, "fully_shard units");
}

// A unit's shard after the broadcast of rank 0's values: its values (a deferred unit
// brought its own), the fp32 master, and the narrow copy its gathers send (gather_dtype).
void init_shard(shard::Unit& u, const shard::DeferredUnit* d, const FullyShardOptions& options) {
  // The root never reshards: its shard is its slice of the gathered buffer (no second
  // copy), and it is all-gathered in place. At one rank every unit's shard is its whole
  // gathered buffer.
  if (d != nullptr && !u.keeps_buffer()) {
    u.values = d->values.to(u.gathered.options());  // model->to() may have changed the dtype or device since
  } else {
    auto mine = u.gathered.slice(0, u.shard.begin, u.shard.end);
    u.values = u.keeps_buffer() ? mine : mine.clone();
  }
  u.master = u.values.scalar_type() == at::kFloat ? u.values : u.values.to(at::kFloat);
  const auto narrow = options.gather_dtype;
  if (narrow == at::ScalarType::Undefined || u.keeps_buffer() ||
      c10::elementSize(narrow) >= c10::elementSize(u.values.scalar_type())) {
    return;
  }
  if (narrow == at::kChar) {
    u.quantized.emplace(u.layout.shard_numel());
    const int64_t packed = u.quantized->packed_bytes();
    u.gather_values = at::empty({packed}, u.values.options().dtype(at::kByte));
    u.refresh_gather_values();
    u.gather_buffer = at::empty({u.layout.padded_numel / u.layout.shard_numel() * packed}, u.gather_values.options());
  } else {
    u.gather_values = u.values.to(narrow);
    u.gather_buffer = at::empty({u.layout.padded_numel}, u.values.options().dtype(narrow));
  }
  compat::resize_storage_bytes(u.gather_buffer, 0);
}

// The model's units (the root last), its backward round, rank 0's values broadcast
// (deferred units have theirs), each unit's shard, and the reductions' launch order.
void build_units(shard::ShardedModel& m, const UnitsFound& units, const FullyShardOptions& options,
                 Communicator& data) {
  torch::NoGradGuard no_grad;
  const auto& deferred = units.deferred;
  const size_t n = units.found.size();
  for (size_t k = 0; k < n; ++k) {
    m.units.push_back(std::make_shared<shard::Unit>(m, m.units.size(), units.found[k].path, units.names[k],
                                                     units.params[k], /*is_root=*/false, deferred[k]));
  }
  if (!units.root_params.empty()) {
    m.units.push_back(std::make_shared<shard::Unit>(m, m.units.size(), "", units.root_names, units.root_params,
                                                     /*is_root=*/true));
  }
  std::vector<shard::ShardGroup*> groups;
  for (auto& u : m.units) groups.push_back(u.get());
  m.round = std::make_unique<shard::BackwardRound>(m, "FullyShardedAdamW", /*reduces_in_backward=*/true,
                                                   /*every_backward=*/true, std::move(groups));
  m.round->reductions().set_replicas(m.topology.replicas);
  std::vector<std::shared_ptr<Work>> works;
  if (data.size() > 1) {
    for (size_t k = 0; k < m.units.size(); ++k) {
      if (k >= deferred.size() || deferred[k] == nullptr) works.push_back(data.broadcast(m.units[k]->gathered, 0));
    }
  }
  for (auto& w : works) comm::block_current(*w, data.device());
  size_t first_param = 0;  // each unit's parameters in FullyShardedAdamW's numbering: units in order
  for (auto& u : m.units) {
    for (size_t i = 0; i < u->tensors.size(); ++i) u->params.push_back(first_param + i);
    first_param += u->tensors.size();
    init_shard(*u, u->index < deferred.size() ? deferred[u->index] : nullptr, options);
    u->register_hooks();
    u->reshard();
  }
  // Reductions issue in reverse registration order (backward visits units in
  // reverse forward order), the root last: the same on every rank.
  for (size_t k = n; k-- > 0;) m.launch_order.push_back(k);
  if (!units.root_params.empty()) m.launch_order.push_back(m.units.size() - 1);
}

}  // namespace

std::shared_ptr<FullyShardedModel> fully_shard(const std::shared_ptr<torch::nn::Module>& root,
                                               ProcessGroup group, FullyShardOptions options) {
  TORCH_CHECK_VALUE(root != nullptr, "fully_shard: the module is null");
  auto comm = group.data;
  check_options(options, comm);
  auto impl = std::make_unique<FullyShardedModel::State>();
  impl->group = group;
  impl->options = options;
  std::vector<UnitsFound::Found> sharded;
  for (const auto& item : root->named_modules()) {
    if (auto* m = dynamic_cast<ShardedModule*>(item.value().get())) {
      TORCH_CHECK_VALUE(!shard::ModuleAccess::unit(*m), "fully_shard: unit '", item.key(), "' is already sharded");
      sharded.push_back({item.key(), item.value(), m, shard::ModuleAccess::deferred(*m).get()});
    }
  }
  UnitsFound units = claim_parameters(root, std::move(sharded));
  const auto& found = units.found;
  const auto& deferred = units.deferred;
  check_units(units, options, group);
  // Before any communicator is made (an error while they exist aborts them).
  const int shard_size = shard::resolve_shard_size(group, options.shard_size, "fully_shard");
  for (size_t k = 0; k < found.size(); ++k) {
    if (deferred[k] == nullptr) continue;
    TORCH_CHECK_VALUE(deferred[k]->layout.world_size == shard_size, "fully_shard: unit '", found[k].path,
                      "' was built under a DeferredInit for shard groups of ", deferred[k]->layout.world_size,
                      " ranks, but fully_shard shards across ", shard_size,
                      "; give DeferredInit the group and shard_size fully_shard gets");
  }
  impl->topology = shard::make_shard_topology(group, options.shard_size, "fully_shard");
  impl->comm = impl->topology.shard;
  impl->reduce_comm = impl->comm->dup();
  impl->rank = impl->topology.shard_rank;
  impl->world = impl->topology.shard_size;
  for (size_t k = 0; k < found.size(); ++k) {
    TORCH_INTERNAL_ASSERT(deferred[k] == nullptr || deferred[k]->shard_rank == impl->rank);
  }

  auto& m = *impl;
  build_units(m, units, options, *comm);
  for (size_t k = 0; k < found.size(); ++k) {
    shard::ModuleAccess::unit(*found[k].marker) = m.units[k];
    shard::ModuleAccess::deferred(*found[k].marker).reset();  // its shard is the unit's now
    m.unit_modules.push_back(found[k].module);
  }
  m.peak_gathered = m.gathered_bytes;  // the working set counts from here (every unit is resharded)

  int64_t total = 0, mine = 0;
  for (auto& u : m.units) {
    total += u->layout.numel;
    mine += u->shard.size();
  }
  log_info("fully_shard: " + std::to_string(found.size()) + " units + root, " + std::to_string(total) +
           " parameters; this rank holds " + std::to_string(mine) + " of them" + m.topology.describe());
  return std::shared_ptr<FullyShardedModel>(new FullyShardedModel(std::move(impl)));
}

}  // namespace zeroshard
