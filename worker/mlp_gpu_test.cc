// The whole MLP training step on the GPU against the same step on the CPU:
// the same parameters and batches through CreateMlp on both backends, for a
// few SGD steps, comparing the loss, the accuracy count and every gradient.
// The op-by-op parity tests (kernels/cuda_backend_test) cannot catch a model
// that wires correct ops together wrongly on one backend only (a missed
// synchronization, a workspace reused too early, a transposed GEMM flag).
//
// The GPU tests skip where there is no GPU (and fail instead under
// PSTRAIN_REQUIRE_GPU=1); MlpBf16Test runs on the CPU alone.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/gpu_test_support.h"
#include "proto/ps.pb.h"
#include "worker/model.h"

namespace pstrain {
namespace {

using kernels::Backend;
using kernels::DeviceArray;

constexpr int64_t kInputs = 784;
constexpr int64_t kClasses = 10;
constexpr int64_t kBatch = 96;
constexpr int kSteps = 5;
constexpr float kLearningRate = 0.1f;

int64_t NumElements(const DenseTensorSpec& spec) {
  int64_t n = 1;
  for (int64_t d : spec.shape()) n *= d;
  return n;
}

// One backend's model and its parameter, gradient and batch buffers.
struct Side {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
  std::vector<DeviceArray<float>> params, grads;
  DeviceArray<float> features;
  DeviceArray<int32_t> labels;

  void Create(absl::StatusOr<std::unique_ptr<Backend>> created,
              const std::vector<int64_t>& hidden) {
    ASSERT_TRUE(created.ok()) << created.status();
    backend = *std::move(created);
    absl::StatusOr<std::unique_ptr<Model>> mlp =
        CreateMlp(backend.get(), kInputs, hidden, kClasses, kBatch);
    ASSERT_TRUE(mlp.ok()) << mlp.status();
    model = *std::move(mlp);
    for (const DenseTensorSpec& spec : model->Params()) {
      for (auto* list : {&params, &grads}) {
        absl::StatusOr<DeviceArray<float>> array =
            DeviceArray<float>::Create(backend.get(), NumElements(spec));
        ASSERT_TRUE(array.ok()) << array.status();
        list->push_back(*std::move(array));
      }
    }
    absl::StatusOr<DeviceArray<float>> f =
        DeviceArray<float>::Create(backend.get(), kBatch * kInputs);
    absl::StatusOr<DeviceArray<int32_t>> l =
        DeviceArray<int32_t>::Create(backend.get(), kBatch);
    ASSERT_TRUE(f.ok() && l.ok());
    features = *std::move(f);
    labels = *std::move(l);
  }

  // Uploads the parameters and batch, runs ComputeGradients, downloads the
  // gradients into *host_grads.
  BatchResult Step(const std::vector<std::vector<float>>& host_params,
                   const std::vector<float>& host_features,
                   const std::vector<int32_t>& host_labels,
                   std::vector<std::vector<float>>* host_grads) {
    std::vector<const float*> param_ptrs;
    std::vector<float*> grad_ptrs;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(backend
                      ->CopyToDevice(host_params[i].data(), params[i].data(),
                                     params[i].bytes())
                      .ok());
      param_ptrs.push_back(params[i].data());
      grad_ptrs.push_back(grads[i].data());
    }
    EXPECT_TRUE(backend
                    ->CopyToDevice(host_features.data(), features.data(),
                                   features.bytes())
                    .ok());
    EXPECT_TRUE(
        backend->CopyToDevice(host_labels.data(), labels.data(), labels.bytes())
            .ok());
    DeviceBatch batch;
    batch.rows = kBatch;
    batch.features = features.data();
    batch.labels = labels.data();
    absl::StatusOr<BatchResult> result =
        model->ComputeGradients(param_ptrs, batch, grad_ptrs);
    EXPECT_TRUE(result.ok()) << result.status();
    host_grads->resize(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      (*host_grads)[i].assign(grads[i].size(), 0.0f);
      EXPECT_TRUE(backend
                      ->CopyToHost(grads[i].data(), (*host_grads)[i].data(),
                                   grads[i].bytes())
                      .ok());
    }
    return result.ok() ? *result : BatchResult();
  }
};

// max |gpu - cpu| over a tensor, relative to its largest CPU magnitude.
double RelativeError(const std::vector<float>& gpu,
                     const std::vector<float>& cpu) {
  double largest = 0, worst = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    largest = std::max(largest, std::fabs(double{cpu[i]}));
    const double diff = std::fabs(double{gpu[i]} - cpu[i]);
    worst = std::isnan(diff) ? INFINITY : std::max(worst, diff);
  }
  return largest == 0 ? worst : worst / largest;
}

absl::StatusOr<std::unique_ptr<Backend>> Gpu(const std::string& precision) {
  kernels::BackendOptions options;
  options.device = "cuda:0";
  options.precision = precision;
  return kernels::CreateBackend(options);
}

absl::StatusOr<std::unique_ptr<Backend>> Cpu(kernels::CpuGemm gemm) {
  return std::unique_ptr<Backend>(std::make_unique<kernels::CpuBackend>(gemm));
}

// Largest relative errors of a step: allowed, or seen.
struct StepErrors {
  double loss = 0;      // relative to the loss sum
  double gradient = 0;  // RelativeError of any gradient tensor
};

// Trains kSteps SGD steps with the reference's gradients (so both sides see
// the same parameters every step) and compares the tested backend's step
// with the reference's. Returns (and prints) the largest errors seen: the
// figure the tolerance was chosen from.
StepErrors TrainAndCompare(absl::StatusOr<std::unique_ptr<Backend>> reference,
                           absl::StatusOr<std::unique_ptr<Backend>> tested,
                           const std::vector<int64_t>& hidden,
                           StepErrors tolerance) {
  Side want_side, got_side;
  StepErrors worst;
  want_side.Create(std::move(reference), hidden);
  got_side.Create(std::move(tested), hidden);
  if (testing::Test::HasFatalFailure()) return worst;
  const std::string names = absl::StrCat(got_side.backend->Name(), " against ",
                                         want_side.backend->Name());

  std::mt19937 rng(7);
  std::uniform_real_distribution<float> weight(-0.08f, 0.08f);
  std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
  std::uniform_int_distribution<int32_t> label(0, kClasses - 1);
  std::vector<std::vector<float>> params;
  for (const DenseTensorSpec& spec : want_side.model->Params()) {
    params.emplace_back(NumElements(spec));
    for (float& w : params.back()) w = weight(rng);
  }
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE(absl::StrCat(names, ", step ", step));
    std::vector<float> features(kBatch * kInputs);
    for (float& x : features) x = pixel(rng);
    std::vector<int32_t> labels(kBatch);
    for (int32_t& y : labels) y = label(rng);

    std::vector<std::vector<float>> want_grads, got_grads;
    const BatchResult want =
        want_side.Step(params, features, labels, &want_grads);
    const BatchResult got = got_side.Step(params, features, labels, &got_grads);
    EXPECT_EQ(got.rows, want.rows);
    const double loss_error = std::fabs(got.loss_sum - want.loss_sum) /
                              std::max(1.0, std::fabs(want.loss_sum));
    worst.loss = std::max(worst.loss, loss_error);
    EXPECT_LE(loss_error, tolerance.loss);
    // A logit tie broken differently by rounding may move one example.
    EXPECT_NEAR(got.num_correct, want.num_correct, 1);
    for (size_t i = 0; i < params.size(); ++i) {
      const double error = RelativeError(got_grads[i], want_grads[i]);
      worst.gradient = std::max(worst.gradient, error);
      EXPECT_LE(error, tolerance.gradient)
          << want_side.model->Params()[i].name();
      for (size_t j = 0; j < params[i].size(); ++j) {
        params[i][j] -= kLearningRate * want_grads[i][j];
      }
    }
  }
  std::cout << names << ": largest relative error of the loss " << worst.loss
            << ", of a gradient " << worst.gradient << std::endl;
  return worst;
}

TEST(MlpGpuTest, TrainingStepsMatchTheCpu) {
  PSTRAIN_REQUIRE_GPU_OR_SKIP();
  TrainAndCompare(Cpu(kernels::CpuGemm::kBlas), Gpu("fp32"), {256, 128},
                  StepErrors{1e-5, 1e-4});
}

TEST(MlpGpuTest, SoftmaxRegressionStepsMatchTheCpu) {
  PSTRAIN_REQUIRE_GPU_OR_SKIP();
  TrainAndCompare(Cpu(kernels::CpuGemm::kBlas), Gpu("fp32"), {},
                  StepErrors{1e-5, 1e-4});
}

// The GPU's bf16 step against the CPU's with the same rounding of the GEMM
// inputs: what is left is summation order, and an activation that a tiny
// difference rounds to the neighbouring bf16 value.
TEST(MlpGpuTest, Bf16TrainingStepsMatchTheCpuWithBf16Inputs) {
  PSTRAIN_REQUIRE_GPU_OR_SKIP();
  TrainAndCompare(Cpu(kernels::CpuGemm::kBf16Inputs), Gpu("bf16"), {256, 128},
                  StepErrors{1e-3, 1e-2});
}

// How far bf16 GEMM inputs move a step from fp32 on this model: up to ~17%
// of a gradient's largest element (fc0, fc1; the loss ~3e-5). That is why
// the GPU's bf16 step is checked against the emulation above: against fp32,
// with a 5% bound, it failed at 6-16% on an H200 with nothing wrong.
TEST(MlpBf16Test, Bf16InputsMoveTheStepFromFp32) {
  const StepErrors seen = TrainAndCompare(Cpu(kernels::CpuGemm::kBlas),
                                          Cpu(kernels::CpuGemm::kBf16Inputs),
                                          {256, 128}, StepErrors{1e-4, 0.3});
  // Rounding happened: float summation order alone moves a gradient ~1e-6.
  EXPECT_GT(seen.gradient, 1e-2);
}

}  // namespace
}  // namespace pstrain
