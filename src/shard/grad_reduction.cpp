// grad_reduction.cpp — getting each rank its slice of the mean gradient.
//
// Stage 2: a post hook on every parameter's gradient accumulator fires once
// the parameter's gradient of this backward is complete; it is copied into the
// bucket's flat buffer and p.grad() is freed. A complete bucket is
// reduce-scattered at once, but buckets launch strictly in index order, so
// every rank issues the same collectives in the same order even if autograd
// visits parameters differently. An autograd final callback launches what is
// left at the end of backward (parameters that got no gradient contribute
// zeros). At most `max_inflight_buckets` reductions are outstanding: launching
// one more first drains the oldest (adds its result into the gradient shard).
//
// Stage 0 is stage 2 with buckets laid out for one rank: the same path
// all-reduces them (ReductionQueue), so every rank gets the whole mean.
//
// Stage 1: p.grad() is a slice of the bucket's flat gradient buffer, so
// backward accumulates straight into it; step() reduce-scatters every bucket.
#include "shard/sharded_adamw_impl.h"

#include "compat/autograd_hooks.h"
#include "shard/tensor_alias.h"
#include "zeroshard/log.h"



namespace zeroshard {

void ShardedAdamW::Impl::register_hooks() {
  for (size_t i = 0; i < params.size(); ++i) {
    std::weak_ptr<shard::HookTarget> weak = target;
    hooks.emplace_back(params[i], [weak, i] {
      if (auto t = weak.lock()) {
        std::lock_guard<std::recursive_mutex> lock(t->mu);
        if (t->impl != nullptr) t->impl->on_grad_ready(i);
      }
    }, "ShardedAdamW: parameter '" + infos[i].name + "'");
  }
}

void ShardedAdamW::Impl::remove_hooks() { hooks.clear(); }

void ShardedAdamW::Impl::copy_grad_into(size_t param, shard::Bucket& b) {
  auto& p = params[param];
  const size_t entry = location[param].second;
  if (!b.rs_in.defined()) {
    b.rs_in = at::zeros({b.layout.padded_numel}, b.flat_params.options());
    track(b.rs_in.nbytes());
  }
  b.rs_in.slice(0, b.layout.offsets[entry], b.layout.offsets[entry] + infos[param].numel())
      .view(p.sizes())
      .copy_(p.grad());
  p.mutable_grad() = at::Tensor();
}

// Stage 1 keeps gradients in the bucket's flat buffer, which backward adds into
// and step() reduce-scatters in place. A gradient found elsewhere (the first
// backward, or one after the gradients were set to None: Module::zero_grad(),
// or torch::optim::Optimizer::zero_grad(), which is not virtual and so runs for a
// caller holding the base class) is copied into its slot the moment it is
// ready, and p.grad() becomes the slot; one parameter's gradient is the most
// ever held twice. A parameter without a gradient gets a zeroed slot.
void ShardedAdamW::Impl::grad_into_flat(size_t param) {
  auto& b = buckets[location[param].first];
  if (!b.flat_grads.defined()) b.flat_grads = at::zeros({b.layout.padded_numel}, b.flat_params.options());
  auto& p = params[param];
  const int64_t off = b.layout.offsets[location[param].second];
  auto slot = b.flat_grads.slice(0, off, off + infos[param].numel());
  const auto& g = p.grad();
  if (g.defined() && g.data_ptr() == slot.data_ptr()) return;  // already the slot
  if (g.defined()) {
    slot.view(p.sizes()).copy_(g);
    had_grad(param) = 1;
  } else {
    slot.zero_();
  }
  p.mutable_grad() = shard::alias_of(b.flat_grads, off, p.sizes());
}

void ShardedAdamW::Impl::on_grad_ready(size_t param) {
  if (backward_aborted) {
    recover_from_aborted_backward();
    log_warn("ShardedAdamW: an earlier backward pass ended with an exception part-way; the gradients this "
             "step had reduced so far were discarded, and this backward starts the step afresh (call "
             "zero_grad() after a failed backward, as with any LibTorch optimizer)");
  }
  TORCH_CHECK(!reduced, "ShardedAdamW: backward() ran after clip_grad_norm() and before step(); the gradients "
                        "were already reduced and clipped for this step. Call clip_grad_norm() after the last "
                        "backward of the step");
  if (!params[param].grad().defined()) return;  // an undefined gradient (a custom Function returned none)
  if (!callback_queued) {  // first gradient of this backward
    callback_queued = true;
    sync_this_backward = reduce_in_backward() && no_sync_depth == 0 && options.reduce_every_backward;
    std::weak_ptr<shard::HookTarget> weak = target;
    auto with_impl = [weak](void (*fn)(Impl&)) {
      if (auto t = weak.lock()) {
        std::lock_guard<std::recursive_mutex> lock(t->mu);
        if (t->impl != nullptr) fn(*t->impl);
      }
    };
    compat::on_end_of_backward([with_impl] { with_impl([](Impl& im) { im.end_backward(); }); },
                               [with_impl] { with_impl([](Impl& im) { im.backward_aborted = true; }); });
  }
  had_grad(param) = 1;
  if (!sync_this_backward) {  // stays in p.grad() (stage 1, no_sync, or local accumulation)
    if (reduce_in_backward()) {
      local_grads_pending = true;
    } else {
      grad_into_flat(param);
    }
    return;
  }
  if (ready[param]) return;
  ready[param] = 1;
  auto& b = buckets[location[param].first];
  copy_grad_into(param, b);
  if (++b.ready == b.params.size()) launch_ready_in_order(false);
}

void ShardedAdamW::Impl::end_backward() {
  callback_queued = false;
  if (sync_this_backward) flush_backward();
}

void ShardedAdamW::Impl::recover_from_aborted_backward() {
  // The failed pass's gradients are partly in buckets (dropped here) and partly
  // in p.grad() (the caller's to clear with zero_grad(), as after any failed backward).
  backward_aborted = false;
  reductions.clear();  // each Work keeps its tensors until it finishes; its result is not wanted
  transient_bytes = 0;
  for (auto& b : buckets) {
    b.rs_in = at::Tensor();
    b.ready = 0;
  }
  std::fill(ready.begin(), ready.end(), 0);
  next_launch = 0;
  callback_queued = false;
  release_step_gradients();
  owner.forget_step();  // an agreement or clip of this step (apply_clip before the failed backward) goes too
}

void ShardedAdamW::Impl::launch(size_t index) {
  auto& b = buckets[index];
  at::Tensor in = std::move(b.rs_in);
  b.rs_in = at::Tensor();  // the next backward fills a fresh buffer
  // Stage 2's (and 0's) input is this backward's scratch buffer; stage 1's is flat_grads, which p.grad() aliases.
  const auto& e = reductions.launch(*comm, b, std::move(in), reduce_in_backward(), "bucket " + std::to_string(index));
  if (!e.out.is_same(e.in)) track(e.out.nbytes());
  if (reduce_in_backward()) {
    reductions.drain_to(static_cast<size_t>(options.max_inflight_buckets),
                        [this](const shard::ReductionQueue::Entry& e) { untrack(e); });
  }
}

void ShardedAdamW::Impl::untrack(const shard::ReductionQueue::Entry& e) {
  if (!e.out.is_same(e.in)) track(-e.out.nbytes());  // from here on it counts as a gradient shard, or is gone
  if (reduce_in_backward()) track(-e.in.nbytes());  // stage 1's input is flat_grads itself
}

void ShardedAdamW::Impl::launch_ready_in_order(bool force) {
  while (next_launch < buckets.size()) {
    auto& b = buckets[next_launch];
    if (!force && b.ready < b.params.size()) break;
    if (force) {
      // Parameters without a gradient in this backward: a leftover p.grad()
      // (accumulated under no_sync) goes in; otherwise the slot stays zero.
      for (size_t param : b.params) {
        if (!ready[param] && params[param].grad().defined()) {
          had_grad(param) = 1;
          copy_grad_into(param, b);
        }
      }
      if (!b.rs_in.defined()) {
        b.rs_in = at::zeros({b.layout.padded_numel}, b.flat_params.options());
        track(b.rs_in.nbytes());
      }
    }
    launch(next_launch++);
  }
}

void ShardedAdamW::Impl::flush_backward() {
  launch_ready_in_order(true);
  local_grads_pending = false;
  std::fill(ready.begin(), ready.end(), 0);
  for (auto& b : buckets) b.ready = 0;
  next_launch = 0;
  callback_queued = false;
  flushed_since_step = true;
}

void ShardedAdamW::Impl::drain_all() {
  reductions.drain_all([this](const shard::ReductionQueue::Entry& e) { untrack(e); });
}

void ShardedAdamW::Impl::reduce_all() {
  if (reduced) return;
  if (options.zero_stage == 1) {
    for (size_t index = 0; index < buckets.size(); ++index) {
      auto& b = buckets[index];
      for (size_t param : b.params) grad_into_flat(param);
      if (!b.flat_grads.defined()) b.flat_grads = at::zeros({b.layout.padded_numel}, b.flat_params.options());
      b.rs_in = b.flat_grads;
      launch(index);
    }
  } else if (!flushed_since_step || local_grads_pending) {
    flush_backward();  // gradients still in p.grad(): from no_sync or local accumulation
  }
  drain_all();
  reduced = true;
}

// The buckets' gradient shards are the core's to clear (end_step_state, forget_step).
void ShardedAdamW::Impl::release_step_gradients() {
  reduced = false;
  flushed_since_step = false;
}


}  // namespace zeroshard
