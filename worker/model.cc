#include "worker/model.h"

#include <vector>

#include "absl/status/statusor.h"

namespace pstrain {

absl::StatusOr<BatchResult> Model::ComputeGradients(
    const std::vector<const float*>& params, const DeviceBatch& batch,
    const std::vector<float*>& grads,
    const GradientReadyCallback& on_gradient_ready) {
  if (!on_gradient_ready) {
    return ComputeGradientsImpl(params, batch, grads, [](int) {});
  }
  // Holding the model to "exactly once" here means a caller can count on
  // it whatever the model does.
  const int count = static_cast<int>(Params().size());
  std::vector<bool> reported(count, false);
  absl::StatusOr<BatchResult> result =
      ComputeGradientsImpl(params, batch, grads, [&](int i) {
        if (i < 0 || i >= count || reported[i]) return;
        reported[i] = true;
        on_gradient_ready(i);
      });
  if (!result.ok()) return result;
  for (int i = count - 1; i >= 0; --i) {
    if (!reported[i]) on_gradient_ready(i);
  }
  return result;
}

}  // namespace pstrain
