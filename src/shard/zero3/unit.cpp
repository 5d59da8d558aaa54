// unit.cpp — gathering, resharding and gradient reduction of one ZeRO-3 unit.
#include "shard/zero3/unit.h"

#include "comm/work.h"
#include "compat/torch_compat.h"
#include "shard/backward/recompute.h"
#include "shard/core/resharded_param.h"
#include "shard/core/tensor_alias.h"
#include "zeroshard/trace.h"


#include <chrono>

namespace zeroshard::shard {

Unit::Unit(shard::ShardedModel& model_, size_t index_, std::string name_, std::vector<std::string> names,
           std::vector<at::Tensor> params_, bool is_root_, const DeferredUnit* deferred)
    : model(model_), index(index_), name(std::move(name_)), is_root(is_root_), tensors(std::move(params_)) {
  std::vector<ParamInfo> infos;
  for (size_t i = 0; i < tensors.size(); ++i) {
    infos.push_back({names[i], deferred ? deferred->layout.params[i].shape : tensors[i].sizes().vec(),
                     tensors[i].scalar_type()});
  }
  layout = make_flat_layout(std::move(infos), model.world);
  shard = layout.shard(model.rank);
  segments = shard_segments(layout, model.rank);
  gathered = at::zeros({layout.padded_numel}, at::TensorOptions().dtype(layout.dtype).device(model.comm->device()));
  if (!keeps_buffer()) model.track_gathered(static_cast<int64_t>(gathered.nbytes()));
  torch::NoGradGuard no_grad;
  if (deferred != nullptr && keeps_buffer()) gathered.copy_(deferred->values);  // at one rank the shard is the buffer
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto& p = tensors[i];
    const int64_t off = layout.offsets[i];
    const c10::IntArrayRef shape = layout.params[i].shape;
    if (deferred == nullptr) gathered.slice(0, off, off + p.numel()).view(p.sizes()).copy_(p.detach());
    views_.push_back(shard::alias_of(gathered, off, shape));
    empties_.push_back(shard::make_resharded_placeholder(p));
    shard::remember_resharded_param(p, names[i], name);
    p.set_data(views_.back());
    trainable.push_back(p.requires_grad() ? 1 : 0);
    trainable_count_ += trainable.back();
  }
  ready_.assign(tensors.size(), 0);
  had_grad.assign(tensors.size(), 0);
  // A deferred unit's parameters now have their shapes (autograd's hooks
  // record them) over a buffer that never fills: reshard() finishes the job.
  if (deferred != nullptr && !keeps_buffer()) compat::resize_storage_bytes(gathered, 0);
}

Unit::~Unit() {
  remove_hooks();
  for (const auto& p : tensors) shard::forget_resharded_param(p);
}

void Unit::register_hooks() {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!trainable[i]) continue;
    // Created now, while the parameter has its full shape: the accumulator
    // records that shape, and gradients are checked against it.
    if (grad_markers_.size() < tensors.size()) grad_markers_.resize(tensors.size());
    if (!grad_markers_[i].defined()) {
      grad_markers_[i] = shard::make_reduced_grad_marker(tensors[i], "FullyShardedAdamW (ZeRO-3)", layout.params[i].name);
    }
    hooks_.emplace_back(tensors[i],
                        model.round->guarded<shard::ShardedModel>(
                            [unit = index, i](shard::ShardedModel& m) { m.units[unit]->on_grad_ready(i); }),
                        [p = tensors[i]] { shard::clear_reduced_grad_marker(p); },
                        "fully_shard: parameter '" + layout.params[i].name + "' of unit '" + name + "'");
  }
}

void Unit::remove_hooks() {
  hooks_.clear();
  for (size_t i = 0; i < grad_markers_.size(); ++i) {
    if (!grad_markers_[i].defined()) continue;
    shard::clear_reduced_grad_marker(tensors[i]);
    shard::forget_reduced_grad_marker(grad_markers_[i]);
  }
  grad_markers_.clear();
}

at::Tensor Unit::reduced_grad_marker(size_t param) const {
  return param < grad_markers_.size() ? grad_markers_[param] : at::Tensor();
}

bool Unit::keeps_buffer() const { return is_root || model.world == 1; }

void Unit::refresh_gather_values() {
  if (quantized) {
    quantized->quantize(values, gather_values);
  } else if (narrow_gather()) {
    gather_values.copy_(values);
  }
}

void Unit::start_unshard() {
  if (is_gathered || gather_work_ || keeps_buffer()) return;
  compat::resize_storage_bytes(gathered, static_cast<size_t>(layout.padded_numel) * gathered.element_size());
  model.track_gathered(static_cast<int64_t>(gathered.nbytes()));
  if (narrow_gather()) {  // gathered in the narrow dtype, widened once it lands
    compat::resize_storage_bytes(gather_buffer, static_cast<size_t>(gather_buffer.numel()) * gather_buffer.element_size());
    model.track_gathered(static_cast<int64_t>(gather_buffer.nbytes()));
    gather_work_ = model.comm->all_gather(gather_buffer, gather_values);
  } else {
    gather_work_ = model.comm->all_gather(gathered, values);
  }
}

void Unit::unshard() {
  if (is_gathered) return;
  start_unshard();
  if (gather_work_) {
    const auto t0 = std::chrono::steady_clock::now();
    comm::block_current(*gather_work_, gathered.device());  // on a device: orders the stream, no host wait
    model.exposed_gather_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (trace::enabled()) trace::record("wait for gather of " + label(), "wait", t0);
    gather_work_.reset();
    if (narrow_gather()) {
      if (quantized) {
        quantized->dequantize(gather_buffer, gathered);
      } else {
        gathered.copy_(gather_buffer);
      }
      compat::resize_storage_bytes(gather_buffer, 0);
      model.track_gathered(-static_cast<int64_t>(gather_buffer.nbytes()));
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].set_data(views_[i]);
  is_gathered = true;
}

void Unit::reshard() {
  if (is_root || model.keep_gathered_depth > 0) return;
  if (gather_work_) unshard();  // a prefetch in flight: let it land before freeing its buffer
  if (!is_gathered) return;
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].set_data(empties_[i]);
  if (!keeps_buffer()) {
    compat::resize_storage_bytes(gathered, 0);
    model.track_gathered(-static_cast<int64_t>(gathered.nbytes()));
  }
  is_gathered = false;
}

void Unit::before_forward() {
  // A recomputation inside backward (activation checkpointing) runs in the
  // outer backward's graph task: begin the backward there, so its end-of-backward
  // callback belongs to the outer pass, not to the nested one about to start.
  if (in_recompute()) {
    model.round->begin();
  } else {
    model.on_forward(index);  // records the order, or prefetches the next units
    if (at::GradMode::is_enabled() || in_checkpointed_forward()) ++forward_uses_;
    segments_at_forward_ = checkpointed_segments();
  }
  unshard();
  forward_start_ = std::chrono::steady_clock::now();
}

std::string Unit::label() const { return is_root ? std::string("(root)") : name; }

at::Tensor Unit::after_forward(at::Tensor out) {
  if (out.defined() && out.requires_grad() && at::GradMode::is_enabled()) {
    auto pre = model.round->guarded<shard::ShardedModel>(
        [unit = index](shard::ShardedModel& m) { m.units[unit]->pre_backward(); });
    out.register_hook([pre](const at::Tensor&) { pre(); });
  }
  return out;
}

void Unit::end_forward() {
  if (!in_recompute() && checkpointed_segments() != segments_at_forward_) ran_segment_ = true;
  if (trace::enabled()) trace::record("forward " + label(), "compute", forward_start_);
  // Inside backward this forward is a recomputation (activation checkpointing):
  // the unit's own backward comes next and needs its parameters.
  if (model.options.reshard_after_forward && !model.round->in_pass() && !model.backward_comes_next(index)) reshard();
}

void Unit::start_backward() {
  // Held: a unit whose gradients can arrive after it completed (run twice in the forward, or
  // with a checkpointed segment inside whose nested backward brings some parameters' gradients
  // apart from the rest), so that no rank reduces a late round the others do not.
  hold_ = is_root || forward_uses_ > 1 || ran_segment_;
  forward_uses_ = 0;
  ran_segment_ = false;
  late_round_ = false;
  std::fill(ready_.begin(), ready_.end(), 0);
  ready_count_ = 0;
  complete_ = false;
  pre_backward_done_ = false;
}

void Unit::pre_backward() {
  model.round->begin();
  if (complete_) {
    // Its backward again in this pass, after the unit's gradients were complete
    // and it resharded: a use outside a checkpointed segment whose nested
    // backward came first. That backward needs the parameters gathered again;
    // its gradients go in a late round (on_grad_ready).
    unshard();
    return;
  }
  if (pre_backward_done_) return;
  pre_backward_done_ = true;
  model.on_pre_backward(index);
  unshard();
  backward_start_ = std::chrono::steady_clock::now();
}

void Unit::on_grad_ready(size_t param) {
  model.round->begin();
  if (!shard::has_gradient(tensors[param])) return;
  if (hold_ && model.round->syncs()) {
    // Held (the root, a reused unit): its gradients add up in p.grad() however many times they
    // arrive, it stays gathered, and end_pass() reduces it once, in the order, on every rank alike.
    return;
  }
  if (complete_ && model.round->syncs()) {
    // A gradient after the unit completed: it ran again within this backward
    // (a checkpointed unit used twice recomputes in a nested backward of its own).
    if (rs_in_.defined()) {  // packed, not launched yet: add it in
      const int64_t off = layout.offsets[param];
      rs_in_.slice(0, off, off + layout.params[param].numel()).view(tensors[param].grad().sizes()).add_(tensors[param].grad());
      tensors[param].mutable_grad() = reduced_grad_marker(param);
      had_grad[param] = 1;
      return;
    }
    complete_ = false;  // already reducing: gather this round's gradients for one more reduction
    late_round_ = true;
    std::fill(ready_.begin(), ready_.end(), 0);
    ready_count_ = 0;
  }
  if (complete_ || ready_[param]) return;
  ready_[param] = 1;
  if (++ready_count_ == trainable_count_) {
    if (trace::enabled() && pre_backward_done_) trace::record("backward " + label(), "compute", backward_start_);
    if (!model.round->syncs()) {  // no_sync: gradients stay in p.grad(), in full
      complete_ = true;
      reshard();
      return;
    }
    complete_gradients();
    finish_round();
  }
}

void Unit::finish_round() {
  if (late_round_) {
    late_round_ = false;
    model.launch(index, ReductionQueue::Input::kLate);  // its place in the order has passed; every rank does the same here
  } else {
    model.try_launch();
  }
}

void Unit::complete_gradients() {
  const auto reduce_dtype = model.options.reduce_dtype == at::ScalarType::Undefined ? layout.dtype
                                                                                     : model.options.reduce_dtype;
  // Every element written once: gradients copied in, the rest (alignment gaps,
  // padding, parameters without a gradient) zeroed.
  rs_in_ = at::empty({layout.padded_numel}, gathered.options().dtype(reduce_dtype));
  int64_t pos = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto& p = tensors[i];
    const int64_t off = layout.offsets[i], numel = layout.params[i].numel();
    if (off > pos) rs_in_.slice(0, pos, off).zero_();
    auto slot = rs_in_.slice(0, off, off + numel);
    pos = off + numel;
    if (!trainable[i] || !shard::has_gradient(p)) {
      slot.zero_();
      continue;
    }
    slot.view(p.grad().sizes()).copy_(p.grad());
    p.mutable_grad() = reduced_grad_marker(i);
    had_grad[i] = 1;
  }
  if (pos < layout.padded_numel) rs_in_.slice(0, pos, layout.padded_numel).zero_();
  complete_ = true;
  reshard();
}

at::Tensor Unit::take_packed_gradients() {
  at::Tensor in = std::move(rs_in_);
  rs_in_ = at::Tensor();
  return in;
}

}  // namespace zeroshard::shard
