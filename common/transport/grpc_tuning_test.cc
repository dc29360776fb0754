#include "common/transport/grpc_tuning.h"

#include <string>
#include <vector>

#include "absl/flags/reflection.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

// As a command line would set it.
void Set(const char* flag, const std::string& value) {
  std::string error;
  ASSERT_TRUE(absl::FindCommandLineFlag(flag)->ParseFrom(value, &error))
      << error;
}

TEST(GrpcTuningTest, DefaultsKeepGrpcsOwnSettings) {
  absl::FlagSaver saver;
  absl::StatusOr<GrpcTuning> tuning = GrpcTuningFromFlags();
  ASSERT_TRUE(tuning.ok()) << tuning.status();
  EXPECT_TRUE(GrpcTuningArgs(*tuning).empty());
}

TEST(GrpcTuningTest, SetFlagsTravelToAnotherProcess) {
  absl::FlagSaver saver;
  Set("grpc_max_frame_bytes", "1048576");
  Set("grpc_stream_window_bytes", "8388608");
  absl::StatusOr<GrpcTuning> tuning = GrpcTuningFromFlags();
  ASSERT_TRUE(tuning.ok()) << tuning.status();
  EXPECT_EQ(GrpcTuningArgs(*tuning),
            (std::vector<std::string>{"--grpc_max_frame_bytes=1048576",
                                      "--grpc_stream_window_bytes=8388608"}));
}

TEST(GrpcTuningTest, OutOfRangeValuesNameTheFlag) {
  absl::FlagSaver saver;
  Set("grpc_max_frame_bytes", "1000");
  EXPECT_NE(GrpcTuningFromFlags().status().message().find(
                "--grpc_max_frame_bytes must be 0 or in [16384, 16777215]"),
            std::string::npos);
  Set("grpc_max_frame_bytes", "0");
  Set("grpc_stream_window_bytes", "-1");
  EXPECT_NE(GrpcTuningFromFlags().status().message().find(
                "--grpc_stream_window_bytes must be in [0, "),
            std::string::npos);
}

}  // namespace
}  // namespace pstrain
