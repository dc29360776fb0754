#include "worker/libsvm.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

TEST(LibsvmTest, SplitsLabelAndFeatures) {
  LibsvmLine line;
  ASSERT_TRUE(ParseLibsvmLine("+1 0:1\t3:0.5  17:-2e3", &line).ok());
  EXPECT_EQ(line.label, "+1");
  ASSERT_EQ(line.features.size(), 3u);
  EXPECT_EQ(line.features[0].index, 0u);
  EXPECT_EQ(line.features[0].value, "1");
  EXPECT_EQ(line.features[1].index, 3u);
  EXPECT_EQ(line.features[1].value, "0.5");
  EXPECT_EQ(line.features[2].index, 17u);
  EXPECT_EQ(line.features[2].value, "-2e3");
}

TEST(LibsvmTest, ALabelAloneHasNoFeatures) {
  LibsvmLine line;
  line.features.push_back({9, "stale"});
  ASSERT_TRUE(ParseLibsvmLine("0", &line).ok());
  EXPECT_EQ(line.label, "0");
  EXPECT_TRUE(line.features.empty());
}

TEST(LibsvmTest, RefusesMalformedFeaturesNamingThem) {
  LibsvmLine line;
  for (const auto& [text, expected] :
       std::vector<std::pair<const char*, const char*>>{
           {"1 abc", "'abc' is not index:value"},
           {"1 -3:1", "'-3:1' is not index:value"},
           {"1 :1", "':1' is not index:value"},
           {"1 2:1 2:1", "index 2 does not increase (previous 2)"},
           {"1 5:1 3:1", "index 3 does not increase (previous 5)"},
       }) {
    absl::Status status = ParseLibsvmLine(text, &line);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(std::string(status.message()), HasSubstr(expected)) << text;
  }
}

}  // namespace
}  // namespace pstrain
