#include "common/consistency_mode.h"

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

TEST(ConsistencyModeTest, EveryModeReadsBackItsName) {
  for (ConsistencyMode mode : {ConsistencyMode::kSync, ConsistencyMode::kAsync,
                               ConsistencyMode::kSsp}) {
    absl::StatusOr<ConsistencyMode> parsed =
        ParseConsistencyMode(ConsistencyModeName(mode));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, mode);
  }
}

TEST(ConsistencyModeTest, UnknownNameIsRefusedNamingIt) {
  for (absl::string_view bad : {"", "Sync", "bsp", "sync "}) {
    absl::StatusOr<ConsistencyMode> parsed = ParseConsistencyMode(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find(absl::StrCat("'", bad, "'")),
              absl::string_view::npos)
        << parsed.status();
  }
}

}  // namespace
}  // namespace pstrain
