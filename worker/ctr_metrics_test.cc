#include "worker/ctr_metrics.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

// The definition: the fraction of (positive, negative) pairs ranked right,
// ties counting one half. O(n^2), for checking the O(n log n) version.
double BruteForceAuc(const std::vector<float>& labels,
                     const std::vector<double>& scores) {
  double wins = 0;
  double pairs = 0;
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] < 0.5f) continue;
    for (size_t j = 0; j < labels.size(); ++j) {
      if (labels[j] >= 0.5f) continue;
      pairs += 1;
      if (scores[i] > scores[j]) wins += 1;
      if (scores[i] == scores[j]) wins += 0.5;
    }
  }
  return wins / pairs;
}

TEST(AucTest, KnownValues) {
  // The scikit-learn roc_auc_score doc example.
  EXPECT_DOUBLE_EQ(Auc({0, 0, 1, 1}, std::vector<double>{0.1, 0.4, 0.35, 0.8}),
                   0.75);
  // Positive 0.5 ties negative 0.5 (1/2) and beats 0.2 (1); 0.9 beats both.
  EXPECT_DOUBLE_EQ(Auc({0, 1, 0, 1}, std::vector<double>{0.5, 0.5, 0.2, 0.9}),
                   3.5 / 4);
  EXPECT_DOUBLE_EQ(Auc({0, 0, 1, 1}, std::vector<double>{1, 2, 3, 4}), 1.0);
  EXPECT_DOUBLE_EQ(Auc({1, 1, 0, 0}, std::vector<double>{1, 2, 3, 4}), 0.0);
  EXPECT_DOUBLE_EQ(Auc({1, 0, 1, 0, 0}, std::vector<double>(5, 7.0)), 0.5);
}

TEST(AucTest, FloatScoresAndMonotoneTransformsAgree) {
  const std::vector<float> labels = {1, 0, 0, 1, 0, 1, 1, 0};
  const std::vector<float> logits = {2, -1, 0.5, 0.5, -3, 1, -1, 0};
  std::vector<double> probabilities;
  for (float z : logits) probabilities.push_back(1.0 / (1.0 + std::exp(-z)));
  const double expected =
      BruteForceAuc(labels, std::vector<double>(logits.begin(), logits.end()));
  EXPECT_DOUBLE_EQ(Auc(labels, logits), expected);
  EXPECT_DOUBLE_EQ(Auc(labels, probabilities), expected);
}

TEST(AucTest, MatchesBruteForceOnRandomDataWithTies) {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 50; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 400);
    // Few distinct score values so that ties are everywhere, including
    // groups mixing positives and negatives.
    const int levels = 1 + static_cast<int>(rng() % 20);
    std::vector<float> labels(n);
    std::vector<double> scores(n);
    for (int i = 0; i < n; ++i) {
      labels[i] = static_cast<float>(rng() % 3 == 0);
      scores[i] = static_cast<double>(rng() % levels) * 0.25 - 1.0;
    }
    labels[0] = 1;
    if (n > 1) labels[1] = 0;
    if (n == 1) continue;
    EXPECT_NEAR(Auc(labels, scores), BruteForceAuc(labels, scores), 1e-12)
        << "trial " << trial << " n " << n << " levels " << levels;
  }
}

TEST(AucTest, UndefinedIsNaN) {
  EXPECT_TRUE(std::isnan(Auc({1, 1}, std::vector<double>{0.1, 0.2})));
  EXPECT_TRUE(std::isnan(Auc({0, 0}, std::vector<double>{0.1, 0.2})));
  EXPECT_TRUE(std::isnan(Auc({}, std::vector<double>{})));
  EXPECT_TRUE(std::isnan(Auc({0, 1}, std::vector<double>{0.1})));
  EXPECT_TRUE(std::isnan(
      Auc({0, 1},
          std::vector<double>{0.1, std::numeric_limits<double>::quiet_NaN()})));
}

TEST(AucTest, LargeInputIsFastAndExact) {
  // 10^6 examples in two score levels: exact in closed form.
  const int n = 1000000;
  std::vector<float> labels(n);
  std::vector<double> scores(n);
  for (int i = 0; i < n; ++i) {
    labels[i] = static_cast<float>(i % 4 == 0);  // 250000 positives
    scores[i] = (i % 2 == 0) ? 1.0 : 0.0;
  }
  // Positives all score 1; negatives: 250000 score 1 (ties), 500000 score 0.
  const double expected =
      (250000.0 * 500000 + 0.5 * 250000.0 * 250000) / (250000.0 * 750000);
  EXPECT_DOUBLE_EQ(Auc(labels, scores), expected);
}

TEST(LogLossTest, KnownValues) {
  EXPECT_NEAR(LogLoss({1}, std::vector<double>{0.5}), std::log(2.0), 1e-15);
  EXPECT_NEAR(LogLoss({0, 1}, std::vector<double>{0.2, 0.9}),
              -(std::log(0.8) + std::log(0.9)) / 2, 1e-15);
  // Soft labels: y = 0.3, p = 0.3 is the entropy of 0.3.
  EXPECT_NEAR(LogLoss({0.3f}, std::vector<double>{0.3}),
              -(0.3f * std::log(0.3) + (1 - 0.3f) * std::log(0.7)), 1e-7);
}

TEST(LogLossTest, ClipsAtEpsilon) {
  EXPECT_NEAR(LogLoss({1}, std::vector<double>{0.0}),
              -std::log(kLogLossEpsilon), 1e-12);
  EXPECT_NEAR(LogLoss({0}, std::vector<double>{1.0}),
              -std::log(kLogLossEpsilon), 1e-6);
  EXPECT_NEAR(LogLoss({1}, std::vector<double>{1.0}), kLogLossEpsilon, 1e-12);
  EXPECT_TRUE(std::isfinite(LogLoss({1, 0}, std::vector<double>{0.0, 1.0})));
}

TEST(LogLossTest, UndefinedIsNaN) {
  EXPECT_TRUE(std::isnan(LogLoss({}, std::vector<double>{})));
  EXPECT_TRUE(std::isnan(LogLoss({1}, std::vector<double>{0.5, 0.5})));
  EXPECT_TRUE(std::isnan(LogLossFromLogits({}, std::vector<float>{})));
}

TEST(LogLossTest, FromLogitsMatchesProbabilitiesAndNeverOverflows) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> labels;
  std::vector<float> logits;
  std::vector<double> probabilities;
  for (int i = 0; i < 1000; ++i) {
    labels.push_back(static_cast<float>(rng() % 2));
    logits.push_back(normal(rng));
    probabilities.push_back(1.0 / (1.0 + std::exp(-double(logits.back()))));
  }
  EXPECT_NEAR(LogLossFromLogits(labels, logits), LogLoss(labels, probabilities),
              1e-9);
  // Confident mistakes cost |z| exactly, far past where p rounds to 0 or 1.
  EXPECT_NEAR(LogLossFromLogits({0}, std::vector<float>{100}), 100.0, 1e-9);
  EXPECT_NEAR(LogLossFromLogits({1}, std::vector<float>{-100}), 100.0, 1e-9);
  EXPECT_NEAR(LogLossFromLogits({1}, std::vector<float>{100}), 0.0, 1e-40);
}

}  // namespace
}  // namespace pstrain
