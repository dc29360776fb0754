// The CUDA backend's math ops: Gemm through cuBLAS, every other op through
// the kernels of cuda_kernels.cu. Kept apart from the backend's state (the
// allocator, staging and stream, in cuda_backend.cc, whose opening comment
// says which file holds what) because each op only checks its arguments and
// issues work on the stream.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <library_types.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend.h"
#include "kernels/cuda_backend_internal.h"
#include "kernels/cuda_kernels.h"
#include "kernels/op_checks.h"

namespace pstrain::kernels::cuda_internal {

using internal::Validate;

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

absl::Status CudaBackend::FloatToBf16(int64_t n, const float* x, uint16_t* y) {
  constexpr absl::string_view kOp = "FloatToBf16";
  PSTRAIN_RETURN_IF_ERROR(
      Validate(kOp, {{"n", n}}, {{"x", x, n > 0}, {"y", y, n > 0}}));
  if (n == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(kOp, cuda::LaunchFloatToBf16(stream_, n, x, y));
  return absl::OkStatus();
}

absl::Status CudaBackend::Bf16ToFloat(int64_t n, const uint16_t* x, float* y) {
  constexpr absl::string_view kOp = "Bf16ToFloat";
  PSTRAIN_RETURN_IF_ERROR(
      Validate(kOp, {{"n", n}}, {{"x", x, n > 0}, {"y", y, n > 0}}));
  if (n == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(kOp, cuda::LaunchBf16ToFloat(stream_, n, x, y));
  return absl::OkStatus();
}

absl::Status CudaBackend::FloatToFp16(int64_t n, const float* x, uint16_t* y) {
  constexpr absl::string_view kOp = "FloatToFp16";
  PSTRAIN_RETURN_IF_ERROR(
      Validate(kOp, {{"n", n}}, {{"x", x, n > 0}, {"y", y, n > 0}}));
  if (n == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(kOp, cuda::LaunchFloatToFp16(stream_, n, x, y));
  return absl::OkStatus();
}

absl::Status CudaBackend::Fp16ToFloat(int64_t n, const uint16_t* x, float* y) {
  constexpr absl::string_view kOp = "Fp16ToFloat";
  PSTRAIN_RETURN_IF_ERROR(
      Validate(kOp, {{"n", n}}, {{"x", x, n > 0}, {"y", y, n > 0}}));
  if (n == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(Enter(kOp));
  PSTRAIN_CUDA_RETURN_IF_ERROR(kOp, cuda::LaunchFp16ToFloat(stream_, n, x, y));
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

namespace {

cuda::WindowGeometry Geometry(const Window2D& w) {
  return cuda::WindowGeometry{w.batch,    w.height,       w.width,
                              w.channels, w.kernel,       w.stride,
                              w.pad,      w.out_height(), w.out_width()};
}

}  // namespace

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

}  // namespace pstrain::kernels::cuda_internal
