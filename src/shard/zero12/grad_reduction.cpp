// grad_reduction.cpp — getting each rank its slice of the mean gradient.
//
// The protocol of a backward pass (its first hook, no_sync, the launch order,
// its end, recovery when it fails) is BackwardRound's; this file is what
// ZeRO-0/1/2 do at its moments.
//
// Stage 2: a post hook on every parameter's gradient accumulator fires once
// the parameter's gradient of this backward is complete; it is copied into the
// bucket's flat buffer and p.grad() becomes a stand-in without values
// (shard::make_reduced_grad_marker), which a pre hook on the same accumulator
// takes out before the next backward accumulates. Under activation
// checkpointing the accumulator can fire more than once in one backward (once
// per nested backward of a segment that uses the parameter, and once for the
// outer graph's uses): each arrival is added to the first. A bucket is
// complete once each of its parameters had as many arrivals as the ranks
// agreed at the last step; an arrival beyond that (a parameter's first
// backward with more) is held for a late round of that bucket, which every
// rank reduces at the step's agreement once it says some rank holds one
// (reduce_late), so no contribution is left behind and no rank decides a
// collective from its own graph. A complete bucket is
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
#include "shard/zero12/sharded_adamw_impl.h"

#include "compat/autograd_hooks.h"
#include "shard/core/resharded_param.h"
#include "shard/core/tensor_alias.h"
#include "zeroshard/sharded_adamw.h"
#include "zeroshard/log.h"



namespace zeroshard {

void ShardedAdamW::Impl::register_hooks() {
  for (size_t i = 0; i < params.size(); ++i) {
    std::function<void()> before;
    if (reduce_in_backward()) {
      grad_markers.push_back(shard::make_reduced_grad_marker(
          params[i], "ShardedAdamW (ZeRO-" + std::to_string(options.zero_stage) + ")", infos[i].name));
      before = [p = params[i]] { shard::clear_reduced_grad_marker(p); };
    }
    hooks.emplace_back(params[i], round->guarded<Impl>([i](Impl& im) { im.on_grad_ready(i); }), std::move(before),
                       "ShardedAdamW: parameter '" + infos[i].name + "'");
  }
}

void ShardedAdamW::Impl::remove_hooks() {
  hooks.clear();
  for (size_t i = 0; i < grad_markers.size(); ++i) {
    shard::clear_reduced_grad_marker(params[i]);
    shard::forget_reduced_grad_marker(grad_markers[i]);
  }
  grad_markers.clear();
}

void ShardedAdamW::Impl::move_grad_into(size_t param, const shard::Bucket& b, at::Tensor& into, bool first) {
  auto& p = params[param];
  const size_t entry = location[param].second;
  if (!into.defined()) {
    into = at::zeros({b.layout.padded_numel}, b.flat_params.options());
    track(into.nbytes());
  }
  auto slot = into.slice(0, b.layout.offsets[entry], b.layout.offsets[entry] + infos[param].numel()).view(p.sizes());
  if (first) {
    slot.copy_(p.grad());
  } else {
    slot.add_(p.grad());
  }
  p.mutable_grad() = grad_markers.empty() ? at::Tensor() : grad_markers[param];
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
  round->begin();
  if (!shard::has_gradient(params[param])) return;  // an undefined gradient (a custom Function returned none)
  had_grad(param) = 1;
  if (!round->syncs()) {  // stays in p.grad() (no_sync, or local accumulation), or in stage 1's flat buffer
    if (!reduce_in_backward()) grad_into_flat(param);
    return;
  }
  const size_t k = location[param].first;
  auto& b = buckets[k];
  const int n = ++arrivals[param];
  if (n <= expected(param) || !counts_agreed) {
    // The bucket waits for this arrival (it launches once each parameter had its expected
    // number): the first is copied in, a later one (another checkpointed segment's nested
    // backward) added to it.
    TORCH_INTERNAL_ASSERT(k >= round->next_launch(), "ShardedAdamW: bucket ", k, " launched before '",
                          infos[param].name, "' had its expected arrivals");
    move_grad_into(param, b, b.rs_in, n == 1);
  } else {
    // More arrivals than the ranks agreed to expect (a backward that reuses the parameter more
    // than the last step did): held for a late round of the bucket at the step's agreement. The
    // step's noise sample is then left out (its small norm would miss these).
    move_grad_into(param, b, b.late_in, false);
    b.note_late();
  }
  // Until the ranks first agree on the counts, every bucket waits for the end of the pass: no
  // late round can then depend on which buckets one rank happened to launch.
  if (counts_agreed && n == expected(param) && ++b.ready == b.params.size()) launch_ready_in_order(false);
}

void ShardedAdamW::Impl::begin_pass() {
  std::fill(arrivals.begin(), arrivals.end(), 0);
  for (auto& b : buckets) b.ready = 0;
}

void ShardedAdamW::Impl::end_pass() {
  if (round->syncs()) flush_backward();
}

void ShardedAdamW::Impl::abandon_pass() {
  // The failed pass's gradients are partly in buckets (dropped here) and partly
  // in p.grad() (the caller's to clear with zero_grad(), as after any failed backward).
  transient_bytes = 0;
  for (auto& b : buckets) {
    b.rs_in = b.late_in = at::Tensor();
    if (b.late_held.defined()) track(b.late_held.nbytes());  // of the step's backwards that ended
  }
  begin_pass();  // no bucket holds a gradient of this backward
  flushed_since_step = false;
}

void ShardedAdamW::Impl::launch(size_t index, at::Tensor in, shard::ReductionQueue::Input kind) {
  auto& b = buckets[index];
  // Stage 2's (and 0's) input is this backward's scratch buffer; stage 1's is flat_grads, which p.grad() aliases.
  const auto& e = round->reductions().launch(*comm, b, std::move(in), reduce_in_backward(),
                                            "bucket " + std::to_string(index), kind);
  if (!e.out.is_same(e.in)) track(e.out.nbytes());
  if (reduce_in_backward()) {
    round->reductions().drain_to(static_cast<size_t>(options.max_inflight_buckets),
                        [this](const shard::ReductionQueue::Entry& e) { untrack(e); });
  }
}

// An arrival is late when it exceeds the count the ranks agreed on. Which ranks have late
// arrivals depends on their graphs (a parameter reused more on one rank than it was, and unused
// on another), so nothing is reduced at the end of the pass: the late gradients of the step's
// backwards add up in late_held, the step's agreement tells every rank whether any rank holds
// some, and then every rank reduces a late round of every bucket, in order (zeros where it holds
// none), before the norms are summed again. A rank whose count differs is named at the agreement.
void ShardedAdamW::Impl::hold_late() {
  for (auto& b : buckets) {
    if (!b.late_in.defined()) continue;
    if (b.late_held.defined()) {
      b.late_held.add_(b.late_in);
      track(-b.late_in.nbytes());
    } else {
      b.late_held = std::move(b.late_in);
    }
    b.late_in = at::Tensor();
  }
}

bool ShardedAdamW::Impl::holds_late() const {
  return std::any_of(buckets.begin(), buckets.end(), [](const shard::Bucket& b) { return b.late_held.defined(); });
}

void ShardedAdamW::Impl::reduce_late() {
  for (size_t k = 0; k < buckets.size(); ++k) {
    auto& b = buckets[k];
    at::Tensor in = std::move(b.late_held);
    b.late_held = at::Tensor();
    if (!in.defined()) {
      in = at::zeros({b.layout.padded_numel}, b.flat_params.options());
      track(in.nbytes());
    }
    launch(k, std::move(in), shard::ReductionQueue::Input::kLate);
  }
  drain_reductions();
}

void ShardedAdamW::Impl::untrack(const shard::ReductionQueue::Entry& e) {
  if (!e.out.is_same(e.in)) track(-e.out.nbytes());  // from here on it counts as a gradient shard, or is gone
  if (reduce_in_backward()) track(-e.in.nbytes());  // stage 1's input is flat_grads itself
}

void ShardedAdamW::Impl::launch_ready_in_order(bool force) {
  auto complete = [this](size_t k) { return buckets[k].ready == buckets[k].params.size(); };
  round->launch_in_order(buckets.size(), force ? std::function<bool(size_t)>() : complete, [&](size_t k) {
    auto& b = buckets[k];
    if (force) {
      // Parameters without a gradient in this backward: a leftover p.grad()
      // (accumulated under no_sync) goes in; otherwise the slot stays zero.
      for (size_t param : b.params) {
        if (arrivals[param] == 0 && shard::has_gradient(params[param])) {
          had_grad(param) = 1;
          move_grad_into(param, b, b.rs_in, true);
        }
      }
      if (!b.rs_in.defined()) {
        b.rs_in = at::zeros({b.layout.padded_numel}, b.flat_params.options());
        track(b.rs_in.nbytes());
      }
    }
    launch(k, std::move(b.rs_in), shard::ReductionQueue::Input::kPart);
  });
}

void ShardedAdamW::Impl::flush_backward() {
  launch_ready_in_order(true);
  hold_late();
  for (size_t i = 0; i < params.size(); ++i) step_max_arrivals[i] = std::max(step_max_arrivals[i], arrivals[i]);
  round->clear_local_pending();
  begin_pass();
  round->restart_order();
  flushed_since_step = true;
}

void ShardedAdamW::Impl::drain_reductions() {
  round->reductions().drain_all([this](const shard::ReductionQueue::Entry& e) { untrack(e); });
}

void ShardedAdamW::Impl::reduce_gradients() {
  if (round->frozen()) return;
  if (options.zero_stage == 1) {
    for (size_t index = 0; index < buckets.size(); ++index) {
      auto& b = buckets[index];
      for (size_t param : b.params) grad_into_flat(param);
      if (!b.flat_grads.defined()) b.flat_grads = at::zeros({b.layout.padded_numel}, b.flat_params.options());
      launch(index, b.flat_grads, shard::ReductionQueue::Input::kPart);
    }
  } else if (!flushed_since_step || round->local_pending()) {
    flush_backward();  // gradients still in p.grad(): from no_sync or local accumulation
  }
  drain_reductions();
}

// The buckets' gradient shards are the core's to clear (end_step_state).
void ShardedAdamW::Impl::end_step() { flushed_since_step = false; }

// The next backwards expect what every rank saw in this step's; a parameter no rank had
// keeps its count (an intermittent use: LayerDrop, an expert without tokens).
void ShardedAdamW::Impl::agreed_arrivals(const std::vector<int>& counts) {
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] >= 0) expected_arrivals[i] = counts[i];
  }
  counts_agreed = true;
  std::fill(step_max_arrivals.begin(), step_max_arrivals.end(), 0);
}


}  // namespace zeroshard
