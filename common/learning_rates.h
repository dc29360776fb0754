// The learning rate each optimizer gets when the user gives none. One rate
// shared by every optimizer cannot fit them all: SGD's 0.1 makes Adam
// diverge to chance (issue 29), Adam's 1e-3 makes SGD crawl. These follow
// what PyTorch and Keras users already know; each says where it comes from,
// and so does the flag's help that uses it.
#ifndef PSTRAIN_COMMON_LEARNING_RATES_H_
#define PSTRAIN_COMMON_LEARNING_RATES_H_

#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace pstrain {

struct DefaultLearningRate {
  double value = 0;
  const char* source = "";  // e.g. "torch.optim.Adam and keras Adam"
};

// Dense optimizers of ps_server (--optimizer): sgd, momentum, adam.
// nullopt for a name it does not know (the optimizer refuses it later).
std::optional<DefaultLearningRate> DefaultDenseLearningRate(
    absl::string_view optimizer);

// Sparse-table optimizers (--sparse_optimizer): sgd, adagrad, adam. FTRL
// takes its rate from --ftrl_alpha instead: nullopt, as for unknown names.
std::optional<DefaultLearningRate> DefaultSparseLearningRate(
    absl::string_view optimizer);

// The optimizer's default when `given` is 0 (the flag left alone), else
// `given` as it is: a negative one is for validation to refuse, and so is
// 0 for an optimizer without a default.
double EffectiveLearningRate(
    double given, const std::optional<DefaultLearningRate>& fallback);

// "0.001 (adam's default, as in torch.optim.Adam and keras Adam; <flag>
// sets it)" or "0.05 (<flag>)": what a start-up log line says.
std::string DescribeLearningRate(
    double given, absl::string_view optimizer,
    const std::optional<DefaultLearningRate>& fallback, absl::string_view flag);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_LEARNING_RATES_H_
