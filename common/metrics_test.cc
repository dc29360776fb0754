#include "common/metrics.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "prometheus/metric_family.h"
#include "proto/ps.pb.h"

namespace pstrain {
namespace {

const prometheus::MetricFamily* Find(
    const std::vector<prometheus::MetricFamily>& families,
    const std::string& name) {
  for (const auto& family : families) {
    if (family.name == name) return &family;
  }
  return nullptr;
}

TEST(ShardStatsCollectorTest, AReplicaSaysItsRoleEpochAndCatchUps) {
  StatsResponse stats;
  stats.set_shard_id(1);
  stats.set_replicas(2);
  stats.set_replica_index(0);
  stats.set_replica_role("primary");
  stats.set_replica_epoch(2);
  stats.set_replica_takeovers(1);
  stats.set_replica_catchups(3);
  stats.set_step_record_sends(4);
  stats.set_step_record_confirm_seconds(0.5);
  const std::vector<prometheus::MetricFamily> families =
      ShardStatsCollector([&stats] { return stats; }).Collect();
  const prometheus::MetricFamily* info = Find(families, "pstrain_replica_info");
  ASSERT_NE(info, nullptr);
  ASSERT_EQ(info->metric.size(), 1u);
  bool primary = false;
  for (const auto& label : info->metric[0].label) {
    primary |= label.name == "role" && label.value == "primary";
  }
  EXPECT_TRUE(primary);
  const prometheus::MetricFamily* epoch =
      Find(families, "pstrain_replica_epoch");
  ASSERT_NE(epoch, nullptr);
  EXPECT_EQ(epoch->metric[0].gauge.value, 2);
  const prometheus::MetricFamily* catchups =
      Find(families, "pstrain_replica_catchups_total");
  ASSERT_NE(catchups, nullptr);
  EXPECT_EQ(catchups->metric[0].counter.value, 3);
  const prometheus::MetricFamily* confirm =
      Find(families, "pstrain_replica_step_record_confirm_seconds_total");
  ASSERT_NE(confirm, nullptr);
  EXPECT_EQ(confirm->metric[0].counter.value, 0.5);
}

TEST(ShardStatsCollectorTest, AnUnreplicatedShardHasNoReplicaFamilies) {
  StatsResponse stats;
  stats.set_replicas(1);
  const std::vector<prometheus::MetricFamily> families =
      ShardStatsCollector([&stats] { return stats; }).Collect();
  EXPECT_EQ(Find(families, "pstrain_replica_info"), nullptr);
  EXPECT_NE(Find(families, "pstrain_shard_version"), nullptr);
}

}  // namespace
}  // namespace pstrain
