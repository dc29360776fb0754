// Async mode: two workers pushing on arrival reach the synthetic task's
// target accuracy, and every push is applied exactly once.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"

namespace pstrain {
namespace {

// Two async workers training the synthetic MLP task with `extra_flags`;
// their stdout, after checking each reached the target accuracy (best
// achievable: 0.95 + 0.05 / 4 = 0.9625; chance is 0.25).
std::unique_ptr<testing::TestCluster> TrainTwoAsyncWorkers(
    const std::string& name, int steps,
    const std::vector<std::string>& extra_flags) {
  testing::ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  options.mode = "async";
  options.server_flags = {"--optimizer=adam", "--learning_rate=0.01"};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return nullptr;
  std::vector<std::string> flags = {
      "--model=mlp",        "--hidden=32",
      "--num_features=16",  "--num_classes=4",
      "--label_noise=0.05", "--batch_size=32",
      "--log_every=100",    absl::StrCat("--steps=", steps),
      "--device=cpu"};
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({flags, flags}, absl::Seconds(180));
  EXPECT_TRUE(outputs.ok()) << outputs.status();
  if (!outputs.ok()) return nullptr;
  for (const std::string& out : *outputs) {
    absl::StatusOr<double> accuracy =
        testing::FinalJsonNumber(out, "test_accuracy");
    EXPECT_TRUE(accuracy.ok()) << accuracy.status() << "\n" << out;
    if (accuracy.ok()) {
      EXPECT_GE(*accuracy, 0.85) << out;
    }
    EXPECT_NE(out.find("\"mode\":\"async\""), std::string::npos) << out;
  }
  return std::move(*cluster);
}

TEST(AsyncConvergenceTest, TwoWorkersReachTargetAccuracy) {
  constexpr int kSteps = 300;
  std::unique_ptr<testing::TestCluster> cluster =
      TrainTwoAsyncWorkers("async", kSteps, {});
  ASSERT_NE(cluster, nullptr);

  PsClientOptions client_options;
  client_options.hosts = cluster->HostList();
  auto client = std::move(*PsClient::Create(client_options));
  absl::StatusOr<std::vector<StatsResponse>> stats = client->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  // Every block of every shard got exactly one update per worker step.
  for (const StatsResponse& shard : *stats) {
    EXPECT_EQ(shard.version(), 2 * kSteps);
    EXPECT_EQ(shard.blocks_applied(), 2 * kSteps * shard.num_blocks());
    EXPECT_EQ(shard.blocks_duplicate(), 0);
    EXPECT_GE(shard.staleness_max(), 0);
  }
}

// Top-k compression with error feedback: each push sends a tenth of every
// block, and the job still reaches the target.
TEST(AsyncConvergenceTest, TopKCompressedGradientsReachTargetAccuracy) {
  EXPECT_NE(
      TrainTwoAsyncWorkers("async_topk", 600,
                           {"--block_elements=64", "--gradient_wire_type=topk",
                            "--gradient_topk_fraction=0.1"}),
      nullptr);
}

}  // namespace
}  // namespace pstrain
