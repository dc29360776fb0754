// Private to the CUDA backend (kernels/cuda_backend*.cc): the CudaBackend
// class and the error helpers and macros that its files share. In the
// cuda_backend library's srcs, not its hdrs, so that only cuda_backend.h is
// its API; nothing outside those files may include this.
#ifndef PSTRAIN_KERNELS_CUDA_BACKEND_INTERNAL_H_
#define PSTRAIN_KERNELS_CUDA_BACKEND_INTERNAL_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <glog/logging.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend.h"
#include "kernels/cuda_kernels.h"

namespace pstrain::kernels::cuda_internal {

// What a failed CUDA runtime / cuBLAS call becomes: the message names the
// Backend op, the call and the error; the code tells out-of-memory
// (ResourceExhausted) and a missing or unusable device (Unavailable) apart
// from everything else (Internal).
absl::Status CudaError(absl::string_view op, absl::string_view call,
                       cudaError_t error);
absl::Status CublasError(absl::string_view op, absl::string_view call,
                         cublasStatus_t status);

// Every CUDA runtime / cuBLAS call in the backend goes through one of these.
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
  absl::StatusOr<void*> AllocateHost(size_t bytes) override;
  void FreeHost(void* ptr) override;
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
  absl::Status FloatToBf16(int64_t n, const float* x, uint16_t* y) override;
  absl::Status Bf16ToFloat(int64_t n, const uint16_t* x, float* y) override;
  absl::Status FloatToFp16(int64_t n, const float* x, uint16_t* y) override;
  absl::Status Fp16ToFloat(int64_t n, const uint16_t* x, float* y) override;
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

  // True when [host, host + bytes) lies inside one AllocateHost block: the
  // copy can be one DMA, with no staging.
  bool IsPinnedLocked(const void* host, size_t bytes) const
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

  // AllocateHost's page-locked blocks: start address -> bytes.
  std::map<uintptr_t, size_t> pinned_ ABSL_GUARDED_BY(mu_);

  Staging staging_[2] ABSL_GUARDED_BY(mu_);
  int next_staging_ ABSL_GUARDED_BY(mu_) = 0;

  ScratchBuffer scratch_[kNumScratch] ABSL_GUARDED_BY(mu_);

  // What kernels report to the host: device memory, and a pinned host copy.
  cuda::DeviceStatus* device_status_ = nullptr;
  cuda::DeviceStatus* host_status_ = nullptr;
  // Whether a Gather/ScatterAdd ran since the index error was last read.
  bool index_check_pending_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pstrain::kernels::cuda_internal

#endif  // PSTRAIN_KERNELS_CUDA_BACKEND_INTERNAL_H_
