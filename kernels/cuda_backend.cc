// CudaBackend: the host side of the CUDA backend (memory, copies, cuBLAS,
// error handling). The kernels themselves are in cuda_kernels.cu; this file
// is compiled by the host compiler, with the CUDA runtime and cuBLAS headers.
#include "kernels/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <glog/logging.h>
#include <library_types.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/cuda_kernels.h"
#include "kernels/cuda_policy.h"
#include "kernels/op_checks.h"

namespace pstrain::kernels {
namespace {

using internal::Validate;

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

}  // namespace

// Every CUDA runtime / cuBLAS call in this file goes through one of these.
// `op` names the Backend operation for the message.
#define PSTRAIN_CUDA_RETURN_IF_ERROR(op, call)            \
  do {                                                    \
    const cudaError_t pstrain_cuda_error_ = (call);       \
    if (pstrain_cuda_error_ != cudaSuccess) {             \
      return CudaError((op), #call, pstrain_cuda_error_); \
    }                                                     \
  } while (false)

#define PSTRAIN_CUBLAS_RETURN_IF_ERROR(op, call)               \
  do {                                                         \
    const cublasStatus_t pstrain_cublas_status_ = (call);      \
    if (pstrain_cublas_status_ != CUBLAS_STATUS_SUCCESS) {     \
      return CublasError((op), #call, pstrain_cublas_status_); \
    }                                                          \
  } while (false)

// For calls whose failure can only be logged (destructor, Free).
#define PSTRAIN_CUDA_LOG_IF_ERROR(op, call)                                \
  do {                                                                     \
    const cudaError_t pstrain_cuda_error_ = (call);                        \
    if (pstrain_cuda_error_ != cudaSuccess) {                              \
      LOG(ERROR) << CudaError((op), #call, pstrain_cuda_error_).message(); \
    }                                                                      \
  } while (false)

#define PSTRAIN_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    absl::Status pstrain_status_ = (expr);             \
    if (!pstrain_status_.ok()) return pstrain_status_; \
  } while (false)

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

enum ScratchSlot : int {
  kScratchBf16A,
  kScratchBf16B,
  kScratchBiasGrad,
  kScratchRowLoss,
  kScratchRowCorrect,
  kNumScratch,
};

class CudaBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(
      int ordinal, Precision precision);
  ~CudaBackend() override;

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string Name() const override { return name_; }
  cudaStream_t stream() const { return stream_; }

  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* ptr) override;
  absl::Status CopyToDevice(const void* host, void* device,
                            size_t bytes) override;
  absl::Status CopyToHost(const void* device, void* host,
                          size_t bytes) override;
  absl::Status Synchronize() override;

  absl::Status Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                    float alpha, const float* a, const float* b, float beta,
                    float* c) override;
  absl::Status AddBias(int64_t rows, int64_t cols, const float* bias,
                       float* y) override;
  absl::Status BiasGrad(int64_t rows, int64_t cols, const float* dy,
                        float* bias_grad) override;
  absl::Status Relu(int64_t n, const float* x, float* y) override;
  absl::Status ReluGrad(int64_t n, const float* y, const float* dy,
                        float* dx) override;
  absl::Status SoftmaxCrossEntropy(int64_t rows, int64_t cols,
                                   const float* logits, const int32_t* labels,
                                   float grad_scale, float* dlogits,
                                   double* loss_sum,
                                   int64_t* num_correct) override;
  absl::Status Axpy(int64_t n, float alpha, const float* x, float* y) override;
  absl::Status Scale(int64_t n, float alpha, float* x) override;
  absl::Status Fill(int64_t n, float value, float* x) override;
  absl::Status Gather(int64_t num_indices, int64_t dim, int64_t table_rows,
                      const float* table, const int64_t* indices,
                      float* out) override;
  absl::Status ScatterAdd(int64_t num_indices, int64_t dim, int64_t table_rows,
                          const float* grads, const int64_t* indices,
                          float* table) override;
  absl::Status Im2Col(const Window2D& w, const float* x, float* col) override;
  absl::Status Col2Im(const Window2D& w, const float* col, float* x) override;
  absl::Status MaxPool2D(const Window2D& w, const float* x, float* y,
                         int64_t* argmax) override;
  absl::Status MaxPool2DGrad(const Window2D& w, const float* dy,
                             const int64_t* argmax, float* dx) override;

 private:
  struct Staging {
    void* host = nullptr;  // pinned (cudaMallocHost)
    size_t capacity = 0;
    // Recorded after the last transfer that used `host`; the buffer may be
    // rewritten once it has completed.
    cudaEvent_t done = nullptr;
  };

  struct ScratchBuffer {
    void* ptr = nullptr;
    size_t bytes = 0;
  };

  CudaBackend(int ordinal, Precision precision)
      : ordinal_(ordinal), precision_(precision) {}

  absl::Status Init();

  // Makes this backend's device current on the calling thread: the CUDA
  // runtime's current device is per thread, and callers may switch threads.
  absl::Status Enter(absl::string_view op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::StatusOr<void*> AllocateLocked(absl::string_view op, size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeLocked(void* ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns every cached (free) block to the driver.
  absl::Status ReleaseCached(absl::string_view op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A device buffer of at least `bytes` reserved for one internal use,
  // grown (through the pool) when too small. Stream order makes reuse safe.
  absl::StatusOr<void*> Scratch(absl::string_view op, ScratchSlot slot,
                                size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Waits for the staging buffer to be free and grows it to `bytes`.
  absl::Status ReadyStaging(absl::string_view op, Staging& staging,
                            size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // After the stream has been synchronized: reports an index error that a
  // Gather/ScatterAdd kernel left on the device, and clears it.
  absl::Status CheckIndexError(absl::string_view op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Synchronizes the stream (reporting asynchronous kernel errors) and then
  // any device-side index error.
  absl::Status SyncLocked(absl::string_view op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Runs a cuBLAS call; when cuBLAS itself runs out of device memory (its
  // workspace), the cached free blocks are returned to the driver and the
  // call is tried once more, as AllocateLocked does for cudaMalloc.
  template <typename CublasCall>
  absl::Status CublasTrimmingOnOom(absl::string_view op, const char* call_text,
                                   const CublasCall& call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    cublasStatus_t status = call();
    if (status == CUBLAS_STATUS_ALLOC_FAILED) {
      PSTRAIN_RETURN_IF_ERROR(ReleaseCached(op));
      status = call();
    }
    if (status != CUBLAS_STATUS_SUCCESS) {
      return CublasError(op, call_text, status);
    }
    return absl::OkStatus();
  }

  absl::Status GemmBf16(absl::string_view op, cublasOperation_t op_a,
                        cublasOperation_t op_b, int m, int n, int k,
                        float alpha, const float* a, int lda, const float* b,
                        int ldb, float beta, float* c)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int ordinal_;
  const Precision precision_;
  std::string name_;

  absl::Mutex mu_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;

  // The caching allocator: live blocks with their size class, and free
  // blocks by size class.
  absl::flat_hash_map<void*, size_t> live_ ABSL_GUARDED_BY(mu_);
  std::map<size_t, std::vector<void*>> free_ ABSL_GUARDED_BY(mu_);

  Staging staging_[2] ABSL_GUARDED_BY(mu_);
  int next_staging_ ABSL_GUARDED_BY(mu_) = 0;

  ScratchBuffer scratch_[kNumScratch] ABSL_GUARDED_BY(mu_);

  // What kernels report to the host: device memory, and a pinned host copy.
  cuda::DeviceStatus* device_status_ = nullptr;
  cuda::DeviceStatus* host_status_ = nullptr;
  // Whether a Gather/ScatterAdd ran since the index error was last read.
  bool index_check_pending_ ABSL_GUARDED_BY(mu_) = false;
};

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

// ---------------------------------------------------------------------------
// Compute.

absl::Status CudaBackend::Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n,
                               int64_t k, float alpha, const float* a,
                               const float* b, float beta, float* c) {
  constexpr absl::string_view kOp = "Gemm";
  const bool product = m > 0 && n > 0 && k > 0;
  PSTRAIN_RETURN_IF_ERROR(Validate(
      kOp, {{"m", m}, {"n", n}, {"k", k}},
      {{"a", a, product}, {"b", b, product}, {"c", c, m > 0 && n > 0}}));
  if (m == 0 || n == 0) return absl::OkStatus();
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gemm: m, n and k must fit cuBLAS's int, got ", m, ", ", n, ", ", k));
  }
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  // As in BLAS (and the CPU backend), alpha == 0 or k == 0 leaves
  // C = beta * C without reading A or B, and beta == 0 ignores C.
  if (k == 0 || alpha == 0.0f) {
    if (beta == 0.0f) {
      PSTRAIN_CUDA_RETURN_IF_ERROR(kOp,
                                   cuda::LaunchFill(stream_, m * n, 0.0f, c));
    } else if (beta != 1.0f) {
      PSTRAIN_CUDA_RETURN_IF_ERROR(kOp,
                                   cuda::LaunchScale(stream_, m * n, beta, c));
    }
    return absl::OkStatus();
  }
  // cuBLAS is column-major. A row-major [r, c] matrix is the column-major
  // [c, r] matrix of its transpose, so the row-major C = op(A) op(B) is
  // computed as the column-major C^T = op(B)^T op(A)^T: swap the operands,
  // keep each one's transpose flag, and use the row lengths as leading
  // dimensions.
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int lda = static_cast<int>(trans_a ? m : k);
  const int ldb = static_cast<int>(trans_b ? k : n);
  if (precision_ == Precision::kBf16) {
    return GemmBf16(kOp, op_a, op_b, static_cast<int>(m), static_cast<int>(n),
                    static_cast<int>(k), alpha, a, lda, b, ldb, beta, c);
  }
  return CublasTrimmingOnOom(kOp, "cublasSgemm", [&] {
    return cublasSgemm(cublas_, op_b, op_a, static_cast<int>(n),
                       static_cast<int>(m), static_cast<int>(k), &alpha, b, ldb,
                       a, lda, &beta, c, static_cast<int>(n));
  });
}

absl::Status CudaBackend::GemmBf16(absl::string_view op, cublasOperation_t op_a,
                                   cublasOperation_t op_b, int m, int n, int k,
                                   float alpha, const float* a, int lda,
                                   const float* b, int ldb, float beta,
                                   float* c) {
  const int64_t a_elements = int64_t{m} * k;
  const int64_t b_elements = int64_t{k} * n;
  constexpr size_t kBf16Bytes = 2;
  absl::StatusOr<void*> a16 =
      Scratch(op, kScratchBf16A, a_elements * kBf16Bytes);
  if (!a16.ok()) return a16.status();
  absl::StatusOr<void*> b16 =
      Scratch(op, kScratchBf16B, b_elements * kBf16Bytes);
  if (!b16.ok()) return b16.status();
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      op, cuda::LaunchFloatToBf16(stream_, a_elements, a, *a16));
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      op, cuda::LaunchFloatToBf16(stream_, b_elements, b, *b16));
  // bf16 inputs, fp32 accumulation (CUBLAS_COMPUTE_32F), fp32 C.
  return CublasTrimmingOnOom(op, "cublasGemmEx", [&] {
    return cublasGemmEx(cublas_, op_b, op_a, n, m, k, &alpha, *b16, CUDA_R_16BF,
                        ldb, *a16, CUDA_R_16BF, lda, &beta, c, CUDA_R_32F, n,
                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  });
}

absl::Status CudaBackend::AddBias(int64_t rows, int64_t cols, const float* bias,
                                  float* y) {
  constexpr absl::string_view kOp = "AddBias";
  const bool any = rows > 0 && cols > 0;
  PSTRAIN_RETURN_IF_ERROR(Validate(kOp, {{"rows", rows}, {"cols", cols}},
                                   {{"bias", bias, any}, {"y", y, any}}));
  if (!any) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp, cuda::LaunchAddBias(stream_, rows, cols, bias, y));
  return absl::OkStatus();
}

absl::Status CudaBackend::BiasGrad(int64_t rows, int64_t cols, const float* dy,
                                   float* bias_grad) {
  constexpr absl::string_view kOp = "BiasGrad";
  PSTRAIN_RETURN_IF_ERROR(Validate(
      kOp, {{"rows", rows}, {"cols", cols}},
      {{"dy", dy, rows > 0 && cols > 0}, {"bias_grad", bias_grad, cols > 0}}));
  if (cols == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  if (rows == 0) {
    PSTRAIN_CUDA_RETURN_IF_ERROR(
        kOp, cuda::LaunchFill(stream_, cols, 0.0f, bias_grad));
    return absl::OkStatus();
  }
  double* scratch = nullptr;
  if (const int64_t elements = cuda::BiasGradScratchElements(rows, cols);
      elements > 0) {
    absl::StatusOr<void*> ptr =
        Scratch(kOp, kScratchBiasGrad, elements * sizeof(double));
    if (!ptr.ok()) return ptr.status();
    scratch = static_cast<double*>(*ptr);
  }
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp, cuda::LaunchBiasGrad(stream_, rows, cols, dy, bias_grad, scratch));
  return absl::OkStatus();
}

absl::Status CudaBackend::Relu(int64_t n, const float* x, float* y) {
  constexpr absl::string_view kOp = "Relu";
  PSTRAIN_RETURN_IF_ERROR(
      Validate(kOp, {{"n", n}}, {{"x", x, n > 0}, {"y", y, n > 0}}));
  if (n == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(kOp, cuda::LaunchRelu(stream_, n, x, y));
  return absl::OkStatus();
}

absl::Status CudaBackend::ReluGrad(int64_t n, const float* y, const float* dy,
                                   float* dx) {
  constexpr absl::string_view kOp = "ReluGrad";
  PSTRAIN_RETURN_IF_ERROR(
      Validate(kOp, {{"n", n}},
               {{"y", y, n > 0}, {"dy", dy, n > 0}, {"dx", dx, n > 0}}));
  if (n == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(kOp,
                               cuda::LaunchReluGrad(stream_, n, y, dy, dx));
  return absl::OkStatus();
}

absl::Status CudaBackend::SoftmaxCrossEntropy(
    int64_t rows, int64_t cols, const float* logits, const int32_t* labels,
    float grad_scale, float* dlogits, double* loss_sum, int64_t* num_correct) {
  constexpr absl::string_view kOp = "SoftmaxCrossEntropy";
  PSTRAIN_RETURN_IF_ERROR(Validate(kOp, {{"rows", rows}, {"cols", cols}},
                                   {{"logits", logits, rows > 0},
                                    {"labels", labels, rows > 0},
                                    {"loss_sum", loss_sum, true},
                                    {"num_correct", num_correct, true}}));
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  if (rows == 0) {
    // Nothing to compute, but the op still returns host results, so it
    // keeps its promise of being a synchronization point.
    PSTRAIN_RETURN_IF_ERROR(SyncLocked(kOp));
    *loss_sum = 0.0;
    *num_correct = 0;
    return absl::OkStatus();
  }
  absl::StatusOr<void*> row_loss =
      Scratch(kOp, kScratchRowLoss, rows * sizeof(double));
  if (!row_loss.ok()) return row_loss.status();
  absl::StatusOr<void*> row_correct =
      Scratch(kOp, kScratchRowCorrect, rows * sizeof(int));
  if (!row_correct.ok()) return row_correct.status();
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp, cuda::LaunchSoftmaxCrossEntropy(
               stream_, rows, cols, logits, labels, grad_scale, dlogits,
               static_cast<double*>(*row_loss), static_cast<int*>(*row_correct),
               &device_status_->softmax_ce));
  // The step's one wait for the GPU: the loss and count come back with any
  // bad label in one small copy.
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp, cudaMemcpyAsync(
               &host_status_->softmax_ce, &device_status_->softmax_ce,
               sizeof(cuda::SoftmaxCeResult), cudaMemcpyDeviceToHost, stream_));
  PSTRAIN_RETURN_IF_ERROR(SyncLocked(kOp));
  const cuda::SoftmaxCeResult result = host_status_->softmax_ce;
  if (result.bad_row != cuda::SoftmaxCeResult::kNoBadRow) {
    return absl::InvalidArgumentError(
        absl::StrCat("SoftmaxCrossEntropy: row ", result.bad_row, " has label ",
                     result.bad_label, ", outside [0, ", cols, ")"));
  }
  *loss_sum = result.loss_sum;
  *num_correct = result.num_correct;
  return absl::OkStatus();
}

absl::Status CudaBackend::Axpy(int64_t n, float alpha, const float* x,
                               float* y) {
  constexpr absl::string_view kOp = "Axpy";
  PSTRAIN_RETURN_IF_ERROR(
      Validate(kOp, {{"n", n}}, {{"x", x, n > 0}, {"y", y, n > 0}}));
  if (n == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(kOp, cuda::LaunchAxpy(stream_, n, alpha, x, y));
  return absl::OkStatus();
}

absl::Status CudaBackend::Scale(int64_t n, float alpha, float* x) {
  constexpr absl::string_view kOp = "Scale";
  PSTRAIN_RETURN_IF_ERROR(Validate(kOp, {{"n", n}}, {{"x", x, n > 0}}));
  if (n == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(kOp, cuda::LaunchScale(stream_, n, alpha, x));
  return absl::OkStatus();
}

absl::Status CudaBackend::Fill(int64_t n, float value, float* x) {
  constexpr absl::string_view kOp = "Fill";
  PSTRAIN_RETURN_IF_ERROR(Validate(kOp, {{"n", n}}, {{"x", x, n > 0}}));
  if (n == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(kOp, cuda::LaunchFill(stream_, n, value, x));
  return absl::OkStatus();
}

absl::Status CudaBackend::Gather(int64_t num_indices, int64_t dim,
                                 int64_t table_rows, const float* table,
                                 const int64_t* indices, float* out) {
  constexpr absl::string_view kOp = "Gather";
  const bool any = num_indices > 0 && dim > 0;
  PSTRAIN_RETURN_IF_ERROR(Validate(
      kOp,
      {{"num_indices", num_indices}, {"dim", dim}, {"table_rows", table_rows}},
      {{"table", table, any},
       {"indices", indices, num_indices > 0},
       {"out", out, any}}));
  if (num_indices == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp, cuda::LaunchGather(stream_, num_indices, dim, table_rows, table,
                              indices, out, &device_status_->index_error));
  index_check_pending_ = true;
  return absl::OkStatus();
}

absl::Status CudaBackend::ScatterAdd(int64_t num_indices, int64_t dim,
                                     int64_t table_rows, const float* grads,
                                     const int64_t* indices, float* table) {
  constexpr absl::string_view kOp = "ScatterAdd";
  const bool any = num_indices > 0 && dim > 0;
  PSTRAIN_RETURN_IF_ERROR(Validate(
      kOp,
      {{"num_indices", num_indices}, {"dim", dim}, {"table_rows", table_rows}},
      {{"grads", grads, any},
       {"indices", indices, num_indices > 0},
       {"table", table, any}}));
  if (num_indices == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp,
      cuda::LaunchScatterAdd(stream_, num_indices, dim, table_rows, grads,
                             indices, table, &device_status_->index_error));
  index_check_pending_ = true;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Sliding windows: the checks are the CPU's (op_checks.h), the kernels in
// cuda_kernels.cu.

cuda::WindowGeometry Geometry(const Window2D& w) {
  return cuda::WindowGeometry{w.batch,    w.height,       w.width,
                              w.channels, w.kernel,       w.stride,
                              w.pad,      w.out_height(), w.out_width()};
}

absl::Status CudaBackend::Im2Col(const Window2D& w, const float* x,
                                 float* col) {
  constexpr absl::string_view kOp = "Im2Col";
  PSTRAIN_RETURN_IF_ERROR(internal::ValidateWindow(kOp, w, true));
  if (!internal::WindowHasWork(w)) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(
      Validate(kOp, {}, {{"x", x, true}, {"col", col, true}}));
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp, cuda::LaunchIm2Col(stream_, Geometry(w), x, col));
  return absl::OkStatus();
}

absl::Status CudaBackend::Col2Im(const Window2D& w, const float* col,
                                 float* x) {
  constexpr absl::string_view kOp = "Col2Im";
  PSTRAIN_RETURN_IF_ERROR(internal::ValidateWindow(kOp, w, true));
  if (!internal::WindowHasWork(w)) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(
      Validate(kOp, {}, {{"col", col, true}, {"x", x, true}}));
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp, cuda::LaunchCol2Im(stream_, Geometry(w), col, x));
  return absl::OkStatus();
}

absl::Status CudaBackend::MaxPool2D(const Window2D& w, const float* x, float* y,
                                    int64_t* argmax) {
  constexpr absl::string_view kOp = "MaxPool2D";
  PSTRAIN_RETURN_IF_ERROR(internal::ValidateWindow(kOp, w, false));
  if (!internal::WindowHasWork(w)) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(Validate(kOp, {}, {{"x", x, true}, {"y", y, true}}));
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp, cuda::LaunchMaxPool2D(stream_, Geometry(w), x, y, argmax));
  return absl::OkStatus();
}

absl::Status CudaBackend::MaxPool2DGrad(const Window2D& w, const float* dy,
                                        const int64_t* argmax, float* dx) {
  constexpr absl::string_view kOp = "MaxPool2DGrad";
  PSTRAIN_RETURN_IF_ERROR(internal::ValidateWindow(kOp, w, false));
  if (!internal::WindowHasWork(w)) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(Validate(
      kOp, {}, {{"dy", dy, true}, {"argmax", argmax, true}, {"dx", dx, true}}));
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(
      kOp, cuda::LaunchMaxPool2DGrad(stream_, Geometry(w), dy, argmax, dx));
  return absl::OkStatus();
}

}  // namespace

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
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend =
      CudaBackend::Create(ordinal, precision);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Backend>(*std::move(backend));
}

void* CudaStreamOf(Backend* backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(backend);
  return cuda == nullptr ? nullptr : static_cast<void*>(cuda->stream());
}

}  // namespace pstrain::kernels
