// The MLP of model.h: a layer list of dense and ReLU layers (layers.h).
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "worker/layers.h"
#include "worker/model.h"

namespace pstrain {

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
  std::vector<LayerSpec> layers;
  for (int64_t width : hidden_sizes) {
    if (width < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CreateMlp: hidden layer sizes must be positive, got ", width));
    }
    layers.push_back({LayerSpec::Kind::kDense, width});
    layers.push_back({LayerSpec::Kind::kRelu});
  }
  layers.push_back({LayerSpec::Kind::kDense, num_classes});
  return CreateLayerModel(backend, ExampleShape{1, 1, input_dim}, layers,
                          num_classes, max_batch, "MLP");
}

}  // namespace pstrain
