#include "kernels/cpu_backend.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

TEST(CpuBackendTest, Name) { EXPECT_EQ(CpuBackend().Name(), "cpu"); }

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
  CpuBackend backend;
  // [[1, 2], [3, 4]] * [[5, 6], [7, 8]] = [[19, 22], [43, 50]].
  const std::vector<float> a = {1, 2, 3, 4};
  const std::vector<float> b = {5, 6, 7, 8};
  std::vector<float> c(4, kNaN);
  ASSERT_TRUE(
      backend
          .Gemm(false, false, 2, 2, 2, 1.0f, a.data(), b.data(), 0.0f, c.data())
          .ok());
  EXPECT_EQ(c, (std::vector<float>{19, 22, 43, 50}));
  // a^T * b = [[1, 3], [2, 4]] * [[5, 6], [7, 8]] = [[26, 30], [38, 44]].
  ASSERT_TRUE(
      backend
          .Gemm(true, false, 2, 2, 2, 1.0f, a.data(), b.data(), 0.0f, c.data())
          .ok());
  EXPECT_EQ(c, (std::vector<float>{26, 30, 38, 44}));
}

struct GemmCase {
  bool trans_a;
  bool trans_b;
  int64_t m, n, k;
};

class GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmTest, MatchesNaiveLoopWithBetaZeroOverNaN) {
  const GemmCase& p = GetParam();
  CpuBackend backend;
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

TEST_P(GemmTest, MatchesNaiveLoopWithBetaAccumulation) {
  const GemmCase& p = GetParam();
  CpuBackend backend;
  const std::vector<float> a = RandomVector(p.m * p.k, 3);
  const std::vector<float> b = RandomVector(p.k * p.n, 4);
  const std::vector<float> c0 = RandomVector(p.m * p.n, 5);
  std::vector<float> c = c0;
  ASSERT_TRUE(backend
                  .Gemm(p.trans_a, p.trans_b, p.m, p.n, p.k, -0.75f, a.data(),
                        b.data(), 0.5f, c.data())
                  .ok());
  ExpectNear(
      c, NaiveGemm(p.trans_a, p.trans_b, p.m, p.n, p.k, -0.75f, a, b, 0.5f, c0),
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
  CpuBackend backend;
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

TEST(CpuBackendTest, GemmEmptyOutputIsANoOp) {
  CpuBackend backend;
  EXPECT_TRUE(
      backend.Gemm(false, false, 0, 5, 7, 1.0f, nullptr, nullptr, 0.0f, nullptr)
          .ok());
}

TEST(CpuBackendTest, GemmRejectsBadArguments) {
  CpuBackend backend;
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
                HasSubstr("--device must be auto, cpu or cuda:N, got '" +
                          device + "'"));
  }
}

}  // namespace
}  // namespace pstrain::kernels
