// Server-side optimizers. Each owns no memory: the shard keeps the parameter,
// the optimizer state (state_per_element() floats per parameter, laid out
// slot-major: all of slot 0, then all of slot 1) and the update count.
//
// Two families: the server's own (--optimizer: sgd, momentum, adam), and
// torch.optim's rules with their formulas and defaults (CreateTorch: SGD
// with momentum, dampening, nesterov and weight decay; Adam; AdamW;
// Adagrad with lr_decay and initial_accumulator_value; RMSprop with alpha,
// momentum and centered), one per tensor, as a user's torch optimizer
// describes each param group. Every rule takes the rate of each update as
// an argument: a scheduler's edits travel with the pushes.
#ifndef PSTRAIN_PS_SERVER_OPTIMIZER_H_
#define PSTRAIN_PS_SERVER_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/ps.pb.h"

namespace pstrain {

struct OptimizerConfig {
  std::string name = "sgd";  // sgd | momentum | adam | adamw
  float learning_rate = 0.1f;
  float momentum = 0.9f;  // momentum
  float beta1 = 0.9f;     // adam
  float beta2 = 0.999f;   // adam
  float epsilon = 1e-8f;  // adam
  // torch.optim's weight_decay: added to the gradient (sgd, momentum,
  // adam), or decoupled (adamw).
  float weight_decay = 0;
};

// What a step may change of an update rule: the rate (a scheduler's), and
// the momentum (OneCycleLR cycles SGD's and RMSprop's momentum and Adam's
// beta1); absent, the rule's own.
struct StepHyper {
  float lr = 0;
  std::optional<float> momentum;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // Refuses unknown names and out-of-range hyper-parameters, naming the flag.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(
      const OptimizerConfig& config);
  // torch.optim's rule `config` names; refuses an unknown name and
  // out-of-range hyper-parameters (as torch's constructors do), naming the
  // option.
  static absl::StatusOr<std::unique_ptr<Optimizer>> CreateTorch(
      const TorchOptimizer& config);

  virtual int state_per_element() const = 0;
  // The rate an update uses when none is given: the flag's, or the torch
  // group's rate at registration.
  virtual float learning_rate() const = 0;
  // Fills a new block's state (all of its slots): zeros, except where
  // torch's rule starts elsewhere (Adagrad's initial_accumulator_value).
  virtual void InitState(absl::Span<float> state) const;

  // Applies one update at `hyper` to elements [offset, offset +
  // grad.size()) of a block: `param` is the whole block and `state` its
  // whole optimizer state (state_per_element() planes of param.size()
  // floats each). Every optimizer here is elementwise, so updating a block
  // piece by piece, as a gradient is decoded, equals updating it at once.
  // `update_count` is 1 for the first update this block receives (Adam's
  // bias correction, SGD momentum's first buffer, Adagrad's lr_decay).
  // The gradient applied is grad_scale * grad (a sync step's mean from the
  // workers' sum, without a pass of its own).
  virtual void UpdateRange(int64_t update_count, const StepHyper& hyper,
                           absl::Span<float> param, int64_t offset,
                           absl::Span<const float> grad,
                           absl::Span<float> state, float grad_scale) const = 0;

  // The rule's own hyper-parameters (learning_rate(), no momentum change).
  StepHyper OwnHyper() const { return StepHyper{learning_rate(), {}}; }

  // The whole block: grad.size() == param.size(), at OwnHyper().
  void Update(int64_t update_count, absl::Span<float> param,
              absl::Span<const float> grad, absl::Span<float> state,
              float grad_scale = 1.0f) const {
    UpdateRange(update_count, OwnHyper(), param, 0, grad, state, grad_scale);
  }
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_OPTIMIZER_H_
