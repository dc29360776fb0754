// Metrics of a binary classifier on held-out data: ROC AUC and logloss.
// Labels are 0/1 floats (as in CtrDataset); a label >= 0.5 counts as positive
// for the AUC.
#ifndef PSTRAIN_WORKER_CTR_METRICS_H_
#define PSTRAIN_WORKER_CTR_METRICS_H_

#include "absl/types/span.h"

namespace pstrain {

// Exact ROC AUC: the probability that a random positive scores above a random
// negative, ties counting one half (the Mann-Whitney U statistic over
// n_pos * n_neg, i.e. average ranks for ties). O(n log n) (one sort); pair
// counts are exact integers in double up to 2^53 pairs.
// Returns NaN when it is undefined: no positives or no negatives, a NaN score,
// or labels and scores of different sizes. Any monotone transform of the
// scores (probabilities, logits) gives the same AUC.
double Auc(absl::Span<const float> labels, absl::Span<const double> scores);
double Auc(absl::Span<const float> labels, absl::Span<const float> scores);

// Probabilities are clipped to [kLogLossEpsilon, 1 - kLogLossEpsilon]: a
// float32 probability cannot tell 1 - p apart below ~6e-8, so a tighter clip
// would only reward rounding, and one confident mistake costs at most
// -log(1e-7) ~= 16.1 instead of infinity.
inline constexpr double kLogLossEpsilon = 1e-7;

// Mean binary cross-entropy -[y log p + (1 - y) log(1 - p)] over the
// examples (labels in [0, 1]; soft labels are fine). NaN when empty or the
// sizes differ.
double LogLoss(absl::Span<const float> labels,
               absl::Span<const double> probabilities);

// The same loss from logits z (p = sigmoid(z)), computed stably as
// softplus(z) - y z with no clipping: prefer it when the model has logits.
double LogLossFromLogits(absl::Span<const float> labels,
                         absl::Span<const float> logits);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CTR_METRICS_H_
