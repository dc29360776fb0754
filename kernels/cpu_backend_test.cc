#include "kernels/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/transport/tensor_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend.h"

namespace pstrain::kernels {
namespace {

using ::testing::HasSubstr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> RandomVector(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// The textbook triple loop, in double, straight from the op's definition.
std::vector<double> NaiveGemm(bool trans_a, bool trans_b, int64_t m, int64_t n,
                              int64_t k, float alpha,
                              const std::vector<float>& a,
                              const std::vector<float>& b, float beta,
                              const std::vector<float>& c) {
  std::vector<double> out(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double a_ip = trans_a ? a[p * m + i] : a[i * k + p];
        const double b_pj = trans_b ? b[j * k + p] : b[p * n + j];
        sum += a_ip * b_pj;
      }
      out[i * n + j] =
          alpha * sum + (beta == 0.0f ? 0.0 : beta * double(c[i * n + j]));
    }
  }
  return out;
}

void ExpectNear(const std::vector<float>& actual,
                const std::vector<double>& expected, double tolerance) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], tolerance) << "at index " << i;
  }
}

TEST(CpuBackendTest, Name) {
  EXPECT_EQ(CpuBackend().Name(), "cpu");
  EXPECT_EQ(CpuBackend(CpuGemm::kReference).Name(), "cpu_reference");
  EXPECT_EQ(CpuBackend(CpuGemm::kBf16Inputs).Name(), "cpu bf16 inputs");
  EXPECT_EQ(CpuBackend(CpuGemm::kBlas, /*staged=*/true).Name(), "cpu_staged");
  EXPECT_TRUE(CpuBackend().MemoryIsHost());
  EXPECT_FALSE(CpuBackend(CpuGemm::kBlas, /*staged=*/true).MemoryIsHost());
}

// The backend's casts are the wire codec's conversions (a worker may cast
// on its device instead of in the client): the same bits for every finite
// value and infinity, NaN kept NaN, and the widening exact.
TEST(CpuBackendTest, Bf16CastsAreTheWireCodecs) {
  CpuBackend cpu;
  std::vector<float> x;
  uint32_t state = 12345;
  for (int i = 0; i < 100000; ++i) {
    state = state * 1664525u + 1013904223u;  // every bit pattern's region
    float v;
    std::memcpy(&v, &state, sizeof(v));
    x.push_back(v);
  }
  for (float v : {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -0.0f,
                  std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::infinity(), 1e-40f}) {
    x.push_back(v);
  }
  std::vector<uint16_t> bits(x.size());
  ASSERT_TRUE(cpu.FloatToBf16(x.size(), x.data(), bits.data()).ok());
  std::vector<float> widened(x.size());
  ASSERT_TRUE(cpu.Bf16ToFloat(x.size(), bits.data(), widened.data()).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      ASSERT_TRUE(std::isnan(widened[i])) << i;
      continue;
    }
    ASSERT_EQ(bits[i], ::pstrain::FloatToBfloat16Bits(x[i])) << "element " << i;
    ASSERT_EQ(widened[i], ::pstrain::Bfloat16BitsToFloat(bits[i]))
        << "element " << i;
  }
  EXPECT_EQ(cpu.FloatToBf16(-1, x.data(), bits.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu.Bf16ToFloat(2, nullptr, widened.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

// IEEE binary16 as the wire codec makes it: ties to even, 65520 and up to
// infinity, subnormals down to 2^-24, and every half widened exactly (each
// of the 65,536 patterns but NaN comes back to itself).
TEST(CpuBackendTest, Fp16CastsRoundToNearestEvenAndWidenExactly) {
  CpuBackend cpu;
  const std::vector<std::pair<float, uint16_t>> cases = {
      {1.0f, 0x3c00},
      {1.0f + 0x1p-11f, 0x3c00},      // a tie: to the even one below
      {1.0f + 3 * 0x1p-11f, 0x3c02},  // a tie: to the even one above
      {-2.5f, 0xc100},
      {65504.0f, 0x7bff},
      {65519.0f, 0x7bff},
      {65520.0f, 0x7c00},  // rounds past the largest: infinity
      {std::numeric_limits<float>::infinity(), 0x7c00},
      {-std::numeric_limits<float>::infinity(), 0xfc00},
      {0x1p-24f, 0x0001},         // the smallest subnormal
      {0x1p-25f, 0x0000},         // a tie with zero: to zero
      {1.5f * 0x1p-25f, 0x0001},  // past the tie
      {-0.0f, 0x8000},
      {1e-40f, 0x0000},
  };
  std::vector<float> x;
  for (const auto& [value, bits] : cases) x.push_back(value);
  std::vector<uint16_t> bits(x.size());
  ASSERT_TRUE(cpu.FloatToFp16(x.size(), x.data(), bits.data()).ok());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(bits[i], cases[i].second) << "element " << i << ": " << x[i];
  }
  std::vector<uint16_t> every(1 << 16);
  for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<uint16_t>(i);
  std::vector<float> widened(every.size());
  ASSERT_TRUE(cpu.Fp16ToFloat(every.size(), every.data(), widened.data()).ok());
  std::vector<uint16_t> back(every.size());
  ASSERT_TRUE(cpu.FloatToFp16(every.size(), widened.data(), back.data()).ok());
  for (size_t i = 0; i < every.size(); ++i) {
    const bool nan = (i & 0x7c00) == 0x7c00 && (i & 0x3ff) != 0;
    if (nan) {
      ASSERT_TRUE(std::isnan(widened[i])) << i;
    } else {
      ASSERT_EQ(back[i], every[i]) << "pattern " << i << ": " << widened[i];
    }
  }
  EXPECT_EQ(widened[0x3c00], 1.0f);
  EXPECT_EQ(widened[0x0001], 0x1p-24f);
  EXPECT_EQ(cpu.FloatToFp16(-1, x.data(), bits.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu.Fp16ToFloat(2, nullptr, widened.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

// bfloat16 keeps 8 significant bits: the step between 1 and 2 is 2^-7.
TEST(RoundToBf16Test, RoundsToNearestWithTiesToEven) {
  EXPECT_EQ(RoundToBf16(1.0f), 1.0f);
  EXPECT_EQ(RoundToBf16(1.0f + 0x1p-9f), 1.0f);  // below half
  EXPECT_EQ(RoundToBf16(1.0f + 0x1p-8f), 1.0f);  // tie: even
  EXPECT_EQ(RoundToBf16(1.0f + 0x1p-8f + 0x1p-20f), 1.0f + 0x1p-7f);
  EXPECT_EQ(RoundToBf16(1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);  // tie: even
  EXPECT_EQ(RoundToBf16(-1.0f - 0x1p-8f - 0x1p-20f), -1.0f - 0x1p-7f);
  EXPECT_EQ(RoundToBf16(0.0f), 0.0f);
  EXPECT_EQ(RoundToBf16(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(RoundToBf16(std::numeric_limits<float>::max()),
            std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(RoundToBf16(kNaN)));
  uint32_t low_payload_nan_bits = 0x7f800001u;  // all of it in the low half
  float low_payload_nan;
  std::memcpy(&low_payload_nan, &low_payload_nan_bits, sizeof(float));
  EXPECT_TRUE(std::isnan(RoundToBf16(low_payload_nan)));
}

// The bf16-inputs GEMM is the exact product of the rounded inputs (small
// integers times rounded fractions, so float sums are exact too).
TEST(CpuBackendTest, Bf16InputsGemmMultipliesTheRoundedInputs) {
  const std::vector<float> a = {1.0f + 0x1p-9f, 2, 3 + 0x1p-5f, 4};
  const std::vector<float> b = {5, 6 + 0x1p-6f, 7, 8};
  std::vector<float> rounded_a, rounded_b;
  for (float x : a) rounded_a.push_back(RoundToBf16(x));
  for (float x : b) rounded_b.push_back(RoundToBf16(x));
  ASSERT_NE(rounded_a, a);
  ASSERT_NE(rounded_b, b);
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      SCOPED_TRACE(absl::StrCat("trans_a ", trans_a, " trans_b ", trans_b));
      std::vector<float> want(4, kNaN), got(4, kNaN);
      ASSERT_TRUE(CpuBackend(CpuGemm::kReference)
                      .Gemm(trans_a, trans_b, 2, 2, 2, 1.0f, rounded_a.data(),
                            rounded_b.data(), 0.0f, want.data())
                      .ok());
      ASSERT_TRUE(CpuBackend(CpuGemm::kBf16Inputs)
                      .Gemm(trans_a, trans_b, 2, 2, 2, 1.0f, a.data(), b.data(),
                            0.0f, got.data())
                      .ok());
      EXPECT_EQ(got, want);
    }
  }
}

// The GEMM tests run on both CPU GEMMs: OpenBLAS (what training uses) must
// keep every contract of the reference.
constexpr CpuGemm kBothGemms[] = {CpuGemm::kReference, CpuGemm::kBlas};

std::string GemmName(CpuGemm gemm) {
  return gemm == CpuGemm::kBlas ? "blas" : "reference";
}

TEST(CpuBackendTest, AllocateIsAlignedAndZeroBytesIsFreeable) {
  CpuBackend backend;
  for (size_t bytes :
       {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{1000}}) {
    absl::StatusOr<void*> ptr = backend.Allocate(bytes);
    ASSERT_TRUE(ptr.ok()) << ptr.status();
    ASSERT_NE(*ptr, nullptr) << bytes;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*ptr) % 64, 0u) << bytes;
    backend.Free(*ptr);
  }
  backend.Free(nullptr);
}

TEST(CpuBackendTest, HostArraysAreAlignedAndCopyBothWays) {
  CpuBackend backend;
  absl::StatusOr<HostArray<float>> host = HostArray<float>::Create(&backend, 5);
  absl::StatusOr<DeviceArray<float>> device =
      DeviceArray<float>::Create(&backend, 5);
  ASSERT_TRUE(host.ok() && device.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(host->data()) % 64, 0u);
  EXPECT_EQ(host->bytes(), 5 * sizeof(float));
  for (int i = 0; i < 5; ++i) host->data()[i] = 0.5f * i;
  ASSERT_TRUE(
      backend.CopyToDevice(host->data(), device->data(), host->bytes()).ok());
  std::fill(host->data(), host->data() + 5, -1.0f);
  ASSERT_TRUE(
      backend.CopyToHost(device->data(), host->data(), host->bytes()).ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(host->data()[i], 0.5f * i);
  absl::StatusOr<HostArray<float>> empty =
      HostArray<float>::Create(&backend, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_NE(empty->data(), nullptr);
  // Moved from: the new owner frees it, once.
  HostArray<float> moved = *std::move(host);
  EXPECT_EQ(moved.size(), 5u);
}

TEST(CpuBackendTest, AllocateTooLargeFails) {
  CpuBackend backend;
  absl::StatusOr<void*> ptr =
      backend.Allocate(std::numeric_limits<size_t>::max());
  EXPECT_FALSE(ptr.ok());
}

TEST(CpuBackendTest, CopyRoundTrip) {
  CpuBackend backend;
  absl::StatusOr<DeviceArray<float>> array =
      DeviceArray<float>::Create(&backend, 4);
  ASSERT_TRUE(array.ok()) << array.status();
  const std::vector<float> in = {1, -2, 3.5f, kNaN};
  ASSERT_TRUE(
      backend.CopyToDevice(in.data(), array->data(), array->bytes()).ok());
  std::vector<float> out(4);
  ASSERT_TRUE(
      backend.CopyToHost(array->data(), out.data(), array->bytes()).ok());
  ASSERT_TRUE(backend.Synchronize().ok());
  EXPECT_EQ(out[0], 1);
  EXPECT_EQ(out[1], -2);
  EXPECT_EQ(out[2], 3.5f);
  EXPECT_TRUE(std::isnan(out[3]));

  EXPECT_TRUE(backend.CopyToHost(nullptr, nullptr, 0).ok());
  EXPECT_EQ(backend.CopyToDevice(nullptr, array->data(), 4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend.CopyToHost(array->data(), nullptr, 4).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackendTest, GemmHandComputed) {
  for (CpuGemm gemm : kBothGemms) {
    SCOPED_TRACE(GemmName(gemm));
    CpuBackend backend(gemm);
    // [[1, 2], [3, 4]] * [[5, 6], [7, 8]] = [[19, 22], [43, 50]].
    const std::vector<float> a = {1, 2, 3, 4};
    const std::vector<float> b = {5, 6, 7, 8};
    std::vector<float> c(4, kNaN);
    ASSERT_TRUE(backend
                    .Gemm(false, false, 2, 2, 2, 1.0f, a.data(), b.data(), 0.0f,
                          c.data())
                    .ok());
    EXPECT_EQ(c, (std::vector<float>{19, 22, 43, 50}));
    // a^T * b = [[1, 3], [2, 4]] * [[5, 6], [7, 8]] = [[26, 30], [38, 44]].
    ASSERT_TRUE(backend
                    .Gemm(true, false, 2, 2, 2, 1.0f, a.data(), b.data(), 0.0f,
                          c.data())
                    .ok());
    EXPECT_EQ(c, (std::vector<float>{26, 30, 38, 44}));
  }
}

struct GemmCase {
  bool trans_a;
  bool trans_b;
  int64_t m, n, k;
};

class GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmTest, MatchesNaiveLoopWithBetaZeroOverNaN) {
  const GemmCase& p = GetParam();
  for (CpuGemm gemm : kBothGemms) {
    SCOPED_TRACE(GemmName(gemm));
    CpuBackend backend(gemm);
    const std::vector<float> a = RandomVector(p.m * p.k, 1);
    const std::vector<float> b = RandomVector(p.k * p.n, 2);
    // beta == 0: c is write-only, so NaN in it must not leak into the result.
    std::vector<float> c(p.m * p.n, kNaN);
    ASSERT_TRUE(backend
                    .Gemm(p.trans_a, p.trans_b, p.m, p.n, p.k, 1.5f, a.data(),
                          b.data(), 0.0f, c.data())
                    .ok());
    const double tolerance = 1e-5 * p.k;
    ExpectNear(
        c, NaiveGemm(p.trans_a, p.trans_b, p.m, p.n, p.k, 1.5f, a, b, 0.0f, c),
        tolerance);
  }
}

TEST_P(GemmTest, MatchesNaiveLoopWithBetaAccumulation) {
  const GemmCase& p = GetParam();
  for (CpuGemm gemm : kBothGemms) {
    SCOPED_TRACE(GemmName(gemm));
    CpuBackend backend(gemm);
    const std::vector<float> a = RandomVector(p.m * p.k, 3);
    const std::vector<float> b = RandomVector(p.k * p.n, 4);
    const std::vector<float> c0 = RandomVector(p.m * p.n, 5);
    std::vector<float> c = c0;
    ASSERT_TRUE(backend
                    .Gemm(p.trans_a, p.trans_b, p.m, p.n, p.k, -0.75f, a.data(),
                          b.data(), 0.5f, c.data())
                    .ok());
    ExpectNear(
        c,
        NaiveGemm(p.trans_a, p.trans_b, p.m, p.n, p.k, -0.75f, a, b, 0.5f, c0),
        1e-5 * p.k);
    // beta == 1 adds onto c unchanged.
    c = c0;
    ASSERT_TRUE(backend
                    .Gemm(p.trans_a, p.trans_b, p.m, p.n, p.k, 1.0f, a.data(),
                          b.data(), 1.0f, c.data())
                    .ok());
    ExpectNear(
        c, NaiveGemm(p.trans_a, p.trans_b, p.m, p.n, p.k, 1.0f, a, b, 1.0f, c0),
        1e-5 * p.k);
  }
}

std::vector<GemmCase> GemmCases() {
  std::vector<GemmCase> cases;
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      cases.push_back({trans_a, trans_b, 3, 5, 7});
      cases.push_back({trans_a, trans_b, 1, 1, 1});
      // Crosses the k and n cache blocks and the 8-wide unrolled tail.
      cases.push_back({trans_a, trans_b, 13, 531, 263});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllTransposes, GemmTest,
                         ::testing::ValuesIn(GemmCases()),
                         [](const ::testing::TestParamInfo<GemmCase>& info) {
                           const GemmCase& p = info.param;
                           return std::string(p.trans_a ? "At" : "A") +
                                  (p.trans_b ? "Bt" : "B") + "_" +
                                  std::to_string(p.m) + "x" +
                                  std::to_string(p.n) + "x" +
                                  std::to_string(p.k);
                         });

TEST(CpuBackendTest, GemmWithKZeroScalesC) {
  for (CpuGemm gemm : kBothGemms) {
    SCOPED_TRACE(GemmName(gemm));
    CpuBackend backend(gemm);
    std::vector<float> c = {1, 2, 3, 4, 5, 6};
    ASSERT_TRUE(
        backend
            .Gemm(false, false, 2, 3, 0, 1.0f, nullptr, nullptr, 2.0f, c.data())
            .ok());
    EXPECT_EQ(c, (std::vector<float>{2, 4, 6, 8, 10, 12}));
    std::vector<float> nan_c(6, kNaN);
    ASSERT_TRUE(backend
                    .Gemm(false, false, 2, 3, 0, 1.0f, nullptr, nullptr, 0.0f,
                          nan_c.data())
                    .ok());
    EXPECT_EQ(nan_c, std::vector<float>(6, 0.0f));
  }
}

TEST(CpuBackendTest, GemmEmptyOutputIsANoOp) {
  for (CpuGemm gemm : kBothGemms) {
    SCOPED_TRACE(GemmName(gemm));
    CpuBackend backend(gemm);
    EXPECT_TRUE(
        backend
            .Gemm(false, false, 0, 5, 7, 1.0f, nullptr, nullptr, 0.0f, nullptr)
            .ok());
  }
}

TEST(CpuBackendTest, GemmRejectsBadArguments) {
  for (CpuGemm gemm : kBothGemms) {
    SCOPED_TRACE(GemmName(gemm));
    CpuBackend backend(gemm);
    std::vector<float> buf(64);
    absl::Status s = backend.Gemm(false, false, -1, 2, 2, 1.0f, buf.data(),
                                  buf.data(), 0.0f, buf.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("Gemm"));
    EXPECT_THAT(s.message(), HasSubstr("m"));
    s = backend.Gemm(false, false, 2, 2, 2, 1.0f, nullptr, buf.data(), 0.0f,
                     buf.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("Gemm: a is null"));
    s = backend.Gemm(false, false, 2, 2, 2, 1.0f, buf.data(), buf.data(), 0.0f,
                     nullptr);
    EXPECT_THAT(s.message(), HasSubstr("Gemm: c is null"));
  }
}

TEST(CpuBackendTest, AddBiasAndBiasGrad) {
  CpuBackend backend;
  std::vector<float> y = {1, 2, 3, 4, 5, 6};  // [2, 3]
  const std::vector<float> bias = {10, 20, 30};
  ASSERT_TRUE(backend.AddBias(2, 3, bias.data(), y.data()).ok());
  EXPECT_EQ(y, (std::vector<float>{11, 22, 33, 14, 25, 36}));

  // BiasGrad overwrites, so stale contents (NaN) must not matter.
  std::vector<float> grad(3, kNaN);
  ASSERT_TRUE(backend.BiasGrad(2, 3, y.data(), grad.data()).ok());
  EXPECT_EQ(grad, (std::vector<float>{25, 47, 69}));
  ASSERT_TRUE(backend.BiasGrad(0, 3, nullptr, grad.data()).ok());
  EXPECT_EQ(grad, std::vector<float>(3, 0.0f));

  // Wider than the unrolled kernel, with a ragged tail.
  const int64_t rows = 5, cols = 19;
  const std::vector<float> dy = RandomVector(rows * cols, 7);
  std::vector<float> wide(cols);
  ASSERT_TRUE(backend.BiasGrad(rows, cols, dy.data(), wide.data()).ok());
  for (int64_t c = 0; c < cols; ++c) {
    double sum = 0;
    for (int64_t r = 0; r < rows; ++r) sum += dy[r * cols + c];
    EXPECT_NEAR(wide[c], sum, 1e-5) << c;
  }

  EXPECT_THAT(backend.AddBias(2, -3, bias.data(), y.data()).message(),
              HasSubstr("AddBias"));
  EXPECT_THAT(backend.BiasGrad(2, 3, nullptr, grad.data()).message(),
              HasSubstr("BiasGrad: dy is null"));
}

TEST(CpuBackendTest, ReluAndReluGrad) {
  CpuBackend backend;
  const std::vector<float> x = {-2, -0.5f, 0, 0.5f, 3};
  std::vector<float> y(5);
  ASSERT_TRUE(backend.Relu(5, x.data(), y.data()).ok());
  EXPECT_EQ(y, (std::vector<float>{0, 0, 0, 0.5f, 3}));

  // In place.
  std::vector<float> z = x;
  ASSERT_TRUE(backend.Relu(5, z.data(), z.data()).ok());
  EXPECT_EQ(z, y);

  // Gradient flows only where the output is positive (not at y == 0).
  std::vector<float> dy = {1, 2, 3, 4, 5};
  std::vector<float> dx(5, kNaN);
  ASSERT_TRUE(backend.ReluGrad(5, y.data(), dy.data(), dx.data()).ok());
  EXPECT_EQ(dx, (std::vector<float>{0, 0, 0, 4, 5}));
  ASSERT_TRUE(backend.ReluGrad(5, y.data(), dy.data(), dy.data()).ok());
  EXPECT_EQ(dy, dx);

  EXPECT_THAT(backend.Relu(-1, x.data(), y.data()).message(),
              HasSubstr("Relu"));
  EXPECT_THAT(backend.ReluGrad(5, y.data(), nullptr, dx.data()).message(),
              HasSubstr("ReluGrad: dy is null"));
}

TEST(CpuBackendTest, ReluPropagatesNaN) {
  CpuBackend backend;
  const float x = kNaN;
  float y = 0;
  ASSERT_TRUE(backend.Relu(1, &x, &y).ok());
  EXPECT_TRUE(std::isnan(y));
}

// loss and gradient straight from the definition, in double.
void ReferenceSoftmaxCe(int64_t rows, int64_t cols,
                        const std::vector<float>& logits,
                        const std::vector<int32_t>& labels, double grad_scale,
                        double* loss_sum, std::vector<double>* dlogits) {
  *loss_sum = 0;
  dlogits->assign(rows * cols, 0);
  for (int64_t r = 0; r < rows; ++r) {
    double z = 0;
    for (int64_t c = 0; c < cols; ++c)
      z += std::exp(double(logits[r * cols + c]));
    *loss_sum += -std::log(std::exp(double(logits[r * cols + labels[r]])) / z);
    for (int64_t c = 0; c < cols; ++c) {
      const double p = std::exp(double(logits[r * cols + c])) / z;
      (*dlogits)[r * cols + c] = (p - (c == labels[r])) * grad_scale;
    }
  }
}

TEST(CpuBackendTest, SoftmaxCrossEntropyMatchesDefinition) {
  CpuBackend backend;
  const int64_t rows = 4, cols = 5;
  std::vector<float> logits = RandomVector(rows * cols, 11);
  for (float& x : logits) x *= 3;
  const std::vector<int32_t> labels = {0, 4, 2, 2};
  const float grad_scale = 0.25f;

  double expected_loss;
  std::vector<double> expected_grad;
  ReferenceSoftmaxCe(rows, cols, logits, labels, grad_scale, &expected_loss,
                     &expected_grad);

  std::vector<float> dlogits(rows * cols, kNaN);
  double loss = -1;
  int64_t correct = -1;
  ASSERT_TRUE(backend
                  .SoftmaxCrossEntropy(rows, cols, logits.data(), labels.data(),
                                       grad_scale, dlogits.data(), &loss,
                                       &correct)
                  .ok());
  EXPECT_NEAR(loss, expected_loss, 1e-6);
  ExpectNear(dlogits, expected_grad, 1e-7);

  // Gradient rows of softmax CE sum to zero.
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += dlogits[r * cols + c];
    EXPECT_NEAR(sum, 0, 1e-7);
  }

  int64_t expected_correct = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t best = 0;
    for (int64_t c = 1; c < cols; ++c) {
      if (logits[r * cols + c] > logits[r * cols + best]) best = c;
    }
    expected_correct += best == labels[r];
  }
  EXPECT_EQ(correct, expected_correct);

  // In place: dlogits aliasing logits gives the same answer.
  std::vector<float> in_place = logits;
  double loss2 = -1;
  int64_t correct2 = -1;
  ASSERT_TRUE(backend
                  .SoftmaxCrossEntropy(rows, cols, in_place.data(),
                                       labels.data(), grad_scale,
                                       in_place.data(), &loss2, &correct2)
                  .ok());
  EXPECT_EQ(loss2, loss);
  EXPECT_EQ(correct2, correct);
  EXPECT_EQ(in_place, dlogits);

  // Forward only.
  double loss3 = -1;
  int64_t correct3 = -1;
  ASSERT_TRUE(backend
                  .SoftmaxCrossEntropy(rows, cols, logits.data(), labels.data(),
                                       grad_scale, nullptr, &loss3, &correct3)
                  .ok());
  EXPECT_EQ(loss3, loss);
  EXPECT_EQ(correct3, correct);
}

TEST(CpuBackendTest, SoftmaxCrossEntropyHandComputed) {
  CpuBackend backend;
  // Uniform logits over 4 classes: loss = log 4, p = 1/4 everywhere.
  const std::vector<float> logits = {7, 7, 7, 7};
  const std::vector<int32_t> labels = {2};
  std::vector<float> d(4);
  double loss;
  int64_t correct;
  ASSERT_TRUE(backend
                  .SoftmaxCrossEntropy(1, 4, logits.data(), labels.data(), 1.0f,
                                       d.data(), &loss, &correct)
                  .ok());
  EXPECT_NEAR(loss, std::log(4.0), 1e-12);
  EXPECT_EQ(d, (std::vector<float>{0.25f, 0.25f, -0.75f, 0.25f}));
  // A tie is won by the first maximal logit (class 0), not the label.
  EXPECT_EQ(correct, 0);
}

TEST(CpuBackendTest, SoftmaxCrossEntropyIsStableForHugeLogits) {
  CpuBackend backend;
  // exp(1e4) overflows even in double; the shifted form must not.
  const std::vector<float> logits = {10000, 10001, 9999, -10000, -10001, -9999};
  const std::vector<float> shifted = {1, 2, 0, 0, -1, 1};
  const std::vector<int32_t> labels = {0, 2};
  std::vector<float> d(6);
  double loss;
  int64_t correct;
  ASSERT_TRUE(backend
                  .SoftmaxCrossEntropy(2, 3, logits.data(), labels.data(), 1.0f,
                                       d.data(), &loss, &correct)
                  .ok());
  double expected_loss;
  std::vector<double> expected_grad;
  ReferenceSoftmaxCe(2, 3, shifted, labels, 1.0, &expected_loss,
                     &expected_grad);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, expected_loss, 1e-9);
  ExpectNear(d, expected_grad, 1e-7);
  EXPECT_EQ(correct, 1);  // row 0 predicts class 1; row 1 predicts class 2
}

TEST(CpuBackendTest, SoftmaxCrossEntropyCountsCorrectRows) {
  CpuBackend backend;
  const std::vector<float> logits = {
      3, 1, 2,  // argmax 0
      1, 3, 2,  // argmax 1
      1, 2, 3,  // argmax 2
      5, 5, 1,  // tie: argmax 0
  };
  const std::vector<int32_t> labels = {0, 2, 2, 1};
  double loss;
  int64_t correct = -1;
  ASSERT_TRUE(backend
                  .SoftmaxCrossEntropy(4, 3, logits.data(), labels.data(), 1.0f,
                                       nullptr, &loss, &correct)
                  .ok());
  EXPECT_EQ(correct, 2);
}

TEST(CpuBackendTest, SoftmaxCrossEntropyRejectsBadLabels) {
  CpuBackend backend;
  std::vector<float> logits = RandomVector(6, 3);
  const std::vector<float> before = logits;
  double loss = 123;
  int64_t correct = 456;
  for (int32_t bad : {3, -1}) {
    const std::vector<int32_t> labels = {0, bad};
    absl::Status s =
        backend.SoftmaxCrossEntropy(2, 3, logits.data(), labels.data(), 1.0f,
                                    logits.data(), &loss, &correct);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("SoftmaxCrossEntropy"));
    EXPECT_THAT(s.message(), HasSubstr("row 1"));
    EXPECT_THAT(s.message(), HasSubstr("label " + std::to_string(bad)));
  }
  // Nothing was written.
  EXPECT_EQ(logits, before);
  EXPECT_EQ(loss, 123);
  EXPECT_EQ(correct, 456);

  const std::vector<int32_t> labels = {0, 1};
  EXPECT_THAT(backend
                  .SoftmaxCrossEntropy(2, 3, logits.data(), labels.data(), 1.0f,
                                       nullptr, nullptr, &correct)
                  .message(),
              HasSubstr("loss_sum is null"));
}

TEST(CpuBackendTest, AxpyScaleFill) {
  CpuBackend backend;
  std::vector<float> x(11), y(11);
  ASSERT_TRUE(backend.Fill(11, 2.0f, x.data()).ok());
  EXPECT_EQ(x, std::vector<float>(11, 2.0f));
  for (int i = 0; i < 11; ++i) y[i] = static_cast<float>(i);
  ASSERT_TRUE(backend.Axpy(11, -0.5f, x.data(), y.data()).ok());
  for (int i = 0; i < 11; ++i) EXPECT_EQ(y[i], i - 1.0f) << i;
  ASSERT_TRUE(backend.Scale(11, 3.0f, y.data()).ok());
  for (int i = 0; i < 11; ++i) EXPECT_EQ(y[i], 3.0f * (i - 1.0f)) << i;
  // y = 2y when x aliases y.
  ASSERT_TRUE(backend.Axpy(11, 1.0f, y.data(), y.data()).ok());
  for (int i = 0; i < 11; ++i) EXPECT_EQ(y[i], 6.0f * (i - 1.0f)) << i;

  EXPECT_TRUE(backend.Fill(0, 1.0f, nullptr).ok());
  EXPECT_THAT(backend.Fill(-2, 1.0f, x.data()).message(), HasSubstr("Fill"));
  EXPECT_THAT(backend.Scale(3, 1.0f, nullptr).message(),
              HasSubstr("Scale: x is null"));
  EXPECT_THAT(backend.Axpy(3, 1.0f, nullptr, y.data()).message(),
              HasSubstr("Axpy: x is null"));
}

TEST(CpuBackendTest, GatherCopiesRows) {
  CpuBackend backend;
  const int64_t table_rows = 5, dim = 3;
  const std::vector<float> table = RandomVector(table_rows * dim, 21);
  // Repeats and out-of-order indices.
  const std::vector<int64_t> indices = {4, 0, 4, 2};
  std::vector<float> out(indices.size() * dim, kNaN);
  ASSERT_TRUE(backend
                  .Gather(indices.size(), dim, table_rows, table.data(),
                          indices.data(), out.data())
                  .ok());
  for (size_t i = 0; i < indices.size(); ++i) {
    for (int64_t d = 0; d < dim; ++d) {
      EXPECT_EQ(out[i * dim + d], table[indices[i] * dim + d]) << i << "," << d;
    }
  }
  EXPECT_TRUE(
      backend.Gather(0, dim, table_rows, nullptr, nullptr, nullptr).ok());
}

TEST(CpuBackendTest, ScatterAddAccumulatesRepeatedRows) {
  CpuBackend backend;
  const int64_t table_rows = 4, dim = 2;
  std::vector<float> table = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<int64_t> indices = {3, 1, 3};
  const std::vector<float> grads = {10, 20, 30, 40, 50, 60};
  ASSERT_TRUE(backend
                  .ScatterAdd(indices.size(), dim, table_rows, grads.data(),
                              indices.data(), table.data())
                  .ok());
  EXPECT_EQ(table, (std::vector<float>{1, 2, 33, 44, 5, 6, 67, 88}));
}

TEST(CpuBackendTest, GatherAndScatterAddRejectBadIndices) {
  CpuBackend backend;
  const int64_t table_rows = 3, dim = 2;
  std::vector<float> table(table_rows * dim, 1.0f);
  const std::vector<float> before = table;
  std::vector<float> out(4, kNaN);
  for (int64_t bad : {int64_t{3}, int64_t{-1}}) {
    const std::vector<int64_t> indices = {0, bad};
    absl::Status s = backend.Gather(2, dim, table_rows, table.data(),
                                    indices.data(), out.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(),
                HasSubstr("Gather: indices[1] = " + std::to_string(bad) +
                          " is outside the table's rows [0, 3)"));
    s = backend.ScatterAdd(2, dim, table_rows, out.data(), indices.data(),
                           table.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("ScatterAdd: indices[1]"));
  }
  // Nothing was written.
  EXPECT_EQ(table, before);
  for (float x : out) EXPECT_TRUE(std::isnan(x));

  const std::vector<int64_t> indices = {0};
  EXPECT_THAT(
      backend.Gather(1, 2, 3, nullptr, indices.data(), out.data()).message(),
      HasSubstr("Gather: table is null"));
  EXPECT_THAT(
      backend.ScatterAdd(1, -2, 3, out.data(), indices.data(), table.data())
          .message(),
      HasSubstr("ScatterAdd: dim must be non-negative"));
}

TEST(CreateBackendTest, Cpu) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu");
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->Name(), "cpu");
  BackendOptions options;
  options.device = "cpu";
  backend = CreateBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->Name(), "cpu");
}

TEST(CreateBackendTest, CpuReferenceAndThreads) {
  BackendOptions options;
  options.device = "cpu_reference";
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->Name(), "cpu_reference");
  options.device = "cpu";
  options.cpu_threads = 1;
  EXPECT_TRUE(CreateBackend(options).ok());
  options.cpu_threads = -1;
  backend = CreateBackend(options);
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(backend.status().message(), HasSubstr("--cpu_threads"));
  EXPECT_GE(AvailableCores(), 1);
  EXPECT_EQ(SetCpuGemmThreads(0), AvailableCores());
}

// "auto" is the GPU where one is visible, else the CPU; both are fine here.
TEST(CreateBackendTest, AutoPicksWhatIsVisible) {
  const bool gpu = CudaDeviceCount() > 0;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("auto");
    ASSERT_TRUE(backend.ok()) << backend.status();
    if (gpu) {
      EXPECT_THAT((*backend)->Name(), ::testing::StartsWith("cuda:0 ("));
    } else {
      EXPECT_EQ((*backend)->Name(), "cpu");
    }
  }
}

TEST(CreateBackendTest, CudaBeyondTheVisibleDevicesIsUnavailable) {
  const int count = CudaDeviceCount();
  for (int ordinal : {count, count + 3, count + 12}) {
    const std::string device = "cuda:" + std::to_string(ordinal);
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(device);
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kUnavailable)
        << device;
    EXPECT_THAT(backend.status().message(), HasSubstr("--device=" + device))
        << backend.status();
    if (!CudaBackendCompiled()) {
      EXPECT_THAT(backend.status().message(),
                  HasSubstr("this build has no CUDA backend"));
    } else if (count == 0) {
      EXPECT_THAT(backend.status().message(),
                  HasSubstr("no CUDA device visible"));
    } else {
      EXPECT_THAT(backend.status().message(),
                  HasSubstr("CUDA device(s) visible"));
    }
  }
}

TEST(CreateBackendTest, Precision) {
  BackendOptions options;
  options.device = "cpu";
  options.precision = "fp32";
  EXPECT_TRUE(CreateBackend(options).ok());

  options.precision = "bf16";
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(options);
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(backend.status().message(),
              HasSubstr("--precision=bf16 needs a CUDA device"));

  if (CudaDeviceCount() == 0) {
    options.device = "auto";
    backend = CreateBackend(options);
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(backend.status().message(),
                HasSubstr("--precision=bf16 needs a CUDA device"));
  }

  for (const std::string precision : {"fp16", "", "BF16", "tf32"}) {
    options.device = "cpu";
    options.precision = precision;
    backend = CreateBackend(options);
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(
        backend.status().message(),
        HasSubstr("--precision must be fp32 or bf16, got '" + precision + "'"));
  }
}

TEST(CreateBackendTest, RejectsUnknownDevices) {
  for (const std::string device :
       {"gpu", "", "CPU", "cuda", "cuda:", "cuda:x", "cuda:-1", "cuda:+1",
        "cuda: 1", "cuda:1x", "cuda:99999999999"}) {
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(device);
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument)
        << device;
    EXPECT_THAT(backend.status().message(),
                HasSubstr("--device must be auto, cpu or cuda:N"));
    EXPECT_THAT(backend.status().message(), HasSubstr("got '" + device + "'"));
  }
}

// ---------------------------------------------------------------------------
// Sliding windows, each against a naive loop written from the definition.

Window2D MakeWindow(int64_t batch, int64_t height, int64_t width,
                    int64_t channels, int64_t kernel, int64_t stride,
                    int64_t pad) {
  Window2D w;
  w.batch = batch;
  w.height = height;
  w.width = width;
  w.channels = channels;
  w.kernel = kernel;
  w.stride = stride;
  w.pad = pad;
  return w;
}

std::string WindowName(const Window2D& w) {
  return absl::StrCat(w.batch, "x", w.height, "x", w.width, "x", w.channels,
                      "_k", w.kernel, "_s", w.stride, "_p", w.pad);
}

// x at (n, h, w, c) of an NHWC batch, or 0 outside the image.
float PixelOrZero(const Window2D& w, const std::vector<float>& x, int64_t n,
                  int64_t h, int64_t col, int64_t c) {
  if (h < 0 || h >= w.height || col < 0 || col >= w.width) return 0.0f;
  return x[((n * w.height + h) * w.width + col) * w.channels + c];
}

// Direct convolution: y[n, oh, ow, o] = sum over (kh, kw, c) of
// x[n, oh*s-p+kh, ow*s-p+kw, c] * filter[kh, kw, c, o].
std::vector<double> NaiveConv(const Window2D& w, const std::vector<float>& x,
                              const std::vector<float>& filter,
                              int64_t out_channels) {
  std::vector<double> y;
  for (int64_t n = 0; n < w.batch; ++n) {
    for (int64_t oh = 0; oh < w.out_height(); ++oh) {
      for (int64_t ow = 0; ow < w.out_width(); ++ow) {
        for (int64_t o = 0; o < out_channels; ++o) {
          double sum = 0;
          for (int64_t kh = 0; kh < w.kernel; ++kh) {
            for (int64_t kw = 0; kw < w.kernel; ++kw) {
              for (int64_t c = 0; c < w.channels; ++c) {
                sum += double{PixelOrZero(w, x, n, oh * w.stride - w.pad + kh,
                                          ow * w.stride - w.pad + kw, c)} *
                       filter[((kh * w.kernel + kw) * w.channels + c) *
                                  out_channels +
                              o];
              }
            }
          }
          y.push_back(sum);
        }
      }
    }
  }
  return y;
}

double Dot(const std::vector<float>& a, const std::vector<float>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += double{a[i]} * b[i];
  return sum;
}

class WindowTest : public ::testing::TestWithParam<Window2D> {};

// Im2Col followed by a GEMM is the convolution (the layout the layers rely
// on), and Col2Im is Im2Col's adjoint: <Im2Col(x), c> = <x, Col2Im(c)>.
TEST_P(WindowTest, Im2ColGemmIsConvolutionAndCol2ImIsItsAdjoint) {
  const Window2D w = GetParam();
  CpuBackend backend(CpuGemm::kReference);
  const int64_t out_channels = 5;
  const std::vector<float> x = RandomVector(w.input_elements(), 11);
  const std::vector<float> filter =
      RandomVector(w.col_cols() * out_channels, 12);
  // Poisoned: Im2Col must write every entry, padding included.
  std::vector<float> col(w.col_rows() * w.col_cols(), kNaN);
  ASSERT_TRUE(backend.Im2Col(w, x.data(), col.data()).ok());
  std::vector<float> y(w.col_rows() * out_channels, kNaN);
  ASSERT_TRUE(backend
                  .Gemm(false, false, w.col_rows(), out_channels, w.col_cols(),
                        1.0f, col.data(), filter.data(), 0.0f, y.data())
                  .ok());
  ExpectNear(y, NaiveConv(w, x, filter, out_channels), 1e-5 * w.col_cols());

  const std::vector<float> c = RandomVector(col.size(), 13);
  std::vector<float> back(x.size(), kNaN);
  ASSERT_TRUE(backend.Col2Im(w, c.data(), back.data()).ok());
  EXPECT_NEAR(Dot(col, c), Dot(x, back), 1e-4 * col.size());
  // And entry by entry: each pixel is the sum of the entries read from it.
  std::vector<double> expected(x.size(), 0.0);
  int64_t entry = 0;
  for (int64_t n = 0; n < w.batch; ++n) {
    for (int64_t oh = 0; oh < w.out_height(); ++oh) {
      for (int64_t ow = 0; ow < w.out_width(); ++ow) {
        for (int64_t kh = 0; kh < w.kernel; ++kh) {
          for (int64_t kw = 0; kw < w.kernel; ++kw) {
            for (int64_t ch = 0; ch < w.channels; ++ch, ++entry) {
              const int64_t h = oh * w.stride - w.pad + kh;
              const int64_t col_w = ow * w.stride - w.pad + kw;
              if (h < 0 || h >= w.height || col_w < 0 || col_w >= w.width) {
                continue;
              }
              expected[((n * w.height + h) * w.width + col_w) * w.channels +
                       ch] += c[entry];
            }
          }
        }
      }
    }
  }
  ExpectNear(back, expected, 1e-5 * w.kernel * w.kernel);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, WindowTest,
    ::testing::Values(MakeWindow(2, 7, 5, 3, 3, 2, 1),  // padding, stride 2
                      MakeWindow(1, 6, 6, 1, 2, 2, 0),  // pooling-like
                      MakeWindow(3, 5, 9, 4, 3, 1, 0),  // non-square
                      MakeWindow(2, 8, 7, 5, 3, 3, 2),  // stride > kernel - pad
                      MakeWindow(1, 4, 4, 2, 4, 1, 0),  // one output pixel
                      MakeWindow(2, 28, 28, 1, 3, 1, 1)  // Fashion-MNIST, same
                      ),
    [](const ::testing::TestParamInfo<Window2D>& info) {
      return WindowName(info.param);
    });

class MaxPoolTest : public ::testing::TestWithParam<Window2D> {};

TEST_P(MaxPoolTest, MatchesNaiveLoopForwardAndBackward) {
  const Window2D w = GetParam();
  CpuBackend backend;
  std::vector<float> x = RandomVector(w.input_elements(), 21);
  // Ties: the first maximal element in window order must win.
  for (size_t i = 0; i + 1 < x.size(); i += 7) x[i + 1] = x[i];
  std::vector<float> y(w.output_elements(), kNaN);
  std::vector<int64_t> argmax(y.size(), -7);
  ASSERT_TRUE(backend.MaxPool2D(w, x.data(), y.data(), argmax.data()).ok());
  const std::vector<float> dy = RandomVector(y.size(), 22);
  std::vector<double> expected_dx(x.size(), 0.0);
  int64_t out = 0;
  for (int64_t n = 0; n < w.batch; ++n) {
    for (int64_t oh = 0; oh < w.out_height(); ++oh) {
      for (int64_t ow = 0; ow < w.out_width(); ++ow) {
        for (int64_t c = 0; c < w.channels; ++c, ++out) {
          int64_t best = -1;
          for (int64_t kh = 0; kh < w.kernel; ++kh) {
            for (int64_t kw = 0; kw < w.kernel; ++kw) {
              const int64_t i = ((n * w.height + oh * w.stride + kh) * w.width +
                                 ow * w.stride + kw) *
                                    w.channels +
                                c;
              if (best < 0 || x[i] > x[best]) best = i;
            }
          }
          ASSERT_EQ(argmax[out], best) << "output " << out;
          ASSERT_EQ(y[out], x[best]) << "output " << out;
          expected_dx[best] += dy[out];
        }
      }
    }
  }
  std::vector<float> dx(x.size(), kNaN);
  ASSERT_TRUE(
      backend.MaxPool2DGrad(w, dy.data(), argmax.data(), dx.data()).ok());
  ExpectNear(dx, expected_dx, 1e-6 * w.kernel * w.kernel);
  // Forward only: argmax may be null.
  std::vector<float> y2(y.size(), kNaN);
  ASSERT_TRUE(backend.MaxPool2D(w, x.data(), y2.data(), nullptr).ok());
  EXPECT_EQ(y2, y);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MaxPoolTest,
    ::testing::Values(MakeWindow(1, 6, 6, 1, 2, 2, 0),
                      MakeWindow(2, 7, 5, 3, 2, 2, 0),   // odd sizes: tails
                      MakeWindow(3, 5, 9, 4, 3, 1, 0),   // overlapping windows
                      MakeWindow(2, 9, 8, 17, 3, 2, 0),  // overlap, stride 2
                      MakeWindow(1, 4, 4, 2, 4, 1, 0),   // one output pixel
                      MakeWindow(2, 26, 26, 16, 2, 2, 0)),
    [](const ::testing::TestParamInfo<Window2D>& info) {
      return WindowName(info.param);
    });

TEST(CpuBackendTest, MaxPoolPropagatesNaN) {
  CpuBackend backend;
  const Window2D w = MakeWindow(1, 2, 2, 1, 2, 2, 0);
  const std::vector<float> x = {1.0f, kNaN, 3.0f, kNaN};
  float y = 0;
  int64_t argmax = -1;
  ASSERT_TRUE(backend.MaxPool2D(w, x.data(), &y, &argmax).ok());
  EXPECT_TRUE(std::isnan(y));
  EXPECT_EQ(argmax, 1);  // the first NaN
}

TEST(CpuBackendTest, WindowOpsRejectBadGeometry) {
  CpuBackend backend;
  std::vector<float> buf(4096);
  std::vector<int64_t> argmax(4096);
  const auto im2col = [&](const Window2D& w) {
    return backend.Im2Col(w, buf.data(), buf.data() + 2048);
  };
  EXPECT_THAT(im2col(MakeWindow(-1, 4, 4, 1, 3, 1, 0)).message(),
              HasSubstr("Im2Col: batch must be non-negative"));
  EXPECT_THAT(im2col(MakeWindow(1, 4, 4, 1, 3, 0, 0)).message(),
              HasSubstr("kernel and stride must be at least 1"));
  EXPECT_THAT(im2col(MakeWindow(1, 4, 4, 1, 3, 1, 3)).message(),
              HasSubstr("pad 3 must be smaller than the kernel 3"));
  EXPECT_THAT(im2col(MakeWindow(1, 2, 4, 1, 5, 1, 1)).message(),
              HasSubstr("a 5x5 window does not fit a 2x4 image padded by 1"));
  EXPECT_THAT(
      backend.Im2Col(MakeWindow(1, 4, 4, 1, 3, 1, 0), nullptr, buf.data())
          .message(),
      HasSubstr("Im2Col: x is null"));
  EXPECT_THAT(backend
                  .MaxPool2D(MakeWindow(1, 4, 4, 1, 2, 2, 1), buf.data(),
                             buf.data() + 100, argmax.data())
                  .message(),
              HasSubstr("MaxPool2D: pad must be 0, got 1"));
  // An empty batch is a no-op, even with null pointers.
  EXPECT_TRUE(
      backend.Col2Im(MakeWindow(0, 4, 4, 1, 3, 1, 0), nullptr, nullptr).ok());
  // A corrupt argmax is refused before dx is touched.
  const Window2D w = MakeWindow(1, 2, 2, 1, 2, 2, 0);
  float dy = 1.0f;
  int64_t bad = 4;
  std::vector<float> dx(4, 5.0f);
  const absl::Status s = backend.MaxPool2DGrad(w, &dy, &bad, dx.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("argmax[0] = 4 is outside the input"));
  EXPECT_EQ(dx, std::vector<float>(4, 5.0f));
}

}  // namespace
}  // namespace pstrain::kernels
