// nccl_api.cpp — NcclApi over NCCL's C API and the CUDA runtime (CUDA builds).
#include "comm/nccl/nccl_api.h"

#include "comm/nccl/nccl_communicator.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstring>

namespace zeroshard::comm::nccl {
namespace {

std::atomic<int64_t> g_collectives{0};
std::atomic<int64_t> g_point_to_point{0};

ncclDataType_t nccl_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kDouble: return ncclFloat64;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: TORCH_CHECK_VALUE(false, "NCCL: dtype ", t, " is not supported; use float32, bfloat16, float16, "
                               "float64, int32, int64, uint8 or int8");
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

Status status(ncclResult_t r, ncclComm_t comm) {
  if (r == ncclSuccess) return Status::ok();
  if (r == ncclInProgress) return Status::in_progress();
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += std::string(" (") + last + ")";
  return Status::error(s);
}

Status cuda_status(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return Status::ok();
  return Status::error(std::string(call) + ": " + cudaGetErrorString(e));
}

ncclComm_t as_comm(CommHandle c) { return static_cast<ncclComm_t>(c); }
cudaStream_t as_stream(StreamHandle s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(EventHandle e) { return static_cast<cudaEvent_t>(e); }

c10::Device cuda(int device) { return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)); }

class CudaNcclApi final : public NcclApi {
 public:
  int runtime_version() override {
    int v = 0;
    return ncclGetVersion(&v) == ncclSuccess ? v : 0;
  }
  int header_version() override { return NCCL_VERSION_CODE; }

  Status unique_id(UniqueId* id) override {
    ncclUniqueId nid;
    static_assert(sizeof(nid.internal) == sizeof(UniqueId), "ncclUniqueId is 128 bytes");
    const ncclResult_t r = ncclGetUniqueId(&nid);
    if (r == ncclSuccess) std::memcpy(id->data(), nid.internal, id->size());
    return status(r, nullptr);
  }

  Status init_rank(CommHandle* comm, int nranks, const UniqueId& id, int rank, int device) override {
    const c10::cuda::CUDAGuard guard(cuda(device));
    ncclUniqueId nid;
    std::memcpy(nid.internal, id.data(), id.size());
    ncclConfig_t config = nonblocking();
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, nranks, nid, rank, &config);
    *comm = c;
    return status(r, nullptr);
  }

  Status split(CommHandle parent, bool member, int key, CommHandle* child) override {
    // Non-blocking: NCCL stores `child` and writes the new handle through it when the split
    // completes, from its own thread (null until then), so it must be the caller's pointer.
    ncclConfig_t config = nonblocking();
    static_assert(sizeof(CommHandle) == sizeof(ncclComm_t), "a CommHandle holds an ncclComm_t");
    const ncclResult_t r = ncclCommSplit(as_comm(parent), member ? 0 : NCCL_SPLIT_NOCOLOR, key,
                                         reinterpret_cast<ncclComm_t*>(child), &config);
    return status(r, as_comm(parent));
  }

  Status async_error(CommHandle comm) override {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(as_comm(comm), &state);
    if (r != ncclSuccess) return status(r, as_comm(comm));
    return status(state, as_comm(comm));
  }
  Status finalize(CommHandle comm) override { return status(ncclCommFinalize(as_comm(comm)), as_comm(comm)); }
  void destroy(CommHandle comm) override { ncclCommDestroy(as_comm(comm)); }
  void abort(CommHandle comm) override { ncclCommAbort(as_comm(comm)); }

  Status all_gather(const void* in, void* out, size_t count, at::ScalarType dtype, CommHandle comm,
                    StreamHandle stream) override {
    ++g_collectives;
    return status(ncclAllGather(in, out, count, nccl_dtype(dtype), as_comm(comm), as_stream(stream)), as_comm(comm));
  }
  Status reduce_scatter(const void* in, void* out, size_t count, at::ScalarType dtype, ReduceOp op, CommHandle comm,
                        StreamHandle stream) override {
    ++g_collectives;
    return status(ncclReduceScatter(in, out, count, nccl_dtype(dtype), nccl_op(op), as_comm(comm), as_stream(stream)),
                  as_comm(comm));
  }
  Status all_reduce(void* data, size_t count, at::ScalarType dtype, ReduceOp op, CommHandle comm,
                    StreamHandle stream) override {
    ++g_collectives;
    return status(ncclAllReduce(data, data, count, nccl_dtype(dtype), nccl_op(op), as_comm(comm), as_stream(stream)),
                  as_comm(comm));
  }
  Status broadcast(void* data, size_t count, at::ScalarType dtype, int root, CommHandle comm,
                   StreamHandle stream) override {
    ++g_collectives;
    return status(ncclBroadcast(data, data, count, nccl_dtype(dtype), root, as_comm(comm), as_stream(stream)),
                  as_comm(comm));
  }
  Status send(const void* data, size_t count, at::ScalarType dtype, int peer, CommHandle comm,
              StreamHandle stream) override {
    ++g_point_to_point;
    return status(ncclSend(data, count, nccl_dtype(dtype), peer, as_comm(comm), as_stream(stream)), as_comm(comm));
  }
  Status recv(void* data, size_t count, at::ScalarType dtype, int peer, CommHandle comm,
              StreamHandle stream) override {
    ++g_point_to_point;
    return status(ncclRecv(data, count, nccl_dtype(dtype), peer, as_comm(comm), as_stream(stream)), as_comm(comm));
  }

  void set_device(int device) override { C10_CUDA_CHECK(cudaSetDevice(device)); }
  StreamHandle create_stream(int device) override {
    const c10::cuda::CUDAGuard guard(cuda(device));
    int lo = 0, hi = 0;
    C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    cudaStream_t stream = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, hi));
    return stream;
  }
  void destroy_stream(StreamHandle stream, int device) override {
    const c10::cuda::CUDAGuard guard(cuda(device));
    cudaStreamDestroy(as_stream(stream));
  }
  StreamHandle current_stream(int device) override {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  }
  StreamHandle stream_of(const c10::Stream& stream, int device) override {
    TORCH_CHECK_VALUE(stream.device() == cuda(device), "NCCL: a stream of ", stream.device(),
                      " cannot wait for an operation on ", cuda(device), "; block a stream of the communicator's device");
    return c10::cuda::CUDAStream(stream).stream();
  }
  EventHandle create_event(int device) override {
    const c10::cuda::CUDAGuard guard(cuda(device));
    cudaEvent_t event = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }
  void destroy_event(EventHandle event, int device) override {
    const c10::cuda::CUDAGuard guard(cuda(device));
    cudaEventDestroy(as_event(event));  // released once recorded work completes
  }
  Status record(EventHandle event, StreamHandle stream, int device) override {
    const c10::cuda::CUDAGuard guard(cuda(device));
    return cuda_status(cudaEventRecord(as_event(event), as_stream(stream)), "cudaEventRecord");
  }
  Status wait_event(StreamHandle stream, EventHandle event, int device) override {
    const c10::cuda::CUDAGuard guard(cuda(device));
    return cuda_status(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0), "cudaStreamWaitEvent");
  }
  Status query(EventHandle event, int device) override {
    const c10::cuda::CUDAGuard guard(cuda(device));
    const cudaError_t e = cudaEventQuery(as_event(event));
    if (e == cudaErrorNotReady) return Status::in_progress();
    return cuda_status(e, "cudaEventQuery");
  }

 private:
  static ncclConfig_t nonblocking() {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    return config;
  }
};

}  // namespace

NcclApi& cuda_nccl_api() {
  static CudaNcclApi api;
  return api;
}

IssuedCounts cuda_nccl_issued() { return {g_collectives.load(), g_point_to_point.load()}; }

}  // namespace zeroshard::comm::nccl

namespace zeroshard {

ProcessGroup init_nccl(std::shared_ptr<Communicator> cpu, c10::Device device, const CommOptions& options) {
  TORCH_CHECK_VALUE(device.is_cuda() && device.has_index(), "init_nccl: device ", device,
                    " is not a CUDA device with an index; pass c10::Device(c10::kCUDA, local_rank)");
  auto* tcp = dynamic_cast<comm::TcpCommunicator*>(cpu.get());
  TORCH_CHECK_VALUE(tcp != nullptr, "init_nccl: `cpu` must be a communicator made by init_communicator (or a split "
                    "or dup of one): the NCCL unique id travels through its rendezvous store");
  auto data = comm::nccl::make_nccl_communicator(comm::nccl::cuda_nccl_api(), *tcp, device, device.index(), options);
  return ProcessGroup{std::move(data), std::move(cpu)};
}

}  // namespace zeroshard
