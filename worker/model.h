// Models trained by the worker. A model declares its parameters (the schema
// the servers hold) and computes the mean loss of a batch and its gradient
// with respect to every parameter, using only the compute backend.
#ifndef PSTRAIN_WORKER_MODEL_H_
#define PSTRAIN_WORKER_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "proto/ps.pb.h"

namespace pstrain {

// A batch resident in the backend's memory.
struct DeviceBatch {
  int64_t rows = 0;
  const float* features = nullptr;  // [rows, input_dim], row-major
  const int32_t* labels = nullptr;  // [rows], each in [0, num_classes)
};

struct BatchResult {
  double loss_sum = 0;  // sum of per-example losses (mean = loss_sum / rows)
  int64_t num_correct = 0;
  int64_t rows = 0;
};

// Told by ComputeGradients that the gradient of parameter `param_index`
// (into Params()) is final: every op writing it has been issued on the
// backend. On a GPU that is stream order, not completion: read it through
// the same backend (CopyToHost waits for it). Called on the calling thread,
// once per parameter, in backward order (the last layer's first), so the
// caller can send a layer's gradient while backward goes on.
using GradientReadyCallback = std::function<void(int param_index)>;

// How a pipelined step (--pipeline_step) reads its parameters as they
// arrive and hands out its gradients as they are made.
struct ParameterStream {
  // Waits until elements [0, end) of parameter `param` hold this step's
  // values in backend memory, ahead of any work issued after it returns.
  std::function<absl::Status(int param, int64_t end)> wait_pulled;
  // Elements [0, end) of parameter `param`'s gradient are issued (the
  // hook copies them out of device memory itself where it must).
  std::function<void(int param, int64_t end)> gradient_ready;
  // Called once forward and the loss are done, before any gradient is
  // written. False: the step ends there, with its loss and no gradient.
  std::function<absl::StatusOr<bool>()> before_backward;
  // In host memory, the first dense layer's weight is read and written
  // this many elements at a time (its block size); on a device, every
  // parameter is whole.
  int64_t chunk_elements = 8192;
};

// A model owns its workspace: one instance serves one thread at a time.
class Model {
 public:
  virtual ~Model() = default;

  // ComputeGradients through a ParameterStream (the pipelined step). A
  // layer model: on a device any, in host memory one whose first layer is
  // dense; others are UNIMPLEMENTED.
  virtual absl::StatusOr<BatchResult> ComputeGradientsStreamed(
      const std::vector<const float*>& params, const DeviceBatch& batch,
      const std::vector<float*>& grads, const ParameterStream& stream) {
    return absl::UnimplementedError("this model cannot stream its step");
  }

  // The parameters, in a fixed order: the schema registered on the servers.
  // Element counts are the products of the shapes.
  virtual const std::vector<DenseTensorSpec>& Params() const = 0;

  // Forward and backward on one batch. params[i] and grads[i] point at
  // backend memory holding Params()[i]; grads receive the gradient of the
  // *mean* loss over the batch (overwritten). batch.rows <= max_batch.
  // on_gradient_ready (may be empty) hears of every parameter exactly once
  // on success: as its gradient is issued where the model can tell (the
  // layer models), else when backward is done. After an error, what it
  // was told is void.
  absl::StatusOr<BatchResult> ComputeGradients(
      const std::vector<const float*>& params, const DeviceBatch& batch,
      const std::vector<float*>& grads,
      const GradientReadyCallback& on_gradient_ready = nullptr);

  // Forward only: loss and accuracy of a batch.
  virtual absl::StatusOr<BatchResult> Evaluate(
      const std::vector<const float*>& params, const DeviceBatch& batch) = 0;

  // Forward only: the batch's logits, [batch.rows, classes] row-major, in
  // host memory (batch.labels is not read). For exporting predictions and
  // checking an exported model against another implementation.
  virtual absl::StatusOr<std::vector<float>> Logits(
      const std::vector<const float*>& params, const DeviceBatch& batch) {
    return absl::UnimplementedError("this model does not produce logits");
  }

 protected:
  // What ComputeGradients runs. gradient_ready is never empty; call it with
  // a parameter's index as soon as its gradient is issued. Parameters not
  // reported by the time this returns are reported after it, last first.
  virtual absl::StatusOr<BatchResult> ComputeGradientsImpl(
      const std::vector<const float*>& params, const DeviceBatch& batch,
      const std::vector<float*>& grads,
      const GradientReadyCallback& gradient_ready) = 0;
};

// A multi-layer perceptron: input -> [Linear -> ReLU] per hidden size ->
// Linear -> softmax cross-entropy. With no hidden layers it is softmax
// (multinomial logistic) regression. Parameters are named "fc{i}/weight"
// ([in, out], Glorot-uniform init) and "fc{i}/bias" ([out], zeros).
// Workspace for batches of up to max_batch rows is allocated once here.
// It is the layer list dense:h1,relu,...,dense:num_classes (layers.h).
absl::StatusOr<std::unique_ptr<Model>> CreateMlp(
    kernels::Backend* backend, int64_t input_dim,
    const std::vector<int64_t>& hidden_sizes, int64_t num_classes,
    int64_t max_batch);

// A diagnostic model for the parameter servers, not for learning: one tensor
// "probe/w" of num_elements zeros whose gradient is exactly 1 everywhere, every
// step. With SGD at learning rate 1 every element ends at minus the number of
// updates applied (exact in float32 up to 2^24), so a lost or doubly applied
// push shows in every element. Its loss is 0 and it classifies nothing.
// `check_pulls` (a sync job): each step fails, naming the
// element, unless every element it was given is the same, as a sync step's
// are (a block read at another step than the others shows).
absl::StatusOr<std::unique_ptr<Model>> CreateProbeModel(
    kernels::Backend* backend, int64_t num_elements, bool check_pulls = false);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_MODEL_H_
