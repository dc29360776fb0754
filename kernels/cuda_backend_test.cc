// Every op of the CUDA backend against the CPU reference backend, on fresh
// random inputs of several shapes (including sizes that are not multiples of
// any block size). Where no GPU is visible, or the build has no CUDA backend,
// every test skips with the reason.
//
// Tolerances (the measure is max_i |gpu_i - cpu_i| / max(|cpu_i|, floor_i)):
//  - Elementwise ops, Gather: 1e-5 with floor 1e-30 (they are in fact exact:
//    the kernels round like the CPU).
//  - Reductions (Gemm, BiasGrad, ScatterAdd with repeated rows): 1e-5 with
//    floor_i = the sum of the absolute values of the terms that make up
//    element i (for Gemm |alpha| * sum_p |a_ip * b_pj| + |beta * c_ij|).
//    Summation order differs between the backends, and the error of a float
//    sum is bounded relative to that sum of magnitudes, not to the result
//    (which may cancel to near zero). Shapes keep k <= ~2k so float
//    round-off stays well under this.
//  - SoftmaxCrossEntropy: gradients 1e-5 (floor 1e-30); both backends work
//    in double, so they differ by at most the final rounding to float. Loss
//    sums 1e-9 relative; the correct count exactly.
//  - bf16 Gemm: against the CPU on the same inputs rounded to bf16, 1e-3
//    relative to the sum of magnitudes (the products of bf16 numbers are
//    exact in fp32; tensor cores may accumulate with truncation); against
//    the fp32 CPU result 1e-2 relative to the sum of magnitudes (two roundings
//    to 8 significant bits, 2^-8 each, plus accumulation). Rounding of the
//    inputs is checked exactly (A times an identity matrix).
//
// Output buffers are poisoned with NaN first and carry a NaN guard region
// past their end, so an element left unwritten, or one written past the end,
// fails the comparison.
//
// Inputs are fresh per run; the seed is printed with any failure and can be
// fixed with --test_env=PSTRAIN_TEST_SEED=N.
#include "kernels/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/gpu_test_support.h"

namespace pstrain::kernels {
namespace {

using ::testing::HasSubstr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
// NaN elements appended to every output buffer.
constexpr size_t kGuard = 37;
constexpr double kTolerance = 1e-5;
constexpr double kTinyFloor = 1e-30;

uint32_t TestSeed() {
  if (const char* env = std::getenv("PSTRAIN_TEST_SEED"); env != nullptr) {
    return static_cast<uint32_t>(std::strtoul(env, nullptr, 10));
  }
  return std::random_device()();
}

// Round to nearest even to bfloat16 and back (finite inputs).
float RoundToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The worst element of a comparison, for the failure message.
struct Worst {
  double error = 0;
  size_t index = 0;
  std::string problem;  // set for a mismatch no tolerance can excuse
};

// Compares actual[0, n) to expected[0, n). NaN must match NaN and infinities
// must match exactly; otherwise |a - e| / max(|e|, floor[i]) is measured.
Worst Compare(const std::vector<float>& actual,
              const std::vector<float>& expected,
              const std::vector<double>* floors, double floor) {
  Worst worst;
  for (size_t i = 0; i < expected.size(); ++i) {
    const float a = actual[i];
    const float e = expected[i];
    if (std::isnan(e) || std::isnan(a) || std::isinf(e) || std::isinf(a)) {
      const bool same = (std::isnan(e) && std::isnan(a)) || a == e;
      if (!same && worst.problem.empty()) {
        worst.problem = absl::StrCat("index ", i, ": got ", a, ", want ", e);
      }
      continue;
    }
    const double scale = std::max<double>(
        std::fabs(e), floors != nullptr ? (*floors)[i] : floor);
    const double error =
        scale == 0 ? (a == e ? 0.0 : kInf) : std::fabs(double{a} - e) / scale;
    if (error > worst.error) worst = {error, i, worst.problem};
  }
  return worst;
}

#define EXPECT_CLOSE(actual, expected, floors, floor, tolerance)            \
  do {                                                                      \
    const std::vector<float>& a_ = (actual);                                \
    const std::vector<float>& e_ = (expected);                              \
    ASSERT_GE(a_.size(), e_.size());                                        \
    const Worst w_ = Compare(a_, e_, (floors), (floor));                    \
    EXPECT_EQ(w_.problem, "");                                              \
    EXPECT_LE(w_.error, (tolerance))                                        \
        << "at index " << w_.index << ": got " << a_[w_.index] << ", want " \
        << e_[w_.index];                                                    \
  } while (false)

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PSTRAIN_REQUIRE_GPU_OR_SKIP();
    BackendOptions options;
    options.device = "cuda:0";
    options.precision = precision();
    absl::StatusOr<std::unique_ptr<Backend>> gpu = CreateBackend(options);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = *std::move(gpu);
    seed_ = TestSeed();
    rng_.seed(seed_);
    RecordProperty("seed", std::to_string(seed_));
  }

  virtual std::string precision() const { return "fp32"; }

  std::string SeedTrace() const {
    return absl::StrCat("seed ", seed_, " (PSTRAIN_TEST_SEED reproduces)");
  }

  std::vector<float> Random(size_t n, float scale = 1.0f) {
    std::uniform_real_distribution<float> dist(-scale, scale);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }

  template <typename T>
  std::vector<T> RandomInts(size_t n, T lo, T hi) {
    std::uniform_int_distribution<T> dist(lo, hi);
    std::vector<T> v(n);
    for (T& x : v) x = dist(rng_);
    return v;
  }

  // A device copy of `host`, followed by kGuard NaNs (floats only).
  DeviceArray<float> Upload(const std::vector<float>& host) {
    std::vector<float> padded = host;
    padded.resize(host.size() + kGuard, kNaN);
    return UploadExact(padded);
  }

  // n NaNs followed by the kGuard NaNs: an output nothing has written yet.
  DeviceArray<float> Poisoned(size_t n) {
    return UploadExact(std::vector<float>(n + kGuard, kNaN));
  }

  template <typename T>
  DeviceArray<T> UploadExact(const std::vector<T>& host) {
    absl::StatusOr<DeviceArray<T>> array =
        DeviceArray<T>::Create(gpu_.get(), host.size());
    if (!array.ok()) {
      ADD_FAILURE() << array.status();
      return DeviceArray<T>();
    }
    absl::Status s =
        gpu_->CopyToDevice(host.data(), array->data(), host.size() * sizeof(T));
    if (!s.ok()) ADD_FAILURE() << s;
    return *std::move(array);
  }

  // Everything in the array, guard included.
  std::vector<float> Download(const DeviceArray<float>& array) {
    std::vector<float> host(array.size());
    absl::Status s = gpu_->CopyToHost(array.data(), host.data(), array.bytes());
    if (!s.ok()) ADD_FAILURE() << s;
    return host;
  }

  // Elements [n, size) must still be NaN.
  static void ExpectGuardIntact(const std::vector<float>& v, size_t n) {
    for (size_t i = n; i < v.size(); ++i) {
      if (!std::isnan(v[i])) {
        ADD_FAILURE() << "written past the end: element " << i << " (of " << n
                      << ") is " << v[i];
        return;
      }
    }
  }

  // ScatterAdd of `grads` rows at `indices` into `table` on the GPU against
  // the CPU. Repeated rows are summed in a different order: the tolerance is
  // measured against the magnitudes of the terms.
  void CompareScatterAdd(int64_t n, int64_t dim, int64_t table_rows,
                         const std::vector<float>& table,
                         const std::vector<float>& grads,
                         const std::vector<int64_t>& indices) {
    std::vector<double> floors(table.size());
    for (size_t i = 0; i < table.size(); ++i) floors[i] = std::fabs(table[i]);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < dim; ++d) {
        floors[indices[i] * dim + d] += std::fabs(grads[i * dim + d]);
      }
    }
    std::vector<float> expected = table;
    ASSERT_TRUE(cpu_.ScatterAdd(n, dim, table_rows, grads.data(),
                                indices.data(), expected.data())
                    .ok());
    DeviceArray<float> gtable = Upload(table);
    DeviceArray<float> ggrads = Upload(grads);
    DeviceArray<int64_t> gindices = UploadExact(indices);
    ASSERT_TRUE(gpu_->ScatterAdd(n, dim, table_rows, ggrads.data(),
                                 gindices.data(), gtable.data())
                    .ok());
    const std::vector<float> got = Download(gtable);
    EXPECT_CLOSE(got, expected, &floors, 0, kTolerance);
    ExpectGuardIntact(got, table.size());
  }

  // The oracle: the exact hand-written kernels, not OpenBLAS.
  CpuBackend cpu_{CpuGemm::kReference};
  std::unique_ptr<Backend> gpu_;
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

// Sizes that are not multiples of a warp or a block, plus one large enough
// that grid-stride loops go around more than once.
const std::vector<int64_t>& Sizes() {
  static const auto* sizes =
      new std::vector<int64_t>{1, 7, 33, 257, 1000 * 37, (1 << 24) + 3};
  return *sizes;
}

struct Shape {
  int64_t rows, cols;
};

const std::vector<Shape>& Shapes() {
  static const auto* shapes = new std::vector<Shape>{
      {1, 1},   {1, 7},     {7, 33},    {33, 7},   {257, 1},
      {1, 257}, {1000, 37}, {64, 1000}, {5000, 3}, {3, 5000}};
  return *shapes;
}

TEST_F(CudaBackendTest, Name) {
  EXPECT_THAT(gpu_->Name(), ::testing::StartsWith("cuda:0 ("));
}

TEST_F(CudaBackendTest, AllocateFreeAndReuse) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{513}, size_t{1} << 20,
                       (size_t{1} << 20) + 1}) {
    absl::StatusOr<void*> ptr = gpu_->Allocate(bytes);
    ASSERT_TRUE(ptr.ok()) << ptr.status();
    ASSERT_NE(*ptr, nullptr) << bytes;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*ptr) % 256, 0u) << bytes;
    gpu_->Free(*ptr);
    // The pool hands the same block back for the same size.
    absl::StatusOr<void*> again = gpu_->Allocate(bytes);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(*again, *ptr) << bytes;
    gpu_->Free(*again);
  }
  gpu_->Free(nullptr);
  absl::StatusOr<void*> huge =
      gpu_->Allocate(std::numeric_limits<size_t>::max() / 2);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  // Still usable afterwards.
  EXPECT_TRUE(gpu_->Synchronize().ok());
}

TEST_F(CudaBackendTest, CopyRoundTrip) {
  // Odd byte counts, and one larger than the 32 MiB staging chunk.
  for (size_t bytes : {size_t{1}, size_t{13}, size_t{4096 + 3},
                       (size_t{32} << 20) * 2 + 12345}) {
    SCOPED_TRACE(bytes);
    std::vector<unsigned char> in(bytes);
    for (size_t i = 0; i < bytes; ++i)
      in[i] = static_cast<unsigned char>(rng_());
    absl::StatusOr<void*> device = gpu_->Allocate(bytes);
    ASSERT_TRUE(device.ok()) << device.status();
    ASSERT_TRUE(gpu_->CopyToDevice(in.data(), *device, bytes).ok());
    // The host buffer may be reused as soon as CopyToDevice returns.
    const std::vector<unsigned char> expected = in;
    std::fill(in.begin(), in.end(), 0xab);
    std::vector<unsigned char> out(bytes);
    ASSERT_TRUE(gpu_->CopyToHost(*device, out.data(), bytes).ok());
    EXPECT_TRUE(out == expected);
    gpu_->Free(*device);
  }
  EXPECT_TRUE(gpu_->CopyToHost(nullptr, nullptr, 0).ok());
  EXPECT_TRUE(gpu_->CopyToDevice(nullptr, nullptr, 0).ok());
  EXPECT_EQ(gpu_->CopyToDevice(nullptr, gpu_.get(), 4).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaBackendTest, PinnedHostArraysCopyStraightAndWhole) {
  // AllocateHost's memory goes by one DMA each way (no staging): whole
  // arrays, sub-ranges starting inside one, sizes past the staging chunk.
  for (size_t bytes : {size_t{1}, size_t{13}, size_t{4096 + 3},
                       (size_t{32} << 20) * 2 + 12345}) {
    SCOPED_TRACE(bytes);
    absl::StatusOr<HostArray<unsigned char>> in =
        HostArray<unsigned char>::Create(gpu_.get(), bytes);
    absl::StatusOr<HostArray<unsigned char>> out =
        HostArray<unsigned char>::Create(gpu_.get(), bytes);
    absl::StatusOr<DeviceArray<unsigned char>> device =
        DeviceArray<unsigned char>::Create(gpu_.get(), bytes);
    ASSERT_TRUE(in.ok() && out.ok() && device.ok());
    std::vector<unsigned char> expected(bytes);
    for (size_t i = 0; i < bytes; ++i) {
      expected[i] = in->data()[i] = static_cast<unsigned char>(rng_());
    }
    ASSERT_TRUE(gpu_->CopyToDevice(in->data(), device->data(), bytes).ok());
    // The host memory may be reused as soon as CopyToDevice returns.
    std::memset(in->data(), 0xab, bytes);
    std::memset(out->data(), 0, bytes);
    ASSERT_TRUE(gpu_->CopyToHost(device->data(), out->data(), bytes).ok());
    EXPECT_EQ(std::memcmp(out->data(), expected.data(), bytes), 0);
    // A range that starts inside the block.
    const size_t skip = bytes / 2;
    std::memset(out->data(), 0, bytes);
    ASSERT_TRUE(gpu_->CopyToHost(device->data() + skip, out->data() + skip,
                                 bytes - skip)
                    .ok());
    EXPECT_EQ(
        std::memcmp(out->data() + skip, expected.data() + skip, bytes - skip),
        0);
    ASSERT_TRUE(gpu_->CopyToDevice(in->data() + skip, device->data() + skip,
                                   bytes - skip)
                    .ok());
    ASSERT_TRUE(gpu_->CopyToHost(device->data(), out->data(), bytes).ok());
    for (size_t i = skip; i < bytes; ++i) ASSERT_EQ(out->data()[i], 0xab) << i;
  }
  absl::StatusOr<HostArray<float>> empty =
      HostArray<float>::Create(gpu_.get(), 0);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_NE(empty->data(), nullptr);
}

TEST_F(CudaBackendTest, Fill) {
  SCOPED_TRACE(SeedTrace());
  for (int64_t n : Sizes()) {
    SCOPED_TRACE(n);
    const float value = Random(1)[0];
    std::vector<float> expected(n);
    ASSERT_TRUE(cpu_.Fill(n, value, expected.data()).ok());
    DeviceArray<float> x = Poisoned(n);
    ASSERT_TRUE(gpu_->Fill(n, value, x.data()).ok());
    const std::vector<float> got = Download(x);
    EXPECT_CLOSE(got, expected, nullptr, kTinyFloor, kTolerance);
    ExpectGuardIntact(got, n);
  }
  EXPECT_TRUE(gpu_->Fill(0, 1.0f, nullptr).ok());
  EXPECT_THAT(gpu_->Fill(-2, 1.0f, nullptr).message(), HasSubstr("Fill"));
}

// A 16-bit wire cast and its widening: the backend's two calls, and the
// exponent bits that are all ones for infinity and NaN.
struct WireCast {
  absl::Status (Backend::*narrow)(int64_t, const float*, uint16_t*);
  absl::Status (Backend::*widen)(int64_t, const uint16_t*, float*);
  uint16_t exponent_bits;
};

class CudaWireCastTest : public CudaBackendTest {
 protected:
  // Bit for bit the CPU's (the wire codec's) for finite values and
  // infinities, `specials` (ties, overflow, subnormals) among random ones
  // in [-scale, scale]; NaN kept NaN (its payload may differ); the widening
  // exact; nothing written past the end.
  void ExpectMatchesCpu(const WireCast& cast, float scale,
                        const std::vector<float>& specials) {
    SCOPED_TRACE(SeedTrace());
    for (int64_t n : Sizes()) {
      SCOPED_TRACE(n);
      std::vector<float> x = Random(n, scale);
      for (size_t i = 0; i < specials.size() && i < x.size(); ++i) {
        x[i] = specials[i];
      }
      std::vector<uint16_t> expected(n);
      ASSERT_TRUE((cpu_.*cast.narrow)(n, x.data(), expected.data()).ok());
      DeviceArray<float> gx = Upload(x);
      DeviceArray<uint16_t> gbits =
          UploadExact(std::vector<uint16_t>(n + kGuard, 0xdead));
      ASSERT_TRUE(((*gpu_).*cast.narrow)(n, gx.data(), gbits.data()).ok());
      std::vector<uint16_t> bits(n + kGuard);
      ASSERT_TRUE(
          gpu_->CopyToHost(gbits.data(), bits.data(), gbits.bytes()).ok());
      for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(x[i])) {
          EXPECT_EQ(bits[i] & cast.exponent_bits, cast.exponent_bits) << i;
          EXPECT_NE(bits[i] & ~cast.exponent_bits & 0x7fff, 0) << i;
        } else {
          ASSERT_EQ(bits[i], expected[i]) << "element " << i << ": " << x[i];
        }
      }
      for (int64_t i = n; i < n + kGuard; ++i) ASSERT_EQ(bits[i], 0xdead);

      std::vector<float> widened(n);
      ASSERT_TRUE((cpu_.*cast.widen)(n, expected.data(), widened.data()).ok());
      DeviceArray<float> gy = Poisoned(n);
      gbits = UploadExact(expected);
      ASSERT_TRUE(((*gpu_).*cast.widen)(n, gbits.data(), gy.data()).ok());
      const std::vector<float> got = Download(gy);
      for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(widened[i])) {
          EXPECT_TRUE(std::isnan(got[i])) << i;
        } else {
          ASSERT_EQ(got[i], widened[i]) << "element " << i;
        }
      }
      ExpectGuardIntact(got, n);
    }
    EXPECT_TRUE(((*gpu_).*cast.narrow)(0, nullptr, nullptr).ok());
    EXPECT_FALSE(((*gpu_).*cast.widen)(-1, nullptr, nullptr).ok());
  }
};

TEST_F(CudaWireCastTest, Bf16CastsMatchCpuBitForBit) {
  ExpectMatchesCpu({&Backend::FloatToBf16, &Backend::Bf16ToFloat, 0x7f80}, 1e3f,
                   {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -0.0f, 3.4e38f, kInf,
                    -kInf, 1e-40f, kNaN});
  EXPECT_THAT(gpu_->Bf16ToFloat(-1, nullptr, nullptr).message(),
              HasSubstr("Bf16ToFloat"));
}

TEST_F(CudaWireCastTest, Fp16CastsMatchCpuBitForBit) {
  ExpectMatchesCpu(
      {&Backend::FloatToFp16, &Backend::Fp16ToFloat, 0x7c00}, 1e5f,
      {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 65519.0f, 65520.0f, 0x1p-25f,
       1.5f * 0x1p-25f, -0.0f, kInf, -kInf, 1e-40f, kNaN});
  EXPECT_THAT(gpu_->Fp16ToFloat(-1, nullptr, nullptr).message(),
              HasSubstr("Fp16ToFloat"));
}

TEST_F(CudaBackendTest, ScaleAndAxpy) {
  SCOPED_TRACE(SeedTrace());
  for (int64_t n : Sizes()) {
    SCOPED_TRACE(n);
    const float alpha = Random(1, 2.0f)[0];
    const std::vector<float> x = Random(n);
    const std::vector<float> y = Random(n);

    std::vector<float> expected = y;
    ASSERT_TRUE(cpu_.Scale(n, alpha, expected.data()).ok());
    DeviceArray<float> gy = Upload(y);
    ASSERT_TRUE(gpu_->Scale(n, alpha, gy.data()).ok());
    std::vector<float> got = Download(gy);
    EXPECT_CLOSE(got, expected, nullptr, kTinyFloor, kTolerance);
    ExpectGuardIntact(got, n);

    // y + alpha * x may cancel: measure against the terms' magnitudes.
    std::vector<double> floors(n);
    for (int64_t i = 0; i < n; ++i) {
      floors[i] = std::fabs(y[i]) + std::fabs(alpha * x[i]);
    }
    expected = y;
    ASSERT_TRUE(cpu_.Axpy(n, alpha, x.data(), expected.data()).ok());
    DeviceArray<float> gx = Upload(x);
    gy = Upload(y);
    ASSERT_TRUE(gpu_->Axpy(n, alpha, gx.data(), gy.data()).ok());
    got = Download(gy);
    EXPECT_CLOSE(got, expected, &floors, 0, kTolerance);
    ExpectGuardIntact(got, n);

    // x aliasing y.
    expected = y;
    ASSERT_TRUE(cpu_.Axpy(n, alpha, expected.data(), expected.data()).ok());
    gy = Upload(y);
    ASSERT_TRUE(gpu_->Axpy(n, alpha, gy.data(), gy.data()).ok());
    got = Download(gy);
    EXPECT_CLOSE(got, expected, nullptr, kTinyFloor, kTolerance);
  }
  EXPECT_THAT(gpu_->Axpy(3, 1.0f, nullptr, nullptr).message(),
              HasSubstr("Axpy: x is null"));
}

// Im2Col, Col2Im and max pooling against the CPU, on shapes with padding,
// strides, overlapping windows and odd sizes. The kernels gather in the
// CPU's order, so results are expected to match exactly.
TEST_F(CudaBackendTest, WindowOpsMatchCpu) {
  SCOPED_TRACE(SeedTrace());
  struct Shape {
    int64_t batch, height, width, channels, kernel, stride, pad;
  };
  for (const Shape& shape : std::vector<Shape>{{2, 7, 5, 3, 3, 2, 1},
                                               {3, 5, 9, 4, 3, 1, 0},
                                               {2, 8, 7, 5, 3, 3, 2},
                                               {1, 4, 4, 2, 4, 1, 0},
                                               {2, 9, 8, 17, 2, 2, 0},
                                               {64, 28, 28, 1, 3, 1, 1}}) {
    Window2D w;
    w.batch = shape.batch;
    w.height = shape.height;
    w.width = shape.width;
    w.channels = shape.channels;
    w.kernel = shape.kernel;
    w.stride = shape.stride;
    w.pad = shape.pad;
    SCOPED_TRACE(absl::StrCat(w.batch, "x", w.height, "x", w.width, "x",
                              w.channels, " k", w.kernel, " s", w.stride, " p",
                              w.pad));
    const int64_t inputs = w.input_elements();
    const int64_t cols = w.col_rows() * w.col_cols();
    const std::vector<float> x = Random(inputs);
    DeviceArray<float> gx = Upload(x);

    std::vector<float> col(cols);
    ASSERT_TRUE(cpu_.Im2Col(w, x.data(), col.data()).ok());
    DeviceArray<float> gcol = Poisoned(cols);
    ASSERT_TRUE(gpu_->Im2Col(w, gx.data(), gcol.data()).ok());
    std::vector<float> got = Download(gcol);
    EXPECT_CLOSE(got, col, nullptr, kTinyFloor, 0.0);
    ExpectGuardIntact(got, cols);

    const std::vector<float> c = Random(cols);
    std::vector<float> back(inputs);
    ASSERT_TRUE(cpu_.Col2Im(w, c.data(), back.data()).ok());
    DeviceArray<float> gc = Upload(c);
    DeviceArray<float> gback = Poisoned(inputs);
    ASSERT_TRUE(gpu_->Col2Im(w, gc.data(), gback.data()).ok());
    got = Download(gback);
    EXPECT_CLOSE(got, back, nullptr, kTinyFloor, kTolerance);
    ExpectGuardIntact(got, inputs);

    if (w.pad != 0) continue;  // pooling has no padding
    const int64_t outputs = w.output_elements();
    std::vector<float> y(outputs);
    std::vector<int64_t> argmax(outputs);
    ASSERT_TRUE(cpu_.MaxPool2D(w, x.data(), y.data(), argmax.data()).ok());
    DeviceArray<float> gy = Poisoned(outputs);
    DeviceArray<int64_t> gargmax =
        UploadExact(std::vector<int64_t>(outputs, -1));
    ASSERT_TRUE(gpu_->MaxPool2D(w, gx.data(), gy.data(), gargmax.data()).ok());
    got = Download(gy);
    EXPECT_CLOSE(got, y, nullptr, kTinyFloor, 0.0);
    ExpectGuardIntact(got, outputs);
    std::vector<int64_t> got_argmax(outputs);
    ASSERT_TRUE(gpu_->CopyToHost(gargmax.data(), got_argmax.data(),
                                 outputs * sizeof(int64_t))
                    .ok());
    EXPECT_EQ(got_argmax, argmax);

    const std::vector<float> dy = Random(outputs);
    std::vector<float> dx(inputs);
    ASSERT_TRUE(
        cpu_.MaxPool2DGrad(w, dy.data(), argmax.data(), dx.data()).ok());
    DeviceArray<float> gdy = Upload(dy);
    DeviceArray<float> gdx = Poisoned(inputs);
    ASSERT_TRUE(
        gpu_->MaxPool2DGrad(w, gdy.data(), gargmax.data(), gdx.data()).ok());
    got = Download(gdx);
    EXPECT_CLOSE(got, dx, nullptr, kTinyFloor, kTolerance);
    ExpectGuardIntact(got, inputs);
  }
}

TEST_F(CudaBackendTest, WindowOpsRejectWhatTheCpuRejects) {
  Window2D w;
  w.batch = 1;
  w.height = 4;
  w.width = 4;
  w.channels = 1;
  w.kernel = 2;
  w.stride = 2;
  w.pad = 1;
  DeviceArray<float> buf = Poisoned(64);
  const absl::Status gpu =
      gpu_->MaxPool2D(w, buf.data(), buf.data() + 32, nullptr);
  const absl::Status cpu =
      CpuBackend(CpuGemm::kReference).MaxPool2D(w, nullptr, nullptr, nullptr);
  EXPECT_EQ(gpu.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu.message(), cpu.message());
  w.pad = 2;
  EXPECT_EQ(gpu_->Im2Col(w, buf.data(), buf.data() + 32).message(),
            "Im2Col: pad 2 must be smaller than the kernel 2");
}

TEST_F(CudaBackendTest, ReluAndReluGrad) {
  SCOPED_TRACE(SeedTrace());
  for (int64_t n : Sizes()) {
    SCOPED_TRACE(n);
    std::vector<float> x = Random(n);
    // Special values where there is room: exact zeros, NaN, infinities.
    const float specials[] = {0.0f, -0.0f, kNaN, kInf, -kInf};
    for (size_t i = 0; i < std::size(specials) && i * 3 < x.size(); ++i) {
      x[i * 3] = specials[i];
    }
    std::vector<float> y(n);
    ASSERT_TRUE(cpu_.Relu(n, x.data(), y.data()).ok());
    DeviceArray<float> gx = Upload(x);
    DeviceArray<float> gy = Poisoned(n);
    ASSERT_TRUE(gpu_->Relu(n, gx.data(), gy.data()).ok());
    std::vector<float> got = Download(gy);
    EXPECT_CLOSE(got, y, nullptr, kTinyFloor, kTolerance);
    ExpectGuardIntact(got, n);
    // In place.
    ASSERT_TRUE(gpu_->Relu(n, gx.data(), gx.data()).ok());
    got = Download(gx);
    EXPECT_CLOSE(got, y, nullptr, kTinyFloor, kTolerance);

    const std::vector<float> dy = Random(n);
    std::vector<float> dx(n);
    ASSERT_TRUE(cpu_.ReluGrad(n, y.data(), dy.data(), dx.data()).ok());
    DeviceArray<float> gdy = Upload(dy);
    DeviceArray<float> gdx = Poisoned(n);
    ASSERT_TRUE(gpu_->ReluGrad(n, gy.data(), gdy.data(), gdx.data()).ok());
    got = Download(gdx);
    EXPECT_CLOSE(got, dx, nullptr, kTinyFloor, kTolerance);
    ExpectGuardIntact(got, n);
    // dx aliasing dy.
    ASSERT_TRUE(gpu_->ReluGrad(n, gy.data(), gdy.data(), gdy.data()).ok());
    got = Download(gdy);
    EXPECT_CLOSE(got, dx, nullptr, kTinyFloor, kTolerance);
  }
}

TEST_F(CudaBackendTest, AddBias) {
  SCOPED_TRACE(SeedTrace());
  for (const Shape& s : Shapes()) {
    SCOPED_TRACE(absl::StrCat(s.rows, "x", s.cols));
    const std::vector<float> bias = Random(s.cols);
    const std::vector<float> y = Random(s.rows * s.cols);
    std::vector<double> floors(y.size());
    for (size_t i = 0; i < y.size(); ++i) {
      floors[i] = std::fabs(y[i]) + std::fabs(bias[i % s.cols]);
    }
    std::vector<float> expected = y;
    ASSERT_TRUE(
        cpu_.AddBias(s.rows, s.cols, bias.data(), expected.data()).ok());
    DeviceArray<float> gbias = Upload(bias);
    DeviceArray<float> gy = Upload(y);
    ASSERT_TRUE(gpu_->AddBias(s.rows, s.cols, gbias.data(), gy.data()).ok());
    const std::vector<float> got = Download(gy);
    EXPECT_CLOSE(got, expected, &floors, 0, kTolerance);
    ExpectGuardIntact(got, y.size());
  }
  EXPECT_THAT(gpu_->AddBias(2, -3, nullptr, nullptr).message(),
              HasSubstr("AddBias"));
}

TEST_F(CudaBackendTest, BiasGrad) {
  SCOPED_TRACE(SeedTrace());
  std::vector<Shape> shapes = Shapes();
  // Enough rows for the multi-chunk path (partial sums, then a second pass).
  shapes.push_back({100000, 3});
  shapes.push_back({70001, 65});
  for (const Shape& s : shapes) {
    SCOPED_TRACE(absl::StrCat(s.rows, "x", s.cols));
    const std::vector<float> dy = Random(s.rows * s.cols);
    std::vector<double> floors(s.cols, 0.0);
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t c = 0; c < s.cols; ++c) {
        floors[c] += std::fabs(dy[r * s.cols + c]);
      }
    }
    std::vector<float> expected(s.cols);
    ASSERT_TRUE(cpu_.BiasGrad(s.rows, s.cols, dy.data(), expected.data()).ok());
    DeviceArray<float> gdy = Upload(dy);
    DeviceArray<float> grad = Poisoned(s.cols);
    ASSERT_TRUE(gpu_->BiasGrad(s.rows, s.cols, gdy.data(), grad.data()).ok());
    const std::vector<float> got = Download(grad);
    EXPECT_CLOSE(got, expected, &floors, 0, kTolerance);
    ExpectGuardIntact(got, s.cols);
  }
  // No rows: zeros, over the poison.
  DeviceArray<float> grad = Poisoned(5);
  ASSERT_TRUE(gpu_->BiasGrad(0, 5, nullptr, grad.data()).ok());
  const std::vector<float> got = Download(grad);
  EXPECT_CLOSE(got, std::vector<float>(5, 0.0f), nullptr, kTinyFloor,
               kTolerance);
  EXPECT_THAT(gpu_->BiasGrad(2, 3, nullptr, grad.data()).message(),
              HasSubstr("BiasGrad: dy is null"));
}

struct GemmShape {
  int64_t m, n, k;
};

const std::vector<GemmShape>& GemmShapes() {
  static const auto* shapes = new std::vector<GemmShape>{
      {1, 1, 1},   {7, 33, 257},   {33, 7, 1000},  {257, 1, 33},
      {1, 257, 7}, {1000, 37, 64}, {129, 65, 2049}};
  return *shapes;
}

// |alpha| * sum_p |op(a)_ip op(b)_pj| + |beta c_ij|: the scale of element
// (i, j)'s rounding error.
std::vector<double> GemmFloors(bool trans_a, bool trans_b, int64_t m, int64_t n,
                               int64_t k, float alpha,
                               const std::vector<float>& a,
                               const std::vector<float>& b, float beta,
                               const std::vector<float>& c) {
  std::vector<double> floors(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double a_ip = trans_a ? a[p * m + i] : a[i * k + p];
        const double b_pj = trans_b ? b[j * k + p] : b[p * n + j];
        sum += std::fabs(a_ip * b_pj);
      }
      floors[i * n + j] = std::fabs(alpha) * sum +
                          (beta == 0 ? 0.0 : std::fabs(beta * c[i * n + j]));
    }
  }
  return floors;
}

TEST_F(CudaBackendTest, GemmMatchesCpuForAllTransposes) {
  SCOPED_TRACE(SeedTrace());
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      for (const GemmShape& s : GemmShapes()) {
        SCOPED_TRACE(absl::StrCat(trans_a ? "At" : "A", trans_b ? "Bt" : "B",
                                  " ", s.m, "x", s.n, "x", s.k));
        const std::vector<float> a = Random(s.m * s.k);
        const std::vector<float> b = Random(s.k * s.n);
        const std::vector<float> c0 = Random(s.m * s.n);
        DeviceArray<float> ga = Upload(a);
        DeviceArray<float> gb = Upload(b);
        for (const auto& [alpha, beta] : std::vector<std::pair<float, float>>{
                 {1.5f, 0.0f}, {-0.75f, 0.5f}, {1.0f, 1.0f}}) {
          SCOPED_TRACE(absl::StrCat("alpha ", alpha, " beta ", beta));
          std::vector<float> expected = c0;
          ASSERT_TRUE(cpu_.Gemm(trans_a, trans_b, s.m, s.n, s.k, alpha,
                                a.data(), b.data(), beta, expected.data())
                          .ok());
          // beta == 0: C is write-only, so it starts as NaN.
          DeviceArray<float> gc = beta == 0 ? Poisoned(s.m * s.n) : Upload(c0);
          ASSERT_TRUE(gpu_->Gemm(trans_a, trans_b, s.m, s.n, s.k, alpha,
                                 ga.data(), gb.data(), beta, gc.data())
                          .ok());
          const std::vector<float> got = Download(gc);
          const std::vector<double> floors = GemmFloors(
              trans_a, trans_b, s.m, s.n, s.k, alpha, a, b, beta, c0);
          EXPECT_CLOSE(got, expected, &floors, 0, kTolerance);
          ExpectGuardIntact(got, s.m * s.n);
        }
      }
    }
  }
}

TEST_F(CudaBackendTest, GemmDegenerateCases) {
  // k == 0: C = beta * C, or zeros over NaN when beta == 0.
  const std::vector<float> c = {1, 2, 3, 4, 5, 6};
  DeviceArray<float> gc = Upload(c);
  ASSERT_TRUE(
      gpu_->Gemm(false, false, 2, 3, 0, 1.0f, nullptr, nullptr, 2.0f, gc.data())
          .ok());
  std::vector<float> got = Download(gc);
  EXPECT_CLOSE(got, (std::vector<float>{2, 4, 6, 8, 10, 12}), nullptr,
               kTinyFloor, kTolerance);
  DeviceArray<float> poisoned = Poisoned(6);
  ASSERT_TRUE(gpu_->Gemm(false, false, 2, 3, 0, 1.0f, nullptr, nullptr, 0.0f,
                         poisoned.data())
                  .ok());
  got = Download(poisoned);
  EXPECT_CLOSE(got, std::vector<float>(6, 0.0f), nullptr, kTinyFloor,
               kTolerance);
  ExpectGuardIntact(got, 6);
  // alpha == 0 with NaN inputs: A and B are not read.
  DeviceArray<float> nan_ab = Poisoned(6);
  gc = Upload(c);
  ASSERT_TRUE(gpu_->Gemm(false, false, 2, 3, 1, 0.0f, nan_ab.data(),
                         nan_ab.data(), 1.0f, gc.data())
                  .ok());
  got = Download(gc);
  EXPECT_CLOSE(got, c, nullptr, kTinyFloor, kTolerance);
  // Empty output.
  EXPECT_TRUE(
      gpu_->Gemm(false, false, 0, 5, 7, 1.0f, nullptr, nullptr, 0.0f, nullptr)
          .ok());
  absl::Status s = gpu_->Gemm(false, false, 2, 2, 2, 1.0f, nullptr, gc.data(),
                              0.0f, gc.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("Gemm: a is null"));
}

// Reference loss/gradient/count from the CPU backend, and the same from the
// GPU (from poisoned gradient buffers), compared.
void CompareSoftmaxCe(CpuBackend& cpu, Backend& gpu, int64_t rows, int64_t cols,
                      const std::vector<float>& logits,
                      const std::vector<int32_t>& labels, float grad_scale) {
  std::vector<float> expected_grad(rows * cols);
  double expected_loss = 0;
  int64_t expected_correct = 0;
  ASSERT_TRUE(cpu.SoftmaxCrossEntropy(rows, cols, logits.data(), labels.data(),
                                      grad_scale, expected_grad.data(),
                                      &expected_loss, &expected_correct)
                  .ok());
  absl::StatusOr<DeviceArray<float>> glogits =
      DeviceArray<float>::Create(&gpu, logits.size());
  ASSERT_TRUE(glogits.ok());
  ASSERT_TRUE(
      gpu.CopyToDevice(logits.data(), glogits->data(), glogits->bytes()).ok());
  absl::StatusOr<DeviceArray<int32_t>> glabels =
      DeviceArray<int32_t>::Create(&gpu, labels.size());
  ASSERT_TRUE(glabels.ok());
  ASSERT_TRUE(
      gpu.CopyToDevice(labels.data(), glabels->data(), glabels->bytes()).ok());
  std::vector<float> poison(rows * cols + kGuard, kNaN);
  absl::StatusOr<DeviceArray<float>> grad =
      DeviceArray<float>::Create(&gpu, poison.size());
  ASSERT_TRUE(grad.ok());
  ASSERT_TRUE(
      gpu.CopyToDevice(poison.data(), grad->data(), grad->bytes()).ok());

  const auto expect_loss = [&](double loss) {
    if (std::isnan(expected_loss)) {
      EXPECT_TRUE(std::isnan(loss)) << loss;
    } else {
      EXPECT_NEAR(loss, expected_loss,
                  1e-9 * std::max(1.0, std::fabs(expected_loss)));
    }
  };

  double loss = -1;
  int64_t correct = -1;
  ASSERT_TRUE(gpu.SoftmaxCrossEntropy(rows, cols, glogits->data(),
                                      glabels->data(), grad_scale, grad->data(),
                                      &loss, &correct)
                  .ok());
  expect_loss(loss);
  EXPECT_EQ(correct, expected_correct);
  std::vector<float> got(grad->size());
  ASSERT_TRUE(gpu.CopyToHost(grad->data(), got.data(), grad->bytes()).ok());
  EXPECT_CLOSE(got, expected_grad, nullptr, kTinyFloor, kTolerance);
  for (size_t i = rows * cols; i < got.size(); ++i) {
    ASSERT_TRUE(std::isnan(got[i])) << "written past the end at " << i;
  }

  // Forward only.
  loss = -1;
  correct = -1;
  ASSERT_TRUE(gpu.SoftmaxCrossEntropy(rows, cols, glogits->data(),
                                      glabels->data(), grad_scale, nullptr,
                                      &loss, &correct)
                  .ok());
  expect_loss(loss);
  EXPECT_EQ(correct, expected_correct);

  // In place: the gradient overwrites the logits.
  ASSERT_TRUE(gpu.SoftmaxCrossEntropy(rows, cols, glogits->data(),
                                      glabels->data(), grad_scale,
                                      glogits->data(), &loss, &correct)
                  .ok());
  expect_loss(loss);
  EXPECT_EQ(correct, expected_correct);
  got.assign(glogits->size(), 0.0f);
  ASSERT_TRUE(
      gpu.CopyToHost(glogits->data(), got.data(), glogits->bytes()).ok());
  EXPECT_CLOSE(got, expected_grad, nullptr, kTinyFloor, kTolerance);
}

TEST_F(CudaBackendTest, SoftmaxCrossEntropyMatchesCpu) {
  SCOPED_TRACE(SeedTrace());
  std::vector<Shape> shapes = Shapes();
  shapes.push_back({2, 100000});
  for (const Shape& s : shapes) {
    SCOPED_TRACE(absl::StrCat(s.rows, "x", s.cols));
    const std::vector<float> logits = Random(s.rows * s.cols, 5.0f);
    const std::vector<int32_t> labels =
        RandomInts<int32_t>(s.rows, 0, static_cast<int32_t>(s.cols - 1));
    CompareSoftmaxCe(cpu_, *gpu_, s.rows, s.cols, logits, labels,
                     1.0f / static_cast<float>(s.rows));
  }
}

TEST_F(CudaBackendTest, SoftmaxCrossEntropyEdgeCases) {
  SCOPED_TRACE(SeedTrace());
  // Ties (the first maximal logit wins), huge logits (no overflow), NaN at
  // column 0 (wins the argmax, as on the CPU) and elsewhere (ignored by the
  // argmax), infinities.
  const std::vector<float> logits = {
      7,     7,        7,        7,      //
      1e4f,  1e4f + 1, 1e4f - 1, -1e4f,  //
      -1e4f, -1e4f,    -3e4f,    -1e4f,  //
      kNaN,  1,        2,        3,      //
      1,     kNaN,     5,        2,      //
      -kInf, 0,        1,        -kInf,  //
      5,     5,        1,        5,      //
  };
  const std::vector<int32_t> labels = {2, 1, 3, 0, 2, 2, 0};
  CompareSoftmaxCe(cpu_, *gpu_, 7, 4, logits, labels, 0.5f);

  // Many classes with a wide spread: tiny probabilities.
  std::vector<float> wide = Random(3 * 3000, 40.0f);
  CompareSoftmaxCe(cpu_, *gpu_, 3, 3000, wide, {0, 1234, 2999}, 1.0f);

  // No rows.
  double loss = -1;
  int64_t correct = -1;
  ASSERT_TRUE(gpu_->SoftmaxCrossEntropy(0, 4, nullptr, nullptr, 1.0f, nullptr,
                                        &loss, &correct)
                  .ok());
  EXPECT_EQ(loss, 0);
  EXPECT_EQ(correct, 0);
}

TEST_F(CudaBackendTest, SoftmaxCrossEntropyRejectsBadLabels) {
  const int64_t rows = 6, cols = 3;
  const std::vector<float> logits = Random(rows * cols);
  DeviceArray<float> glogits = Upload(logits);
  for (int32_t bad : {3, -1, 1 << 30}) {
    SCOPED_TRACE(bad);
    // Rows 2 and 4 are bad; the error names the first, like the CPU.
    const std::vector<int32_t> labels = {0, 1, bad, 2, bad, 0};
    DeviceArray<int32_t> glabels = UploadExact(labels);
    double loss = 123;
    int64_t correct = 456;
    absl::Status s =
        gpu_->SoftmaxCrossEntropy(rows, cols, glogits.data(), glabels.data(),
                                  1.0f, glogits.data(), &loss, &correct);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(),
                HasSubstr("SoftmaxCrossEntropy: row 2 has label " +
                          std::to_string(bad) + ", outside [0, 3)"));
    // Nothing was written, in place or to the host.
    EXPECT_EQ(loss, 123);
    EXPECT_EQ(correct, 456);
    const std::vector<float> after = Download(glogits);
    EXPECT_CLOSE(after, logits, nullptr, kTinyFloor, 0.0);
  }
  // The error is not sticky: a good batch works afterwards.
  DeviceArray<int32_t> good = UploadExact(std::vector<int32_t>(rows, 1));
  double loss;
  int64_t correct;
  EXPECT_TRUE(gpu_->SoftmaxCrossEntropy(rows, cols, glogits.data(), good.data(),
                                        1.0f, nullptr, &loss, &correct)
                  .ok());
  EXPECT_THAT(gpu_->SoftmaxCrossEntropy(rows, cols, glogits.data(), good.data(),
                                        1.0f, nullptr, nullptr, &correct)
                  .message(),
              HasSubstr("loss_sum is null"));
}

TEST_F(CudaBackendTest, GatherMatchesCpu) {
  SCOPED_TRACE(SeedTrace());
  const int64_t table_rows = 1000;
  for (int64_t dim : {1, 7, 33, 257}) {
    const std::vector<float> table = Random(table_rows * dim);
    DeviceArray<float> gtable = Upload(table);
    for (int64_t n : {1, 7, 257, 5000}) {
      SCOPED_TRACE(absl::StrCat("dim ", dim, " n ", n));
      // Repeats are likely with n > table_rows.
      const std::vector<int64_t> indices =
          RandomInts<int64_t>(n, 0, table_rows - 1);
      std::vector<float> expected(n * dim);
      ASSERT_TRUE(cpu_.Gather(n, dim, table_rows, table.data(), indices.data(),
                              expected.data())
                      .ok());
      DeviceArray<int64_t> gindices = UploadExact(indices);
      DeviceArray<float> out = Poisoned(n * dim);
      ASSERT_TRUE(gpu_->Gather(n, dim, table_rows, gtable.data(),
                               gindices.data(), out.data())
                      .ok());
      const std::vector<float> got = Download(out);
      EXPECT_CLOSE(got, expected, nullptr, kTinyFloor, kTolerance);
      ExpectGuardIntact(got, n * dim);
    }
  }
}

TEST_F(CudaBackendTest, ScatterAddMatchesCpu) {
  SCOPED_TRACE(SeedTrace());
  const int64_t table_rows = 1000;
  for (int64_t dim : {1, 7, 33, 257}) {
    for (int64_t n : {1, 7, 257, 5000}) {
      SCOPED_TRACE(absl::StrCat("dim ", dim, " n ", n));
      const std::vector<float> table = Random(table_rows * dim);
      const std::vector<float> grads = Random(n * dim);
      const std::vector<int64_t> indices =
          RandomInts<int64_t>(n, 0, table_rows - 1);
      CompareScatterAdd(n, dim, table_rows, table, grads, indices);
    }
  }
}

TEST_F(CudaBackendTest, BadEmbeddingIndicesAreReportedAtTheNextSync) {
  const int64_t table_rows = 10, dim = 3;
  DeviceArray<float> table = Upload(Random(table_rows * dim));
  DeviceArray<int64_t> indices =
      UploadExact(std::vector<int64_t>{1, 10, 2, -5});
  DeviceArray<float> out = Poisoned(4 * dim);
  // The kernel cannot fail the call; the next synchronization does.
  ASSERT_TRUE(
      gpu_->Gather(4, dim, table_rows, table.data(), indices.data(), out.data())
          .ok());
  absl::Status s = gpu_->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("Gather: indices["));
  EXPECT_THAT(s.message(), HasSubstr("is outside the table's rows [0, 10)"));
  // Reported once; bad rows were zero-filled, good ones copied.
  EXPECT_TRUE(gpu_->Synchronize().ok());
  const std::vector<float> got = Download(out);
  for (int64_t d = 0; d < dim; ++d) {
    EXPECT_EQ(got[1 * dim + d], 0.0f);
    EXPECT_EQ(got[3 * dim + d], 0.0f);
    EXPECT_FALSE(std::isnan(got[0 * dim + d]));
  }

  ASSERT_TRUE(gpu_->ScatterAdd(4, dim, table_rows, out.data(), indices.data(),
                               table.data())
                  .ok());
  std::vector<float> host(table.size());
  s = gpu_->CopyToHost(table.data(), host.data(), table.bytes());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("ScatterAdd: indices["));
  EXPECT_TRUE(gpu_->Synchronize().ok());
}

// The same fixture with bf16 GEMMs.
class CudaBf16Test : public CudaBackendTest {
 protected:
  std::string precision() const override { return "bf16"; }
};

TEST_F(CudaBf16Test, Name) { EXPECT_THAT(gpu_->Name(), HasSubstr("bf16")); }

TEST_F(CudaBf16Test, InputsAreRoundedToNearestEven) {
  SCOPED_TRACE(SeedTrace());
  // C = A * I is exact in fp32, so it shows the rounded A.
  const int64_t m = 33, k = 17;
  std::vector<float> a = Random(m * k, 3.0f);
  // Values exactly halfway between two bf16 numbers round to even.
  a[0] = 1.0f + 1.0f / 256;  // halfway, rounds down to 1
  a[1] = 1.0f + 3.0f / 256;  // halfway, rounds up to 1 + 4/256
  std::vector<float> identity(k * k, 0.0f);
  for (int64_t i = 0; i < k; ++i) identity[i * k + i] = 1.0f;
  DeviceArray<float> ga = Upload(a);
  DeviceArray<float> gi = Upload(identity);
  DeviceArray<float> gc = Poisoned(m * k);
  ASSERT_TRUE(gpu_->Gemm(false, false, m, k, k, 1.0f, ga.data(), gi.data(),
                         0.0f, gc.data())
                  .ok());
  const std::vector<float> got = Download(gc);
  std::vector<float> expected(a.size());
  for (size_t i = 0; i < a.size(); ++i) expected[i] = RoundToBf16(a[i]);
  EXPECT_EQ(expected[0], 1.0f);
  EXPECT_EQ(expected[1], 1.0f + 4.0f / 256);
  EXPECT_CLOSE(got, expected, nullptr, kTinyFloor, 0.0);
  ExpectGuardIntact(got, m * k);
}

TEST_F(CudaBf16Test, GemmMatchesCpu) {
  SCOPED_TRACE(SeedTrace());
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      for (const GemmShape& s : GemmShapes()) {
        SCOPED_TRACE(absl::StrCat(trans_a ? "At" : "A", trans_b ? "Bt" : "B",
                                  " ", s.m, "x", s.n, "x", s.k));
        const std::vector<float> a = Random(s.m * s.k);
        const std::vector<float> b = Random(s.k * s.n);
        const std::vector<float> c0 = Random(s.m * s.n);
        std::vector<float> a16 = a, b16 = b;
        for (float& x : a16) x = RoundToBf16(x);
        for (float& x : b16) x = RoundToBf16(x);
        DeviceArray<float> ga = Upload(a);
        DeviceArray<float> gb = Upload(b);
        for (const auto& [alpha, beta] : std::vector<std::pair<float, float>>{
                 {1.5f, 0.0f}, {-0.75f, 0.5f}}) {
          SCOPED_TRACE(absl::StrCat("alpha ", alpha, " beta ", beta));
          DeviceArray<float> gc = beta == 0 ? Poisoned(s.m * s.n) : Upload(c0);
          ASSERT_TRUE(gpu_->Gemm(trans_a, trans_b, s.m, s.n, s.k, alpha,
                                 ga.data(), gb.data(), beta, gc.data())
                          .ok());
          const std::vector<float> got = Download(gc);
          ExpectGuardIntact(got, s.m * s.n);
          const std::vector<double> floors = GemmFloors(
              trans_a, trans_b, s.m, s.n, s.k, alpha, a, b, beta, c0);

          std::vector<float> rounded = c0;
          ASSERT_TRUE(cpu_.Gemm(trans_a, trans_b, s.m, s.n, s.k, alpha,
                                a16.data(), b16.data(), beta, rounded.data())
                          .ok());
          EXPECT_CLOSE(got, rounded, &floors, 0, 1e-3);

          std::vector<float> exact = c0;
          ASSERT_TRUE(cpu_.Gemm(trans_a, trans_b, s.m, s.n, s.k, alpha,
                                a.data(), b.data(), beta, exact.data())
                          .ok());
          EXPECT_CLOSE(got, exact, &floors, 0, 1e-2);
        }
      }
    }
  }
}

// --- Gaps a review found: exactness, grid limits, threads, OOM, errors. ---

// The elementwise ops and Gather are documented to round exactly like the
// CPU (no FMA contraction): checked bit for bit, so that a kernel computing
// y + alpha * x with one rounding instead of two fails.
TEST_F(CudaBackendTest, ElementwiseOpsAndGatherAreBitExact) {
  SCOPED_TRACE(SeedTrace());
  constexpr double kExact = 0.0;
  for (int64_t n : {int64_t{1000 * 37}, int64_t{(1 << 24) + 3}}) {
    SCOPED_TRACE(n);
    const float alpha = Random(1, 3.0f)[0];
    const std::vector<float> x = Random(n, 7.0f);
    const std::vector<float> y = Random(n, 5.0f);
    DeviceArray<float> gx = Upload(x);

    std::vector<float> expected = y;
    ASSERT_TRUE(cpu_.Axpy(n, alpha, x.data(), expected.data()).ok());
    DeviceArray<float> gy = Upload(y);
    ASSERT_TRUE(gpu_->Axpy(n, alpha, gx.data(), gy.data()).ok());
    EXPECT_CLOSE(Download(gy), expected, nullptr, kTinyFloor, kExact);

    expected = y;
    ASSERT_TRUE(cpu_.Scale(n, alpha, expected.data()).ok());
    gy = Upload(y);
    ASSERT_TRUE(gpu_->Scale(n, alpha, gy.data()).ok());
    EXPECT_CLOSE(Download(gy), expected, nullptr, kTinyFloor, kExact);

    std::vector<float> relu(n);
    ASSERT_TRUE(cpu_.Relu(n, x.data(), relu.data()).ok());
    DeviceArray<float> grelu = Poisoned(n);
    ASSERT_TRUE(gpu_->Relu(n, gx.data(), grelu.data()).ok());
    EXPECT_CLOSE(Download(grelu), relu, nullptr, kTinyFloor, kExact);

    std::vector<float> dx(n);
    ASSERT_TRUE(cpu_.ReluGrad(n, relu.data(), y.data(), dx.data()).ok());
    DeviceArray<float> gdx = Poisoned(n);
    DeviceArray<float> gdy = Upload(y);
    ASSERT_TRUE(gpu_->ReluGrad(n, grelu.data(), gdy.data(), gdx.data()).ok());
    EXPECT_CLOSE(Download(gdx), dx, nullptr, kTinyFloor, kExact);
  }
  for (const Shape& s : Shapes()) {
    SCOPED_TRACE(absl::StrCat(s.rows, "x", s.cols));
    const std::vector<float> bias = Random(s.cols, 3.0f);
    const std::vector<float> y = Random(s.rows * s.cols);
    std::vector<float> expected = y;
    ASSERT_TRUE(
        cpu_.AddBias(s.rows, s.cols, bias.data(), expected.data()).ok());
    DeviceArray<float> gbias = Upload(bias);
    DeviceArray<float> gy = Upload(y);
    ASSERT_TRUE(gpu_->AddBias(s.rows, s.cols, gbias.data(), gy.data()).ok());
    EXPECT_CLOSE(Download(gy), expected, nullptr, kTinyFloor, kExact);
  }
  const int64_t table_rows = 1000, dim = 33, n = 5000;
  const std::vector<float> table = Random(table_rows * dim);
  const std::vector<int64_t> indices =
      RandomInts<int64_t>(n, 0, table_rows - 1);
  std::vector<float> expected(n * dim);
  ASSERT_TRUE(cpu_.Gather(n, dim, table_rows, table.data(), indices.data(),
                          expected.data())
                  .ok());
  DeviceArray<float> gtable = Upload(table);
  DeviceArray<int64_t> gindices = UploadExact(indices);
  DeviceArray<float> out = Poisoned(n * dim);
  ASSERT_TRUE(gpu_->Gather(n, dim, table_rows, gtable.data(), gindices.data(),
                           out.data())
                  .ok());
  EXPECT_CLOSE(Download(out), expected, nullptr, kTinyFloor, kExact);
}

// More rows (or indices) than the kernels launch blocks for (1 << 16, and
// 65,535 for a grid's y dimension): the loops over rows must go around.
TEST_F(CudaBackendTest, RowLoopsGoPastTheGridLimit) {
  SCOPED_TRACE(SeedTrace());
  constexpr int64_t kRows = 70001;
  for (int64_t cols : {3, 300}) {
    SCOPED_TRACE(absl::StrCat(kRows, "x", cols));
    const std::vector<float> bias = Random(cols);
    const std::vector<float> y = Random(kRows * cols);
    std::vector<float> expected = y;
    ASSERT_TRUE(cpu_.AddBias(kRows, cols, bias.data(), expected.data()).ok());
    DeviceArray<float> gbias = Upload(bias);
    DeviceArray<float> gy = Upload(y);
    ASSERT_TRUE(gpu_->AddBias(kRows, cols, gbias.data(), gy.data()).ok());
    const std::vector<float> got = Download(gy);
    EXPECT_CLOSE(got, expected, nullptr, kTinyFloor, 0.0);
    ExpectGuardIntact(got, y.size());
  }
  {
    SCOPED_TRACE("SoftmaxCrossEntropy");
    const int64_t cols = 3;
    const std::vector<float> logits = Random(kRows * cols, 5.0f);
    const std::vector<int32_t> labels =
        RandomInts<int32_t>(kRows, 0, static_cast<int32_t>(cols - 1));
    CompareSoftmaxCe(cpu_, *gpu_, kRows, cols, logits, labels,
                     1.0f / static_cast<float>(kRows));
  }
  const int64_t table_rows = 1000, dim = 3;
  const std::vector<float> table = Random(table_rows * dim);
  const std::vector<int64_t> indices =
      RandomInts<int64_t>(kRows, 0, table_rows - 1);
  DeviceArray<int64_t> gindices = UploadExact(indices);
  {
    SCOPED_TRACE("Gather");
    std::vector<float> expected(kRows * dim);
    ASSERT_TRUE(cpu_.Gather(kRows, dim, table_rows, table.data(),
                            indices.data(), expected.data())
                    .ok());
    DeviceArray<float> gtable = Upload(table);
    DeviceArray<float> out = Poisoned(kRows * dim);
    ASSERT_TRUE(gpu_->Gather(kRows, dim, table_rows, gtable.data(),
                             gindices.data(), out.data())
                    .ok());
    const std::vector<float> got = Download(out);
    EXPECT_CLOSE(got, expected, nullptr, kTinyFloor, 0.0);
    ExpectGuardIntact(got, kRows * dim);
  }
  {
    SCOPED_TRACE("ScatterAdd");
    CompareScatterAdd(kRows, dim, table_rows, table, Random(kRows * dim),
                      indices);
  }
}

// One backend used from several threads at once (the worker's prefetch and
// training threads do): every thread's results must be what the CPU says.
TEST_F(CudaBackendTest, ThreadsShareOneBackend) {
  SCOPED_TRACE(SeedTrace());
  constexpr int kThreads = 4;
  constexpr int kRounds = 20;
  const int64_t m = 65, n = 33, k = 129;
  struct Work {
    std::vector<float> a, b, bias, expected;
  };
  std::vector<Work> work(kThreads);
  for (Work& w : work) {
    w.a = Random(m * k);
    w.b = Random(k * n);
    w.bias = Random(n);
    w.expected.assign(m * n, 0.0f);
    ASSERT_TRUE(cpu_.Gemm(false, false, m, n, k, 1.0f, w.a.data(), w.b.data(),
                          0.0f, w.expected.data())
                    .ok());
    ASSERT_TRUE(cpu_.AddBias(m, n, w.bias.data(), w.expected.data()).ok());
    ASSERT_TRUE(cpu_.Relu(m * n, w.expected.data(), w.expected.data()).ok());
  }
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const Work& w = work[t];
      Backend* gpu = gpu_.get();
      for (int round = 0; round < kRounds && failures[t].empty(); ++round) {
        absl::StatusOr<DeviceArray<float>> a =
            DeviceArray<float>::Create(gpu, w.a.size());
        absl::StatusOr<DeviceArray<float>> b =
            DeviceArray<float>::Create(gpu, w.b.size());
        absl::StatusOr<DeviceArray<float>> bias =
            DeviceArray<float>::Create(gpu, w.bias.size());
        absl::StatusOr<DeviceArray<float>> c =
            DeviceArray<float>::Create(gpu, m * n);
        if (!a.ok() || !b.ok() || !bias.ok() || !c.ok()) {
          failures[t] = "allocation failed";
          return;
        }
        std::vector<float> got(m * n);
        absl::Status s = gpu->CopyToDevice(w.a.data(), a->data(), a->bytes());
        if (s.ok()) s = gpu->CopyToDevice(w.b.data(), b->data(), b->bytes());
        if (s.ok()) {
          s = gpu->CopyToDevice(w.bias.data(), bias->data(), bias->bytes());
        }
        if (s.ok()) {
          s = gpu->Gemm(false, false, m, n, k, 1.0f, a->data(), b->data(), 0.0f,
                        c->data());
        }
        if (s.ok()) s = gpu->AddBias(m, n, bias->data(), c->data());
        if (s.ok()) s = gpu->Relu(m * n, c->data(), c->data());
        if (s.ok()) s = gpu->CopyToHost(c->data(), got.data(), c->bytes());
        if (!s.ok()) {
          failures[t] = s.ToString();
          return;
        }
        // Loose on purpose (relative to max(|e|, 1)): this test is about
        // races, which produce garbage, not about rounding.
        const Worst worst = Compare(got, w.expected, nullptr, 1.0);
        if (!worst.problem.empty() || worst.error > 1e-4) {
          failures[t] =
              absl::StrCat("round ", round, ": index ", worst.index, " error ",
                           worst.error, " ", worst.problem);
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(failures[t], "") << "thread " << t;
  }
}

// When the device is full, blocks cached by the pool are given back to the
// driver and the allocation retried, so a request of a new size succeeds.
TEST_F(CudaBackendTest, AllocationRetriesAfterReleasingTheCache) {
  constexpr size_t kBlock = size_t{1} << 30;
  constexpr int kMaxBlocks = 1024;  // stops the loop on any device size
  std::vector<void*> blocks;
  absl::Status full;
  for (int i = 0; i < kMaxBlocks; ++i) {
    absl::StatusOr<void*> ptr = gpu_->Allocate(kBlock);
    if (!ptr.ok()) {
      full = ptr.status();
      break;
    }
    blocks.push_back(*ptr);
  }
  ASSERT_FALSE(full.ok()) << "allocated " << blocks.size() << " GiB";
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_THAT(full.message(), HasSubstr("cudaMalloc"));
  ASSERT_GE(blocks.size(), 2u) << "the device has too little memory for this";
  // Every block goes back to the pool's cache, not to the driver.
  for (void* ptr : blocks) gpu_->Free(ptr);
  // A size class none of the cached blocks fits: only a release makes room.
  absl::StatusOr<void*> bigger = gpu_->Allocate(kBlock + kBlock / 2);
  ASSERT_TRUE(bigger.ok()) << bigger.status();
  gpu_->Free(*bigger);
  // And the backend works as before.
  DeviceArray<float> x = Upload(Random(1000));
  ASSERT_TRUE(gpu_->Scale(1000, 2.0f, x.data()).ok());
  EXPECT_TRUE(gpu_->Synchronize().ok());
}

// A bad embedding index found on the device surfaces through the next
// synchronizing op, SoftmaxCrossEntropy included (the step's one wait),
// and names both the culprit and the reporter.
TEST_F(CudaBackendTest, IndexErrorSurfacesThroughSoftmaxCrossEntropy) {
  const int64_t table_rows = 10, dim = 4;
  DeviceArray<float> table = Upload(Random(table_rows * dim));
  DeviceArray<int64_t> indices = UploadExact(std::vector<int64_t>{3, 11});
  DeviceArray<float> logits = Poisoned(2 * dim);
  ASSERT_TRUE(gpu_->Gather(2, dim, table_rows, table.data(), indices.data(),
                           logits.data())
                  .ok());
  DeviceArray<int32_t> labels = UploadExact(std::vector<int32_t>{0, 1});
  double loss = 123;
  int64_t correct = 456;
  absl::Status s = gpu_->SoftmaxCrossEntropy(
      2, dim, logits.data(), labels.data(), 0.5f, nullptr, &loss, &correct);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("Gather: indices["));
  EXPECT_THAT(s.message(), HasSubstr("reported by SoftmaxCrossEntropy"));
  EXPECT_EQ(loss, 123);
  EXPECT_EQ(correct, 456);
  // Reported once: the next step is clean.
  EXPECT_TRUE(gpu_->SoftmaxCrossEntropy(2, dim, logits.data(), labels.data(),
                                        0.5f, nullptr, &loss, &correct)
                  .ok());
}

// On a GPU host, --device=auto must take the GPU, never the CPU.
TEST_F(CudaBackendTest, AutoTakesTheGpu) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("auto");
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_THAT((*backend)->Name(), ::testing::StartsWith("cuda:0 ("));
  EXPECT_TRUE(ClassifyCudaProbe(ProbeCuda()).ok());
}

// Destroying a backend while an allocation of it is still live is a bug in
// the caller (a DeviceArray outliving its backend would later call Free on
// a destroyed object): fatal in debug builds, logged in optimized ones.
TEST_F(CudaBackendTest, DestroyingABackendWithLiveAllocationsIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEBUG_DEATH(
      {
        absl::StatusOr<std::unique_ptr<Backend>> other =
            CreateBackend("cuda:0");
        ASSERT_TRUE(other.ok()) << other.status();
        ASSERT_TRUE((*other)->Allocate(4096).ok());
        other->reset();
      },
      "still in use");
}

// bf16 GEMM accumulating into C (beta = 1), as the CTR model's layers do.
TEST_F(CudaBf16Test, GemmAccumulatesWithBetaOne) {
  SCOPED_TRACE(SeedTrace());
  for (bool trans_a : {false, true}) {
    for (const GemmShape& s : GemmShapes()) {
      SCOPED_TRACE(
          absl::StrCat(trans_a ? "At" : "A", " ", s.m, "x", s.n, "x", s.k));
      const std::vector<float> a = Random(s.m * s.k);
      const std::vector<float> b = Random(s.k * s.n);
      const std::vector<float> c0 = Random(s.m * s.n);
      std::vector<float> a16 = a, b16 = b;
      for (float& x : a16) x = RoundToBf16(x);
      for (float& x : b16) x = RoundToBf16(x);
      DeviceArray<float> ga = Upload(a);
      DeviceArray<float> gb = Upload(b);
      DeviceArray<float> gc = Upload(c0);
      ASSERT_TRUE(gpu_->Gemm(trans_a, false, s.m, s.n, s.k, 1.0f, ga.data(),
                             gb.data(), 1.0f, gc.data())
                      .ok());
      const std::vector<float> got = Download(gc);
      ExpectGuardIntact(got, s.m * s.n);
      std::vector<float> expected = c0;
      ASSERT_TRUE(cpu_.Gemm(trans_a, false, s.m, s.n, s.k, 1.0f, a16.data(),
                            b16.data(), 1.0f, expected.data())
                      .ok());
      const std::vector<double> floors =
          GemmFloors(trans_a, false, s.m, s.n, s.k, 1.0f, a, b, 1.0f, c0);
      EXPECT_CLOSE(got, expected, &floors, 0, 1e-3);
    }
  }
}

}  // namespace
}  // namespace pstrain::kernels
