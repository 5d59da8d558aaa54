// host_copy.cpp — see host_copy.h.
#include "host_copy.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace zeroshard::ckpt {

HostCopier::HostCopier(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (!t.defined() || t.device().is_cpu()) continue;
    bool known = false;
    for (const auto& d : devices_) known = known || d.device == t.device();
    if (known) continue;
    Device d{t.device(), std::make_unique<c10::Event>(t.device().type()), c10::nullopt};
    const c10::impl::VirtualGuardImpl guard(t.device().type());
    d.ready->record(guard.getStream(t.device()));
    devices_.push_back(std::move(d));
  }
}

HostCopier::Device& HostCopier::of(c10::Device device) {
  for (auto& d : devices_) {
    if (d.device == device) return d;
  }
  TORCH_INTERNAL_ASSERT(false, "HostCopier: no mark was recorded for ", device);
}

at::Tensor HostCopier::copy(const at::Tensor& t, at::ScalarType dtype) {
  if (t.device().is_cpu()) return t.to(dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
  auto& d = of(t.device());
  if (!d.side) {
    const c10::impl::VirtualGuardImpl guard(d.device.type());
    d.side = guard.getStreamFromGlobalPool(d.device);
    d.ready->block(*d.side);
  }
  auto host = at::empty(t.sizes(), t.options().dtype(dtype).device(at::kCPU).pinned_memory(true));
  c10::StreamGuard on(*d.side);  // a dtype conversion runs on the side stream too
  host.copy_(t, /*non_blocking=*/true);
  sources_.push_back(t);  // a temporary would go back to its stream's pool while the side stream reads it
  return host;
}

void HostCopier::finish() {
  for (auto& d : devices_) {
    if (d.side) d.side->synchronize();
  }
  sources_.clear();
}

}  // namespace zeroshard::ckpt
