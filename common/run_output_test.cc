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

// A line as wide as the terminal, or wider, breaks the in-place redraw:
// each redraw then starts a new line.
TEST(FitProgressBarTest, NeverReachesTheLastColumn) {
  for (int columns = 1; columns <= 120; ++columns) {
    for (int64_t step : {0, 7, 150, 300}) {
      const std::string line =
          FitProgressBar(step, 300, 0.41234, 123456.7, 4000, columns);
      EXPECT_LT(static_cast<int>(line.size()), std::max(columns, 2))
          << columns << " columns: '" << line << "'";
    }
  }
}

TEST(FitProgressBarTest, DropsTheLeastUsefulPartsFirst) {
  // Wide: the whole line with a 24-cell bar.
  EXPECT_EQ(FitProgressBar(150, 300, 0.41234, 2310.4, 12, 200),
            FormatProgressBar(150, 300, 0.41234, 2310.4, 12, 24));
  // 60 columns: a shorter bar, every number kept.
  const std::string fifty = FitProgressBar(150, 300, 0.41234, 2310.4, 12, 60);
  EXPECT_THAT(fifty, ::testing::HasSubstr("150/300  50%  loss 0.4123"));
  EXPECT_THAT(fifty, ::testing::EndsWith("ETA 0:12"));
  // 40: no bar, samples/s gone, loss kept.
  EXPECT_EQ(FitProgressBar(150, 300, 0.41234, 2310.4, 12, 40),
            "150/300  50%  loss 0.4123  ETA 0:12");
  // 24: the counts and the ETA; narrower still, cut.
  EXPECT_EQ(FitProgressBar(150, 300, 0.41234, 2310.4, 12, 24),
            "150/300  50%  ETA 0:12");
}

TEST(TerminalColumnsTest, ColumnsFromTheEnvironmentWithoutATerminal) {
  // Under bazel test stdout is a file.
  setenv("COLUMNS", "57", 1);
  EXPECT_EQ(TerminalColumns(), 57);
  EXPECT_LT(FormatProgressBar(150, 300, 0.41234, 2310.4, 12).size(), 57u);
  unsetenv("COLUMNS");
  EXPECT_EQ(TerminalColumns(), 80);
}

TEST(MetricsCsvTest, WritesHeaderAndRows) {
  const std::string path =
      std::string(std::getenv("TEST_TMPDIR")) + "/metrics.csv";
  {
    absl::StatusOr<std::unique_ptr<MetricsCsv>> csv = MetricsCsv::Open(path);
    ASSERT_TRUE(csv.ok()) << csv.status();
    MetricsCsv::Row row;
    row.step = 1;
    row.time_s = 0.5;
    row.loss = 1.25;
    row.train_accuracy = 0.5;
    row.samples_per_sec = 128;
    row.pull_ms = 1.5;
    row.push_ms = 2.25;
    row.compute_ms = 3;
    row.network_wait = 0.25;
    ASSERT_TRUE((*csv)->Append(row).ok());
    row = {2, 1.0, 1.0, 0.75, 256, 1, 2, 0.5, 0.875, 4.5, 0.125};
    ASSERT_TRUE((*csv)->Append(row).ok());
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(),
            "step,time_s,loss,train_accuracy,samples_per_sec,pull_ms,push_ms,"
            "test_loss,test_accuracy,compute_ms,network_wait\n"
            "1,0.5000,1.25,0.5,128.0,1.500,2.250,,,3.000,0.250\n"
            "2,1.0000,1,0.75,256.0,1.000,2.000,0.5,0.875,4.500,0.125\n");
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
