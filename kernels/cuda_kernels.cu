// The kernels of the CUDA backend; see cuda_kernels.h for the contracts.
//
// Numerics follow the CPU reference (cpu_backend.cc) so that the two agree
// to the last bit wherever the CPU's result is itself well defined:
//  - Elementwise ops use __fadd_rn/__fmul_rn, which nvcc never contracts
//    into an FMA, because the CPU build (x86-64 baseline, no -mfma) does not
//    either: y + a*x is rounded twice on both.
//  - Reductions (BiasGrad, softmax) accumulate in double, in a fixed order,
//    so results do not change from run to run.
//  - ReLU lets NaN through, and the softmax argmax picks the first maximal
//    logit, ignoring NaNs unless logit 0 is NaN, exactly like the CPU loop.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda_kernels.h"

namespace pstrain::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops cover any n; more blocks than this only add scheduling
// overhead (a Hopper GPU holds ~2k resident blocks of 256 threads).
constexpr int64_t kMaxBlocks = 1 << 16;

unsigned int BlocksFor(int64_t n, int threads = kThreads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// One thread per element of a row (up to kThreads), in whole warps.
int ThreadsForRow(int64_t cols) {
  const int64_t warps = (cols + 31) / 32;
  if (warps <= 1) return 32;
  return warps >= kThreads / 32 ? kThreads : static_cast<int>(warps * 32);
}

__device__ __forceinline__ int64_t GlobalIndex() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t GridStride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// ---------------------------------------------------------------------------
// Block reductions. blockDim.x must be a multiple of 32 (at most 1024). Every
// thread gets the result, and `shared` may be reused once they return.

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

// shared: at least 33 elements.
template <typename T>
__device__ T BlockSum(T v, T* shared) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = WarpSum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T total = lane < static_cast<int>(blockDim.x >> 5) ? shared[lane] : T(0);
    total = WarpSum(total);
    if (lane == 0) shared[32] = total;
  }
  __syncthreads();
  const T result = shared[32];
  __syncthreads();
  return result;
}

// A candidate for the argmax: index < 0 means "none yet".
struct MaxCandidate {
  float value;
  long long index;
};

// Whether b beats a: a larger value, or an equal one further left (the CPU
// keeps the first maximal logit).
__device__ __forceinline__ bool Beats(const MaxCandidate& b,
                                      const MaxCandidate& a) {
  if (b.index < 0) return false;
  if (a.index < 0) return true;
  return b.value > a.value || (b.value == a.value && b.index < a.index);
}

__device__ __forceinline__ MaxCandidate WarpArgMax(MaxCandidate m) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxCandidate other;
    other.value = __shfl_down_sync(0xffffffffu, m.value, offset);
    other.index = __shfl_down_sync(0xffffffffu, m.index, offset);
    if (Beats(other, m)) m = other;
  }
  return m;
}

// shared: at least 33 elements.
__device__ MaxCandidate BlockArgMax(MaxCandidate m, MaxCandidate* shared) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  m = WarpArgMax(m);
  if (lane == 0) shared[warp] = m;
  __syncthreads();
  if (warp == 0) {
    MaxCandidate best{0.0f, -1};
    if (lane < static_cast<int>(blockDim.x >> 5)) best = shared[lane];
    best = WarpArgMax(best);
    if (lane == 0) shared[32] = best;
  }
  __syncthreads();
  const MaxCandidate result = shared[32];
  __syncthreads();
  return result;
}

// ---------------------------------------------------------------------------
// Elementwise.

__global__ void __launch_bounds__(kThreads)
    FillKernel(int64_t n, float value, float* x) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) x[i] = value;
}

__global__ void __launch_bounds__(kThreads)
    ScaleKernel(int64_t n, float alpha, float* x) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    x[i] = __fmul_rn(x[i], alpha);
  }
}

// x may alias y (each element is read before it is written, by one thread).
__global__ void __launch_bounds__(kThreads)
    AxpyKernel(int64_t n, float alpha, const float* x, float* y) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    y[i] = __fadd_rn(y[i], __fmul_rn(alpha, x[i]));
  }
}

__global__ void __launch_bounds__(kThreads)
    ReluKernel(int64_t n, const float* x, float* y) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float v = x[i];
    // NaN passes through, as on the CPU: a diverged model must show NaN.
    y[i] = (v > 0.0f || v != v) ? v : 0.0f;
  }
}

__global__ void __launch_bounds__(kThreads)
    ReluGradKernel(int64_t n, const float* y, const float* dy, float* dx) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
  }
}

// One block row per matrix row: no division per element, and the bias row
// is read once per block from L1/L2.
__global__ void __launch_bounds__(kThreads)
    AddBiasKernel(int64_t rows, int64_t cols, const float* bias, float* y) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float* row = y + r * cols;
    for (int64_t c = GlobalIndex(); c < cols; c += GridStride()) {
      row[c] = __fadd_rn(row[c], bias[c]);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    FloatToBf16Kernel(int64_t n, const float* in, __nv_bfloat16* out) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
    Bf16ToFloatKernel(int64_t n, const uint16_t* in, float* out) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
  }
}

__global__ void __launch_bounds__(kThreads)
    FloatToFp16Kernel(int64_t n, const float* in, uint16_t* out) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    out[i] = __half_as_ushort(__float2half_rn(in[i]));
  }
}

__global__ void __launch_bounds__(kThreads)
    Fp16ToFloatKernel(int64_t n, const uint16_t* in, float* out) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    out[i] = __half2float(__ushort_as_half(in[i]));
  }
}

// ---------------------------------------------------------------------------
// BiasGrad: block (32, 8) sums a 32-column tile over one chunk of rows; with
// several chunks a second kernel adds the chunks' partial sums per column.

constexpr int kBiasTileCols = 32;
constexpr int kBiasThreadRows = 8;
constexpr int64_t kBiasMaxChunks = 1024;
static_assert(kBiasTileCols * kBiasThreadRows <= kThreads,
              "BiasGradPartialKernel's block exceeds its launch bounds");

int64_t BiasGradChunkRows(int64_t rows) {
  const int64_t even = (rows + kBiasMaxChunks - 1) / kBiasMaxChunks;
  return even > 64 ? even : 64;
}

int64_t BiasGradChunks(int64_t rows) {
  const int64_t chunk_rows = BiasGradChunkRows(rows);
  return (rows + chunk_rows - 1) / chunk_rows;
}

// partial == nullptr: a single chunk, written straight to bias_grad.
__global__ void __launch_bounds__(kThreads)
    BiasGradPartialKernel(int64_t rows, int64_t cols, int64_t chunk_rows,
                          const float* dy, float* bias_grad, double* partial) {
  __shared__ double sums[kBiasThreadRows][kBiasTileCols + 1];
  const int64_t c =
      static_cast<int64_t>(blockIdx.x) * kBiasTileCols + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t r0 = chunk * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  double acc = 0.0;
  if (c < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kBiasThreadRows) {
      acc += static_cast<double>(dy[r * cols + c]);
    }
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    double total = 0.0;
    for (int k = 0; k < kBiasThreadRows; ++k) total += sums[k][threadIdx.x];
    if (partial == nullptr) {
      bias_grad[c] = static_cast<float>(total);
    } else {
      partial[chunk * cols + c] = total;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    BiasGradFinishKernel(int64_t cols, int64_t chunks, const double* partial,
                         float* bias_grad) {
  for (int64_t c = GlobalIndex(); c < cols; c += GridStride()) {
    double total = 0.0;
    for (int64_t k = 0; k < chunks; ++k) total += partial[k * cols + c];
    bias_grad[c] = static_cast<float>(total);
  }
}

// ---------------------------------------------------------------------------
// Softmax cross-entropy.

__global__ void __launch_bounds__(kThreads)
    CheckLabelsKernel(int64_t rows, int64_t cols, const int32_t* labels,
                      SoftmaxCeResult* result) {
  for (int64_t r = GlobalIndex(); r < rows; r += GridStride()) {
    const int32_t label = labels[r];
    if (label < 0 || label >= cols) {
      atomicMin(&result->bad_row, static_cast<unsigned long long>(r));
    }
  }
}

// One block per row (grid-stride over rows). Everything a row needs from
// the logits is read before the first barrier that precedes any write of
// the row, and each gradient element is written by the thread that just
// read that logit, so dlogits may alias logits.
__global__ void __launch_bounds__(kThreads)
    SoftmaxCeRowsKernel(int64_t rows, int64_t cols, const float* logits,
                        const int32_t* labels, float grad_scale, float* dlogits,
                        double* row_loss, int* row_correct,
                        const SoftmaxCeResult* result) {
  __shared__ double sum_shared[33];
  __shared__ MaxCandidate max_shared[33];
  // A bad label anywhere: write nothing (as the CPU). Uniform per block.
  if (result->bad_row != SoftmaxCeResult::kNoBadRow) return;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* x = logits + r * cols;
    const int32_t label = labels[r];
    const float x_label = x[label];
    const float x0 = x[0];

    MaxCandidate best{0.0f, -1};
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = x[c];
      // Ascending c, so a strict > keeps this thread's first maximum.
      if (v == v && (best.index < 0 || v > best.value)) best = {v, c};
    }
    best = BlockArgMax(best, max_shared);
    // The CPU starts from x[0] and moves on only for a strictly greater
    // logit: a NaN x[0] wins, any other NaN never does.
    const float max = x0 != x0 ? x0 : best.value;
    const long long argmax = x0 != x0 ? 0 : best.index;

    // Shifting by the row max keeps exp() from overflowing; double keeps
    // the result equal to the CPU's to within its final rounding.
    double sum = 0.0;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      sum += exp(static_cast<double>(x[c]) - max);
    }
    sum = BlockSum(sum, sum_shared);
    const double log_z = max + log(sum);
    if (threadIdx.x == 0) {
      row_loss[r] = log_z - x_label;
      row_correct[r] = argmax == label ? 1 : 0;
    }
    if (dlogits != nullptr) {
      float* dx = dlogits + r * cols;
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        const double p = exp(static_cast<double>(x[c]) - log_z);
        dx[c] = static_cast<float>((p - (c == label ? 1.0 : 0.0)) *
                                   static_cast<double>(grad_scale));
      }
    }
    // The next row's reductions start with a barrier-protected write to
    // shared memory that BlockSum's final barrier already made safe.
  }
}

constexpr int kReduceThreads = 512;

__global__ void __launch_bounds__(kReduceThreads)
    SoftmaxCeReduceKernel(int64_t rows, const double* row_loss,
                          const int* row_correct, const int32_t* labels,
                          SoftmaxCeResult* result) {
  __shared__ double loss_shared[33];
  __shared__ long long correct_shared[33];
  const unsigned long long bad_row = result->bad_row;
  if (bad_row != SoftmaxCeResult::kNoBadRow) {
    if (threadIdx.x == 0) {
      result->loss_sum = 0.0;
      result->num_correct = 0;
      result->bad_label = labels[bad_row];
    }
    return;
  }
  double loss = 0.0;
  long long correct = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    loss += row_loss[r];
    correct += row_correct[r];
  }
  loss = BlockSum(loss, loss_shared);
  correct = BlockSum(correct, correct_shared);
  if (threadIdx.x == 0) {
    result->loss_sum = loss;
    result->num_correct = correct;
    result->bad_label = 0;
  }
}

// ---------------------------------------------------------------------------
// Embeddings: one block per index (grid-stride), threads across the row.

__device__ void RecordIndexError(DeviceError* error, int code,
                                 long long position, long long value,
                                 long long table_rows) {
  if (atomicCAS(&error->code, DeviceError::kNone, code) == DeviceError::kNone) {
    error->position = position;
    error->value = value;
    error->table_rows = table_rows;
  }
}

__global__ void __launch_bounds__(kThreads)
    GatherKernel(int64_t num_indices, int64_t dim, int64_t table_rows,
                 const float* table, const int64_t* indices, float* out,
                 DeviceError* error) {
  for (int64_t i = blockIdx.x; i < num_indices; i += gridDim.x) {
    const int64_t index = indices[i];
    float* out_row = out + i * dim;
    if (index < 0 || index >= table_rows) {
      if (threadIdx.x == 0) {
        RecordIndexError(error, DeviceError::kGatherIndex, i, index,
                         table_rows);
      }
      for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
        out_row[d] = 0.0f;
      }
      continue;
    }
    const float* row = table + index * dim;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      out_row[d] = row[d];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    ScatterAddKernel(int64_t num_indices, int64_t dim, int64_t table_rows,
                     const float* grads, const int64_t* indices, float* table,
                     DeviceError* error) {
  for (int64_t i = blockIdx.x; i < num_indices; i += gridDim.x) {
    const int64_t index = indices[i];
    if (index < 0 || index >= table_rows) {
      if (threadIdx.x == 0) {
        RecordIndexError(error, DeviceError::kScatterAddIndex, i, index,
                         table_rows);
      }
      continue;
    }
    float* row = table + index * dim;
    const float* grad = grads + i * dim;
    // Atomics because indices may repeat within a batch.
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      atomicAdd(row + d, grad[d]);
    }
  }
}

}  // namespace

cudaError_t CheckKernelImage() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, FillKernel);
}

cudaError_t LaunchFill(cudaStream_t stream, int64_t n, float value, float* x) {
  if (n <= 0) return cudaSuccess;
  FillKernel<<<BlocksFor(n), kThreads, 0, stream>>>(n, value, x);
  return cudaGetLastError();
}

cudaError_t LaunchScale(cudaStream_t stream, int64_t n, float alpha, float* x) {
  if (n <= 0) return cudaSuccess;
  ScaleKernel<<<BlocksFor(n), kThreads, 0, stream>>>(n, alpha, x);
  return cudaGetLastError();
}

cudaError_t LaunchAxpy(cudaStream_t stream, int64_t n, float alpha,
                       const float* x, float* y) {
  if (n <= 0) return cudaSuccess;
  AxpyKernel<<<BlocksFor(n), kThreads, 0, stream>>>(n, alpha, x, y);
  return cudaGetLastError();
}

cudaError_t LaunchRelu(cudaStream_t stream, int64_t n, const float* x,
                       float* y) {
  if (n <= 0) return cudaSuccess;
  ReluKernel<<<BlocksFor(n), kThreads, 0, stream>>>(n, x, y);
  return cudaGetLastError();
}

cudaError_t LaunchReluGrad(cudaStream_t stream, int64_t n, const float* y,
                           const float* dy, float* dx) {
  if (n <= 0) return cudaSuccess;
  ReluGradKernel<<<BlocksFor(n), kThreads, 0, stream>>>(n, y, dy, dx);
  return cudaGetLastError();
}

cudaError_t LaunchAddBias(cudaStream_t stream, int64_t rows, int64_t cols,
                          const float* bias, float* y) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int threads = ThreadsForRow(cols);
  const unsigned int col_blocks = BlocksFor(cols, threads);
  // Enough blocks in total to fill the GPU; grid.y is limited to 65535.
  int64_t row_blocks = kMaxBlocks / col_blocks;
  if (row_blocks < 1) row_blocks = 1;
  if (row_blocks > rows) row_blocks = rows;
  if (row_blocks > 65535) row_blocks = 65535;
  const dim3 grid(col_blocks, static_cast<unsigned int>(row_blocks));
  AddBiasKernel<<<grid, threads, 0, stream>>>(rows, cols, bias, y);
  return cudaGetLastError();
}

int64_t BiasGradScratchElements(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t chunks = BiasGradChunks(rows);
  return chunks > 1 ? chunks * cols : 0;
}

cudaError_t LaunchBiasGrad(cudaStream_t stream, int64_t rows, int64_t cols,
                           const float* dy, float* bias_grad, double* scratch) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t chunk_rows = BiasGradChunkRows(rows);
  const int64_t chunks = BiasGradChunks(rows);
  const dim3 block(kBiasTileCols, kBiasThreadRows);
  const dim3 grid(
      static_cast<unsigned int>((cols + kBiasTileCols - 1) / kBiasTileCols),
      static_cast<unsigned int>(chunks));
  BiasGradPartialKernel<<<grid, block, 0, stream>>>(
      rows, cols, chunk_rows, dy, bias_grad, chunks > 1 ? scratch : nullptr);
  if (chunks > 1) {
    cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    BiasGradFinishKernel<<<BlocksFor(cols), kThreads, 0, stream>>>(
        cols, chunks, scratch, bias_grad);
  }
  return cudaGetLastError();
}

cudaError_t LaunchFloatToBf16(cudaStream_t stream, int64_t n, const float* in,
                              void* out) {
  if (n <= 0) return cudaSuccess;
  FloatToBf16Kernel<<<BlocksFor(n), kThreads, 0, stream>>>(
      n, in, static_cast<__nv_bfloat16*>(out));
  return cudaGetLastError();
}

cudaError_t LaunchBf16ToFloat(cudaStream_t stream, int64_t n, const void* in,
                              float* out) {
  if (n <= 0) return cudaSuccess;
  Bf16ToFloatKernel<<<BlocksFor(n), kThreads, 0, stream>>>(
      n, static_cast<const uint16_t*>(in), out);
  return cudaGetLastError();
}

cudaError_t LaunchFloatToFp16(cudaStream_t stream, int64_t n, const float* in,
                              uint16_t* out) {
  if (n <= 0) return cudaSuccess;
  FloatToFp16Kernel<<<BlocksFor(n), kThreads, 0, stream>>>(n, in, out);
  return cudaGetLastError();
}

cudaError_t LaunchFp16ToFloat(cudaStream_t stream, int64_t n,
                              const uint16_t* in, float* out) {
  if (n <= 0) return cudaSuccess;
  Fp16ToFloatKernel<<<BlocksFor(n), kThreads, 0, stream>>>(n, in, out);
  return cudaGetLastError();
}

cudaError_t LaunchSoftmaxCrossEntropy(cudaStream_t stream, int64_t rows,
                                      int64_t cols, const float* logits,
                                      const int32_t* labels, float grad_scale,
                                      float* dlogits, double* row_loss,
                                      int* row_correct,
                                      SoftmaxCeResult* result) {
  if (rows <= 0) return cudaSuccess;
  // All bytes 0xff: bad_row = kNoBadRow; the reduce kernel sets the rest.
  cudaError_t error =
      cudaMemsetAsync(result, 0xff, sizeof(SoftmaxCeResult), stream);
  if (error != cudaSuccess) return error;
  CheckLabelsKernel<<<BlocksFor(rows), kThreads, 0, stream>>>(rows, cols,
                                                              labels, result);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  const unsigned int row_blocks =
      static_cast<unsigned int>(rows < kMaxBlocks ? rows : kMaxBlocks);
  SoftmaxCeRowsKernel<<<row_blocks, ThreadsForRow(cols), 0, stream>>>(
      rows, cols, logits, labels, grad_scale, dlogits, row_loss, row_correct,
      result);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  SoftmaxCeReduceKernel<<<1, kReduceThreads, 0, stream>>>(
      rows, row_loss, row_correct, labels, result);
  return cudaGetLastError();
}

cudaError_t LaunchGather(cudaStream_t stream, int64_t num_indices, int64_t dim,
                         int64_t table_rows, const float* table,
                         const int64_t* indices, float* out,
                         DeviceError* error) {
  if (num_indices <= 0) return cudaSuccess;
  const unsigned int blocks = static_cast<unsigned int>(
      num_indices < kMaxBlocks ? num_indices : kMaxBlocks);
  GatherKernel<<<blocks, ThreadsForRow(dim), 0, stream>>>(
      num_indices, dim, table_rows, table, indices, out, error);
  return cudaGetLastError();
}

cudaError_t LaunchScatterAdd(cudaStream_t stream, int64_t num_indices,
                             int64_t dim, int64_t table_rows,
                             const float* grads, const int64_t* indices,
                             float* table, DeviceError* error) {
  if (num_indices <= 0) return cudaSuccess;
  const unsigned int blocks = static_cast<unsigned int>(
      num_indices < kMaxBlocks ? num_indices : kMaxBlocks);
  ScatterAddKernel<<<blocks, ThreadsForRow(dim), 0, stream>>>(
      num_indices, dim, table_rows, grads, indices, table, error);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------
// Sliding windows (convolution as im2col + GEMM, max pooling), NHWC.

namespace {

__global__ void Im2ColKernel(WindowGeometry w, const float* __restrict__ x,
                             float* __restrict__ col) {
  const int64_t total =
      w.batch * w.out_height * w.out_width * w.kernel * w.kernel * w.channels;
  for (int64_t i = GlobalIndex(); i < total; i += GridStride()) {
    int64_t t = i;
    const int64_t c = t % w.channels;
    t /= w.channels;
    const int64_t kw = t % w.kernel;
    t /= w.kernel;
    const int64_t kh = t % w.kernel;
    t /= w.kernel;
    const int64_t ow = t % w.out_width;
    t /= w.out_width;
    const int64_t oh = t % w.out_height;
    const int64_t n = t / w.out_height;
    const int64_t ih = oh * w.stride - w.pad + kh;
    const int64_t iw = ow * w.stride - w.pad + kw;
    col[i] = (ih < 0 || ih >= w.height || iw < 0 || iw >= w.width)
                 ? 0.0f
                 : x[((n * w.height + ih) * w.width + iw) * w.channels + c];
  }
}

// The output rows/columns whose window covers input coordinate i:
// o * stride - pad <= i < o * stride - pad + kernel.
__device__ __forceinline__ void CoveringRange(int64_t i, int64_t pad,
                                              int64_t kernel, int64_t stride,
                                              int64_t out, int64_t* first,
                                              int64_t* last) {
  const int64_t shifted = i + pad;
  const int64_t low = shifted - kernel + 1;
  *first = low <= 0 ? 0 : (low + stride - 1) / stride;
  const int64_t high = shifted / stride;
  *last = high < out - 1 ? high : out - 1;
}

__global__ void Col2ImKernel(WindowGeometry w, const float* __restrict__ col,
                             float* __restrict__ x) {
  const int64_t total = w.batch * w.height * w.width * w.channels;
  const int64_t row_len = w.kernel * w.kernel * w.channels;
  for (int64_t i = GlobalIndex(); i < total; i += GridStride()) {
    int64_t t = i;
    const int64_t c = t % w.channels;
    t /= w.channels;
    const int64_t iw = t % w.width;
    t /= w.width;
    const int64_t ih = t % w.height;
    const int64_t n = t / w.height;
    int64_t oh0, oh1, ow0, ow1;
    CoveringRange(ih, w.pad, w.kernel, w.stride, w.out_height, &oh0, &oh1);
    CoveringRange(iw, w.pad, w.kernel, w.stride, w.out_width, &ow0, &ow1);
    // The CPU walks col rows in order (oh, then ow) and adds each entry
    // into its pixel; the same order here gives the same rounding.
    float sum = 0.0f;
    for (int64_t oh = oh0; oh <= oh1; ++oh) {
      const int64_t kh = ih + w.pad - oh * w.stride;
      for (int64_t ow = ow0; ow <= ow1; ++ow) {
        const int64_t kw = iw + w.pad - ow * w.stride;
        const int64_t row = (n * w.out_height + oh) * w.out_width + ow;
        sum = __fadd_rn(
            sum, col[row * row_len + (kh * w.kernel + kw) * w.channels + c]);
      }
    }
    x[i] = sum;
  }
}

__global__ void MaxPool2DKernel(WindowGeometry w, const float* __restrict__ x,
                                float* __restrict__ y,
                                int64_t* __restrict__ argmax) {
  const int64_t total = w.batch * w.out_height * w.out_width * w.channels;
  for (int64_t i = GlobalIndex(); i < total; i += GridStride()) {
    int64_t t = i;
    const int64_t c = t % w.channels;
    t /= w.channels;
    const int64_t ow = t % w.out_width;
    t /= w.out_width;
    const int64_t oh = t % w.out_height;
    const int64_t n = t / w.out_height;
    int64_t best = -1;
    float best_value = 0.0f;
    for (int64_t kh = 0; kh < w.kernel; ++kh) {
      const int64_t ih = oh * w.stride + kh;
      for (int64_t kw = 0; kw < w.kernel; ++kw) {
        const int64_t iw = ow * w.stride + kw;
        const int64_t index =
            ((n * w.height + ih) * w.width + iw) * w.channels + c;
        const float v = x[index];
        if (best < 0 || v > best_value || (isnan(v) && !isnan(best_value))) {
          best = index;
          best_value = v;
        }
      }
    }
    y[i] = best_value;
    if (argmax != nullptr) argmax[i] = best;
  }
}

__global__ void MaxPool2DGradKernel(WindowGeometry w,
                                    const float* __restrict__ dy,
                                    const int64_t* __restrict__ argmax,
                                    float* __restrict__ dx) {
  const int64_t total = w.batch * w.height * w.width * w.channels;
  for (int64_t i = GlobalIndex(); i < total; i += GridStride()) {
    int64_t t = i;
    const int64_t c = t % w.channels;
    t /= w.channels;
    const int64_t iw = t % w.width;
    t /= w.width;
    const int64_t ih = t % w.height;
    const int64_t n = t / w.height;
    int64_t oh0, oh1, ow0, ow1;
    CoveringRange(ih, 0, w.kernel, w.stride, w.out_height, &oh0, &oh1);
    CoveringRange(iw, 0, w.kernel, w.stride, w.out_width, &ow0, &ow1);
    float sum = 0.0f;
    for (int64_t oh = oh0; oh <= oh1; ++oh) {
      for (int64_t ow = ow0; ow <= ow1; ++ow) {
        const int64_t out =
            ((n * w.out_height + oh) * w.out_width + ow) * w.channels + c;
        if (argmax[out] == i) sum = __fadd_rn(sum, dy[out]);
      }
    }
    dx[i] = sum;
  }
}

bool HasWork(const WindowGeometry& w) {
  return w.batch > 0 && w.channels > 0 && w.height > 0 && w.width > 0 &&
         w.out_height > 0 && w.out_width > 0;
}

}  // namespace

cudaError_t LaunchIm2Col(cudaStream_t stream, const WindowGeometry& w,
                         const float* x, float* col) {
  if (!HasWork(w)) return cudaSuccess;
  const int64_t total =
      w.batch * w.out_height * w.out_width * w.kernel * w.kernel * w.channels;
  Im2ColKernel<<<BlocksFor(total), kThreads, 0, stream>>>(w, x, col);
  return cudaGetLastError();
}

cudaError_t LaunchCol2Im(cudaStream_t stream, const WindowGeometry& w,
                         const float* col, float* x) {
  if (!HasWork(w)) return cudaSuccess;
  const int64_t total = w.batch * w.height * w.width * w.channels;
  Col2ImKernel<<<BlocksFor(total), kThreads, 0, stream>>>(w, col, x);
  return cudaGetLastError();
}

cudaError_t LaunchMaxPool2D(cudaStream_t stream, const WindowGeometry& w,
                            const float* x, float* y, int64_t* argmax) {
  if (!HasWork(w)) return cudaSuccess;
  const int64_t total = w.batch * w.out_height * w.out_width * w.channels;
  MaxPool2DKernel<<<BlocksFor(total), kThreads, 0, stream>>>(w, x, y, argmax);
  return cudaGetLastError();
}

cudaError_t LaunchMaxPool2DGrad(cudaStream_t stream, const WindowGeometry& w,
                                const float* dy, const int64_t* argmax,
                                float* dx) {
  if (!HasWork(w)) return cudaSuccess;
  const int64_t total = w.batch * w.height * w.width * w.channels;
  MaxPool2DGradKernel<<<BlocksFor(total), kThreads, 0, stream>>>(w, dy, argmax,
                                                                 dx);
  return cudaGetLastError();
}

}  // namespace pstrain::kernels::cuda
