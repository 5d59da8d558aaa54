// torch_compat.h — every LibTorch version difference zeroshard depends on, in one place.
// Supported: LibTorch 1.13 (Debian's CPU build) and 2.x (CUDA builds).
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/native/Resize.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#ifdef ZS_WITH_CUDA
#include <ATen/native/cuda/Resize.h>
#endif

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace zeroshard::compat {

// A TCPStore client, or the server when `is_server`. LibTorch 2.4+ defaults to
// the libuv server; both speak the same protocol, and we keep the default.
inline std::shared_ptr<c10d::TCPStore> make_tcp_store(const std::string& host, uint16_t port,
                                                      bool is_server, int world_size,
                                                      std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = port;
  opts.isServer = is_server;
  opts.numWorkers = static_cast<size_t>(world_size);
  opts.waitWorkers = false;  // missing ranks are named by the mesh's rendezvous instead
  opts.timeout = timeout;
  return std::make_shared<c10d::TCPStore>(host, opts);
}

// Re-sizes a tensor's storage in place, keeping its StorageImpl (views of it
// stay valid and see the new memory). 0 frees the memory. CUDA memory is
// allocated and freed on the current stream (the caching allocator's order).
inline void resize_storage_bytes(const at::Tensor& t, size_t nbytes) {
  if (t.device().is_cpu()) return at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), nbytes);
#ifdef ZS_WITH_CUDA
  if (t.device().is_cuda()) return at::native::resize_bytes_cuda(t.storage().unsafeGetStorageImpl(), nbytes);
#endif
  TORCH_CHECK(false, "resize_storage_bytes: no storage resize for ", t.device(),
              " tensors in this zeroshard (CPU, and CUDA when built against a CUDA LibTorch)");
}

// The default random generator of `device` (a handle on it): the CPU's, or a
// CUDA device's, whose accessor LibTorch 2.x renamed.
inline at::Generator default_generator(c10::Device device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  TORCH_CHECK(device.is_cuda(), "default_generator: no random generator for ", device, " here (CPU and CUDA)");
#if TORCH_VERSION_MAJOR >= 2
  return at::detail::getCUDAHooks().getDefaultGenerator(device.index());
#else
  return at::detail::getCUDAHooks().getDefaultCUDAGenerator(device.index());
#endif
}

// The dispatch key that marks the parameters of a resharded fully_shard unit
// (src/shard/core/resharded_param.cpp routes every operator on them to an error).
// LibTorch reserves no key for out-of-tree functionality; this one is unused
// by LibTorch itself in 1.13 and 2.x, and sits above Autograd, so the error
// comes before autograd records anything.
constexpr c10::DispatchKey kReshardedParamKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

constexpr int kTorchMajor = TORCH_VERSION_MAJOR;
constexpr int kTorchMinor = TORCH_VERSION_MINOR;

}  // namespace zeroshard::compat
