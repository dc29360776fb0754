// Server-side optimizers. Each owns no memory: the shard keeps the parameter,
// the optimizer state (state_per_element() floats per parameter, laid out
// slot-major: all of slot 0, then all of slot 1) and the update count.
#ifndef PSTRAIN_PS_SERVER_OPTIMIZER_H_
#define PSTRAIN_PS_SERVER_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace pstrain {

struct OptimizerConfig {
  std::string name = "sgd";  // sgd | momentum | adam
  float learning_rate = 0.1f;
  float momentum = 0.9f;  // momentum
  float beta1 = 0.9f;     // adam
  float beta2 = 0.999f;   // adam
  float epsilon = 1e-8f;  // adam
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // Refuses unknown names and out-of-range hyper-parameters, naming the flag.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(
      const OptimizerConfig& config);

  virtual int state_per_element() const = 0;

  // Applies one update to elements [offset, offset + grad.size()) of a
  // block: `param` is the whole block and `state` its whole optimizer state
  // (state_per_element() planes of param.size() floats each). Every
  // optimizer here is elementwise, so updating a block piece by piece, as a
  // gradient is decoded, equals updating it at once. `update_count` is 1
  // for the first update this block receives (Adam's bias correction).
  // The gradient applied is grad_scale * grad (a sync step's mean from the
  // workers' sum, without a pass of its own).
  virtual void UpdateRange(int64_t update_count, absl::Span<float> param,
                           int64_t offset, absl::Span<const float> grad,
                           absl::Span<float> state, float grad_scale) const = 0;

  // The whole block: grad.size() == param.size().
  void Update(int64_t update_count, absl::Span<float> param,
              absl::Span<const float> grad, absl::Span<float> state,
              float grad_scale = 1.0f) const {
    UpdateRange(update_count, param, 0, grad, state, grad_scale);
  }
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_OPTIMIZER_H_
