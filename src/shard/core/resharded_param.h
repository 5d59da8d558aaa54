// resharded_param.h — what a parameter of a resharded unit holds.
//
// While its unit is resharded a parameter tensor holds no elements. An empty
// tensor alone is not enough: `p.sum()` would quietly give 0 and `p.t()`
// fails with a shape error that names nothing. The placeholder carries a
// dispatch key whose fallback turns every operator on such a parameter into an
// error naming the parameter, its unit and the fix. Metadata operators that
// sharding itself uses (set_data, detach, requires_grad_) pass through.
// The same key marks the stand-in for a gradient that lives in the shards.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace zeroshard::shard {

// An empty tensor with `like`'s dtype and device, marked resharded: a
// parameter set_data()'d to it takes the mark (and loses it with the next set_data).
at::Tensor make_resharded_placeholder(const at::Tensor& like);

// Names the errors for parameter tensor `p` (by identity) until forgotten.
// `deferred`: its unit was built under DeferredInit and fully_shard() has not
// taken it yet; conversions (Module::to's dtype and device) then give a
// placeholder of the new dtype and device instead of an error.
void remember_resharded_param(const at::Tensor& p, std::string param, std::string unit, bool deferred = false);
void forget_resharded_param(const at::Tensor& p);

// What p.grad() holds once backward has reduced a parameter's gradient into
// the shards (ZeRO-0, 2 and 3), under the same dispatch key: no elements, and
// every operator an error naming `owner`, the parameter and the fix, so that
// code reading p.grad() as the full gradient (torch::nn::utils::clip_grad_norm_)
// fails instead of finding none (and clipping nothing). What clearing a
// gradient calls passes: detach, detach_, zero_ and fill_ (Module::zero_grad()
// in LibTorch 1.13, zero_grad(set_to_none = false) in 2.x). Detached copies
// share the marker's storage and are markers too. Each lives until
// forget_reduced_grad_marker().
at::Tensor make_reduced_grad_marker(const at::Tensor& param, std::string owner, std::string param_name);
void forget_reduced_grad_marker(const at::Tensor& marker);
bool is_reduced_grad_marker(const at::Tensor& t);
// p.grad() holds a gradient: defined, and not a marker.
inline bool has_gradient(const at::Tensor& p) { return p.grad().defined() && !is_reduced_grad_marker(p.grad()); }
// Takes a marker (or a detached copy of one) out of p.grad(): before backward
// accumulates into it, and when the optimizer goes.
inline void clear_reduced_grad_marker(const at::Tensor& p) {
  if (is_reduced_grad_marker(p.grad())) p.mutable_grad() = at::Tensor();
}

}  // namespace zeroshard::shard
