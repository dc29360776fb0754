// The compute backend: every numeric operation a model needs, behind one
// interface so the same model code runs on the CPU reference and on CUDA.
//
// Conventions, for every backend:
//  - Matrices are row-major. Pointers passed to ops are the backend's own
//    memory (from Allocate); the CPU backend's memory is ordinary host memory.
//  - Ops may run asynchronously on the backend's stream; CopyToHost and
//    Synchronize return only once all previously issued work is done.
//  - Every op returns a Status; a failure names the op and the cause. Shapes
//    are validated (negative sizes, null pointers) before anything runs.
//  - Outputs never overlap inputs unless an op says it may alias.
#ifndef PSTRAIN_KERNELS_BACKEND_H_
#define PSTRAIN_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pstrain::kernels {

// The geometry of a square window sliding over a batch of NHWC images (a
// convolution or a pooling): `batch` images of height x width x channels,
// padded by `pad` zeros on every side, a kernel x kernel window moved by
// `stride` in both directions. Every backend validates it the same way
// (op_checks.h: ValidateWindow).
struct Window2D {
  int64_t batch = 0;
  int64_t height = 0;
  int64_t width = 0;
  int64_t channels = 0;
  int64_t kernel = 1;
  int64_t stride = 1;
  int64_t pad = 0;

  int64_t out_height() const {
    return (height + 2 * pad - kernel) / stride + 1;
  }
  int64_t out_width() const { return (width + 2 * pad - kernel) / stride + 1; }
  // Elements of one input image, and of one output image per channel.
  int64_t input_elements() const { return batch * height * width * channels; }
  int64_t output_elements() const {
    return batch * out_height() * out_width() * channels;
  }
  // The im2col matrix is [col_rows, col_cols]: one row per output pixel
  // (n, oh, ow), one column per (kh, kw, c) of the window.
  int64_t col_rows() const { return batch * out_height() * out_width(); }
  int64_t col_cols() const { return kernel * kernel * channels; }
};

class Backend {
 public:
  virtual ~Backend() = default;

  // A human-readable name for logs: "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)".
  virtual std::string Name() const = 0;

  // Memory on the backend's device. Allocate(0) returns a valid, unusable
  // pointer that Free accepts.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  virtual absl::Status CopyToDevice(const void* host, void* device,
                                    size_t bytes) = 0;
  virtual absl::Status CopyToHost(const void* device, void* host,
                                  size_t bytes) = 0;
  // Host memory that CopyToDevice and CopyToHost move at the link's full
  // speed: page-locked on CUDA, so a copy from or to any part of it is one
  // DMA with no pass through the backend's own staging buffers (an ordinary
  // host buffer costs a second copy on the host, each way). The copies'
  // contract is unchanged: the caller may reuse the memory once they return.
  // The default (the CPU backends) is plain 64-byte-aligned memory.
  // AllocateHost(0) returns a valid, unusable pointer that FreeHost accepts.
  virtual absl::StatusOr<void*> AllocateHost(size_t bytes) {
    void* ptr = ::operator new (bytes, std::align_val_t{64}, std::nothrow);
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError("AllocateHost: out of host memory");
    }
    return ptr;
  }
  virtual void FreeHost(void* ptr) {
    ::operator delete (ptr, std::align_val_t{64});
  }
  // True when Allocate's memory is host memory that the host may read and
  // write directly once Synchronize returned (the CPU backends): callers may
  // then skip staging copies.
  virtual bool MemoryIsHost() const { return false; }
  // Waits for all issued work; reports any deferred asynchronous error.
  virtual absl::Status Synchronize() = 0;

  // c[m, n] = alpha * op(a) * op(b) + beta * c, with op(a) of shape [m, k]
  // and op(b) of shape [k, n]; op(x) is x, or x transposed when trans_x.
  // a is stored [m, k] (or [k, m] when trans_a), b [k, n] (or [n, k]).
  // beta == 0 means c is write-only (its old contents, even NaN, are ignored).
  virtual absl::Status Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n,
                            int64_t k, float alpha, const float* a,
                            const float* b, float beta, float* c) = 0;

  // y[r, c] += bias[c] for a [rows, cols] matrix y.
  virtual absl::Status AddBias(int64_t rows, int64_t cols, const float* bias,
                               float* y) = 0;

  // bias_grad[c] = sum over r of dy[r, c] (overwrites bias_grad).
  virtual absl::Status BiasGrad(int64_t rows, int64_t cols, const float* dy,
                                float* bias_grad) = 0;

  // y = max(x, 0); y may alias x.
  virtual absl::Status Relu(int64_t n, const float* x, float* y) = 0;

  // dx = dy where y > 0, else 0 (y is the ReLU output); dx may alias dy.
  virtual absl::Status ReluGrad(int64_t n, const float* y, const float* dy,
                                float* dx) = 0;

  // Fused, numerically stable softmax cross-entropy over a [rows, cols]
  // logits matrix with integer labels in [0, cols):
  //   loss_r = logsumexp(logits_r) - logits_r[label_r]
  //   dlogits[r, c] = (softmax(logits_r)[c] - [c == label_r]) * grad_scale
  // dlogits may be null (forward only) and may alias logits. On return
  // *loss_sum (host) is the sum of loss_r and *num_correct (host) the number
  // of rows whose first maximal logit is at the label. A label out of range
  // is an InvalidArgument error.
  virtual absl::Status SoftmaxCrossEntropy(int64_t rows, int64_t cols,
                                           const float* logits,
                                           const int32_t* labels,
                                           float grad_scale, float* dlogits,
                                           double* loss_sum,
                                           int64_t* num_correct) = 0;

  // Convolution as a GEMM, NHWC: col[(n, oh, ow), (kh, kw, c)] =
  // x[n, oh * stride - pad + kh, ow * stride - pad + kw, c], 0 where that
  // falls into the padding. col is [w.col_rows(), w.col_cols()], write-only.
  // Then col * W[kernel * kernel * channels, out_channels] is the NHWC
  // convolution output.
  virtual absl::Status Im2Col(const Window2D& w, const float* x,
                              float* col) = 0;

  // The adjoint of Im2Col: x (overwritten, [w.input_elements()]) = the sum,
  // over every col entry, of that entry into the pixel it was read from
  // (padding entries are dropped). dx of a convolution = Col2Im(dY * W^T).
  virtual absl::Status Col2Im(const Window2D& w, const float* col,
                              float* x) = 0;

  // Max pooling, NHWC, no padding (w.pad must be 0): y[n, oh, ow, c] = the
  // maximum of x over the window. The first maximal element in window order
  // (kh, then kw) wins; a NaN counts as maximal, so a NaN input shows in y.
  // argmax (may be null: forward only) receives, per y element, the index
  // into x of the winner, for MaxPool2DGrad.
  virtual absl::Status MaxPool2D(const Window2D& w, const float* x, float* y,
                                 int64_t* argmax) = 0;

  // dx (overwritten, [w.input_elements()]) = the sum of dy over the outputs
  // whose winner each input element was (argmax from MaxPool2D).
  virtual absl::Status MaxPool2DGrad(const Window2D& w, const float* dy,
                                     const int64_t* argmax, float* dx) = 0;

  // y = alpha * x + y.
  virtual absl::Status Axpy(int64_t n, float alpha, const float* x,
                            float* y) = 0;

  // x = alpha * x.
  virtual absl::Status Scale(int64_t n, float alpha, float* x) = 0;

  // x[i] = value.
  virtual absl::Status Fill(int64_t n, float value, float* x) = 0;

  // y[i] = the 16 bits of x[i] rounded to bfloat16 (to nearest, ties to
  // even; what overflows becomes infinity; NaN stays NaN). For finite
  // values and infinities, bit for bit what the host's wire codec makes of
  // a gradient under --gradient_wire_type=bf16
  // (common/transport/tensor_codec.h), so a worker may cast on its device
  // before the copy to the host instead.
  virtual absl::Status FloatToBf16(int64_t n, const float* x, uint16_t* y) = 0;

  // y[i] = the float whose top 16 bits are x[i] (exact): pulled bfloat16
  // parameters widened on the device after the copy from the host.
  virtual absl::Status Bf16ToFloat(int64_t n, const uint16_t* x, float* y) = 0;

  // y[i] = x[i] rounded to IEEE binary16 (to nearest, ties to even; what
  // rounds past 65504 becomes infinity, what is below half the smallest
  // subnormal zero; NaN stays NaN). For finite values and infinities, bit
  // for bit the host's wire codec under --gradient_wire_type=fp16.
  virtual absl::Status FloatToFp16(int64_t n, const float* x, uint16_t* y) = 0;

  // y[i] = the binary16 x[i] as a float (exact): pulled fp16 parameters
  // widened on the device.
  virtual absl::Status Fp16ToFloat(int64_t n, const uint16_t* x, float* y) = 0;

  // Embedding lookup: out[i, :] = table[indices[i], :] for i in
  // [0, num_indices), with table of shape [table_rows, dim] and out of shape
  // [num_indices, dim] (write-only). indices live in backend memory.
  // An index outside [0, table_rows) is an InvalidArgument error. The CPU
  // backend checks every index before writing; the CUDA backend finds it on
  // the device, writes zeros to that row, and returns the error from the
  // next call that synchronizes with the host (CopyToHost, Synchronize,
  // SoftmaxCrossEntropy).
  virtual absl::Status Gather(int64_t num_indices, int64_t dim,
                              int64_t table_rows, const float* table,
                              const int64_t* indices, float* out) = 0;

  // Embedding gradient: table[indices[i], :] += grads[i, :] for i in
  // [0, num_indices). Repeated indices accumulate (the CPU in order of i;
  // the CUDA backend with atomics, so in no fixed order: sums of repeated
  // rows can differ in the last bits from run to run). Out-of-range indices
  // as for Gather (the CUDA backend skips those rows).
  virtual absl::Status ScatterAdd(int64_t num_indices, int64_t dim,
                                  int64_t table_rows, const float* grads,
                                  const int64_t* indices, float* table) = 0;
};

// What to build a backend for; the fields mirror the worker's flags.
struct BackendOptions {
  // "cpu" (GEMMs through OpenBLAS), "cpu_reference" (the exact hand-written
  // CPU kernels: the oracle of the tests), "cpu_staged" ("cpu" whose
  // memory a worker treats as a device's: the GPU staging path, for
  // tests), "auto" (a GPU when one is
  // visible and this build has the CUDA backend, otherwise "cpu", said once
  // in the log) or "cuda:N" (Unavailable when that device cannot be had).
  std::string device = "auto";
  // "fp32", or "bf16": GEMM inputs are rounded to bfloat16 and multiplied
  // with fp32 accumulation and fp32 output (CUDA only; every other op and
  // all stored tensors stay fp32).
  std::string precision = "fp32";
  // Threads of the CPU GEMM (OpenBLAS; a process-wide setting, applied by
  // CreateBackend whatever the device). 0: the cores this process may run
  // on (sched_getaffinity).
  int cpu_threads = 0;
};

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    const BackendOptions& options);

// Shorthand for an fp32 backend on `device`.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    const std::string& device);

// Where a BackendArray lives: the backend's memory (Allocate), or host
// memory the backend copies to and from at full speed (AllocateHost).
enum class Memory { kDevice, kHost };

// An array of T allocated by a backend, freed on destruction (before the
// backend is destroyed). Move-only. Use the aliases below.
template <typename T, Memory kWhere>
class BackendArray {
 public:
  BackendArray() = default;
  static absl::StatusOr<BackendArray> Create(Backend* backend, size_t size) {
    if (size > SIZE_MAX / sizeof(T)) {
      return absl::InvalidArgumentError("BackendArray: size overflows");
    }
    absl::StatusOr<void*> ptr = kWhere == Memory::kDevice
                                    ? backend->Allocate(size * sizeof(T))
                                    : backend->AllocateHost(size * sizeof(T));
    if (!ptr.ok()) return ptr.status();
    return BackendArray(backend, static_cast<T*>(*ptr), size);
  }
  BackendArray(BackendArray&& other) noexcept { *this = std::move(other); }
  BackendArray& operator=(BackendArray&& other) noexcept {
    std::swap(backend_, other.backend_);
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    return *this;
  }
  BackendArray(const BackendArray&) = delete;
  BackendArray& operator=(const BackendArray&) = delete;
  ~BackendArray() {
    if (backend_ == nullptr) return;
    if (kWhere == Memory::kDevice) {
      backend_->Free(data_);
    } else {
      backend_->FreeHost(data_);
    }
  }

  T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }

 private:
  BackendArray(Backend* backend, T* data, size_t size)
      : backend_(backend), data_(data), size_(size) {}

  Backend* backend_ = nullptr;
  T* data_ = nullptr;
  size_t size_ = 0;
};

// An array in the backend's memory (what ops read and write).
template <typename T>
using DeviceArray = BackendArray<T, Memory::kDevice>;
// Host memory for what travels between the host and the backend's memory:
// page-locked on CUDA (see Backend::AllocateHost).
template <typename T>
using HostArray = BackendArray<T, Memory::kHost>;

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_BACKEND_H_
