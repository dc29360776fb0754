#include "common/learning_rates.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

TEST(LearningRatesTest, DenseDefaultsFollowPyTorchAndKeras) {
  EXPECT_DOUBLE_EQ(DefaultDenseLearningRate("adam")->value, 1e-3);
  EXPECT_DOUBLE_EQ(DefaultDenseLearningRate("sgd")->value, 0.1);
  EXPECT_DOUBLE_EQ(DefaultDenseLearningRate("momentum")->value, 1e-2);
  EXPECT_FALSE(DefaultDenseLearningRate("lamb").has_value());
}

TEST(LearningRatesTest, SparseDefaults) {
  EXPECT_DOUBLE_EQ(DefaultSparseLearningRate("adam")->value, 1e-3);
  EXPECT_DOUBLE_EQ(DefaultSparseLearningRate("adagrad")->value, 1e-2);
  EXPECT_DOUBLE_EQ(DefaultSparseLearningRate("sgd")->value, 1e-2);
  EXPECT_FALSE(DefaultSparseLearningRate("ftrl").has_value());
}

TEST(LearningRatesTest, AGivenRateWins) {
  EXPECT_DOUBLE_EQ(EffectiveLearningRate(0.5, DefaultDenseLearningRate("adam")),
                   0.5);
  EXPECT_DOUBLE_EQ(EffectiveLearningRate(0, DefaultDenseLearningRate("adam")),
                   1e-3);
  // A bad rate is not replaced: validation refuses it.
  EXPECT_DOUBLE_EQ(EffectiveLearningRate(-1, DefaultDenseLearningRate("sgd")),
                   -1);
  // No default to fall back on: the 0 stays for validation to refuse.
  EXPECT_DOUBLE_EQ(EffectiveLearningRate(0, std::nullopt), 0);
}

TEST(LearningRatesTest, DescriptionNamesTheSource) {
  EXPECT_EQ(DescribeLearningRate(0, "adam", DefaultDenseLearningRate("adam"),
                                 "--learning_rate"),
            "0.001 (adam's default, as in torch.optim.Adam and keras Adam; "
            "--learning_rate sets it)");
  EXPECT_THAT(
      DescribeLearningRate(0.2, "adam", DefaultDenseLearningRate("adam"),
                           "--learning_rate"),
      HasSubstr("0.2 (--learning_rate)"));
}

}  // namespace
}  // namespace pstrain
