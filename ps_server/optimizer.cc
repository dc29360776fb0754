#include "ps_server/optimizer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pstrain {
namespace {

// w -= lr * g
class Sgd : public Optimizer {
 public:
  Sgd(float lr, float wd) : lr_(lr), wd_(wd) {}
  int state_per_element() const override { return 0; }
  float learning_rate() const override { return lr_; }
  void UpdateRange(int64_t, const StepHyper& hyper, absl::Span<float> param,
                   int64_t offset, absl::Span<const float> grad,
                   absl::Span<float>, float grad_scale) const override {
    const size_t n = grad.size();
    const float lr = hyper.lr;
    float* __restrict w = param.data() + offset;
    const float* __restrict g = grad.data();
    if (wd_ == 0) {
      for (size_t i = 0; i < n; ++i) w[i] -= lr * (grad_scale * g[i]);
    } else {
      for (size_t i = 0; i < n; ++i)
        w[i] -= lr * (grad_scale * g[i] + wd_ * w[i]);
    }
  }

 private:
  float lr_, wd_;
};

// Heavy-ball momentum as PyTorch defines it: v = mu * v + g; w -= lr * v.
class Momentum : public Optimizer {
 public:
  Momentum(float lr, float mu, float wd) : lr_(lr), mu_(mu), wd_(wd) {}
  int state_per_element() const override { return 1; }
  float learning_rate() const override { return lr_; }
  void UpdateRange(int64_t, const StepHyper& hyper, absl::Span<float> param,
                   int64_t offset, absl::Span<const float> grad,
                   absl::Span<float> state, float grad_scale) const override {
    const size_t n = grad.size();
    const float lr = hyper.lr;
    float* __restrict w = param.data() + offset;
    const float* __restrict g = grad.data();
    float* __restrict v = state.data() + offset;
    for (size_t i = 0; i < n; ++i) {
      v[i] = mu_ * v[i] + (grad_scale * g[i] + wd_ * w[i]);
      w[i] -= lr * v[i];
    }
  }

 private:
  float lr_, mu_, wd_;
};

// Adam's loop over n elements. Bound by vector square roots and divisions
// when the block is in cache (a shard's share of a small model), so it is
// built twice, for AVX2 (8 lanes) and the x86-64 baseline (4), and the
// loader picks what the CPU has. No FMA: both give the same bits.
__attribute__((target_clones("avx2", "default"))) void AdamLoop(
    size_t n, float* __restrict w, const float* __restrict g,
    float* __restrict m, float* __restrict v, float grad_scale, float beta1,
    float beta2, float eps, float step, float inv_sqrt_c2, float wd) {
  for (size_t i = 0; i < n; ++i) {
    const float gi = grad_scale * g[i] + wd * w[i];
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
  Adam(float lr, float beta1, float beta2, float eps, float wd)
      : lr_(lr), beta1_(beta1), beta2_(beta2), eps_(eps), wd_(wd) {}
  int state_per_element() const override { return 2; }
  float learning_rate() const override { return lr_; }
  void UpdateRange(int64_t update_count, const StepHyper& hyper,
                   absl::Span<float> param, int64_t offset,
                   absl::Span<const float> grad, absl::Span<float> state,
                   float grad_scale) const override {
    const float lr = hyper.lr;
    const double t = static_cast<double>(update_count);
    const float correction1 = static_cast<float>(1 - std::pow(beta1_, t));
    const float correction2 = static_cast<float>(1 - std::pow(beta2_, t));
    // The arrays never overlap each other (AdamLoop's __restrict).
    AdamLoop(grad.size(), param.data() + offset, grad.data(),
             state.data() + offset, state.data() + param.size() + offset,
             grad_scale, beta1_, beta2_, eps_, lr / correction1,
             1.0f / std::sqrt(correction2), wd_);
  }

 private:
  float lr_, beta1_, beta2_, eps_, wd_;
};

// ---------------------------------------------------------------------------
// torch.optim's rules (the single-tensor forms of torch/optim/*.py), in
// float32 as torch computes float32 parameters, with its Python-float
// scalars (bias corrections, the Adagrad rate) in double, as Python has them.

// Their loops: over __restrict arrays, with every option a loop-invariant
// condition GCC unswitches, built for AVX2 and the x86-64 baseline as
// AdamLoop is (no FMA: the same bits either way), so that handing the
// servers a torch optimizer costs what their own would
// (bench/apply_bench.cc measures both).

__attribute__((target_clones("avx2", "default"))) void TorchSgdLoop(
    size_t n, float* __restrict w, const float* __restrict g,
    float* __restrict b, float grad_scale, float lr, float wd, float mu,
    float dampening, bool first, bool nesterov) {
  if (b == nullptr) {  // no momentum buffer
    for (size_t i = 0; i < n; ++i) {
      const float d = grad_scale * g[i] + wd * w[i];
      w[i] = w[i] - lr * d;
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    float d = grad_scale * g[i] + wd * w[i];
    const float bi = first ? d : mu * b[i] + (1 - dampening) * d;
    b[i] = bi;
    d = nesterov ? d + mu * bi : bi;
    w[i] = w[i] - lr * d;
  }
}

__attribute__((target_clones("avx2", "default"))) void TorchAdamLoop(
    size_t n, float* __restrict w, const float* __restrict g,
    float* __restrict m, float* __restrict v, float grad_scale, float beta1,
    float beta2, float eps, float step_size, float inv_correction2_sqrt,
    float coupled_wd, float decay) {
  for (size_t i = 0; i < n; ++i) {
    const float wi = w[i] * decay;  // AdamW's decoupled decay (1 for Adam)
    const float gi = grad_scale * g[i] + coupled_wd * wi;
    const float mi = beta1 * m[i] + (1 - beta1) * gi;
    const float vi = beta2 * v[i] + (1 - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    // torch divides by sqrt(1 - b2^t); a multiply by its inverse saves a
    // division per element (a difference in the last bit).
    const float denom = std::sqrt(vi) * inv_correction2_sqrt + eps;
    w[i] = wi - step_size * (mi / denom);
  }
}

__attribute__((target_clones("avx2", "default"))) void TorchAdagradLoop(
    size_t n, float* __restrict w, const float* __restrict g,
    float* __restrict s, float grad_scale, float wd, float clr, float eps) {
  for (size_t i = 0; i < n; ++i) {
    const float gi = grad_scale * g[i] + wd * w[i];
    const float si = s[i] + gi * gi;
    s[i] = si;
    w[i] = w[i] - clr * (gi / (std::sqrt(si) + eps));
  }
}

__attribute__((target_clones("avx2", "default"))) void TorchRmspropLoop(
    size_t n, float* __restrict w, const float* __restrict g,
    float* __restrict a, float* __restrict c, float* __restrict b,
    float grad_scale, float wd, float alpha, float eps, float mu, float lr) {
  for (size_t i = 0; i < n; ++i) {
    const float gi = grad_scale * g[i] + wd * w[i];
    const float ai = alpha * a[i] + (1 - alpha) * gi * gi;
    a[i] = ai;
    float avg;
    if (c != nullptr) {  // centered
      const float ci = alpha * c[i] + (1 - alpha) * gi;
      c[i] = ci;
      avg = std::sqrt(ai - ci * ci);
    } else {
      avg = std::sqrt(ai);
    }
    avg = avg + eps;
    if (b != nullptr) {  // momentum
      const float bi = mu * b[i] + gi / avg;
      b[i] = bi;
      w[i] = w[i] - lr * bi;
    } else {
      w[i] = w[i] - lr * (gi / avg);
    }
  }
}

// SGD: d = g + wd * w; with momentum, b = d on the first update, else
// b = mu * b + (1 - dampening) * d, and d = nesterov ? d + mu * b : b;
// w -= lr * d.
class TorchSgd : public Optimizer {
 public:
  explicit TorchSgd(const TorchOptimizer& c)
      : lr_(c.lr()),
        wd_(c.weight_decay()),
        mu_(c.momentum()),
        dampening_(c.dampening()),
        nesterov_(c.nesterov()) {}
  int state_per_element() const override { return mu_ != 0 ? 1 : 0; }
  float learning_rate() const override { return lr_; }
  void UpdateRange(int64_t update_count, const StepHyper& hyper,
                   absl::Span<float> param, int64_t offset,
                   absl::Span<const float> grad, absl::Span<float> state,
                   float grad_scale) const override {
    TorchSgdLoop(grad.size(), param.data() + offset, grad.data(),
                 mu_ != 0 ? state.data() + offset : nullptr, grad_scale,
                 hyper.lr, wd_, hyper.momentum.value_or(mu_), dampening_,
                 update_count == 1, nesterov_);
  }

 private:
  float lr_, wd_, mu_, dampening_;
  bool nesterov_;
};

// Adam, and AdamW (decoupled decay: w *= 1 - lr * wd first): g += wd * w
// (Adam only); m = b1 * m + (1 - b1) * g; v = b2 * v + (1 - b2) * g * g;
// w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
class TorchAdam : public Optimizer {
 public:
  TorchAdam(const TorchOptimizer& c, bool decoupled)
      : lr_(c.lr()),
        wd_(c.weight_decay()),
        beta1_(c.beta1()),
        beta2_(c.beta2()),
        eps_(c.eps()),
        decoupled_(decoupled) {}
  int state_per_element() const override { return 2; }
  float learning_rate() const override { return lr_; }
  void UpdateRange(int64_t update_count, const StepHyper& hyper,
                   absl::Span<float> param, int64_t offset,
                   absl::Span<const float> grad, absl::Span<float> state,
                   float grad_scale) const override {
    const float lr = hyper.lr;
    const float beta1 = hyper.momentum.value_or(beta1_);
    const double t = static_cast<double>(update_count);
    const float step_size =
        static_cast<float>(lr / (1 - std::pow(double{beta1}, t)));
    const float inv_correction2_sqrt =
        static_cast<float>(1 / std::sqrt(1 - std::pow(double{beta2_}, t)));
    TorchAdamLoop(grad.size(), param.data() + offset, grad.data(),
                  state.data() + offset, state.data() + param.size() + offset,
                  grad_scale, beta1, beta2_, eps_, step_size,
                  inv_correction2_sqrt, decoupled_ ? 0.0f : wd_,
                  decoupled_ ? 1 - lr * wd_ : 1.0f);
  }

 private:
  float lr_, wd_, beta1_, beta2_, eps_;
  bool decoupled_;
};

// Adagrad: g += wd * w; s += g * g (s starts at initial_accumulator_value);
// w -= lr / (1 + (t - 1) * lr_decay) * g / (sqrt(s) + eps).
class TorchAdagrad : public Optimizer {
 public:
  explicit TorchAdagrad(const TorchOptimizer& c)
      : lr_(c.lr()),
        wd_(c.weight_decay()),
        lr_decay_(c.lr_decay()),
        initial_(c.initial_accumulator_value()),
        eps_(c.eps()) {}
  int state_per_element() const override { return 1; }
  float learning_rate() const override { return lr_; }
  void InitState(absl::Span<float> state) const override {
    std::fill(state.begin(), state.end(), initial_);
  }
  void UpdateRange(int64_t update_count, const StepHyper& hyper,
                   absl::Span<float> param, int64_t offset,
                   absl::Span<const float> grad, absl::Span<float> state,
                   float grad_scale) const override {
    const float clr = static_cast<float>(
        double{hyper.lr} /
        (1 + static_cast<double>(update_count - 1) * lr_decay_));
    TorchAdagradLoop(grad.size(), param.data() + offset, grad.data(),
                     state.data() + offset, grad_scale, wd_, clr, eps_);
  }

 private:
  float lr_, wd_;
  double lr_decay_;
  float initial_, eps_;
};

// RMSprop: g += wd * w; a = alpha * a + (1 - alpha) * g * g; centered:
// c = alpha * c + (1 - alpha) * g, avg = sqrt(a - c * c), else sqrt(a);
// avg += eps; with momentum b = mu * b + g / avg, w -= lr * b; else
// w -= lr * g / avg. Slots: a, then c (centered), then b (momentum).
class TorchRmsprop : public Optimizer {
 public:
  explicit TorchRmsprop(const TorchOptimizer& c)
      : lr_(c.lr()),
        wd_(c.weight_decay()),
        alpha_(c.alpha()),
        eps_(c.eps()),
        mu_(c.momentum()),
        centered_(c.centered()) {}
  int state_per_element() const override {
    return 1 + (centered_ ? 1 : 0) + (mu_ != 0 ? 1 : 0);
  }
  float learning_rate() const override { return lr_; }
  void UpdateRange(int64_t, const StepHyper& hyper, absl::Span<float> param,
                   int64_t offset, absl::Span<const float> grad,
                   absl::Span<float> state, float grad_scale) const override {
    const size_t n = param.size();
    float* a = state.data() + offset;
    float* c = centered_ ? state.data() + n + offset : nullptr;
    float* b =
        mu_ != 0 ? state.data() + (centered_ ? 2 : 1) * n + offset : nullptr;
    TorchRmspropLoop(grad.size(), param.data() + offset, grad.data(), a, c, b,
                     grad_scale, wd_, alpha_, eps_,
                     hyper.momentum.value_or(mu_), hyper.lr);
  }

 private:
  float lr_, wd_, alpha_, eps_, mu_;
  bool centered_;
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

// torch's own checks of a hyper-parameter ("Invalid learning rate: -1"),
// worded for an option a user set on their optimizer.
absl::Status CheckTorch(absl::string_view rule, const char* option,
                        double value, double lo, double hi, bool hi_inclusive) {
  const bool ok = std::isfinite(value) && value >= lo &&
                  (hi_inclusive ? value <= hi : value < hi);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(rule, ": ", option, " must be in [", lo, ", ", hi,
                   hi_inclusive ? "]" : ")", ", got ", value));
}

}  // namespace

void Optimizer::InitState(absl::Span<float> state) const {
  std::fill(state.begin(), state.end(), 0.0f);
}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::CreateTorch(
    const TorchOptimizer& c) {
  const std::string& name = c.name();
  if (name != "sgd" && name != "adam" && name != "adamw" && name != "adagrad" &&
      name != "rmsprop") {
    return absl::InvalidArgumentError(absl::StrCat(
        "torch optimizer '", name,
        "' is not one the servers run (sgd, adam, adamw, adagrad, rmsprop)"));
  }
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<absl::Status> checks = {
      CheckTorch(name, "lr", c.lr(), 0, kInf, false),
      CheckTorch(name, "weight_decay", c.weight_decay(), 0, kInf, false),
      absl::OkStatus()};
  if (c.group() < 0) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat(name, ": group must be >= 0, got ", c.group())));
  }
  if (name == "sgd") {
    checks.push_back(
        CheckTorch(name, "momentum", c.momentum(), 0, kInf, false));
    checks.push_back(
        CheckTorch(name, "dampening", c.dampening(), 0, kInf, false));
    if (c.nesterov() && (c.momentum() <= 0 || c.dampening() != 0)) {
      checks.push_back(absl::InvalidArgumentError(
          "sgd: nesterov needs a momentum and zero dampening"));
    }
  } else if (name == "adam" || name == "adamw") {
    checks.push_back(CheckTorch(name, "betas[0]", c.beta1(), 0, 1, false));
    checks.push_back(CheckTorch(name, "betas[1]", c.beta2(), 0, 1, false));
    checks.push_back(CheckTorch(name, "eps", c.eps(), 0, kInf, false));
  } else if (name == "adagrad") {
    checks.push_back(
        CheckTorch(name, "lr_decay", c.lr_decay(), 0, kInf, false));
    checks.push_back(CheckTorch(name, "initial_accumulator_value",
                                c.initial_accumulator_value(), 0, kInf, false));
    checks.push_back(CheckTorch(name, "eps", c.eps(), 0, kInf, false));
  } else {  // rmsprop
    checks.push_back(CheckTorch(name, "alpha", c.alpha(), 0, kInf, false));
    checks.push_back(CheckTorch(name, "eps", c.eps(), 0, kInf, false));
    checks.push_back(
        CheckTorch(name, "momentum", c.momentum(), 0, kInf, false));
  }
  for (const absl::Status& s : checks) {
    if (!s.ok()) return s;
  }
  if (name == "sgd") return std::make_unique<TorchSgd>(c);
  if (name == "adam") return std::make_unique<TorchAdam>(c, false);
  if (name == "adamw") return std::make_unique<TorchAdam>(c, true);
  if (name == "adagrad") return std::make_unique<TorchAdagrad>(c);
  return std::make_unique<TorchRmsprop>(c);
}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(
    const OptimizerConfig& c) {
  // The name first: a rate left at 0 by an unknown optimizer (which has no
  // default rate, common/learning_rates.h) is not the mistake to report.
  if (c.name != "sgd" && c.name != "momentum" && c.name != "adam" &&
      c.name != "adamw") {
    return absl::InvalidArgumentError(
        absl::StrCat("--optimizer must be sgd, momentum, adam or adamw, got '",
                     c.name, "'"));
  }
  if (!std::isfinite(c.learning_rate) || c.learning_rate <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--learning_rate must be a positive number, got ", c.learning_rate));
  }
  if (!std::isfinite(c.weight_decay) || c.weight_decay < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--weight_decay must be >= 0, got ", c.weight_decay));
  }
  if (c.name == "sgd") {
    return std::make_unique<Sgd>(c.learning_rate, c.weight_decay);
  }
  if (c.name == "momentum") {
    if (absl::Status s = CheckRange("momentum", c.momentum, 0, 1, false);
        !s.ok()) {
      return s;
    }
    return std::make_unique<Momentum>(c.learning_rate, c.momentum,
                                      c.weight_decay);
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
    return std::make_unique<Adam>(c.learning_rate, c.beta1, c.beta2, c.epsilon,
                                  c.weight_decay);
  }
  if (c.name == "adamw") {  // torch.optim.AdamW's rule, from the flags
    TorchOptimizer rule;
    rule.set_name("adamw");
    rule.set_lr(c.learning_rate);
    rule.set_weight_decay(c.weight_decay);
    rule.set_beta1(c.beta1);
    rule.set_beta2(c.beta2);
    rule.set_eps(c.epsilon);
    absl::StatusOr<std::unique_ptr<Optimizer>> adamw = CreateTorch(rule);
    if (!adamw.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--optimizer=adamw: ", adamw.status().message()));
    }
    return adamw;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--optimizer must be sgd, momentum, adam or adamw, got '", c.name, "'"));
}

}  // namespace pstrain
