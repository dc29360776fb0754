// Models described, not compiled in: a model is a list of layers, each
// written only in Backend ops (so it runs on every backend), each owning its
// parameters' specs (registered with the servers as dense tensors like any
// other), its workspace, its forward and its backward.
//
// Activations are NHWC, one example after another: a layer sees its input
// as [rows, height, width, channels] row-major, and a flat vector is
// 1 x 1 x N. A convolution is im2col + GEMM, so the one fast GEMM serves
// dense and convolutional layers alike.
//
// The layer list (--layers), comma-separated items:
//   conv:OUT:K[:STRIDE[:PAD]]  2-D convolution, OUT filters of K x K (stride
//                              1, pad 0 unless given), with a bias
//   maxpool:K[:STRIDE]         K x K max pooling (stride K unless given)
//   relu                       max(x, 0)
//   flatten                    H x W x C -> 1 x 1 x HWC (NHWC order; free)
//   dense:N                    fully connected to N outputs, with a bias;
//                              needs a flat input (flatten first)
// The last layer must output num_classes values per example (the logits of
// a softmax cross-entropy). Example, for 28x28x1 images:
//   conv:16:3,relu,maxpool:2,conv:32:3,relu,maxpool:2,flatten,dense:64,relu,dense:10
//
// Parameters are named "conv{i}/weight" ([K, K, C, OUT], i counting conv
// layers from 0) and "conv{i}/bias" ([OUT]), "fc{i}/weight" ([in, N], i
// counting dense layers) and "fc{i}/bias" ([N]): the names and shapes of the
// MLP (model.h), which is the layer list dense:h1,relu,...,dense:classes.
// Weights start Glorot-uniform (fan-in K*K*C, fan-out K*K*OUT for a conv),
// biases at zero.
#ifndef PSTRAIN_WORKER_LAYERS_H_
#define PSTRAIN_WORKER_LAYERS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "proto/ps.pb.h"
#include "worker/model.h"

namespace pstrain {

// The shape of one example between layers (NHWC without the N).
struct ExampleShape {
  int64_t height = 1;
  int64_t width = 1;
  int64_t channels = 1;

  int64_t elements() const { return height * width * channels; }
  bool flat() const { return height == 1 && width == 1; }
  std::string ToString() const;  // "28x28x1"
  bool operator==(const ExampleShape& other) const {
    return height == other.height && width == other.width &&
           channels == other.channels;
  }
};

// One item of a layer list, as parsed.
struct LayerSpec {
  enum class Kind { kConv, kMaxPool, kRelu, kFlatten, kDense };
  Kind kind = Kind::kRelu;
  int64_t units = 0;  // conv: output channels; dense: outputs
  int64_t kernel = 0;
  int64_t stride = 1;
  int64_t pad = 0;

  // The item in the list's grammar, defaults spelled out: "conv:32:3:1:0".
  std::string ToString() const;
};

// Parses a layer list. An error names the flag, the item (1-based) and what
// is wrong with it, in one line: "--layers item 3 'conv:x:3': OUT must be a
// positive integer, got 'x'".
absl::StatusOr<std::vector<LayerSpec>> ParseLayerList(absl::string_view text);

// Parses "HxWxC" (e.g. "28x28x1"); errors name --input_shape.
absl::StatusOr<ExampleShape> ParseExampleShape(absl::string_view text);

// The input shape when none is given: a square single-channel image when
// `features` is a perfect square greater than 1 (784 -> 28x28x1), else flat
// (1x1xfeatures).
ExampleShape InferExampleShape(int64_t features);

// One layer of a LayerModel; see the file comment. A layer is built for one
// input shape and batches of up to max_batch rows (its workspace is
// allocated once, at creation); it holds the workspace of the last forward
// that backward needs, so one layer serves one thread at a time.
class Layer {
 public:
  virtual ~Layer() = default;

  virtual ExampleShape output_shape() const = 0;

  // Its parameters, in order; names are "" (the model names them).
  virtual std::vector<DenseTensorSpec> ParamSpecs() const { return {}; }

  // Whether the output is the input itself (flatten): the model passes the
  // input on and Forward/Backward are never called.
  virtual bool IsView() const { return false; }

  // y[rows, out] = layer(x[rows, in]). params: this layer's tensors.
  virtual absl::Status Forward(const float* const* params, int64_t rows,
                               const float* x, float* y) = 0;

  // From x and y of the last Forward on the same rows and dy = dloss/dy:
  // grads (overwritten) for each of this layer's parameters, and dx =
  // dloss/dx (overwritten) unless dx is null (the first layer). dy and dx
  // never alias.
  virtual absl::Status Backward(const float* const* params, int64_t rows,
                                const float* x, const float* y, const float* dy,
                                float* dx, float* const* grads) = 0;
};

// Builds the layers of `specs` for inputs of shape `input` (checking that
// each fits the shape before it) and a softmax cross-entropy on the last
// layer's output, which must have num_classes elements. `name` prefixes
// error messages ("MLP", "layers").
absl::StatusOr<std::unique_ptr<Model>> CreateLayerModel(
    kernels::Backend* backend, const ExampleShape& input,
    const std::vector<LayerSpec>& specs, int64_t num_classes, int64_t max_batch,
    const std::string& name = "layers");

// The worker's --model=layers: parses --layers (layer_list) and
// --input_shape (input_shape; empty: InferExampleShape(features)), checks
// that the shape holds `features` values, and builds the model. Every error
// is one line naming the flag and the bad item.
absl::StatusOr<std::unique_ptr<Model>> CreateLayerModelFromFlags(
    kernels::Backend* backend, absl::string_view layer_list,
    absl::string_view input_shape, int64_t features, int64_t num_classes,
    int64_t max_batch);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_LAYERS_H_
