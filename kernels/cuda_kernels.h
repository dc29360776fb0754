// The CUDA kernels behind CudaBackend, as plain launch functions.
//
// cuda_kernels.cu is the only file compiled by nvcc; it sees no Abseil and
// no Backend class, only raw pointers, sizes and the stream. Each Launch*
// function enqueues its kernel(s) on `stream` and returns the launch status
// (cudaGetLastError), never waiting for the GPU. Sizes are already validated
// by the caller (non-negative, pointers non-null where used); zero sizes
// launch nothing.
#ifndef PSTRAIN_KERNELS_CUDA_KERNELS_H_
#define PSTRAIN_KERNELS_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pstrain::kernels::cuda {

// An error found on the device by a kernel that cannot return one (an
// embedding index out of range). The first kernel to find one claims `code`
// (atomicCAS from kNone) and fills the rest; the host reads it at its next
// synchronization and clears it.
struct DeviceError {
  enum Code : int { kNone = 0, kGatherIndex = 1, kScatterAddIndex = 2 };
  int code;
  int unused;
  long long position;    // i, the entry of `indices`
  long long value;       // indices[i]
  long long table_rows;  // the valid range is [0, table_rows)
};

// What SoftmaxCrossEntropy leaves for the host, in one small struct so that
// a single copy brings the loss, the count and any bad label back.
struct SoftmaxCeResult {
  // No label was out of range when bad_row is kNoBadRow; otherwise the
  // smallest bad row and its label, and nothing else was written.
  static constexpr unsigned long long kNoBadRow = ~0ull;
  double loss_sum;
  long long num_correct;
  unsigned long long bad_row;
  long long bad_label;
};

// Everything the device reports to the host, in one allocation.
struct DeviceStatus {
  SoftmaxCeResult softmax_ce;
  DeviceError index_error;
};

// Checks that this binary holds kernel code the current device can run
// (cudaErrorNoKernelImageForDevice or cudaErrorInvalidDeviceFunction if not).
cudaError_t CheckKernelImage();

cudaError_t LaunchFill(cudaStream_t stream, int64_t n, float value, float* x);
cudaError_t LaunchScale(cudaStream_t stream, int64_t n, float alpha, float* x);
cudaError_t LaunchAxpy(cudaStream_t stream, int64_t n, float alpha,
                       const float* x, float* y);
cudaError_t LaunchRelu(cudaStream_t stream, int64_t n, const float* x,
                       float* y);
cudaError_t LaunchReluGrad(cudaStream_t stream, int64_t n, const float* y,
                           const float* dy, float* dx);
cudaError_t LaunchAddBias(cudaStream_t stream, int64_t rows, int64_t cols,
                          const float* bias, float* y);

// BiasGrad sums column slices of up to a few thousand rows in parallel and
// then the slices, both in double and in a fixed order (deterministic).
// `scratch` must hold BiasGradScratchElements(rows, cols) doubles (0: may
// be null). rows must be > 0 (rows == 0 is a Fill with 0).
int64_t BiasGradScratchElements(int64_t rows, int64_t cols);
cudaError_t LaunchBiasGrad(cudaStream_t stream, int64_t rows, int64_t cols,
                           const float* dy, float* bias_grad, double* scratch);

// out[i] = in[i] rounded to bfloat16 (round to nearest even). `out` is a
// __nv_bfloat16 array (void* keeps cuda_bf16.h out of this header).
cudaError_t LaunchFloatToBf16(cudaStream_t stream, int64_t n, const float* in,
                              void* out);

// out[i] = the float whose top 16 bits are in[i] (a __nv_bfloat16 array's
// bits): exact.
cudaError_t LaunchBf16ToFloat(cudaStream_t stream, int64_t n, const void* in,
                              float* out);

// out[i] = in[i] rounded to IEEE binary16 (round to nearest even), as
// __half bits.
cudaError_t LaunchFloatToFp16(cudaStream_t stream, int64_t n, const float* in,
                              uint16_t* out);

// out[i] = the binary16 in[i] as a float: exact.
cudaError_t LaunchFp16ToFloat(cudaStream_t stream, int64_t n,
                              const uint16_t* in, float* out);

// Fused softmax cross-entropy, as Backend::SoftmaxCrossEntropy, leaving its
// results in *result (device memory): labels are checked first (a bad one
// makes the other kernels write nothing), then one block per row computes
// the row's loss, correctness and gradient in double, then one block sums
// the rows in a fixed order. Scratch: row_loss[rows], row_correct[rows].
// rows must be > 0.
cudaError_t LaunchSoftmaxCrossEntropy(cudaStream_t stream, int64_t rows,
                                      int64_t cols, const float* logits,
                                      const int32_t* labels, float grad_scale,
                                      float* dlogits, double* row_loss,
                                      int* row_correct,
                                      SoftmaxCeResult* result);

// out[i, :] = table[indices[i], :]; an index outside [0, table_rows) is
// reported through *error and its output row is zero-filled.
cudaError_t LaunchGather(cudaStream_t stream, int64_t num_indices, int64_t dim,
                         int64_t table_rows, const float* table,
                         const int64_t* indices, float* out,
                         DeviceError* error);

// table[indices[i], :] += grads[i, :] with atomicAdd; an index outside
// [0, table_rows) is reported through *error and its row skipped.
cudaError_t LaunchScatterAdd(cudaStream_t stream, int64_t num_indices,
                             int64_t dim, int64_t table_rows,
                             const float* grads, const int64_t* indices,
                             float* table, DeviceError* error);

// Backend's Window2D (backend.h) with its derived sizes, as plain numbers
// for the kernels. Validated by the caller; every op needs batch, channels
// and the output size to be positive to launch anything.
struct WindowGeometry {
  long long batch, height, width, channels;
  long long kernel, stride, pad;
  long long out_height, out_width;
};

// col[(n, oh, ow), (kh, kw, c)] = x at (n, oh*stride-pad+kh,
// ow*stride-pad+kw, c), or 0 in the padding; one thread per col element.
cudaError_t LaunchIm2Col(cudaStream_t stream, const WindowGeometry& w,
                         const float* x, float* col);

// x (overwritten) = the sum of the col entries read from each pixel. One
// thread per pixel gathers its entries (no atomics) in the order the CPU
// adds them, so the result is bit-identical to the CPU's.
cudaError_t LaunchCol2Im(cudaStream_t stream, const WindowGeometry& w,
                         const float* col, float* x);

// Max pooling (pad 0) with the CPU's tie and NaN rules; argmax may be null.
cudaError_t LaunchMaxPool2D(cudaStream_t stream, const WindowGeometry& w,
                            const float* x, float* y, int64_t* argmax);

// dx (overwritten): each input element gathers dy from the windows that
// cover it and chose it, in output order (bit-identical to the CPU's
// scatter). argmax entries that point elsewhere are simply not gathered.
cudaError_t LaunchMaxPool2DGrad(cudaStream_t stream, const WindowGeometry& w,
                                const float* dy, const int64_t* argmax,
                                float* dx);

}  // namespace pstrain::kernels::cuda

#endif  // PSTRAIN_KERNELS_CUDA_KERNELS_H_
