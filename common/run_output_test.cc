#include "common/run_output.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

TEST(FormatEtaTest, MinutesAndHours) {
  EXPECT_EQ(FormatEta(0), "0:00");
  EXPECT_EQ(FormatEta(12.4), "0:12");
  EXPECT_EQ(FormatEta(125), "2:05");
  EXPECT_EQ(FormatEta(3723), "1:02:03");
  EXPECT_EQ(FormatEta(-1), "?");
  EXPECT_EQ(FormatEta(1.0 / 0.0), "?");
}

TEST(FormatProgressBarTest, ShowsEveryPart) {
  EXPECT_EQ(FormatProgressBar(150, 300, 0.41234, 2310.4, 12, 10),
            "[#####.....] 150/300  50%  loss 0.4123  2310 samples/s  ETA 0:12");
  EXPECT_EQ(FormatProgressBar(7, 300, 1.5, 10, 100, 10),
            "[..........]   7/300   2%  loss 1.5000  10 samples/s  ETA 1:40");
  // Done: full bar, no estimate left.
  EXPECT_EQ(FormatProgressBar(300, 300, 0.1, 5, 99, 4),
            "[####] 300/300 100%  loss 0.1000  5 samples/s  ETA 0:00");
}

TEST(MetricsCsvTest, WritesHeaderAndRows) {
  const std::string path =
      std::string(std::getenv("TEST_TMPDIR")) + "/metrics.csv";
  {
    absl::StatusOr<std::unique_ptr<MetricsCsv>> csv = MetricsCsv::Open(path);
    ASSERT_TRUE(csv.ok()) << csv.status();
    ASSERT_TRUE((*csv)->Append(1, 0.5, 1.25, 0.5, 128, 1.5, 2.25).ok());
    ASSERT_TRUE((*csv)->Append(2, 1.0, 1.0, 0.75, 256, 1, 2, 0.5, 0.875).ok());
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(),
            "step,time_s,loss,train_accuracy,samples_per_sec,pull_ms,push_ms,"
            "test_loss,test_accuracy\n"
            "1,0.5000,1.25,0.5,128.0,1.500,2.250,,\n"
            "2,1.0000,1,0.75,256.0,1.000,2.000,0.5,0.875\n");
}

TEST(MetricsCsvTest, UnwritablePathNamesTheFlag) {
  absl::StatusOr<std::unique_ptr<MetricsCsv>> csv =
      MetricsCsv::Open("/nonexistent/dir/x.csv");
  ASSERT_FALSE(csv.ok());
  EXPECT_THAT(std::string(csv.status().message()),
              ::testing::HasSubstr("--metrics_csv=/nonexistent/dir/x.csv"));
}

}  // namespace
}  // namespace pstrain
