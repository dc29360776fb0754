// Async mode: two workers pushing on arrival reach the synthetic task's
// target accuracy, and every push is applied exactly once.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"
#include "worker/ps_client.h"

namespace pstrain {
namespace {

TEST(AsyncConvergenceTest, TwoWorkersReachTargetAccuracy) {
  testing::ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  options.mode = "async";
  options.server_flags = {"--optimizer=adam", "--learning_rate=0.01"};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "async");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  constexpr int kSteps = 300;
  const std::vector<std::string> flags = {
      "--model=mlp",        "--hidden=32",
      "--num_features=16",  "--num_classes=4",
      "--label_noise=0.05", "--batch_size=32",
      "--log_every=100",    absl::StrCat("--steps=", kSteps),
      "--device=cpu"};
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({flags, flags}, absl::Seconds(180));
  ASSERT_TRUE(outputs.ok()) << outputs.status();

  // Best achievable: 0.95 + 0.05 / 4 = 0.9625; chance is 0.25.
  for (const std::string& out : *outputs) {
    absl::StatusOr<double> accuracy =
        testing::FinalJsonNumber(out, "test_accuracy");
    ASSERT_TRUE(accuracy.ok()) << accuracy.status() << "\n" << out;
    EXPECT_GE(*accuracy, 0.85) << out;
    EXPECT_NE(out.find("\"mode\":\"async\""), std::string::npos) << out;
  }

  PsClientOptions client_options;
  client_options.hosts = (*cluster)->HostList();
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
  testing::ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  options.mode = "async";
  options.server_flags = {"--optimizer=adam", "--learning_rate=0.01"};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "async_topk");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<std::string> flags = {"--model=mlp",
                                          "--hidden=32",
                                          "--num_features=16",
                                          "--num_classes=4",
                                          "--label_noise=0.05",
                                          "--batch_size=32",
                                          "--log_every=0",
                                          "--steps=600",
                                          "--device=cpu",
                                          "--block_elements=64",
                                          "--gradient_wire_type=topk",
                                          "--gradient_topk_fraction=0.1"};
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({flags, flags}, absl::Seconds(180));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  for (const std::string& out : *outputs) {
    absl::StatusOr<double> accuracy =
        testing::FinalJsonNumber(out, "test_accuracy");
    ASSERT_TRUE(accuracy.ok()) << accuracy.status() << "\n" << out;
    EXPECT_GE(*accuracy, 0.85) << out;
  }
}

}  // namespace
}  // namespace pstrain
