// The C++ worker's --lr_schedule and the servers' --weight_decay, end to
// end on real processes with the probe model, whose gradient is 1 in every
// element: each update moves every element by exactly its rate (plus the
// decay), so the final values are closed forms.
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"
#include "worker/lr_schedule.h"

namespace pstrain {
namespace {

constexpr int kSteps = 12;
constexpr int kElements = 64;

// Trains the probe model with one worker (sync, SGD at 0.5 plus
// `server_flags`) and returns its final values.
std::vector<float> Train(const std::vector<std::string>& server_flags,
                         const std::vector<std::string>& worker_flags,
                         const std::string& name) {
  testing::ClusterOptions options;
  options.server_flags = {"--optimizer=sgd", "--learning_rate=0.5"};
  options.server_flags.insert(options.server_flags.end(), server_flags.begin(),
                              server_flags.end());
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return {};
  std::vector<std::string> flags = {
      "--model=probe", absl::StrCat("--probe_elements=", kElements),
      absl::StrCat("--steps=", kSteps), "--log_every=0", "--device=cpu"};
  flags.insert(flags.end(), worker_flags.begin(), worker_flags.end());
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({flags}, absl::Seconds(60));
  EXPECT_TRUE(outputs.ok()) << outputs.status();
  PsClientOptions client_options;
  client_options.hosts = (*cluster)->HostList();
  auto client = std::move(*PsClient::Create(client_options));
  ModelSchema schema;
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("probe/w");
  w->add_shape(kElements);
  w->mutable_init()->set_kind(InitSpec::ZEROS);
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  EXPECT_TRUE(stats.ok());
  if (!stats.ok()) return {};
  std::vector<float> values(kElements);
  EXPECT_TRUE(
      client->Register(stats->front().schema(), 1, /*worker_id=*/-1).ok());
  EXPECT_TRUE(client->Pull(kSteps, {values.data()}).ok());
  return values;
}

TEST(LrScheduleFlagsTest, EveryUpdateUsesTheScheduledRate) {
  LrSchedule schedule;
  schedule.kind = "step";
  schedule.warmup_steps = 2;
  schedule.step_size = 3;
  schedule.gamma = 0.5;
  double expected = 0;
  for (int t = 0; t < kSteps; ++t) expected -= 0.5 * LrFactor(schedule, t);
  const std::vector<float> values =
      Train({},
            {"--lr_schedule=step", "--warmup_steps=2", "--lr_step_size=3",
             "--lr_step_gamma=0.5"},
            "step_schedule");
  ASSERT_EQ(values.size(), static_cast<size_t>(kElements));
  for (float v : values) EXPECT_FLOAT_EQ(v, expected);
  // Not the constant rate's -0.5 * kSteps.
  EXPECT_GT(std::abs(expected + 0.5 * kSteps), 1);
}

TEST(LrScheduleFlagsTest, CosineReachesZeroAtTheLastStep) {
  LrSchedule schedule;
  schedule.kind = "cosine";
  schedule.total_steps = kSteps;
  double expected = 0;
  for (int t = 0; t < kSteps; ++t) expected -= 0.5 * LrFactor(schedule, t);
  const std::vector<float> values =
      Train({}, {"--lr_schedule=cosine"}, "cosine_schedule");
  ASSERT_EQ(values.size(), static_cast<size_t>(kElements));
  for (float v : values) EXPECT_NEAR(v, expected, 1e-5);
}

// The dense tensors of a one-worker CTR job of `steps` steps (sync, SGD at
// `rate` on the servers), as the servers end it.
std::vector<std::vector<float>> TrainCtrDense(
    int steps, const std::string& rate,
    const std::vector<std::string>& worker_flags, const std::string& name) {
  testing::ClusterOptions options;
  options.server_flags = {"--optimizer=sgd",
                          absl::StrCat("--learning_rate=", rate)};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return {};
  std::vector<std::string> flags = {
      "--model=ctr",     "--ctr_fields=2",  "--ctr_dense=2",
      "--ctr_vocab=200", "--batch_size=32", "--seed=3",
      "--log_every=0",   "--device=cpu",    absl::StrCat("--steps=", steps)};
  flags.insert(flags.end(), worker_flags.begin(), worker_flags.end());
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({flags}, absl::Seconds(60));
  EXPECT_TRUE(outputs.ok()) << outputs.status();
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  EXPECT_TRUE(stats.ok());
  if (!stats.ok()) return {};
  PsClientOptions client_options;
  client_options.hosts = (*cluster)->HostList();
  auto client = std::move(*PsClient::Create(client_options));
  const ModelSchema& schema = stats->front().schema();
  EXPECT_TRUE(client->Register(schema, 1, /*worker_id=*/-1).ok());
  std::vector<std::vector<float>> tensors;
  std::vector<float*> pointers;
  for (const DenseTensorSpec& spec : schema.dense()) {
    int64_t n = 1;
    for (int64_t d : spec.shape()) n *= d;
    tensors.emplace_back(n);
  }
  for (auto& t : tensors) pointers.push_back(t.data());
  EXPECT_TRUE(client->Pull(steps, pointers).ok());
  return tensors;
}

// --lr_schedule reaches the CTR worker's dense layers too: a step at a
// quarter of the servers' 0.1 (the first of a 4-step warmup) is a step at
// their rate of 0.025 (0.1 / 4 is the double nearest 0.025), bit for bit.
TEST(LrScheduleFlagsTest, TheCtrWorkersDenseLayersFollowTheSchedule) {
  const auto warmup = TrainCtrDense(1, "0.1", {"--warmup_steps=4"}, "ctr_a");
  const auto quarter = TrainCtrDense(1, "0.025", {}, "ctr_b");
  const auto full = TrainCtrDense(1, "0.1", {}, "ctr_c");
  ASSERT_FALSE(warmup.empty());
  EXPECT_EQ(warmup, quarter);
  EXPECT_NE(warmup, full);  // not vacuous: the rate moves them
}

TEST(LrScheduleFlagsTest, WeightDecayIsTorchs) {
  // torch.optim.SGD(weight_decay=wd): w -= lr * (g + wd * w).
  double w = 0;
  for (int t = 0; t < kSteps; ++t) w -= 0.5 * (1 + 0.1 * w);
  const std::vector<float> values =
      Train({"--weight_decay=0.1"}, {}, "weight_decay");
  ASSERT_EQ(values.size(), static_cast<size_t>(kElements));
  for (float v : values) EXPECT_NEAR(v, w, 1e-5);
  EXPECT_GT(std::abs(w + 0.5 * kSteps), 0.5);  // decay made a difference
}

}  // namespace
}  // namespace pstrain
