// resharded_param.h — what a parameter of a resharded unit holds.
//
// While its unit is resharded a parameter tensor holds no elements. An empty
// tensor alone is not enough: `p.sum()` would quietly give 0 and `p.t()`
// fails with a shape error that names nothing. The placeholder carries a
// dispatch key whose fallback turns every operator on such a parameter into an
// error naming the parameter, its unit and the fix. Metadata operators that
// sharding itself uses (set_data, detach, requires_grad_) pass through.
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

}  // namespace zeroshard::shard
