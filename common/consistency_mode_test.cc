#include "common/consistency_mode.h"

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
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

TEST(TableConsistencyModeTest, EmptyIsTheServersModeAndAsyncGoesUnderAny) {
  for (ConsistencyMode servers :
       {ConsistencyMode::kSync, ConsistencyMode::kAsync,
        ConsistencyMode::kSsp}) {
    absl::StatusOr<ConsistencyMode> own =
        TableConsistencyMode(servers, "t", "");
    ASSERT_TRUE(own.ok()) << own.status();
    EXPECT_EQ(*own, servers);
    absl::StatusOr<ConsistencyMode> named =
        TableConsistencyMode(servers, "t", ConsistencyModeName(servers));
    ASSERT_TRUE(named.ok()) << named.status();
    EXPECT_EQ(*named, servers);
    absl::StatusOr<ConsistencyMode> async =
        TableConsistencyMode(servers, "t", "async");
    ASSERT_TRUE(async.ok()) << async.status();
    EXPECT_EQ(*async, ConsistencyMode::kAsync);
  }
}

TEST(TableConsistencyModeTest, AModeTheServersDoNotRunIsRefusedNamingBoth) {
  absl::StatusOr<ConsistencyMode> sync_under_async =
      TableConsistencyMode(ConsistencyMode::kAsync, "clicks", "sync");
  ASSERT_FALSE(sync_under_async.ok());
  EXPECT_EQ(sync_under_async.status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(sync_under_async.status().message(),
              ::testing::AllOf(::testing::HasSubstr("'clicks'"),
                               ::testing::HasSubstr("--mode=async")));
  absl::StatusOr<ConsistencyMode> ssp_under_sync =
      TableConsistencyMode(ConsistencyMode::kSync, "clicks", "ssp");
  EXPECT_FALSE(ssp_under_sync.ok());
  absl::StatusOr<ConsistencyMode> not_a_mode =
      TableConsistencyMode(ConsistencyMode::kSync, "clicks", "bsp");
  ASSERT_FALSE(not_a_mode.ok());
  EXPECT_THAT(not_a_mode.status().message(),
              ::testing::HasSubstr("not a mode"));
}

}  // namespace
}  // namespace pstrain
