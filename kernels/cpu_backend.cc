#include "kernels/cpu_backend.h"

#include <cblas.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/transport/tensor_codec.h"
#include "kernels/op_checks.h"

// From OpenBLAS's own cblas.h; declared here because the cblas.h found
// first may be another BLAS's (Debian's alternatives), without it.
extern "C" void openblas_set_num_threads(int num_threads);

namespace pstrain::kernels {
namespace {

using internal::Validate;

// c[0, n) += s * b[0, n). The fixed-width inner loop over restrict pointers
// is what lets GCC vectorize it at -O2 (plain loops need -O3 there).
inline void AxpyRow(int64_t n, float s, const float* __restrict b,
                    float* __restrict c) {
  constexpr int kUnroll = 8;
  int64_t j = 0;
  for (; j + kUnroll <= n; j += kUnroll) {
    for (int u = 0; u < kUnroll; ++u) c[j + u] += s * b[j + u];
  }
  for (; j < n; ++j) c[j] += s * b[j];
}

// y = max(x, 0), NaN passing through; y may alias x. Each block of 8 is
// loaded before it is stored, which keeps an aliased y correct and lets
// GCC's SLP vectorizer turn the block into compare-and-mask at -O2.
inline void ReluRow(int64_t n, const float* x, float* y) {
  constexpr int kBlock = 8;
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    float v[kBlock];
    for (int u = 0; u < kBlock; ++u) v[u] = x[j + u];
    // v <= 0 is false for NaN, so NaN is kept; -0 becomes +0.
    for (int u = 0; u < kBlock; ++u) y[j + u] = v[u] <= 0.0f ? 0.0f : v[u];
  }
  for (; j < n; ++j) y[j] = x[j] <= 0.0f ? 0.0f : x[j];
}

// dx = dy where y > 0, else 0; dx may alias dy (blocks as in ReluRow).
inline void ReluGradRow(int64_t n, const float* y, const float* dy, float* dx) {
  constexpr int kBlock = 8;
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    float out[kBlock], grad[kBlock];
    for (int u = 0; u < kBlock; ++u) {
      out[u] = y[j + u];
      grad[u] = dy[j + u];
    }
    for (int u = 0; u < kBlock; ++u) dx[j + u] = out[u] > 0.0f ? grad[u] : 0.0f;
  }
  for (; j < n; ++j) dx[j] = y[j] > 0.0f ? dy[j] : 0.0f;
}

// Per-thread scratch for packing a transposed B, grown on demand, so that
// steady-state Gemm calls do not allocate.
std::vector<float>& PackBuffer() {
  thread_local std::vector<float> buffer;
  return buffer;
}

std::vector<float>& Bf16Buffer(int which) {
  thread_local std::vector<float> buffers[2];
  return buffers[which];
}

// A's or B's elements (`count`) rounded to bfloat16, in a reused buffer.
const float* RoundedToBf16(int which, const float* x, int64_t count) {
  std::vector<float>& rounded = Bf16Buffer(which);
  rounded.resize(count);
  for (int64_t i = 0; i < count; ++i) rounded[i] = RoundToBf16(x[i]);
  return rounded.data();
}

}  // namespace

float RoundToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u) {
    // Infinity keeps its zero mantissa; a NaN whose payload is only in the
    // dropped half is kept a NaN by its quiet bit.
    if ((bits & 0x007fffffu) != 0) bits |= 0x00400000u;
  } else {
    bits += 0x7fffu + ((bits >> 16) & 1u);
  }
  bits &= 0xffff0000u;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

int AvailableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

int SetCpuGemmThreads(int threads) {
  const int count = threads > 0 ? threads : AvailableCores();
  openblas_set_num_threads(count);
  return count;
}

std::string CpuBackend::Name() const {
  switch (gemm_) {
    case CpuGemm::kBlas:
      return staged_ ? "cpu_staged" : "cpu";
    case CpuGemm::kReference:
      return "cpu_reference";
    case CpuGemm::kBf16Inputs:
      return "cpu bf16 inputs";
  }
  return "cpu";
}

absl::StatusOr<void*> CpuBackend::Allocate(size_t bytes) {
  if (bytes > std::numeric_limits<size_t>::max() - kAlignment) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Allocate: ", bytes, " bytes is too large"));
  }
  // aligned_alloc wants a multiple of the alignment; rounding 0 up to one
  // line gives Allocate(0) a real, freeable pointer.
  const size_t rounded =
      std::max(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  void* ptr = std::aligned_alloc(kAlignment, rounded);
  if (ptr == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Allocate: out of host memory allocating ", bytes, " bytes"));
  }
  return ptr;
}

void CpuBackend::Free(void* ptr) { std::free(ptr); }

absl::Status CpuBackend::CopyToDevice(const void* host, void* device,
                                      size_t bytes) {
  if (bytes > 0 && (host == nullptr || device == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CopyToDevice: ", host == nullptr ? "host" : "device", " is null"));
  }
  if (bytes > 0) std::memmove(device, host, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyToHost(const void* device, void* host,
                                    size_t bytes) {
  if (bytes > 0 && (host == nullptr || device == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CopyToHost: ", device == nullptr ? "device" : "host", " is null"));
  }
  if (bytes > 0) std::memmove(host, device, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Synchronize() { return absl::OkStatus(); }

absl::Status CpuBackend::Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n,
                              int64_t k, float alpha, const float* a,
                              const float* b, float beta, float* c) {
  // A and B are only read when C is non-empty and k > 0.
  const bool product = m > 0 && n > 0 && k > 0;
  if (absl::Status s = Validate(
          "Gemm", {{"m", m}, {"n", n}, {"k", k}},
          {{"a", a, product}, {"b", b, product}, {"c", c, m > 0 && n > 0}});
      !s.ok()) {
    return s;
  }
  if (m == 0 || n == 0) return absl::OkStatus();

  // k == 0 and alpha == 0 stay on the path below: BLAS rejects a leading
  // dimension of 0, and the reference's beta handling is already exact.
  if (gemm_ == CpuGemm::kBf16Inputs && k > 0 && alpha != 0.0f) {
    a = RoundedToBf16(0, a, m * k);
    b = RoundedToBf16(1, b, k * n);
  }
  if (gemm_ != CpuGemm::kReference && k > 0 && alpha != 0.0f) {
    // OpenBLAS overwrites C when beta == 0 (stale NaN never leaks), as the
    // interface requires; cpu_backend_test checks it.
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a,
                trans_a ? m : k, b, trans_b ? k : n, beta, c, n);
    return absl::OkStatus();
  }

  // Scale C first; beta == 0 overwrites, so stale contents (even NaN) never
  // reach the result.
  const int64_t mn = m * n;
  if (beta == 0.0f) {
    std::fill(c, c + mn, 0.0f);
  } else if (beta != 1.0f) {
    for (int64_t i = 0; i < mn; ++i) c[i] *= beta;
  }
  // As in BLAS, alpha == 0 means A and B are not read.
  if (k == 0 || alpha == 0.0f) return absl::OkStatus();

  // The kernel walks rows of op(B) contiguously; a transposed B is packed
  // into [k, n] first (O(kn) next to the O(mkn) product).
  const float* bk = b;
  if (trans_b) {
    std::vector<float>& packed = PackBuffer();
    if (packed.size() < static_cast<size_t>(k * n)) packed.resize(k * n);
    for (int64_t j = 0; j < n; ++j) {
      const float* b_row = b + j * k;
      for (int64_t p = 0; p < k; ++p) packed[p * n + j] = b_row[p];
    }
    bk = packed.data();
  }

  // i-k-j order with blocking over k and n: each block of op(B) (at most
  // kBlockK x kBlockN floats, 256 KiB) stays in cache while every row of C
  // is updated from it.
  constexpr int64_t kBlockK = 128;
  constexpr int64_t kBlockN = 512;
  for (int64_t p0 = 0; p0 < k; p0 += kBlockK) {
    const int64_t p1 = std::min(k, p0 + kBlockK);
    for (int64_t j0 = 0; j0 < n; j0 += kBlockN) {
      const int64_t width = std::min(n, j0 + kBlockN) - j0;
      for (int64_t i = 0; i < m; ++i) {
        float* c_row = c + i * n + j0;
        for (int64_t p = p0; p < p1; ++p) {
          const float a_ip = trans_a ? a[p * m + i] : a[i * k + p];
          AxpyRow(width, alpha * a_ip, bk + p * n + j0, c_row);
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::AddBias(int64_t rows, int64_t cols, const float* bias,
                                 float* y) {
  const bool any = rows > 0 && cols > 0;
  if (absl::Status s = Validate("AddBias", {{"rows", rows}, {"cols", cols}},
                                {{"bias", bias, any}, {"y", y, any}});
      !s.ok()) {
    return s;
  }
  if (!any) return absl::OkStatus();
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict y_row = y + r * cols;
    for (int64_t col = 0; col < cols; ++col) y_row[col] += bias[col];
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::BiasGrad(int64_t rows, int64_t cols, const float* dy,
                                  float* bias_grad) {
  if (absl::Status s = Validate("BiasGrad", {{"rows", rows}, {"cols", cols}},
                                {{"dy", dy, rows > 0 && cols > 0},
                                 {"bias_grad", bias_grad, cols > 0}});
      !s.ok()) {
    return s;
  }
  if (cols == 0) return absl::OkStatus();
  std::fill(bias_grad, bias_grad + cols, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    AxpyRow(cols, 1.0f, dy + r * cols, bias_grad);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Relu(int64_t n, const float* x, float* y) {
  if (absl::Status s =
          Validate("Relu", {{"n", n}}, {{"x", x, n > 0}, {"y", y, n > 0}});
      !s.ok()) {
    return s;
  }
  // NaN passes through (instead of becoming 0) so a diverged model shows up
  // as a NaN loss rather than being silently masked.
  ReluRow(n, x, y);
  return absl::OkStatus();
}

absl::Status CpuBackend::ReluGrad(int64_t n, const float* y, const float* dy,
                                  float* dx) {
  if (absl::Status s =
          Validate("ReluGrad", {{"n", n}},
                   {{"y", y, n > 0}, {"dy", dy, n > 0}, {"dx", dx, n > 0}});
      !s.ok()) {
    return s;
  }
  ReluGradRow(n, y, dy, dx);
  return absl::OkStatus();
}

absl::Status CpuBackend::SoftmaxCrossEntropy(
    int64_t rows, int64_t cols, const float* logits, const int32_t* labels,
    float grad_scale, float* dlogits, double* loss_sum, int64_t* num_correct) {
  if (absl::Status s =
          Validate("SoftmaxCrossEntropy", {{"rows", rows}, {"cols", cols}},
                   {{"logits", logits, rows > 0},
                    {"labels", labels, rows > 0},
                    {"loss_sum", loss_sum, true},
                    {"num_correct", num_correct, true}});
      !s.ok()) {
    return s;
  }
  // All labels are checked before any output is written.
  for (int64_t r = 0; r < rows; ++r) {
    if (labels[r] < 0 || labels[r] >= cols) {
      return absl::InvalidArgumentError(
          absl::StrCat("SoftmaxCrossEntropy: row ", r, " has label ", labels[r],
                       ", outside [0, ", cols, ")"));
    }
  }

  double total_loss = 0.0;
  int64_t correct = 0;
  for (int64_t r = 0; r < rows; ++r) {
    // No restrict here: dlogits may alias logits. Everything the row needs
    // from x is read before (or, element-wise, just before) dx is written.
    const float* x = logits + r * cols;
    const int32_t label = labels[r];

    int64_t argmax = 0;
    float max = x[0];
    for (int64_t col = 1; col < cols; ++col) {
      if (x[col] > max) {
        max = x[col];
        argmax = col;
      }
    }
    // Shifting by the row max keeps exp() from overflowing; double keeps
    // the reference accurate.
    double sum = 0.0;
    for (int64_t col = 0; col < cols; ++col) {
      sum += std::exp(static_cast<double>(x[col]) - max);
    }
    const double log_z = max + std::log(sum);
    total_loss += log_z - x[label];
    if (argmax == label) ++correct;

    if (dlogits != nullptr) {
      float* dx = dlogits + r * cols;
      for (int64_t col = 0; col < cols; ++col) {
        const double p = std::exp(static_cast<double>(x[col]) - log_z);
        dx[col] =
            static_cast<float>((p - (col == label ? 1.0 : 0.0)) * grad_scale);
      }
    }
  }
  *loss_sum = total_loss;
  *num_correct = correct;
  return absl::OkStatus();
}

absl::Status CpuBackend::Axpy(int64_t n, float alpha, const float* x,
                              float* y) {
  if (absl::Status s =
          Validate("Axpy", {{"n", n}}, {{"x", x, n > 0}, {"y", y, n > 0}});
      !s.ok()) {
    return s;
  }
  if (x < y + n && y < x + n) {
    // Overlapping arrays would break AxpyRow's restrict promise.
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
  } else {
    AxpyRow(n, alpha, x, y);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Scale(int64_t n, float alpha, float* x) {
  if (absl::Status s = Validate("Scale", {{"n", n}}, {{"x", x, n > 0}});
      !s.ok()) {
    return s;
  }
  for (int64_t i = 0; i < n; ++i) x[i] *= alpha;
  return absl::OkStatus();
}

absl::Status CpuBackend::Fill(int64_t n, float value, float* x) {
  if (absl::Status s = Validate("Fill", {{"n", n}}, {{"x", x, n > 0}});
      !s.ok()) {
    return s;
  }
  std::fill(x, x + n, value);
  return absl::OkStatus();
}

absl::Status CpuBackend::FloatToBf16(int64_t n, const float* x, uint16_t* y) {
  if (absl::Status s = Validate("FloatToBf16", {{"n", n}},
                                {{"x", x, n > 0}, {"y", y, n > 0}});
      !s.ok()) {
    return s;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float rounded = RoundToBf16(x[i]);
    uint32_t bits;
    std::memcpy(&bits, &rounded, sizeof(bits));
    y[i] = static_cast<uint16_t>(bits >> 16);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Bf16ToFloat(int64_t n, const uint16_t* x, float* y) {
  if (absl::Status s = Validate("Bf16ToFloat", {{"n", n}},
                                {{"x", x, n > 0}, {"y", y, n > 0}});
      !s.ok()) {
    return s;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(&y[i], &bits, sizeof(bits));
  }
  return absl::OkStatus();
}

// The wire codec's own conversions: a device cast must round as the host
// would have.
absl::Status CpuBackend::FloatToFp16(int64_t n, const float* x, uint16_t* y) {
  if (absl::Status s = Validate("FloatToFp16", {{"n", n}},
                                {{"x", x, n > 0}, {"y", y, n > 0}});
      !s.ok()) {
    return s;
  }
  for (int64_t i = 0; i < n; ++i) y[i] = FloatToHalfBits(x[i]);
  return absl::OkStatus();
}

absl::Status CpuBackend::Fp16ToFloat(int64_t n, const uint16_t* x, float* y) {
  if (absl::Status s = Validate("Fp16ToFloat", {{"n", n}},
                                {{"x", x, n > 0}, {"y", y, n > 0}});
      !s.ok()) {
    return s;
  }
  for (int64_t i = 0; i < n; ++i) y[i] = HalfBitsToFloat(x[i]);
  return absl::OkStatus();
}

namespace {

// Every index is checked before anything is written, so a bad batch leaves
// the outputs as they were.
absl::Status CheckIndices(absl::string_view op, int64_t num_indices,
                          int64_t table_rows, const int64_t* indices) {
  for (int64_t i = 0; i < num_indices; ++i) {
    if (indices[i] < 0 || indices[i] >= table_rows) {
      return absl::InvalidArgumentError(
          internal::IndexOutOfRangeMessage(op, i, indices[i], table_rows));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CpuBackend::Gather(int64_t num_indices, int64_t dim,
                                int64_t table_rows, const float* table,
                                const int64_t* indices, float* out) {
  const bool any = num_indices > 0 && dim > 0;
  if (absl::Status s = Validate("Gather",
                                {{"num_indices", num_indices},
                                 {"dim", dim},
                                 {"table_rows", table_rows}},
                                {{"table", table, any},
                                 {"indices", indices, num_indices > 0},
                                 {"out", out, any}});
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckIndices("Gather", num_indices, table_rows, indices);
      !s.ok()) {
    return s;
  }
  if (!any) return absl::OkStatus();
  for (int64_t i = 0; i < num_indices; ++i) {
    std::memcpy(out + i * dim, table + indices[i] * dim, dim * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::ScatterAdd(int64_t num_indices, int64_t dim,
                                    int64_t table_rows, const float* grads,
                                    const int64_t* indices, float* table) {
  const bool any = num_indices > 0 && dim > 0;
  if (absl::Status s = Validate("ScatterAdd",
                                {{"num_indices", num_indices},
                                 {"dim", dim},
                                 {"table_rows", table_rows}},
                                {{"grads", grads, any},
                                 {"indices", indices, num_indices > 0},
                                 {"table", table, any}});
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          CheckIndices("ScatterAdd", num_indices, table_rows, indices);
      !s.ok()) {
    return s;
  }
  if (!any) return absl::OkStatus();
  for (int64_t i = 0; i < num_indices; ++i) {
    float* row = table + indices[i] * dim;
    const float* g = grads + i * dim;
    // grads and table are distinct arrays (the op forbids overlap), so the
    // vectorizable row kernel applies.
    AxpyRow(dim, 1.0f, g, row);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Im2Col(const Window2D& w, const float* x, float* col) {
  if (absl::Status s = internal::ValidateWindow("Im2Col", w, true); !s.ok()) {
    return s;
  }
  if (!internal::WindowHasWork(w)) return absl::OkStatus();
  if (absl::Status s =
          Validate("Im2Col", {}, {{"x", x, true}, {"col", col, true}});
      !s.ok()) {
    return s;
  }
  const int64_t oh_count = w.out_height();
  const int64_t ow_count = w.out_width();
  const int64_t c = w.channels;
  // One (kh, kw) step of a row is a contiguous run of c floats in x (NHWC),
  // so a row is built from kernel * kernel memcpys or zero fills.
  float* out = col;
  for (int64_t n = 0; n < w.batch; ++n) {
    const float* image = x + n * w.height * w.width * c;
    for (int64_t oh = 0; oh < oh_count; ++oh) {
      for (int64_t ow = 0; ow < ow_count; ++ow) {
        for (int64_t kh = 0; kh < w.kernel; ++kh) {
          const int64_t ih = oh * w.stride - w.pad + kh;
          for (int64_t kw = 0; kw < w.kernel; ++kw, out += c) {
            const int64_t iw = ow * w.stride - w.pad + kw;
            const bool inside =
                ih >= 0 && ih < w.height && iw >= 0 && iw < w.width;
            if (c == 1) {
              // One channel (a grey image): a library call per float would
              // cost more than the copy.
              *out = inside ? image[ih * w.width + iw] : 0.0f;
            } else if (inside) {
              std::memcpy(out, image + (ih * w.width + iw) * c,
                          c * sizeof(float));
            } else {
              std::fill(out, out + c, 0.0f);
            }
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Col2Im(const Window2D& w, const float* col, float* x) {
  if (absl::Status s = internal::ValidateWindow("Col2Im", w, true); !s.ok()) {
    return s;
  }
  if (!internal::WindowHasWork(w)) return absl::OkStatus();
  if (absl::Status s =
          Validate("Col2Im", {}, {{"col", col, true}, {"x", x, true}});
      !s.ok()) {
    return s;
  }
  const int64_t oh_count = w.out_height();
  const int64_t ow_count = w.out_width();
  const int64_t c = w.channels;
  std::fill(x, x + w.input_elements(), 0.0f);
  // The same walk as Im2Col, adding instead of copying; overlapping windows
  // (stride < kernel) sum in a fixed order.
  const float* in = col;
  for (int64_t n = 0; n < w.batch; ++n) {
    float* image = x + n * w.height * w.width * c;
    for (int64_t oh = 0; oh < oh_count; ++oh) {
      for (int64_t ow = 0; ow < ow_count; ++ow) {
        for (int64_t kh = 0; kh < w.kernel; ++kh) {
          const int64_t ih = oh * w.stride - w.pad + kh;
          for (int64_t kw = 0; kw < w.kernel; ++kw, in += c) {
            const int64_t iw = ow * w.stride - w.pad + kw;
            if (ih < 0 || ih >= w.height || iw < 0 || iw >= w.width) continue;
            AxpyRow(c, 1.0f, in, image + (ih * w.width + iw) * c);
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::MaxPool2D(const Window2D& w, const float* x, float* y,
                                   int64_t* argmax) {
  if (absl::Status s = internal::ValidateWindow("MaxPool2D", w, false);
      !s.ok()) {
    return s;
  }
  if (!internal::WindowHasWork(w)) return absl::OkStatus();
  if (absl::Status s =
          Validate("MaxPool2D", {}, {{"x", x, true}, {"y", y, true}});
      !s.ok()) {
    return s;
  }
  const int64_t oh_count = w.out_height();
  const int64_t ow_count = w.out_width();
  const int64_t c = w.channels;
  // Channels are innermost in NHWC, so each window position is one
  // contiguous row of c values: the running maxima of an output pixel are
  // updated a row at a time, with selects instead of branches.
  float* y_row = y;
  for (int64_t n = 0; n < w.batch; ++n) {
    const int64_t image = n * w.height * w.width * c;
    for (int64_t oh = 0; oh < oh_count; ++oh) {
      for (int64_t ow = 0; ow < ow_count; ++ow, y_row += c) {
        int64_t* argmax_row =
            argmax == nullptr ? nullptr : argmax + (y_row - y);
        for (int64_t kh = 0; kh < w.kernel; ++kh) {
          const int64_t ih = oh * w.stride + kh;
          for (int64_t kw = 0; kw < w.kernel; ++kw) {
            const int64_t iw = ow * w.stride + kw;
            const int64_t base = image + (ih * w.width + iw) * c;
            const float* x_row = x + base;
            if (kh == 0 && kw == 0) {
              std::memcpy(y_row, x_row, c * sizeof(float));
              if (argmax_row != nullptr) {
                for (int64_t ch = 0; ch < c; ++ch) argmax_row[ch] = base + ch;
              }
              continue;
            }
            // The first maximum wins; a NaN wins and keeps winning (v > NaN
            // is false for every v).
            if (argmax_row == nullptr) {
              for (int64_t ch = 0; ch < c; ++ch) {
                const float v = x_row[ch];
                const float best = y_row[ch];
                y_row[ch] = (v > best || (v != v && best == best)) ? v : best;
              }
              continue;
            }
            for (int64_t ch = 0; ch < c; ++ch) {
              const float v = x_row[ch];
              const float best = y_row[ch];
              const bool take = v > best || (v != v && best == best);
              y_row[ch] = take ? v : best;
              argmax_row[ch] = take ? base + ch : argmax_row[ch];
            }
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::MaxPool2DGrad(const Window2D& w, const float* dy,
                                       const int64_t* argmax, float* dx) {
  if (absl::Status s = internal::ValidateWindow("MaxPool2DGrad", w, false);
      !s.ok()) {
    return s;
  }
  if (!internal::WindowHasWork(w)) return absl::OkStatus();
  if (absl::Status s = Validate(
          "MaxPool2DGrad", {},
          {{"dy", dy, true}, {"argmax", argmax, true}, {"dx", dx, true}});
      !s.ok()) {
    return s;
  }
  const int64_t inputs = w.input_elements();
  const int64_t outputs = w.output_elements();
  // Checked first so that a corrupt argmax leaves dx as it was.
  for (int64_t i = 0; i < outputs; ++i) {
    if (argmax[i] < 0 || argmax[i] >= inputs) {
      return absl::InvalidArgumentError(
          absl::StrCat("MaxPool2DGrad: argmax[", i, "] = ", argmax[i],
                       " is outside the input [0, ", inputs, ")"));
    }
  }
  std::fill(dx, dx + inputs, 0.0f);
  for (int64_t i = 0; i < outputs; ++i) dx[argmax[i]] += dy[i];
  return absl::OkStatus();
}

}  // namespace pstrain::kernels
