#include "worker/ctr_metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace pstrain {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

template <typename Score>
double AucImpl(absl::Span<const float> labels, absl::Span<const Score> scores) {
  if (labels.size() != scores.size()) return kNaN;
  const size_t n = scores.size();
  // A NaN would break the sort's strict weak ordering (undefined behaviour),
  // and no ranking of it is right anyway.
  for (Score s : scores) {
    if (std::isnan(s)) return kNaN;
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return scores[a] < scores[b]; });
  // Walk groups of equal scores from the lowest: each positive in a group
  // beats every negative below it and ties (half) with the group's own.
  double negatives_below = 0;
  double wins = 0;  // counts halves, so exact while below 2^52 pairs
  double positives = 0;
  for (size_t begin = 0; begin < n;) {
    size_t end = begin;
    double group_pos = 0;
    double group_neg = 0;
    while (end < n && scores[order[end]] == scores[order[begin]]) {
      if (labels[order[end]] >= 0.5f) {
        ++group_pos;
      } else {
        ++group_neg;
      }
      ++end;
    }
    wins += group_pos * negatives_below + 0.5 * group_pos * group_neg;
    negatives_below += group_neg;
    positives += group_pos;
    begin = end;
  }
  if (positives == 0 || negatives_below == 0) return kNaN;
  return wins / (positives * negatives_below);
}

}  // namespace

double Auc(absl::Span<const float> labels, absl::Span<const double> scores) {
  return AucImpl(labels, scores);
}

double Auc(absl::Span<const float> labels, absl::Span<const float> scores) {
  return AucImpl(labels, scores);
}

double LogLoss(absl::Span<const float> labels,
               absl::Span<const double> probabilities) {
  if (labels.empty() || labels.size() != probabilities.size()) return kNaN;
  double sum = 0;
  for (size_t i = 0; i < labels.size(); ++i) {
    const double p =
        std::clamp(probabilities[i], kLogLossEpsilon, 1.0 - kLogLossEpsilon);
    const double y = labels[i];
    sum -= y * std::log(p) + (1.0 - y) * std::log1p(-p);
  }
  return sum / static_cast<double>(labels.size());
}

double LogLossFromLogits(absl::Span<const float> labels,
                         absl::Span<const float> logits) {
  if (labels.empty() || labels.size() != logits.size()) return kNaN;
  double sum = 0;
  for (size_t i = 0; i < labels.size(); ++i) {
    const double z = logits[i];
    // softplus(z) = max(z, 0) + log(1 + exp(-|z|)): no overflow for any z.
    const double softplus =
        std::max(z, 0.0) + std::log1p(std::exp(-std::abs(z)));
    sum += softplus - static_cast<double>(labels[i]) * z;
  }
  return sum / static_cast<double>(labels.size());
}

}  // namespace pstrain
