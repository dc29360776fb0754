// The MLP of model.h, written only in Backend ops so that the same code runs
// on every backend; it never dereferences a parameter, gradient or batch
// pointer on the host.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "proto/ps.pb.h"
#include "worker/model.h"

namespace pstrain {
namespace {

using kernels::Backend;
using kernels::DeviceArray;

// Not thread-safe: the workspace is shared by every call on one instance.
class Mlp : public Model {
 public:
  // dims = {input, hidden..., classes}; layer l maps dims[l] -> dims[l + 1].
  static absl::StatusOr<std::unique_ptr<Mlp>> Create(Backend* backend,
                                                     std::vector<int64_t> dims,
                                                     int64_t max_batch);

  const std::vector<DenseTensorSpec>& Params() const override {
    return params_;
  }

  absl::StatusOr<BatchResult> ComputeGradients(
      const std::vector<const float*>& params, const DeviceBatch& batch,
      const std::vector<float*>& grads) override;

  absl::StatusOr<BatchResult> Evaluate(const std::vector<const float*>& params,
                                       const DeviceBatch& batch) override;

  absl::StatusOr<std::vector<float>> Logits(
      const std::vector<const float*>& params,
      const DeviceBatch& batch) override;

 private:
  Mlp(Backend* backend, std::vector<int64_t> dims, int64_t max_batch);

  int num_layers() const { return static_cast<int>(dims_.size()) - 1; }
  static const float* Weight(const std::vector<const float*>& params, int l) {
    return params[2 * l];
  }
  static const float* Bias(const std::vector<const float*>& params, int l) {
    return params[2 * l + 1];
  }

  absl::Status CheckArgs(const std::vector<const float*>& params,
                         const DeviceBatch& batch,
                         const std::vector<float*>* grads) const;

  // Runs every layer, leaving ReLU outputs in hidden_ and logits in logits_.
  absl::Status Forward(const std::vector<const float*>& params,
                       const DeviceBatch& batch);

  // The input of layer l: the batch features, or the previous ReLU output.
  const float* LayerInput(const DeviceBatch& batch, int l) const {
    return l == 0 ? batch.features : hidden_[l - 1].data();
  }

  Backend* backend_;
  std::vector<int64_t> dims_;
  int64_t max_batch_;
  std::vector<DenseTensorSpec> params_;

  // Workspace, sized for max_batch_ rows.
  std::vector<DeviceArray<float>> hidden_;  // post-ReLU output per hidden layer
  DeviceArray<float> logits_;  // logits, then overwritten by their gradient
  // Backprop ping-pongs between two buffers, because the Gemm producing a
  // layer's input gradient reads the output gradient and must not alias it.
  DeviceArray<float> delta_[2];
};

Mlp::Mlp(Backend* backend, std::vector<int64_t> dims, int64_t max_batch)
    : backend_(backend), dims_(std::move(dims)), max_batch_(max_batch) {
  for (int l = 0; l < num_layers(); ++l) {
    const int64_t in = dims_[l];
    const int64_t out = dims_[l + 1];
    DenseTensorSpec weight;
    weight.set_name(absl::StrCat("fc", l, "/weight"));
    weight.add_shape(in);
    weight.add_shape(out);
    // Glorot-uniform keeps activation variance roughly constant across layers.
    weight.mutable_init()->set_kind(InitSpec::UNIFORM);
    weight.mutable_init()->set_scale(
        static_cast<float>(std::sqrt(6.0 / static_cast<double>(in + out))));
    params_.push_back(std::move(weight));

    DenseTensorSpec bias;
    bias.set_name(absl::StrCat("fc", l, "/bias"));
    bias.add_shape(out);
    bias.mutable_init()->set_kind(InitSpec::ZEROS);
    params_.push_back(std::move(bias));
  }
}

absl::StatusOr<std::unique_ptr<Mlp>> Mlp::Create(Backend* backend,
                                                 std::vector<int64_t> dims,
                                                 int64_t max_batch) {
  std::unique_ptr<Mlp> mlp(new Mlp(backend, std::move(dims), max_batch));
  int64_t widest_hidden = 0;
  for (int l = 0; l + 1 < mlp->num_layers(); ++l) {
    const int64_t width = mlp->dims_[l + 1];
    widest_hidden = std::max(widest_hidden, width);
    absl::StatusOr<DeviceArray<float>> h =
        DeviceArray<float>::Create(backend, max_batch * width);
    if (!h.ok()) return h.status();
    mlp->hidden_.push_back(*std::move(h));
  }
  absl::StatusOr<DeviceArray<float>> logits =
      DeviceArray<float>::Create(backend, max_batch * mlp->dims_.back());
  if (!logits.ok()) return logits.status();
  mlp->logits_ = *std::move(logits);
  for (DeviceArray<float>& delta : mlp->delta_) {
    absl::StatusOr<DeviceArray<float>> d =
        DeviceArray<float>::Create(backend, max_batch * widest_hidden);
    if (!d.ok()) return d.status();
    delta = *std::move(d);
  }
  return mlp;
}

absl::Status Mlp::CheckArgs(const std::vector<const float*>& params,
                            const DeviceBatch& batch,
                            const std::vector<float*>* grads) const {
  if (batch.rows < 1 || batch.rows > max_batch_) {
    return absl::InvalidArgumentError(
        absl::StrCat("MLP: batch has ", batch.rows, " rows; must be in [1, ",
                     max_batch_, "]"));
  }
  if (batch.features == nullptr) {
    return absl::InvalidArgumentError("MLP: batch features are null");
  }
  if (params.size() != params_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("MLP: got ", params.size(),
                                                   " parameter tensors, want ",
                                                   params_.size()));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("MLP: parameter ", params_[i].name(), " is null"));
    }
  }
  if (grads == nullptr) return absl::OkStatus();
  if (grads->size() != params_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("MLP: got ", grads->size(),
                                                   " gradient tensors, want ",
                                                   params_.size()));
  }
  for (size_t i = 0; i < grads->size(); ++i) {
    if ((*grads)[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("MLP: gradient of ", params_[i].name(), " is null"));
    }
  }
  return absl::OkStatus();
}

absl::Status Mlp::Forward(const std::vector<const float*>& params,
                          const DeviceBatch& batch) {
  const int64_t rows = batch.rows;
  for (int l = 0; l < num_layers(); ++l) {
    const bool last = l + 1 == num_layers();
    float* out = last ? logits_.data() : hidden_[l].data();
    const int64_t in_dim = dims_[l];
    const int64_t out_dim = dims_[l + 1];
    // out[rows, out_dim] = input[rows, in_dim] * W[in_dim, out_dim] + b.
    absl::Status s =
        backend_->Gemm(false, false, rows, out_dim, in_dim, 1.0f,
                       LayerInput(batch, l), Weight(params, l), 0.0f, out);
    if (s.ok()) s = backend_->AddBias(rows, out_dim, Bias(params, l), out);
    if (s.ok() && !last) s = backend_->Relu(rows * out_dim, out, out);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<BatchResult> Mlp::ComputeGradients(
    const std::vector<const float*>& params, const DeviceBatch& batch,
    const std::vector<float*>& grads) {
  if (absl::Status s = CheckArgs(params, batch, &grads); !s.ok()) return s;
  if (batch.labels == nullptr) {
    return absl::InvalidArgumentError("MLP: batch labels are null");
  }
  if (absl::Status s = Forward(params, batch); !s.ok()) return s;

  const int64_t rows = batch.rows;
  BatchResult result;
  result.rows = rows;
  // Scaling by 1/rows here makes every gradient below that of the mean loss.
  // The logits gradient overwrites the logits, which are no longer needed.
  if (absl::Status s = backend_->SoftmaxCrossEntropy(
          rows, dims_.back(), logits_.data(), batch.labels,
          1.0f / static_cast<float>(rows), logits_.data(), &result.loss_sum,
          &result.num_correct);
      !s.ok()) {
    return s;
  }

  // delta holds d(loss)/d(pre-activation output) of layer l.
  float* delta = logits_.data();
  for (int l = num_layers() - 1; l >= 0; --l) {
    const int64_t in_dim = dims_[l];
    const int64_t out_dim = dims_[l + 1];
    const float* input = LayerInput(batch, l);
    // dW[in_dim, out_dim] = input^T[in_dim, rows] * delta[rows, out_dim].
    absl::Status s = backend_->Gemm(true, false, in_dim, out_dim, rows, 1.0f,
                                    input, delta, 0.0f, grads[2 * l]);
    if (s.ok()) s = backend_->BiasGrad(rows, out_dim, delta, grads[2 * l + 1]);
    if (s.ok() && l > 0) {
      // d(input)[rows, in_dim] = delta * W^T, then through the ReLU that
      // produced the input (its output is the input itself).
      float* next = delta_[l % 2].data();
      s = backend_->Gemm(false, true, rows, in_dim, out_dim, 1.0f, delta,
                         Weight(params, l), 0.0f, next);
      if (s.ok()) s = backend_->ReluGrad(rows * in_dim, input, next, next);
      delta = next;
    }
    if (!s.ok()) return s;
  }
  return result;
}

absl::StatusOr<BatchResult> Mlp::Evaluate(
    const std::vector<const float*>& params, const DeviceBatch& batch) {
  if (absl::Status s = CheckArgs(params, batch, nullptr); !s.ok()) return s;
  if (batch.labels == nullptr) {
    return absl::InvalidArgumentError("MLP: batch labels are null");
  }
  if (absl::Status s = Forward(params, batch); !s.ok()) return s;
  BatchResult result;
  result.rows = batch.rows;
  if (absl::Status s = backend_->SoftmaxCrossEntropy(
          batch.rows, dims_.back(), logits_.data(), batch.labels, 1.0f, nullptr,
          &result.loss_sum, &result.num_correct);
      !s.ok()) {
    return s;
  }
  return result;
}

absl::StatusOr<std::vector<float>> Mlp::Logits(
    const std::vector<const float*>& params, const DeviceBatch& batch) {
  if (absl::Status s = CheckArgs(params, batch, nullptr); !s.ok()) return s;
  if (absl::Status s = Forward(params, batch); !s.ok()) return s;
  std::vector<float> logits(batch.rows * dims_.back());
  if (absl::Status s = backend_->CopyToHost(logits_.data(), logits.data(),
                                            logits.size() * sizeof(float));
      !s.ok()) {
    return s;
  }
  return logits;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> CreateMlp(
    kernels::Backend* backend, int64_t input_dim,
    const std::vector<int64_t>& hidden_sizes, int64_t num_classes,
    int64_t max_batch) {
  if (backend == nullptr) {
    return absl::InvalidArgumentError("CreateMlp: backend is null");
  }
  if (input_dim < 1 || num_classes < 1 || max_batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CreateMlp: input_dim, num_classes and max_batch must be positive, "
        "got ",
        input_dim, ", ", num_classes, " and ", max_batch));
  }
  std::vector<int64_t> dims = {input_dim};
  for (int64_t width : hidden_sizes) {
    if (width < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CreateMlp: hidden layer sizes must be positive, got ", width));
    }
    dims.push_back(width);
  }
  dims.push_back(num_classes);
  absl::StatusOr<std::unique_ptr<Mlp>> mlp =
      Mlp::Create(backend, std::move(dims), max_batch);
  if (!mlp.ok()) return mlp.status();
  return std::unique_ptr<Model>(*std::move(mlp));
}

}  // namespace pstrain
