#include "ps_server/optimizer.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace pstrain {
namespace {

// w -= lr * g
class Sgd : public Optimizer {
 public:
  explicit Sgd(float lr) : lr_(lr) {}
  int state_per_element() const override { return 0; }
  void UpdateRange(int64_t, absl::Span<float> param, int64_t offset,
                   absl::Span<const float> grad, absl::Span<float>,
                   float grad_scale) const override {
    const size_t n = grad.size();
    float* __restrict w = param.data() + offset;
    const float* __restrict g = grad.data();
    for (size_t i = 0; i < n; ++i) w[i] -= lr_ * (grad_scale * g[i]);
  }

 private:
  float lr_;
};

// Heavy-ball momentum as PyTorch defines it: v = mu * v + g; w -= lr * v.
class Momentum : public Optimizer {
 public:
  Momentum(float lr, float mu) : lr_(lr), mu_(mu) {}
  int state_per_element() const override { return 1; }
  void UpdateRange(int64_t, absl::Span<float> param, int64_t offset,
                   absl::Span<const float> grad, absl::Span<float> state,
                   float grad_scale) const override {
    const size_t n = grad.size();
    float* __restrict w = param.data() + offset;
    const float* __restrict g = grad.data();
    float* __restrict v = state.data() + offset;
    for (size_t i = 0; i < n; ++i) {
      v[i] = mu_ * v[i] + grad_scale * g[i];
      w[i] -= lr_ * v[i];
    }
  }

 private:
  float lr_, mu_;
};

// Adam's loop over n elements. Bound by vector square roots and divisions
// when the block is in cache (a shard's share of a small model), so it is
// built twice, for AVX2 (8 lanes) and the x86-64 baseline (4), and the
// loader picks what the CPU has. No FMA: both give the same bits.
__attribute__((target_clones("avx2", "default"))) void AdamLoop(
    size_t n, float* __restrict w, const float* __restrict g,
    float* __restrict m, float* __restrict v, float grad_scale, float beta1,
    float beta2, float eps, float step, float inv_sqrt_c2) {
  for (size_t i = 0; i < n; ++i) {
    const float gi = grad_scale * g[i];
    const float mi = beta1 * m[i] + (1 - beta1) * gi;
    const float vi = beta2 * v[i] + (1 - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    w[i] -= step * mi / (std::sqrt(vi) * inv_sqrt_c2 + eps);
  }
}

// Adam (Kingma & Ba) with bias correction folded into the step size.
class Adam : public Optimizer {
 public:
  Adam(float lr, float beta1, float beta2, float eps)
      : lr_(lr), beta1_(beta1), beta2_(beta2), eps_(eps) {}
  int state_per_element() const override { return 2; }
  void UpdateRange(int64_t update_count, absl::Span<float> param,
                   int64_t offset, absl::Span<const float> grad,
                   absl::Span<float> state, float grad_scale) const override {
    const double t = static_cast<double>(update_count);
    const float correction1 = static_cast<float>(1 - std::pow(beta1_, t));
    const float correction2 = static_cast<float>(1 - std::pow(beta2_, t));
    // The arrays never overlap each other (AdamLoop's __restrict).
    AdamLoop(grad.size(), param.data() + offset, grad.data(),
             state.data() + offset, state.data() + param.size() + offset,
             grad_scale, beta1_, beta2_, eps_, lr_ / correction1,
             1.0f / std::sqrt(correction2));
  }

 private:
  float lr_, beta1_, beta2_, eps_;
};

absl::Status CheckRange(const char* flag, float value, float lo, float hi,
                        bool hi_inclusive) {
  const bool ok = std::isfinite(value) && value >= lo &&
                  (hi_inclusive ? value <= hi : value < hi);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be in [", lo, ", ", hi,
                   hi_inclusive ? "]" : ")", ", got ", value));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(
    const OptimizerConfig& c) {
  // The name first: a rate left at 0 by an unknown optimizer (which has no
  // default rate, common/learning_rates.h) is not the mistake to report.
  if (c.name != "sgd" && c.name != "momentum" && c.name != "adam") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--optimizer must be sgd, momentum or adam, got '", c.name, "'"));
  }
  if (!std::isfinite(c.learning_rate) || c.learning_rate <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--learning_rate must be a positive number, got ", c.learning_rate));
  }
  if (c.name == "sgd") return std::make_unique<Sgd>(c.learning_rate);
  if (c.name == "momentum") {
    if (absl::Status s = CheckRange("momentum", c.momentum, 0, 1, false);
        !s.ok()) {
      return s;
    }
    return std::make_unique<Momentum>(c.learning_rate, c.momentum);
  }
  if (c.name == "adam") {
    for (absl::Status s : {CheckRange("adam_beta1", c.beta1, 0, 1, false),
                           CheckRange("adam_beta2", c.beta2, 0, 1, false),
                           CheckRange("adam_epsilon", c.epsilon, 0, 1, true)}) {
      if (!s.ok()) return s;
    }
    if (c.epsilon <= 0) {
      return absl::InvalidArgumentError("--adam_epsilon must be positive");
    }
    return std::make_unique<Adam>(c.learning_rate, c.beta1, c.beta2, c.epsilon);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--optimizer must be sgd, momentum or adam, got '", c.name, "'"));
}

}  // namespace pstrain
