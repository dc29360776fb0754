// CudaBackend: the host side of the CUDA backend (memory, copies, cuBLAS,
// error handling). The kernels themselves are in cuda_kernels.cu; the host
// side is compiled by the host compiler, with the CUDA runtime and cuBLAS
// headers, and kept in three files so that each stays readable:
//  - cuda_backend_internal.h: the CudaBackend class, and the error helpers
//    and macros that both .cc files use;
//  - cuda_backend.cc (this file): the error helpers' definitions, a
//    backend's creation and destruction, the caching allocator, staged
//    copies and synchronization, and the functions of cuda_backend.h;
//  - cuda_backend_ops.cc: the math ops (Gemm through cuBLAS, the rest
//    through the kernels of cuda_kernels.cu).
#include "kernels/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <glog/logging.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend_internal.h"
#include "kernels/cuda_kernels.h"
#include "kernels/cuda_policy.h"
#include "kernels/op_checks.h"

namespace pstrain::kernels {
namespace cuda_internal {
namespace {

// "cudaMemcpyAsync(dst, src, ...)" -> "cudaMemcpyAsync": the callee's name
// says which call failed; its argument text would only clutter the message.
absl::string_view CallName(absl::string_view call) {
  return call.substr(0, call.find('('));
}

absl::StatusCode CodeForCuda(cudaError_t error) {
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInvalidDevice:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

absl::Status CudaError(absl::string_view op, absl::string_view call,
                       cudaError_t error) {
  return absl::Status(CodeForCuda(error),
                      absl::StrCat(op, ": ", CallName(call),
                                   " failed: ", cudaGetErrorName(error), " (",
                                   cudaGetErrorString(error), ")"));
}

absl::Status CublasError(absl::string_view op, absl::string_view call,
                         cublasStatus_t status) {
  const absl::StatusCode code = status == CUBLAS_STATUS_ALLOC_FAILED
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(op, ": ", CallName(call), " failed: ",
                                         cublasGetStatusName(status), " (",
                                         cublasGetStatusString(status), ")"));
}

namespace {

// Allocation size classes: 512-byte steps up to 64 KiB, then four classes
// per power of two (so a block is at most 25% larger than asked for).
constexpr size_t kMinBlock = 512;
constexpr size_t kSmallLimit = 64 << 10;
// Larger requests are refused before rounding could overflow.
constexpr size_t kMaxAllocation = size_t{1} << 48;

size_t SizeClass(size_t bytes) {
  if (bytes <= kSmallLimit) {
    return std::max(kMinBlock, (bytes + kMinBlock - 1) / kMinBlock * kMinBlock);
  }
  size_t power = kSmallLimit;
  while (power * 2 <= bytes) power *= 2;
  const size_t step = power / 4;
  return (bytes + step - 1) / step * step;
}

// Host<->device copies go through two pinned staging buffers of at most
// this size each; larger copies are pipelined through them in chunks.
constexpr size_t kStagingChunk = 32 << 20;
constexpr size_t kMinStaging = 1 << 20;

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    int ordinal, Precision precision) {
  std::unique_ptr<CudaBackend> backend(new CudaBackend(ordinal, precision));
  if (absl::Status s = backend->Init(); !s.ok()) return s;
  return backend;
}

absl::Status CudaBackend::Init() {
  absl::MutexLock lock(&mu_);
  const std::string device = absl::StrCat("cuda:", ordinal_);
  PSTRAIN_CUDA_RETURN_IF_ERROR(device, cudaSetDevice(ordinal_));
  cudaDeviceProp prop;
  PSTRAIN_CUDA_RETURN_IF_ERROR(device,
                               cudaGetDeviceProperties(&prop, ordinal_));
  // A binary built for other GPU generations fails here, with advice,
  // rather than at the first kernel launch of the first step.
  if (const cudaError_t error = cuda::CheckKernelImage();
      error != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrFormat(
        "%s (%s, compute capability %d.%d): this binary has no CUDA kernels "
        "it can run there (%s: %s); rebuild with "
        "--repo_env=PSTRAIN_CUDA_ARCHS=sm_%d%d,...",
        device, prop.name, prop.major, prop.minor, cudaGetErrorName(error),
        cudaGetErrorString(error), prop.major, prop.minor));
  }
  name_ = absl::StrCat(device, " (", prop.name, ")");
  if (precision_ == Precision::kBf16) absl::StrAppend(&name_, " bf16");

  // Non-blocking: the stream never waits on (or for) the legacy default
  // stream that other libraries in the process may use.
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      device, cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  PSTRAIN_CUBLAS_RETURN_IF_ERROR(device, cublasCreate(&cublas_));
  PSTRAIN_CUBLAS_RETURN_IF_ERROR(device, cublasSetStream(cublas_, stream_));
  // No TF32 for fp32 GEMMs: their results must match the CPU to 1e-5.
  PSTRAIN_CUBLAS_RETURN_IF_ERROR(
      device, cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  for (Staging& staging : staging_) {
    PSTRAIN_CUDA_RETURN_IF_ERROR(
        device,
        cudaEventCreateWithFlags(&staging.done, cudaEventDisableTiming));
  }
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      device, cudaMalloc(reinterpret_cast<void**>(&device_status_),
                         sizeof(cuda::DeviceStatus)));
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      device,
      cudaMemsetAsync(device_status_, 0, sizeof(cuda::DeviceStatus), stream_));
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      device, cudaMallocHost(reinterpret_cast<void**>(&host_status_),
                             sizeof(cuda::DeviceStatus)));
  PSTRAIN_CUDA_RETURN_IF_ERROR(device, cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

CudaBackend::~CudaBackend() {
  absl::MutexLock lock(&mu_);
  constexpr absl::string_view kOp = "~CudaBackend";
  if (cudaSetDevice(ordinal_) != cudaSuccess) {
    cudaGetLastError();
    return;  // the device is gone; nothing below could succeed
  }
  if (stream_ != nullptr) {
    PSTRAIN_CUDA_LOG_IF_ERROR(kOp, cudaStreamSynchronize(stream_));
  }
  // The scratch buffers are the backend's own allocations.
  for (ScratchBuffer& scratch : scratch_) {
    if (scratch.ptr != nullptr) FreeLocked(scratch.ptr);
    scratch = ScratchBuffer();
  }
  // Live blocks here belong to DeviceArrays (or raw Allocates) that outlive
  // the backend: their destructors will call Free on a destroyed object.
  // Freeing the blocks now would also hand their memory to the next
  // allocation while a caller may still write to it, so they are left to
  // the driver (reclaimed at process exit) and the bug is reported loudly:
  // fatal in debug builds and tests, an error in optimized ones.
  if (!live_.empty()) {
    size_t live_bytes = 0;
    for (const auto& [ptr, size] : live_) live_bytes += size;
    LOG(DFATAL) << name_ << " destroyed while " << live_.size()
                << " of its allocations (" << live_bytes
                << " bytes) are still in use: destroy every DeviceArray "
                   "before its backend";
  }
  // Likewise for AllocateHost's blocks (HostArrays).
  if (!pinned_.empty()) {
    LOG(DFATAL) << name_ << " destroyed while " << pinned_.size()
                << " of its host allocations are still in use: destroy "
                   "every HostArray before its backend";
  }
  for (const auto& [size, blocks] : free_) {
    for (void* ptr : blocks) PSTRAIN_CUDA_LOG_IF_ERROR(kOp, cudaFree(ptr));
  }
  for (Staging& staging : staging_) {
    if (staging.host != nullptr) {
      PSTRAIN_CUDA_LOG_IF_ERROR(kOp, cudaFreeHost(staging.host));
    }
    if (staging.done != nullptr) {
      PSTRAIN_CUDA_LOG_IF_ERROR(kOp, cudaEventDestroy(staging.done));
    }
  }
  if (device_status_ != nullptr) {
    PSTRAIN_CUDA_LOG_IF_ERROR(kOp, cudaFree(device_status_));
  }
  if (host_status_ != nullptr) {
    PSTRAIN_CUDA_LOG_IF_ERROR(kOp, cudaFreeHost(host_status_));
  }
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (stream_ != nullptr) {
    PSTRAIN_CUDA_LOG_IF_ERROR(kOp, cudaStreamDestroy(stream_));
  }
}

absl::Status CudaBackend::Enter(absl::string_view op) {
  PSTRAIN_CUDA_RETURN_IF_ERROR(op, cudaSetDevice(ordinal_));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Memory.

absl::StatusOr<void*> CudaBackend::Allocate(size_t bytes) {
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter("Allocate"));
  return AllocateLocked("Allocate", bytes);
}

absl::StatusOr<void*> CudaBackend::AllocateLocked(absl::string_view op,
                                                  size_t bytes) {
  if (bytes > kMaxAllocation) {
    return absl::ResourceExhaustedError(
        absl::StrCat(op, ": ", bytes, " bytes is too large"));
  }
  const size_t size = SizeClass(bytes);
  if (auto it = free_.find(size); it != free_.end() && !it->second.empty()) {
    void* ptr = it->second.back();
    it->second.pop_back();
    live_.emplace(ptr, size);
    return ptr;
  }
  void* ptr = nullptr;
  cudaError_t error = cudaMalloc(&ptr, size);
  if (error == cudaErrorMemoryAllocation) {
    // Cached blocks of other sizes may be what is missing: give them back
    // and try once more.
    cudaGetLastError();
    PSTRAIN_RETURN_IF_ERROR(ReleaseCached(op));
    error = cudaMalloc(&ptr, size);
  }
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::Status(
        CodeForCuda(error),
        absl::StrCat(op, ": cudaMalloc of ", size, " bytes (for ", bytes,
                     ") failed: ", cudaGetErrorName(error), " (",
                     cudaGetErrorString(error), ")"));
  }
  live_.emplace(ptr, size);
  return ptr;
}

absl::Status CudaBackend::ReleaseCached(absl::string_view op) {
  // cudaFree would wait for the device anyway; waiting for our stream first
  // makes it explicit that no queued kernel still uses a cached block.
  PSTRAIN_CUDA_RETURN_IF_ERROR(op, cudaStreamSynchronize(stream_));
  // Each block leaves the cache before its cudaFree, so a failure part way
  // leaves only blocks that were not handed to cudaFree (and none twice).
  while (!free_.empty()) {
    std::vector<void*>& blocks = free_.begin()->second;
    if (blocks.empty()) {
      free_.erase(free_.begin());
      continue;
    }
    void* ptr = blocks.back();
    blocks.pop_back();
    PSTRAIN_CUDA_RETURN_IF_ERROR(op, cudaFree(ptr));
  }
  return absl::OkStatus();
}

void CudaBackend::Free(void* ptr) {
  if (ptr == nullptr) return;
  absl::MutexLock lock(&mu_);
  FreeLocked(ptr);
}

void CudaBackend::FreeLocked(void* ptr) {
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    LOG(ERROR) << name_ << ": Free of " << ptr
               << ", which this backend did not allocate (or freed already)";
    return;
  }
  // Kernels already queued that use the block run before anything queued
  // after its reuse, because everything runs on stream_.
  free_[it->second].push_back(ptr);
  live_.erase(it);
}

absl::StatusOr<void*> CudaBackend::Scratch(absl::string_view op,
                                           ScratchSlot slot, size_t bytes) {
  ScratchBuffer& scratch = scratch_[slot];
  if (scratch.ptr != nullptr && scratch.bytes >= bytes) return scratch.ptr;
  if (scratch.ptr != nullptr) FreeLocked(scratch.ptr);
  scratch = ScratchBuffer();
  absl::StatusOr<void*> ptr = AllocateLocked(op, bytes);
  if (!ptr.ok()) return ptr.status();
  scratch.ptr = *ptr;
  scratch.bytes = SizeClass(bytes);
  return scratch.ptr;
}

// ---------------------------------------------------------------------------
// Copies and synchronization.

absl::Status CudaBackend::ReadyStaging(absl::string_view op, Staging& staging,
                                       size_t bytes) {
  PSTRAIN_CUDA_RETURN_IF_ERROR(op, cudaEventSynchronize(staging.done));
  if (staging.capacity >= bytes) return absl::OkStatus();
  // Grow geometrically so a run of ever larger copies allocates rarely:
  // every cudaFreeHost + cudaMallocHost synchronizes the whole device. The
  // new size is taken from the old one before that one is released.
  const size_t capacity = internal::NextStagingCapacity(
      staging.capacity, bytes, kMinStaging, kStagingChunk);
  if (staging.host != nullptr) {
    PSTRAIN_CUDA_RETURN_IF_ERROR(op, cudaFreeHost(staging.host));
    staging.host = nullptr;
    staging.capacity = 0;
  }
  PSTRAIN_CUDA_RETURN_IF_ERROR(op, cudaMallocHost(&staging.host, capacity));
  staging.capacity = capacity;
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToDevice(const void* host, void* device,
                                       size_t bytes) {
  if (bytes > 0 && (host == nullptr || device == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CopyToDevice: ", host == nullptr ? "host" : "device", " is null"));
  }
  if (bytes == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  constexpr absl::string_view kOp = "CopyToDevice";
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  if (IsPinnedLocked(host, bytes)) {
    PSTRAIN_CUDA_RETURN_IF_ERROR(
        kOp,
        cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
    // The caller may write `host` again on return, as after a staged copy.
    return SyncLocked(kOp);
  }
  // Alternating between the two staging buffers lets the host fill one
  // while the other is being transferred.
  for (size_t offset = 0; offset < bytes; offset += kStagingChunk) {
    const size_t length = std::min(kStagingChunk, bytes - offset);
    Staging& staging = staging_[next_staging_];
    next_staging_ ^= 1;
    PSTRAIN_RETURN_IF_ERROR(ReadyStaging(kOp, staging, length));
    std::memcpy(staging.host, static_cast<const char*>(host) + offset, length);
    PSTRAIN_CUDA_RETURN_IF_ERROR(
        kOp, cudaMemcpyAsync(static_cast<char*>(device) + offset, staging.host,
                             length, cudaMemcpyHostToDevice, stream_));
    PSTRAIN_CUDA_RETURN_IF_ERROR(kOp, cudaEventRecord(staging.done, stream_));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToHost(const void* device, void* host,
                                     size_t bytes) {
  if (bytes > 0 && (host == nullptr || device == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CopyToHost: ", device == nullptr ? "device" : "host", " is null"));
  }
  absl::MutexLock lock(&mu_);
  constexpr absl::string_view kOp = "CopyToHost";
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  if (bytes > 0 && IsPinnedLocked(host, bytes)) {
    PSTRAIN_CUDA_RETURN_IF_ERROR(
        kOp,
        cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_));
    return SyncLocked(kOp);
  }
  // Chunk i goes through staging buffer i % 2: chunk i + 1 is in flight
  // while chunk i is copied out on the host.
  struct InFlight {
    Staging* staging = nullptr;
    size_t offset = 0;
    size_t length = 0;
  };
  InFlight in_flight[2];
  auto drain = [&](InFlight& chunk) -> absl::Status {
    if (chunk.staging == nullptr) return absl::OkStatus();
    PSTRAIN_CUDA_RETURN_IF_ERROR(kOp,
                                 cudaEventSynchronize(chunk.staging->done));
    std::memcpy(static_cast<char*>(host) + chunk.offset, chunk.staging->host,
                chunk.length);
    chunk = InFlight();
    return absl::OkStatus();
  };
  int slot = 0;
  for (size_t offset = 0; offset < bytes; offset += kStagingChunk) {
    const size_t length = std::min(kStagingChunk, bytes - offset);
    PSTRAIN_RETURN_IF_ERROR(drain(in_flight[slot]));
    Staging& staging = staging_[slot];
    PSTRAIN_RETURN_IF_ERROR(ReadyStaging(kOp, staging, length));
    PSTRAIN_CUDA_RETURN_IF_ERROR(
        kOp,
        cudaMemcpyAsync(staging.host, static_cast<const char*>(device) + offset,
                        length, cudaMemcpyDeviceToHost, stream_));
    PSTRAIN_CUDA_RETURN_IF_ERROR(kOp, cudaEventRecord(staging.done, stream_));
    in_flight[slot] = {&staging, offset, length};
    slot ^= 1;
  }
  // Oldest first: `slot` is the buffer that was not written last.
  PSTRAIN_RETURN_IF_ERROR(drain(in_flight[slot]));
  PSTRAIN_RETURN_IF_ERROR(drain(in_flight[slot ^ 1]));
  // Waits for all earlier work too (a no-op wait when the copies above
  // already did), and reports what it left behind.
  return SyncLocked(kOp);
}

absl::StatusOr<void*> CudaBackend::AllocateHost(size_t bytes) {
  absl::MutexLock lock(&mu_);
  constexpr absl::string_view kOp = "AllocateHost";
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  void* ptr = nullptr;
  // One byte for AllocateHost(0): a valid, distinct pointer.
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp,
      cudaHostAlloc(&ptr, std::max<size_t>(bytes, 1), cudaHostAllocDefault));
  pinned_[reinterpret_cast<uintptr_t>(ptr)] = bytes;
  return ptr;
}

void CudaBackend::FreeHost(void* ptr) {
  absl::MutexLock lock(&mu_);
  if (pinned_.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) {
    LOG(DFATAL) << name_ << ": FreeHost of " << ptr
                << ", which AllocateHost did not return";
    return;
  }
  // cudaFreeHost waits for copies still using the block.
  PSTRAIN_CUDA_LOG_IF_ERROR("FreeHost", cudaFreeHost(ptr));
}

bool CudaBackend::IsPinnedLocked(const void* host, size_t bytes) const {
  const uintptr_t start = reinterpret_cast<uintptr_t>(host);
  auto after = pinned_.upper_bound(start);
  if (after == pinned_.begin()) return false;
  const auto& [block, block_bytes] = *std::prev(after);
  return start - block <= block_bytes && bytes <= block_bytes - (start - block);
}

absl::Status CudaBackend::Synchronize() {
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter("Synchronize"));
  return SyncLocked("Synchronize");
}

absl::Status CudaBackend::SyncLocked(absl::string_view op) {
  PSTRAIN_CUDA_RETURN_IF_ERROR(op, cudaStreamSynchronize(stream_));
  return CheckIndexError(op);
}

absl::Status CudaBackend::CheckIndexError(absl::string_view op) {
  if (!index_check_pending_) return absl::OkStatus();
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      op, cudaMemcpyAsync(
              &host_status_->index_error, &device_status_->index_error,
              sizeof(cuda::DeviceError), cudaMemcpyDeviceToHost, stream_));
  PSTRAIN_CUDA_RETURN_IF_ERROR(op, cudaStreamSynchronize(stream_));
  index_check_pending_ = false;
  const cuda::DeviceError error = host_status_->index_error;
  if (error.code == cuda::DeviceError::kNone) return absl::OkStatus();
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      op, cudaMemsetAsync(&device_status_->index_error, 0,
                          sizeof(cuda::DeviceError), stream_));
  const char* culprit =
      error.code == cuda::DeviceError::kGatherIndex ? "Gather" : "ScatterAdd";
  return absl::InvalidArgumentError(
      absl::StrCat(internal::IndexOutOfRangeMessage(
                       culprit, error.position, error.value, error.table_rows),
                   " (found on the GPU, reported by ", op, ")"));
}

}  // namespace cuda_internal

bool CudaBackendCompiled() { return true; }

CudaProbe ProbeCuda() {
  CudaProbe probe;
  probe.compiled = true;
  const cudaError_t error = cudaGetDeviceCount(&probe.device_count);
  if (error != cudaSuccess) {
    // Not sticky (no context exists yet); clear it so that it cannot be
    // mistaken for a later call's error.
    cudaGetLastError();
    probe.device_count = 0;
    probe.error = static_cast<int>(error);
    probe.error_name = cudaGetErrorName(error);
    probe.error_string = cudaGetErrorString(error);
  }
  // Both succeed without a driver (the driver version is then 0).
  if (cudaDriverGetVersion(&probe.driver_version) != cudaSuccess) {
    cudaGetLastError();
    probe.driver_version = 0;
  }
  if (cudaRuntimeGetVersion(&probe.runtime_version) != cudaSuccess) {
    cudaGetLastError();
    probe.runtime_version = CUDART_VERSION;
  }
  return probe;
}

int CudaDeviceCount(std::string* why_none) {
  const CudaProbe probe = ProbeCuda();
  if (const absl::Status usable = ClassifyCudaProbe(probe); !usable.ok()) {
    if (why_none != nullptr) *why_none = std::string(usable.message());
    return 0;
  }
  return probe.device_count;
}

std::string DescribeCudaDevice(int ordinal) {
  cudaDeviceProp prop;
  if (const cudaError_t error = cudaGetDeviceProperties(&prop, ordinal);
      error != cudaSuccess) {
    cudaGetLastError();
    return absl::StrCat("cuda:", ordinal, ": cudaGetDeviceProperties failed: ",
                        cudaGetErrorName(error));
  }
  return absl::StrFormat(
      "cuda:%d: %s, %.1f GiB, compute capability %d.%d, %d SMs", ordinal,
      prop.name, static_cast<double>(prop.totalGlobalMem) / (1 << 30),
      prop.major, prop.minor, prop.multiProcessorCount);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    int ordinal, Precision precision) {
  std::string why_none;
  const int count = CudaDeviceCount(&why_none);
  if (ordinal < 0 || ordinal >= count) {
    return absl::UnavailableError(
        count == 0 ? absl::StrCat("cuda:", ordinal,
                                  ": no CUDA device visible (", why_none, ")")
                   : absl::StrCat(
                         "cuda:", ordinal, ": only ", count,
                         " CUDA device(s) visible (cuda:0 to cuda:", count - 1,
                         "; CUDA_VISIBLE_DEVICES applies)"));
  }
  absl::StatusOr<std::unique_ptr<cuda_internal::CudaBackend>> backend =
      cuda_internal::CudaBackend::Create(ordinal, precision);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Backend>(*std::move(backend));
}

void* CudaStreamOf(Backend* backend) {
  auto* cuda = dynamic_cast<cuda_internal::CudaBackend*>(backend);
  return cuda == nullptr ? nullptr : static_cast<void*>(cuda->stream());
}

}  // namespace pstrain::kernels
