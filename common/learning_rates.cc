#include "common/learning_rates.h"

#include "absl/strings/str_cat.h"

namespace pstrain {

std::optional<DefaultLearningRate> DefaultDenseLearningRate(
    absl::string_view optimizer) {
  // PyTorch 1.13's torch.optim.SGD has no default (lr is required) and
  // Keras' 0.01 halves what the default worker job reaches in its 300
  // steps (0.65 against 0.90 held-out accuracy), so plain SGD takes the
  // rate of PyTorch's reference recipe. With momentum 0.9 the same step
  // size (lr / (1 - momentum) = 0.1) is Keras' 0.01.
  if (optimizer == "sgd") {
    return DefaultLearningRate{
        0.1, "torchvision's reference classification recipe (--lr 0.1)"};
  }
  if (optimizer == "momentum") {
    return DefaultLearningRate{0.01, "keras SGD(momentum=0.9)"};
  }
  if (optimizer == "adam") {
    return DefaultLearningRate{0.001, "torch.optim.Adam and keras Adam"};
  }
  if (optimizer == "adamw") {
    return DefaultLearningRate{0.001, "torch.optim.AdamW"};
  }
  return std::nullopt;
}

std::optional<DefaultLearningRate> DefaultSparseLearningRate(
    absl::string_view optimizer) {
  if (optimizer == "sgd") return DefaultLearningRate{0.01, "keras SGD"};
  // Keras' Adagrad starts at 0.001; PyTorch's is the one embedding users
  // (torch.optim.Adagrad on sparse gradients) meet.
  if (optimizer == "adagrad") {
    return DefaultLearningRate{0.01, "torch.optim.Adagrad"};
  }
  if (optimizer == "adam") {
    return DefaultLearningRate{0.001, "torch.optim.SparseAdam and keras Adam"};
  }
  return std::nullopt;
}

double EffectiveLearningRate(
    double given, const std::optional<DefaultLearningRate>& fallback) {
  // Only 0 asks for the default: a negative rate is kept for validation
  // to refuse, never silently replaced.
  if (given != 0 || !fallback.has_value()) return given;
  return fallback->value;
}

std::string DescribeLearningRate(
    double given, absl::string_view optimizer,
    const std::optional<DefaultLearningRate>& fallback,
    absl::string_view flag) {
  const double rate = EffectiveLearningRate(given, fallback);
  if (given != 0 || !fallback.has_value()) {
    return absl::StrCat(rate, " (", flag, ")");
  }
  return absl::StrCat(rate, " (", optimizer, "'s default, as in ",
                      fallback->source, "; ", flag, " sets it)");
}

}  // namespace pstrain
