// Test helpers shared by the model tests: parameters mirrored between the
// host and a backend, random batches, and the finite-difference gradient
// check every model and layer must pass.
#ifndef PSTRAIN_WORKER_MODEL_TESTING_H_
#define PSTRAIN_WORKER_MODEL_TESTING_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "proto/ps.pb.h"
#include "worker/model.h"

namespace pstrain::model_testing {

using kernels::Backend;
using kernels::DeviceArray;

inline std::unique_ptr<Backend> CpuBackend() {
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      kernels::CreateBackend("cpu");
  EXPECT_TRUE(backend.ok()) << backend.status();
  return *std::move(backend);
}

inline int64_t NumElements(const DenseTensorSpec& spec) {
  int64_t n = 1;
  for (int64_t d : spec.shape()) n *= d;
  return n;
}

template <typename T>
DeviceArray<T> Upload(Backend* backend, const std::vector<T>& host) {
  absl::StatusOr<DeviceArray<T>> array =
      DeviceArray<T>::Create(backend, host.size());
  EXPECT_TRUE(array.ok()) << array.status();
  EXPECT_TRUE(
      backend->CopyToDevice(host.data(), array->data(), array->bytes()).ok());
  return *std::move(array);
}

template <typename T>
std::vector<T> Download(Backend* backend, const DeviceArray<T>& array) {
  std::vector<T> host(array.size());
  EXPECT_TRUE(
      backend->CopyToHost(array.data(), host.data(), array.bytes()).ok());
  return host;
}

// A model's parameters and gradients, held on the host and mirrored in
// backend memory.
class Tensors {
 public:
  Tensors(Backend* backend, const Model& model) : backend_(backend) {
    for (const DenseTensorSpec& spec : model.Params()) {
      host_.emplace_back(NumElements(spec), 0.0f);
      params_.push_back(Upload(backend, host_.back()));
      grads_.push_back(Upload(backend, host_.back()));
    }
  }

  std::vector<float>& host(size_t i) { return host_[i]; }
  size_t size() const { return host_.size(); }

  // Copies host(i) to the backend.
  void Sync(size_t i) {
    ASSERT_TRUE(backend_
                    ->CopyToDevice(host_[i].data(), params_[i].data(),
                                   params_[i].bytes())
                    .ok());
  }
  void SyncAll() {
    for (size_t i = 0; i < size(); ++i) Sync(i);
  }
  // Fills every tensor as the servers' InitSpec would (uniform in
  // [-scale, scale], or zeros), drawing from `rng`, and syncs it.
  void InitializeLikeServers(const Model& model, std::mt19937& rng) {
    for (size_t i = 0; i < size(); ++i) {
      const InitSpec& init = model.Params()[i].init();
      std::uniform_real_distribution<float> uniform(-init.scale(),
                                                    init.scale());
      for (float& x : host_[i]) {
        x = init.kind() == InitSpec::UNIFORM ? uniform(rng) : 0.0f;
      }
    }
    SyncAll();
  }

  std::vector<const float*> params() const {
    std::vector<const float*> out;
    for (const auto& p : params_) out.push_back(p.data());
    return out;
  }
  std::vector<float*> grads() const {
    std::vector<float*> out;
    for (const auto& g : grads_) out.push_back(g.data());
    return out;
  }
  std::vector<float> grad(size_t i) const {
    return Download(backend_, grads_[i]);
  }
  const DeviceArray<float>& device_param(size_t i) const { return params_[i]; }
  const DeviceArray<float>& device_grad(size_t i) const { return grads_[i]; }

 private:
  Backend* backend_;
  std::vector<std::vector<float>> host_;
  std::vector<DeviceArray<float>> params_;
  std::vector<DeviceArray<float>> grads_;
};

struct HostBatch {
  std::vector<float> features;
  std::vector<int32_t> labels;
};

inline HostBatch RandomBatch(int64_t rows, int64_t input_dim, int64_t classes,
                             std::mt19937* rng) {
  std::uniform_real_distribution<float> feature(-1.0f, 1.0f);
  std::uniform_int_distribution<int32_t> label(0, classes - 1);
  HostBatch batch;
  for (int64_t i = 0; i < rows * input_dim; ++i) {
    batch.features.push_back(feature(*rng));
  }
  for (int64_t i = 0; i < rows; ++i) batch.labels.push_back(label(*rng));
  return batch;
}

// Compares every gradient element of `model` on `host_batch` with a central
// difference of the mean loss (computed by Evaluate, accumulated in double),
// from random weights and biases (uniform in +-weight_scale, biases in
// +-0.3 weight_scale). At most max_kinks elements may be skipped as kinks (a
// ReLU or max-pool decision flipping within the step).
inline void ExpectGradientsMatchFiniteDifferences(Backend* backend,
                                                  Model& model,
                                                  const HostBatch& host_batch,
                                                  int64_t max_kinks = 3,
                                                  float weight_scale = 1.0f) {
  // Random weights *and* biases, so that some ReLUs are off for some rows and
  // a missing mask would show.
  std::mt19937 rng(6);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  Tensors tensors(backend, model);
  for (size_t i = 0; i < tensors.size(); ++i) {
    // Smaller biases (odd i) leave most units alive for some rows.
    const float scale = weight_scale * (i % 2 == 0 ? 1.0f : 0.3f);
    for (float& x : tensors.host(i)) x = scale * uniform(rng);
  }
  tensors.SyncAll();

  const int64_t rows = static_cast<int64_t>(host_batch.labels.size());
  DeviceArray<float> features = Upload(backend, host_batch.features);
  DeviceArray<int32_t> labels = Upload(backend, host_batch.labels);
  const DeviceBatch batch{rows, features.data(), labels.data()};

  absl::StatusOr<BatchResult> result =
      model.ComputeGradients(tensors.params(), batch, tensors.grads());
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->rows, rows);

  auto mean_loss = [&]() {
    absl::StatusOr<BatchResult> r = model.Evaluate(tensors.params(), batch);
    EXPECT_TRUE(r.ok()) << r.status();
    return r->loss_sum / rows;
  };

  // eps balances truncation error (O(eps^2)) against float rounding in the
  // forward pass (O(1e-7 / eps)); both stay far below the tolerance, which
  // is still far below any real mistake (a sign, a missing mask or scale).
  constexpr float kEps = 1e-3f;
  constexpr double kAbsTol = 1e-4;
  constexpr double kRelTol = 5e-3;
  // A step that moves some ReLU input across zero makes the difference
  // quotient meaningless; it shows as one-sided slopes that disagree by far
  // more than curvature explains. Such elements are skipped, but only a few.
  constexpr double kKinkGap = 1e-3;
  const double loss = mean_loss();
  int64_t checked = 0;
  int64_t kinks = 0;
  double largest = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string& name = model.Params()[i].name();
    const std::vector<float> analytic = tensors.grad(i);
    std::vector<float>& param = tensors.host(i);
    for (size_t j = 0; j < param.size(); ++j) {
      const float original = param[j];
      const float plus = original + kEps;
      const float minus = original - kEps;
      param[j] = plus;
      tensors.Sync(i);
      const double loss_plus = mean_loss();
      param[j] = minus;
      tensors.Sync(i);
      const double loss_minus = mean_loss();
      param[j] = original;
      tensors.Sync(i);
      // Steps are measured after float rounding, in double.
      const double step_plus = double{plus} - double{original};
      const double step_minus = double{original} - double{minus};
      const double slope_plus = (loss_plus - loss) / step_plus;
      const double slope_minus = (loss - loss_minus) / step_minus;
      if (std::abs(slope_plus - slope_minus) > kKinkGap) {
        ++kinks;
        continue;
      }
      const double numeric =
          (loss_plus - loss_minus) / (step_plus + step_minus);
      EXPECT_NEAR(analytic[j], numeric, kAbsTol + kRelTol * std::abs(numeric))
          << name << "[" << j << "]";
      largest = std::max(largest, std::abs(numeric));
      ++checked;
    }
  }
  EXPECT_LE(kinks, max_kinks);
  // Guard against a vacuous pass (e.g. every gradient zero).
  EXPECT_GT(largest, 0.05);
  EXPECT_GT(checked, 0);
}

}  // namespace pstrain::model_testing

#endif  // PSTRAIN_WORKER_MODEL_TESTING_H_
