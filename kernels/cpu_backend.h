// The CPU backend: plain host-memory implementations of every Backend op.
// It is the reference the other backends are tested against, so it favours
// exactness and clear semantics (double accumulation where it is cheap,
// NaN propagation) over peak speed, while staying cache-friendly.
//
// Ops run synchronously on the calling thread. One CpuBackend may be used
// from several threads at once: it holds no mutable state of its own.
#ifndef PSTRAIN_KERNELS_CPU_BACKEND_H_
#define PSTRAIN_KERNELS_CPU_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace pstrain::kernels {

class CpuBackend final : public Backend {
 public:
  // Alignment of every Allocate result, in bytes (a cache line; enough for
  // any SIMD load).
  static constexpr size_t kAlignment = 64;

  CpuBackend() = default;
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  std::string Name() const override;

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
};

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_CPU_BACKEND_H_
