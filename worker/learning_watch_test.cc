#include "worker/learning_watch.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST(LearningWatchTest, AFallingLossSaysNothing) {
  LearningWatch watch(20, "adam", 0.001);
  for (int step = 1; step <= 100; ++step) {
    EXPECT_THAT(watch.OnStep(step, 2.0 / step), IsEmpty());
  }
  EXPECT_FALSE(watch.fired());
}

TEST(LearningWatchTest, AFlatLossWarnsOnceNamingTheOptimizer) {
  LearningWatch watch(20, "adam", 0.1);
  int warnings = 0;
  for (int step = 1; step <= 100; ++step) {
    const std::string w = watch.OnStep(step, 1.3863);
    if (w.empty()) continue;
    ++warnings;
    EXPECT_EQ(step, 21);
    EXPECT_THAT(w, HasSubstr("has not fallen below its first value"));
    EXPECT_THAT(w, HasSubstr("adam at learning rate 0.1"));
  }
  EXPECT_EQ(warnings, 1);
  EXPECT_TRUE(watch.fired());
}

// The case: Adam at 0.1 on 4 classes, a first loss near chance and
// the loss hovering a little under it, learning nothing.
TEST(LearningWatchTest, HoveringJustUnderTheFirstLossWarns) {
  LearningWatch watch(20, "adam", 0.1);
  EXPECT_THAT(watch.OnStep(1, 1.41), IsEmpty());
  std::string warning;
  for (int step = 2; step <= 21; ++step) warning = watch.OnStep(step, 1.35);
  EXPECT_THAT(warning, HasSubstr("has not fallen below its first value"));
}

TEST(LearningWatchTest, NanOrInfWarnsAtOnce) {
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity()}) {
    LearningWatch watch(100, "sgd", 10);
    EXPECT_THAT(watch.OnStep(1, 2.0), IsEmpty());
    EXPECT_THAT(watch.OnStep(2, bad), HasSubstr("training loss is"));
    EXPECT_THAT(watch.OnStep(3, bad), IsEmpty());  // once
    EXPECT_TRUE(watch.fired());
  }
}

TEST(LearningWatchTest, NanAfterLearningStillWarns) {
  LearningWatch watch(5, "sgd", 1);
  for (int step = 1; step <= 10; ++step) watch.OnStep(step, 2.0 / step);
  EXPECT_FALSE(watch.fired());
  EXPECT_THAT(watch.OnStep(11, std::nan("")), HasSubstr("nan"));
}

TEST(LearningWatchTest, ZeroPatienceWatchesOnlyNonFinite) {
  LearningWatch watch(0, "", 0);
  for (int step = 1; step <= 50; ++step) watch.OnStep(step, 1.0);
  EXPECT_FALSE(watch.fired());
  EXPECT_THAT(watch.OnStep(51, std::nan("")),
              HasSubstr("they did not say which"));
}

}  // namespace
}  // namespace pstrain
