// The CPU backend: plain host-memory implementations of every Backend op.
// Its hand-written kernels are the reference the other backends are tested
// against, so they favour exactness and clear semantics (double
// accumulation where it is cheap, NaN propagation) over peak speed, while
// staying cache-friendly. For training, Gemm (where nearly all the time of
// a dense or convolutional model goes) runs through OpenBLAS instead:
// CpuGemm::kBlas, what --device=cpu trains with; --device=cpu_reference
// (CpuGemm::kReference) keeps the exact kernel everywhere.
//
// Ops run synchronously on the calling thread (OpenBLAS may fan a GEMM out
// to its own threads). One CpuBackend may be used from several threads at
// once: it holds no mutable state of its own.
#ifndef PSTRAIN_KERNELS_CPU_BACKEND_H_
#define PSTRAIN_KERNELS_CPU_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace pstrain::kernels {

// How CpuBackend::Gemm multiplies.
enum class CpuGemm {
  kBlas,       // cblas_sgemm from OpenBLAS: fast, float accumulation
  kReference,  // the exact hand-written kernel
  // A and B rounded to bfloat16 (to nearest, ties to even), then kBlas: the
  // CPU reference of the CUDA backend's --precision=bf16 GEMMs, which round
  // the same way and accumulate in float. A bf16 x bf16 product is exact in
  // float, so the two differ only in summation order. For tests.
  kBf16Inputs,
};

// `x` rounded to the nearest bfloat16 (ties to even), as a float; NaN stays
// NaN and what overflows becomes infinity, as __float2bfloat16_rn does.
float RoundToBf16(float x);

// Sets the threads OpenBLAS uses, for the whole process (OpenBLAS has one
// pool); threads <= 0 means the cores this process may run on. Returns the
// count set.
int SetCpuGemmThreads(int threads);

// The cores this process may run on (sched_getaffinity), at least 1.
int AvailableCores();

class CpuBackend final : public Backend {
 public:
  // Alignment of every Allocate result, in bytes (a cache line; enough for
  // any SIMD load).
  static constexpr size_t kAlignment = 64;

  // `staged`: MemoryIsHost() says false, so a worker stages its tensors
  // through host copies (and casts for the wire on the "device") as it does
  // on a GPU: --device=cpu_staged, which runs that path where there is no
  // GPU (tests). Everything else is kBlas's.
  explicit CpuBackend(CpuGemm gemm = CpuGemm::kBlas, bool staged = false)
      : gemm_(gemm), staged_(staged) {}
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  std::string Name() const override;
  bool MemoryIsHost() const override { return !staged_; }

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
  const CpuGemm gemm_;
  const bool staged_;
};

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_CPU_BACKEND_H_
