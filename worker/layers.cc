// The layers of layers.h and the model that chains them, written only in
// Backend ops: no parameter, gradient or activation is read on the host.
#include "worker/layers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "proto/ps.pb.h"
#include "worker/model.h"

namespace pstrain {
namespace {

using kernels::Backend;
using kernels::DeviceArray;
using kernels::Window2D;

// A Glorot-uniform weight of `shape`, or a zero bias, unnamed.
DenseTensorSpec WeightSpec(std::vector<int64_t> shape, int64_t fan_in,
                           int64_t fan_out) {
  DenseTensorSpec spec;
  for (int64_t d : shape) spec.add_shape(d);
  // Glorot-uniform keeps activation variance roughly constant across layers.
  spec.mutable_init()->set_kind(InitSpec::UNIFORM);
  spec.mutable_init()->set_scale(static_cast<float>(
      std::sqrt(6.0 / static_cast<double>(fan_in + fan_out))));
  return spec;
}

DenseTensorSpec BiasSpec(int64_t size) {
  DenseTensorSpec spec;
  spec.add_shape(size);
  spec.mutable_init()->set_kind(InitSpec::ZEROS);
  return spec;
}

absl::StatusOr<DeviceArray<float>> Workspace(Backend* backend, int64_t size) {
  return DeviceArray<float>::Create(backend, static_cast<size_t>(size));
}

// ---------------------------------------------------------------------------
// The layers.

class DenseLayer : public Layer {
 public:
  DenseLayer(Backend* backend, int64_t in, int64_t out)
      : backend_(backend), in_(in), out_(out) {}

  ExampleShape output_shape() const override { return {1, 1, out_}; }

  std::vector<DenseTensorSpec> ParamSpecs() const override {
    return {WeightSpec({in_, out_}, in_, out_), BiasSpec(out_)};
  }

  int64_t in() const { return in_; }
  int64_t out() const { return out_; }

  absl::Status Forward(const float* const* params, int64_t rows, const float* x,
                       float* y) override {
    // y[rows, out] = x[rows, in] * W[in, out] + b.
    absl::Status s = backend_->Gemm(false, false, rows, out_, in_, 1.0f, x,
                                    params[0], 0.0f, y);
    if (s.ok()) s = backend_->AddBias(rows, out_, params[1], y);
    return s;
  }

  absl::Status Backward(const float* const* params, int64_t rows,
                        const float* x, const float* /*y*/, const float* dy,
                        float* dx, float* const* grads) override {
    // dW[in, out] = x^T * dy; db = column sums of dy; dx = dy * W^T.
    absl::Status s = backend_->Gemm(true, false, in_, out_, rows, 1.0f, x, dy,
                                    0.0f, grads[0]);
    if (s.ok()) s = backend_->BiasGrad(rows, out_, dy, grads[1]);
    if (s.ok() && dx != nullptr) {
      s = backend_->Gemm(false, true, rows, in_, out_, 1.0f, dy, params[0],
                         0.0f, dx);
    }
    return s;
  }

 private:
  Backend* backend_;
  int64_t in_;
  int64_t out_;
};

class ReluLayer : public Layer {
 public:
  ReluLayer(Backend* backend, ExampleShape shape)
      : backend_(backend), shape_(shape) {}

  ExampleShape output_shape() const override { return shape_; }

  absl::Status Forward(const float* const* /*params*/, int64_t rows,
                       const float* x, float* y) override {
    return backend_->Relu(rows * shape_.elements(), x, y);
  }

  absl::Status Backward(const float* const* /*params*/, int64_t rows,
                        const float* /*x*/, const float* y, const float* dy,
                        float* dx, float* const* /*grads*/) override {
    if (dx == nullptr) return absl::OkStatus();
    return backend_->ReluGrad(rows * shape_.elements(), y, dy, dx);
  }

 private:
  Backend* backend_;
  ExampleShape shape_;
};

class FlattenLayer : public Layer {
 public:
  explicit FlattenLayer(ExampleShape input) : input_(input) {}

  ExampleShape output_shape() const override {
    return {1, 1, input_.elements()};
  }
  // NHWC rows are already the flattened vectors.
  bool IsView() const override { return true; }

  absl::Status Forward(const float* const*, int64_t, const float*,
                       float*) override {
    return absl::InternalError("flatten is a view; Forward is never called");
  }
  absl::Status Backward(const float* const*, int64_t, const float*,
                        const float*, const float*, float*,
                        float* const*) override {
    return absl::InternalError("flatten is a view; Backward is never called");
  }

 private:
  ExampleShape input_;
};

// The window of a conv or pool layer over `rows` examples.
Window2D MakeWindow(const ExampleShape& input, int64_t kernel, int64_t stride,
                    int64_t pad, int64_t rows) {
  Window2D w;
  w.batch = rows;
  w.height = input.height;
  w.width = input.width;
  w.channels = input.channels;
  w.kernel = kernel;
  w.stride = stride;
  w.pad = pad;
  return w;
}

// Convolution as im2col + GEMM (backend.h): the im2col matrix of the last
// forward stays in col_ for the weight gradient, then col_ takes dcol.
class ConvLayer : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<ConvLayer>> Create(
      Backend* backend, ExampleShape input, const LayerSpec& spec,
      int64_t max_batch) {
    std::unique_ptr<ConvLayer> layer(new ConvLayer(backend, input, spec));
    const Window2D w = layer->Window(max_batch);
    absl::StatusOr<DeviceArray<float>> col =
        Workspace(backend, w.col_rows() * w.col_cols());
    if (!col.ok()) return col.status();
    layer->col_ = *std::move(col);
    return layer;
  }

  ExampleShape output_shape() const override {
    const Window2D w = Window(1);
    return {w.out_height(), w.out_width(), out_channels_};
  }

  std::vector<DenseTensorSpec> ParamSpecs() const override {
    const int64_t k = spec_.kernel;
    return {WeightSpec({k, k, input_.channels, out_channels_},
                       k * k * input_.channels, k * k * out_channels_),
            BiasSpec(out_channels_)};
  }

  absl::Status Forward(const float* const* params, int64_t rows, const float* x,
                       float* y) override {
    const Window2D w = Window(rows);
    absl::Status s = backend_->Im2Col(w, x, col_.data());
    // y[(n, oh, ow), out] = col * W[k*k*c, out] + b: NHWC directly.
    if (s.ok()) {
      s = backend_->Gemm(false, false, w.col_rows(), out_channels_,
                         w.col_cols(), 1.0f, col_.data(), params[0], 0.0f, y);
    }
    if (s.ok())
      s = backend_->AddBias(w.col_rows(), out_channels_, params[1], y);
    return s;
  }

  absl::Status Backward(const float* const* params, int64_t rows,
                        const float* /*x*/, const float* /*y*/, const float* dy,
                        float* dx, float* const* grads) override {
    const Window2D w = Window(rows);
    // dW = col^T * dY (col still holds this batch's im2col), db = sums.
    absl::Status s =
        backend_->Gemm(true, false, w.col_cols(), out_channels_, w.col_rows(),
                       1.0f, col_.data(), dy, 0.0f, grads[0]);
    if (s.ok())
      s = backend_->BiasGrad(w.col_rows(), out_channels_, dy, grads[1]);
    if (s.ok() && dx != nullptr) {
      // dcol = dY * W^T, then back onto the pixels each entry came from.
      s = backend_->Gemm(false, true, w.col_rows(), w.col_cols(), out_channels_,
                         1.0f, dy, params[0], 0.0f, col_.data());
      if (s.ok()) s = backend_->Col2Im(w, col_.data(), dx);
    }
    return s;
  }

 private:
  ConvLayer(Backend* backend, ExampleShape input, const LayerSpec& spec)
      : backend_(backend),
        input_(input),
        spec_(spec),
        out_channels_(spec.units) {}

  Window2D Window(int64_t rows) const {
    return MakeWindow(input_, spec_.kernel, spec_.stride, spec_.pad, rows);
  }

  Backend* backend_;
  ExampleShape input_;
  LayerSpec spec_;
  int64_t out_channels_;
  DeviceArray<float> col_;
};

class MaxPoolLayer : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<MaxPoolLayer>> Create(
      Backend* backend, ExampleShape input, const LayerSpec& spec,
      int64_t max_batch) {
    std::unique_ptr<MaxPoolLayer> layer(new MaxPoolLayer(backend, input, spec));
    absl::StatusOr<DeviceArray<int64_t>> argmax = DeviceArray<int64_t>::Create(
        backend,
        static_cast<size_t>(layer->Window(max_batch).output_elements()));
    if (!argmax.ok()) return argmax.status();
    layer->argmax_ = *std::move(argmax);
    return layer;
  }

  ExampleShape output_shape() const override {
    const Window2D w = Window(1);
    return {w.out_height(), w.out_width(), input_.channels};
  }

  absl::Status Forward(const float* const* /*params*/, int64_t rows,
                       const float* x, float* y) override {
    return backend_->MaxPool2D(Window(rows), x, y, argmax_.data());
  }

  absl::Status Backward(const float* const* /*params*/, int64_t rows,
                        const float* /*x*/, const float* /*y*/, const float* dy,
                        float* dx, float* const* /*grads*/) override {
    if (dx == nullptr) return absl::OkStatus();
    return backend_->MaxPool2DGrad(Window(rows), dy, argmax_.data(), dx);
  }

 private:
  MaxPoolLayer(Backend* backend, ExampleShape input, const LayerSpec& spec)
      : backend_(backend), input_(input), spec_(spec) {}

  Window2D Window(int64_t rows) const {
    return MakeWindow(input_, spec_.kernel, spec_.stride, 0, rows);
  }

  Backend* backend_;
  ExampleShape input_;
  LayerSpec spec_;
  DeviceArray<int64_t> argmax_;  // winners of the last forward
};

// Checks that `spec` can follow a layer with output `input`, and builds it.
absl::StatusOr<std::unique_ptr<Layer>> CreateLayer(Backend* backend,
                                                   const ExampleShape& input,
                                                   const LayerSpec& spec,
                                                   int64_t max_batch) {
  switch (spec.kind) {
    case LayerSpec::Kind::kDense:
      if (!input.flat()) {
        return absl::InvalidArgumentError(
            absl::StrCat("needs a flat input, got ", input.ToString(),
                         ": put flatten before it"));
      }
      return std::make_unique<DenseLayer>(backend, input.elements(),
                                          spec.units);
    case LayerSpec::Kind::kRelu:
      return std::make_unique<ReluLayer>(backend, input);
    case LayerSpec::Kind::kFlatten:
      return std::make_unique<FlattenLayer>(input);
    case LayerSpec::Kind::kConv:
    case LayerSpec::Kind::kMaxPool: {
      const int64_t pad = spec.kind == LayerSpec::Kind::kConv ? spec.pad : 0;
      if (input.height + 2 * pad < spec.kernel ||
          input.width + 2 * pad < spec.kernel) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a ", spec.kernel, "x", spec.kernel,
            " window does not fit its input ", input.ToString(),
            pad > 0 ? absl::StrCat(" padded by ", pad) : "",
            input.flat() ? " (a flat input: give --input_shape=HxWxC)" : ""));
      }
      if (spec.kind == LayerSpec::Kind::kConv) {
        absl::StatusOr<std::unique_ptr<ConvLayer>> conv =
            ConvLayer::Create(backend, input, spec, max_batch);
        if (!conv.ok()) return conv.status();
        return std::unique_ptr<Layer>(*std::move(conv));
      }
      absl::StatusOr<std::unique_ptr<MaxPoolLayer>> pool =
          MaxPoolLayer::Create(backend, input, spec, max_batch);
      if (!pool.ok()) return pool.status();
      return std::unique_ptr<Layer>(*std::move(pool));
    }
  }
  return absl::InternalError("unknown layer kind");
}

// ---------------------------------------------------------------------------
// The model: layers in a chain, softmax cross-entropy on the last output.

// Not thread-safe: the workspace is shared by every call on one instance.
int64_t ElementsOf(const DenseTensorSpec& spec) {
  int64_t n = 1;
  for (int64_t d : spec.shape()) n *= d;
  return n;
}

class LayerModel : public Model {
 public:
  static absl::StatusOr<std::unique_ptr<LayerModel>> Create(
      Backend* backend, const ExampleShape& input,
      const std::vector<LayerSpec>& specs, int64_t num_classes,
      int64_t max_batch, const std::string& name);

  const std::vector<DenseTensorSpec>& Params() const override {
    return params_;
  }

  absl::StatusOr<BatchResult> Evaluate(const std::vector<const float*>& params,
                                       const DeviceBatch& batch) override;

  absl::StatusOr<std::vector<float>> Logits(
      const std::vector<const float*>& params,
      const DeviceBatch& batch) override;

 protected:
  absl::StatusOr<BatchResult> ComputeGradientsImpl(
      const std::vector<const float*>& params, const DeviceBatch& batch,
      const std::vector<float*>& grads,
      const GradientReadyCallback& gradient_ready) override;

 public:
  absl::StatusOr<BatchResult> ComputeGradientsStreamed(
      const std::vector<const float*>& params, const DeviceBatch& batch,
      const std::vector<float*>& grads, const ParameterStream& stream) override;

 private:
  // The batch transposed ([features, rows]), so that a chunk of the first
  // layer's input rows is a contiguous GEMM operand both ways.
  std::vector<float> xt_;
  struct Entry {
    std::unique_ptr<Layer> layer;
    int first_param = 0;
    int num_params = 0;
    // Whether backward must produce dloss/dinput: some layer before this
    // one has parameters.
    bool needs_input_grad = false;
  };

  LayerModel(Backend* backend, std::string name, int64_t max_batch)
      : backend_(backend), name_(std::move(name)), max_batch_(max_batch) {}

  absl::Status CheckArgs(const std::vector<const float*>& params,
                         const DeviceBatch& batch,
                         const std::vector<float*>* grads) const;

  // The step a whole parameter at a time: the plain step (`stream` null)
  // and a device's streamed one (see the .cc).
  absl::StatusOr<BatchResult> StepByParam(
      const std::vector<const float*>& params, const DeviceBatch& batch,
      const std::vector<float*>& grads, const ParameterStream* stream,
      const GradientReadyCallback& gradient_ready);

  // Runs every layer; activations_[i + 1] is then layer i's output.
  absl::Status Forward(const std::vector<const float*>& params,
                       const DeviceBatch& batch);
  // Runs layers `first`.. on activations_[first], `output` being the first
  // one's output buffer (outputs_ index); with `stream`, each layer once its
  // parameters are pulled.
  absl::Status ForwardFrom(size_t first, size_t output,
                           const std::vector<const float*>& params,
                           int64_t rows, const ParameterStream* stream);
  // The loss of the logits of the last forward, its gradient (of the mean
  // loss) in delta_[0].
  absl::StatusOr<BatchResult> Loss(int64_t rows, const int32_t* labels);
  // Backward from the last layer down to layer `last`, from the loss's
  // gradient; `ready` hears of each parameter as its gradient is made.
  // Returns the gradient of layer `last`'s input (null where no layer
  // before it has parameters).
  absl::StatusOr<float*> BackwardDownTo(
      size_t last, const std::vector<const float*>& params, int64_t rows,
      const std::vector<float*>& grads,
      const std::function<void(int param)>& ready);

  const float* logits() const { return activations_.back(); }

  Backend* backend_;
  std::string name_;
  int64_t max_batch_;
  int64_t num_classes_ = 0;
  std::vector<Entry> layers_;
  std::vector<DenseTensorSpec> params_;
  // Output buffers of the layers that are not views (max_batch rows each).
  std::vector<DeviceArray<float>> outputs_;
  // activations_[0] is the batch's features, activations_[i + 1] layer i's
  // output (a view's is its input). Sized once; set by every Forward.
  std::vector<const float*> activations_;
  // Backward ping-pongs between two buffers of the largest activation: a
  // layer reads dy from one and writes dx to the other.
  DeviceArray<float> delta_[2];
};

absl::StatusOr<std::unique_ptr<LayerModel>> LayerModel::Create(
    Backend* backend, const ExampleShape& input,
    const std::vector<LayerSpec>& specs, int64_t num_classes, int64_t max_batch,
    const std::string& name) {
  std::unique_ptr<LayerModel> model(new LayerModel(backend, name, max_batch));
  model->num_classes_ = num_classes;
  ExampleShape shape = input;
  int64_t largest = shape.elements();
  int conv_count = 0;
  int dense_count = 0;
  bool any_params = false;
  for (size_t i = 0; i < specs.size(); ++i) {
    const LayerSpec& spec = specs[i];
    absl::StatusOr<std::unique_ptr<Layer>> layer =
        CreateLayer(backend, shape, spec, max_batch);
    if (!layer.ok()) {
      return absl::Status(
          layer.status().code(),
          absl::StrCat(name, ": layer ", i + 1, " '", spec.ToString(),
                       "': ", layer.status().message()));
    }
    Entry entry;
    entry.first_param = static_cast<int>(model->params_.size());
    entry.needs_input_grad = any_params;
    std::vector<DenseTensorSpec> layer_params = (*layer)->ParamSpecs();
    std::string prefix;
    if (spec.kind == LayerSpec::Kind::kConv) {
      prefix = absl::StrCat("conv", conv_count++);
    } else if (spec.kind == LayerSpec::Kind::kDense) {
      prefix = absl::StrCat("fc", dense_count++);
    }
    for (size_t p = 0; p < layer_params.size(); ++p) {
      layer_params[p].set_name(
          absl::StrCat(prefix, p == 0 ? "/weight" : "/bias"));
      model->params_.push_back(std::move(layer_params[p]));
    }
    entry.num_params = static_cast<int>(layer_params.size());
    any_params = any_params || entry.num_params > 0;
    shape = (*layer)->output_shape();
    largest = std::max(largest, shape.elements());
    if (!(*layer)->IsView()) {
      absl::StatusOr<DeviceArray<float>> out =
          Workspace(backend, max_batch * shape.elements());
      if (!out.ok()) return out.status();
      model->outputs_.push_back(*std::move(out));
    }
    entry.layer = *std::move(layer);
    model->layers_.push_back(std::move(entry));
  }
  if (model->layers_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": no layers"));
  }
  if (shape.elements() != num_classes) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": the last layer '", specs.back().ToString(),
                     "' outputs ", shape.ToString(), " = ", shape.elements(),
                     " values per example; the loss needs one per class (",
                     num_classes, "): end with dense:", num_classes));
  }
  model->activations_.assign(model->layers_.size() + 1, nullptr);
  for (DeviceArray<float>& delta : model->delta_) {
    absl::StatusOr<DeviceArray<float>> d =
        Workspace(backend, max_batch * largest);
    if (!d.ok()) return d.status();
    delta = *std::move(d);
  }
  return model;
}

absl::Status LayerModel::CheckArgs(const std::vector<const float*>& params,
                                   const DeviceBatch& batch,
                                   const std::vector<float*>* grads) const {
  if (batch.rows < 1 || batch.rows > max_batch_) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": batch has ", batch.rows,
                     " rows; must be in [1, ", max_batch_, "]"));
  }
  if (batch.features == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": batch features are null"));
  }
  if (params.size() != params_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": got ", params.size(),
                     " parameter tensors, want ", params_.size()));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": parameter ", params_[i].name(), " is null"));
    }
  }
  if (grads == nullptr) return absl::OkStatus();
  if (grads->size() != params_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": got ", grads->size(), " gradient tensors, want ",
                     params_.size()));
  }
  for (size_t i = 0; i < grads->size(); ++i) {
    if ((*grads)[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": gradient of ", params_[i].name(), " is null"));
    }
  }
  return absl::OkStatus();
}

absl::Status LayerModel::Forward(const std::vector<const float*>& params,
                                 const DeviceBatch& batch) {
  activations_[0] = batch.features;
  return ForwardFrom(0, 0, params, batch.rows, nullptr);
}

absl::Status LayerModel::ForwardFrom(size_t first, size_t output,
                                     const std::vector<const float*>& params,
                                     int64_t rows,
                                     const ParameterStream* stream) {
  for (size_t i = first; i < layers_.size(); ++i) {
    Entry& entry = layers_[i];
    if (entry.layer->IsView()) {
      activations_[i + 1] = activations_[i];
      continue;
    }
    for (int p = 0; p < entry.num_params && stream != nullptr; ++p) {
      const int index = entry.first_param + p;
      if (absl::Status s =
              stream->wait_pulled(index, ElementsOf(params_[index]));
          !s.ok()) {
        return s;
      }
    }
    float* y = outputs_[output++].data();
    if (absl::Status s = entry.layer->Forward(params.data() + entry.first_param,
                                              rows, activations_[i], y);
        !s.ok()) {
      return s;
    }
    activations_[i + 1] = y;
  }
  return absl::OkStatus();
}

absl::StatusOr<BatchResult> LayerModel::Loss(int64_t rows,
                                             const int32_t* labels) {
  BatchResult result;
  result.rows = rows;
  // Scaling by 1/rows here makes every gradient below that of the mean loss.
  if (absl::Status s = backend_->SoftmaxCrossEntropy(
          rows, num_classes_, logits(), labels, 1.0f / static_cast<float>(rows),
          delta_[0].data(), &result.loss_sum, &result.num_correct);
      !s.ok()) {
    return s;
  }
  return result;
}

absl::StatusOr<float*> LayerModel::BackwardDownTo(
    size_t last, const std::vector<const float*>& params, int64_t rows,
    const std::vector<float*>& grads,
    const std::function<void(int param)>& ready) {
  float* dy = delta_[0].data();
  for (int i = static_cast<int>(layers_.size()) - 1;
       i >= static_cast<int>(last); --i) {
    Entry& entry = layers_[i];
    if (entry.layer->IsView()) continue;  // dx is dy, in the same buffer
    float* dx = nullptr;
    if (entry.needs_input_grad) {
      dx = dy == delta_[0].data() ? delta_[1].data() : delta_[0].data();
    }
    if (absl::Status s = entry.layer->Backward(
            params.data() + entry.first_param, rows, activations_[i],
            activations_[i + 1], dy, dx, grads.data() + entry.first_param);
        !s.ok()) {
      return s;
    }
    for (int p = 0; p < entry.num_params; ++p) ready(entry.first_param + p);
    if (dx == nullptr) return nullptr;  // nothing before has parameters
    dy = dx;
  }
  return dy;
}

// The step of ComputeGradientsImpl, reading each parameter once
// it is pulled and reporting each gradient as it is made; the first dense
// layer's weight a chunk (of its input rows) at a time, both ways, so that
// its forward starts on the first blocks to arrive and its gradient leaves
// a block at a time. Its forward sums the chunks one after another
// (different rounding from one GEMM, the same on every run).
absl::StatusOr<BatchResult> LayerModel::ComputeGradientsStreamed(
    const std::vector<const float*>& params, const DeviceBatch& batch,
    const std::vector<float*>& grads, const ParameterStream& stream) {
  if (absl::Status s = CheckArgs(params, batch, &grads); !s.ok()) return s;
  if (!backend_->MemoryIsHost()) {
    return StepByParam(params, batch, grads, &stream, [&](int param) {
      stream.gradient_ready(param, ElementsOf(params_[param]));
    });
  }
  auto* first = dynamic_cast<DenseLayer*>(layers_[0].layer.get());
  if (first == nullptr || layers_[0].first_param != 0) {
    return absl::UnimplementedError(
        "the pipelined step needs a dense first layer in host memory");
  }
  const int64_t rows = batch.rows;
  const int64_t in = first->in();
  const int64_t out = first->out();
  xt_.resize(in * rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = batch.features + r * in;
    for (int64_t c = 0; c < in; ++c) xt_[c * rows + r] = x[c];
  }
  const int64_t chunk_rows = std::max<int64_t>(1, stream.chunk_elements / out);
  float* y0 = outputs_[0].data();
  for (int64_t r0 = 0; r0 < in; r0 += chunk_rows) {
    const int64_t r1 = std::min(in, r0 + chunk_rows);
    if (absl::Status s = stream.wait_pulled(0, r1 * out); !s.ok()) return s;
    if (absl::Status s = backend_->Gemm(
            true, false, rows, out, r1 - r0, 1.0f, xt_.data() + r0 * rows,
            params[0] + r0 * out, r0 == 0 ? 0.0f : 1.0f, y0);
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = stream.wait_pulled(1, out); !s.ok()) return s;
  if (absl::Status s = backend_->AddBias(rows, out, params[1], y0); !s.ok()) {
    return s;
  }
  activations_[0] = batch.features;
  activations_[1] = y0;
  if (absl::Status s = ForwardFrom(1, 1, params, rows, &stream); !s.ok()) {
    return s;
  }
  absl::StatusOr<BatchResult> result = Loss(rows, batch.labels);
  if (!result.ok()) return result.status();
  absl::StatusOr<bool> go_on = stream.before_backward();
  if (!go_on.ok()) return go_on.status();
  if (!*go_on) return result;
  absl::StatusOr<float*> dy =
      BackwardDownTo(1, params, rows, grads, [&](int param) {
        stream.gradient_ready(param, ElementsOf(params_[param]));
      });
  if (!dy.ok()) return dy.status();
  for (int64_t r0 = 0; r0 < in; r0 += chunk_rows) {
    const int64_t r1 = std::min(in, r0 + chunk_rows);
    if (absl::Status s = backend_->Gemm(false, false, r1 - r0, out, rows, 1.0f,
                                        xt_.data() + r0 * rows, *dy, 0.0f,
                                        grads[0] + r0 * out);
        !s.ok()) {
      return s;
    }
    stream.gradient_ready(0, r1 * out);
  }
  if (absl::Status s = backend_->BiasGrad(rows, out, *dy, grads[1]); !s.ok()) {
    return s;
  }
  stream.gradient_ready(1, out);
  return result;
}

absl::StatusOr<BatchResult> LayerModel::ComputeGradientsImpl(
    const std::vector<const float*>& params, const DeviceBatch& batch,
    const std::vector<float*>& grads,
    const GradientReadyCallback& gradient_ready) {
  if (absl::Status s = CheckArgs(params, batch, &grads); !s.ok()) return s;
  return StepByParam(params, batch, grads, nullptr, gradient_ready);
}

// With `stream` (on a device, whose copies in and out the trainer makes in
// the stream's hooks): forward waits for each layer's parameters before
// it, and each gradient leaves as backward issues it. One GEMM a layer
// either way, so the pipelined step rounds as the plain one.
absl::StatusOr<BatchResult> LayerModel::StepByParam(
    const std::vector<const float*>& params, const DeviceBatch& batch,
    const std::vector<float*>& grads, const ParameterStream* stream,
    const GradientReadyCallback& gradient_ready) {
  if (batch.labels == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": batch labels are null"));
  }
  activations_[0] = batch.features;
  if (absl::Status s = ForwardFrom(0, 0, params, batch.rows, stream); !s.ok()) {
    return s;
  }
  absl::StatusOr<BatchResult> result = Loss(batch.rows, batch.labels);
  if (!result.ok()) return result.status();
  if (stream != nullptr) {
    absl::StatusOr<bool> go_on = stream->before_backward();
    if (!go_on.ok()) return go_on.status();
    if (!*go_on) return result;
  }
  absl::StatusOr<float*> dx =
      BackwardDownTo(0, params, batch.rows, grads, gradient_ready);
  if (!dx.ok()) return dx.status();
  return result;
}

absl::StatusOr<BatchResult> LayerModel::Evaluate(
    const std::vector<const float*>& params, const DeviceBatch& batch) {
  if (absl::Status s = CheckArgs(params, batch, nullptr); !s.ok()) return s;
  if (batch.labels == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": batch labels are null"));
  }
  if (absl::Status s = Forward(params, batch); !s.ok()) return s;
  BatchResult result;
  result.rows = batch.rows;
  if (absl::Status s = backend_->SoftmaxCrossEntropy(
          batch.rows, num_classes_, logits(), batch.labels, 1.0f, nullptr,
          &result.loss_sum, &result.num_correct);
      !s.ok()) {
    return s;
  }
  return result;
}

absl::StatusOr<std::vector<float>> LayerModel::Logits(
    const std::vector<const float*>& params, const DeviceBatch& batch) {
  if (absl::Status s = CheckArgs(params, batch, nullptr); !s.ok()) return s;
  if (absl::Status s = Forward(params, batch); !s.ok()) return s;
  std::vector<float> host(batch.rows * num_classes_);
  if (absl::Status s = backend_->CopyToHost(logits(), host.data(),
                                            host.size() * sizeof(float));
      !s.ok()) {
    return s;
  }
  return host;
}

// A positive integer field of a layer item, or an error naming it.
absl::Status ParseField(absl::string_view field, absl::string_view what,
                        int64_t min, int64_t* value) {
  int64_t parsed = 0;
  bool digits = !field.empty();
  for (char ch : field) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(ch))) digits = false;
  }
  if (!digits || !absl::SimpleAtoi(field, &parsed) || parsed < min ||
      parsed > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " must be an integer >= ", min, ", got '", field, "'"));
  }
  *value = parsed;
  return absl::OkStatus();
}

absl::StatusOr<LayerSpec> ParseLayerItem(absl::string_view item) {
  const std::vector<absl::string_view> fields = absl::StrSplit(item, ':');
  const absl::string_view kind = fields[0];
  const size_t args = fields.size() - 1;
  const auto arity = [&](size_t min, size_t max,
                         absl::string_view grammar) -> absl::Status {
    if (args < min || args > max) {
      return absl::InvalidArgumentError(
          absl::StrCat("expected ", grammar, ", got ", args, " argument",
                       args == 1 ? "" : "s"));
    }
    return absl::OkStatus();
  };
  LayerSpec spec;
  if (kind == "conv") {
    spec.kind = LayerSpec::Kind::kConv;
    if (absl::Status s = arity(2, 4, "conv:OUT:K[:STRIDE[:PAD]]"); !s.ok()) {
      return s;
    }
    if (absl::Status s = ParseField(fields[1], "OUT", 1, &spec.units);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = ParseField(fields[2], "K", 1, &spec.kernel); !s.ok()) {
      return s;
    }
    if (args >= 3) {
      if (absl::Status s = ParseField(fields[3], "STRIDE", 1, &spec.stride);
          !s.ok()) {
        return s;
      }
    }
    if (args >= 4) {
      if (absl::Status s = ParseField(fields[4], "PAD", 0, &spec.pad);
          !s.ok()) {
        return s;
      }
      if (spec.pad >= spec.kernel) {
        return absl::InvalidArgumentError(absl::StrCat(
            "PAD must be smaller than K (", spec.kernel, "), got ", spec.pad));
      }
    }
    return spec;
  }
  if (kind == "maxpool") {
    spec.kind = LayerSpec::Kind::kMaxPool;
    if (absl::Status s = arity(1, 2, "maxpool:K[:STRIDE]"); !s.ok()) return s;
    if (absl::Status s = ParseField(fields[1], "K", 1, &spec.kernel); !s.ok()) {
      return s;
    }
    spec.stride = spec.kernel;
    if (args >= 2) {
      if (absl::Status s = ParseField(fields[2], "STRIDE", 1, &spec.stride);
          !s.ok()) {
        return s;
      }
    }
    return spec;
  }
  if (kind == "dense") {
    spec.kind = LayerSpec::Kind::kDense;
    if (absl::Status s = arity(1, 1, "dense:N"); !s.ok()) return s;
    if (absl::Status s = ParseField(fields[1], "N", 1, &spec.units); !s.ok()) {
      return s;
    }
    return spec;
  }
  if (kind == "relu" || kind == "flatten") {
    spec.kind =
        kind == "relu" ? LayerSpec::Kind::kRelu : LayerSpec::Kind::kFlatten;
    if (absl::Status s = arity(0, 0, kind); !s.ok()) return s;
    return spec;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown layer '", kind,
                   "' (known: conv, maxpool, relu, flatten, dense)"));
}

}  // namespace

std::string ExampleShape::ToString() const {
  return absl::StrCat(height, "x", width, "x", channels);
}

std::string LayerSpec::ToString() const {
  switch (kind) {
    case Kind::kConv:
      return absl::StrCat("conv:", units, ":", kernel, ":", stride, ":", pad);
    case Kind::kMaxPool:
      return absl::StrCat("maxpool:", kernel, ":", stride);
    case Kind::kRelu:
      return "relu";
    case Kind::kFlatten:
      return "flatten";
    case Kind::kDense:
      return absl::StrCat("dense:", units);
  }
  return "?";
}

absl::StatusOr<std::vector<LayerSpec>> ParseLayerList(absl::string_view text) {
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError(
        "--layers is empty; e.g. "
        "--layers=conv:16:3,relu,maxpool:2,flatten,dense:10");
  }
  std::vector<LayerSpec> specs;
  int index = 0;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    ++index;
    item = absl::StripAsciiWhitespace(item);
    absl::StatusOr<LayerSpec> spec = ParseLayerItem(item);
    if (!spec.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--layers item ", index, " '", item, "': ", spec.status().message()));
    }
    specs.push_back(*spec);
  }
  return specs;
}

absl::StatusOr<ExampleShape> ParseExampleShape(absl::string_view text) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, 'x');
  ExampleShape shape;
  int64_t* fields[] = {&shape.height, &shape.width, &shape.channels};
  bool ok = parts.size() == 3;
  for (size_t i = 0; ok && i < 3; ++i) {
    ok = ParseField(parts[i], "", 1, fields[i]).ok();
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--input_shape must be HxWxC with positive integers (e.g. 28x28x1), "
        "got '",
        text, "'"));
  }
  return shape;
}

ExampleShape InferExampleShape(int64_t features) {
  const int64_t side =
      static_cast<int64_t>(std::llround(std::sqrt(double(features))));
  if (features > 1 && side * side == features) return {side, side, 1};
  return {1, 1, std::max<int64_t>(features, 1)};
}

absl::StatusOr<std::unique_ptr<Model>> CreateLayerModel(
    kernels::Backend* backend, const ExampleShape& input,
    const std::vector<LayerSpec>& specs, int64_t num_classes, int64_t max_batch,
    const std::string& name) {
  if (backend == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": backend is null"));
  }
  if (input.height < 1 || input.width < 1 || input.channels < 1 ||
      num_classes < 1 || max_batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        name,
        ": the input shape, num_classes and max_batch must be positive, got ",
        input.ToString(), ", ", num_classes, " and ", max_batch));
  }
  absl::StatusOr<std::unique_ptr<LayerModel>> model =
      LayerModel::Create(backend, input, specs, num_classes, max_batch, name);
  if (!model.ok()) return model.status();
  return std::unique_ptr<Model>(*std::move(model));
}

absl::StatusOr<std::unique_ptr<Model>> CreateLayerModelFromFlags(
    kernels::Backend* backend, absl::string_view layer_list,
    absl::string_view input_shape, int64_t features, int64_t num_classes,
    int64_t max_batch) {
  absl::StatusOr<std::vector<LayerSpec>> specs = ParseLayerList(layer_list);
  if (!specs.ok()) return specs.status();
  ExampleShape shape = InferExampleShape(features);
  if (!input_shape.empty()) {
    absl::StatusOr<ExampleShape> parsed = ParseExampleShape(input_shape);
    if (!parsed.ok()) return parsed.status();
    if (parsed->elements() != features) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--input_shape=", input_shape, " holds ", parsed->elements(),
          " values per example, but the data has ", features, " features"));
    }
    shape = *parsed;
  }
  return CreateLayerModel(backend, shape, *specs, num_classes, max_batch,
                          "--layers");
}

}  // namespace pstrain
