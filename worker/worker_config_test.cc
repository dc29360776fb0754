#include "worker/worker_config.h"

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/client/client_config.h"
#include "worker/client/ps_client.h"

namespace pstrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

WorkerConfig WithHosts() {
  WorkerConfig config;
  config.client.hosts = {"127.0.0.1:5000", "127.0.0.1:5001"};
  return config;
}

std::vector<std::string> Lines(const absl::Status& status) {
  return absl::StrSplit(status.message(), '\n', absl::SkipEmpty());
}

TEST(WorkerConfigTest, TheDefaultsWithServersAreValid) {
  EXPECT_TRUE(ValidateWorkerConfig(WithHosts()).ok());
}

TEST(WorkerConfigTest, ServersAreRequiredUnlessEvaluatingAFile) {
  WorkerConfig config;
  EXPECT_THAT(Lines(ValidateWorkerConfig(config)),
              ElementsAre("--ps_hosts is required (host:port of every "
                          "ps_server)"));
  config.eval.eval_only = true;
  config.eval.model_file = "model.safetensors";
  EXPECT_TRUE(ValidateWorkerConfig(config).ok());
}

// One status, one line per problem, each in the words of its flag.
TEST(WorkerConfigTest, EveryProblemAtOnce) {
  WorkerConfig config = WithHosts();
  config.worker_id = 3;
  config.num_workers = 2;
  config.model.name = "cnn";
  config.data.source = "csv";
  config.training.steps = 0;
  config.output.progress = "fancy";
  config.client.rpc_timeout_s = 0;
  config.client.gradient_wire_type = "int8";
  config.client.gradient_topk_fraction = 2;
  const absl::Status status = ValidateWorkerConfig(config);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(
      Lines(status),
      UnorderedElementsAre(
          "--worker_id must be in [0, --num_workers=2), got 3",
          "--model must be softmax, mlp, probe or ctr, or layers (with "
          "--layers), got 'cnn'",
          "--data=csv needs --train_file", "--steps must be >= 1, got 0",
          "--progress must be auto, bar or lines, got 'fancy'",
          "--rpc_timeout_s must be >= 0.001, got 0",
          "--gradient_wire_type must be fp32, fp16, bf16 or topk, got 'int8'",
          "--gradient_topk_fraction must be in (0, 1], got 2"));
}

// A layer list with another model would train something else than asked.
TEST(WorkerConfigTest, LayersWithAnotherModelIsAnError) {
  WorkerConfig config = WithHosts();
  config.model.layers = "flatten,dense:10";
  EXPECT_THAT(Lines(ValidateWorkerConfig(config)),
              ElementsAre("--layers is read only with --model=layers, got "
                          "--model=mlp"));
  config.model.name = "layers";
  EXPECT_TRUE(ValidateWorkerConfig(config).ok());
}

TEST(WorkerConfigTest, CtrFlagsAreCheckedWithTheRest) {
  WorkerConfig config = WithHosts();
  config.model.name = "ctr";
  config.ctr.data = "criteo";
  config.ctr.sparse_optimizer = "lamb";
  config.ctr.embedding_max_bytes = -1;
  config.ctr.embedding_mode = "sync";
  config.ctr.cardinalities = "3,x";
  config.training.batch_size = 0;
  EXPECT_THAT(Lines(ValidateWorkerConfig(config)),
              UnorderedElementsAre(
                  "--batch_size must be >= 1, got 0",
                  "--embedding_max_bytes must be >= 0 (0: no budget), got -1",
                  "--embedding_mode must be empty (the servers' --mode) or "
                  "async, got 'sync'",
                  "--ctr_cardinalities must be criteo or positive integers "
                  "joined by ',', got '3,x'",
                  "--ctr_data=criteo needs --train_file",
                  "--sparse_optimizer must be sgd, adagrad, adam or ftrl, "
                  "got 'lamb'",
                  // lamb has no default rate, and none was given
                  "--sparse_learning_rate and --ftrl_alpha must be positive"));
  config.model.name = "mlp";  // the CTR flags are not read
  EXPECT_THAT(Lines(ValidateWorkerConfig(config)),
              ElementsAre("--batch_size must be >= 1, got 0"));
}

TEST(WorkerConfigTest, BatchAndStepsFromTheGlobalSettings) {
  WorkerConfig config = WithHosts();
  config.num_workers = 4;
  config.training.global_batch_size = 128;
  EXPECT_EQ(WorkerBatchSize(config).value(), 32);
  // A --batch_size that was given must agree; the default need not.
  config.training.batch_size_given = true;
  EXPECT_THAT(std::string(WorkerBatchSize(config).status().message()),
              HasSubstr("--batch_size=64 and --global_batch_size=128 "
                        "disagree"));
  config.training.global_batch_size = 130;
  EXPECT_THAT(std::string(WorkerBatchSize(config).status().message()),
              HasSubstr("is not divisible by --num_workers=4"));

  config.training.epochs = 2;
  EXPECT_EQ(TrainingSteps(config.training, 50).value(), 100);
  config.training.steps_given = true;
  EXPECT_THAT(
      std::string(TrainingSteps(config.training, 50).status().message()),
      HasSubstr("--steps=300 contradicts --epochs=2"));
}

TEST(WorkerConfigTest, HiddenSizes) {
  EXPECT_THAT(ParseHidden("128,64").value(), ElementsAre(128, 64));
  EXPECT_FALSE(ParseHidden("32,x").ok());
}

// The Python binding builds its client through ClientConfig: its defaults
// must be the client's own, as they were when it filled PsClientOptions.
TEST(ClientConfigTest, DefaultsAreThePsClientDefaults) {
  ClientConfig config;
  config.hosts = {"127.0.0.1:5000"};
  absl::StatusOr<PsClientOptions> made = MakePsClientOptions(config);
  ASSERT_TRUE(made.ok()) << made.status();
  const PsClientOptions defaults;
  EXPECT_THAT(made->hosts, ElementsAre("127.0.0.1:5000"));
  EXPECT_EQ(made->rpc_timeout, defaults.rpc_timeout);
  EXPECT_EQ(made->connect_timeout, defaults.connect_timeout);
  EXPECT_EQ(made->max_message_bytes, defaults.max_message_bytes);
  EXPECT_EQ(made->connections_per_shard, defaults.connections_per_shard);
  EXPECT_EQ(made->call_streams, defaults.call_streams);
  EXPECT_EQ(made->gradient_wire_type, defaults.gradient_wire_type);
  EXPECT_EQ(made->gradient_topk_fraction, defaults.gradient_topk_fraction);
  EXPECT_EQ(made->heartbeat_interval, defaults.heartbeat_interval);
  EXPECT_EQ(made->retry_window, defaults.retry_window);
  EXPECT_EQ(made->data_plane, defaults.data_plane);
  EXPECT_EQ(made->credentials, nullptr);
  EXPECT_EQ(made->data_plane_tls, nullptr);
  EXPECT_EQ(made->auth_token, "");
  EXPECT_EQ(made->inject_duplicate_push_probability,
            defaults.inject_duplicate_push_probability);
}

TEST(ClientConfigTest, EveryProblemAtOnce) {
  ClientConfig config;
  config.hosts = {"nohostport"};
  config.connections_per_shard = -1;
  config.retry_window_s = -1;
  config.auth_token_file = "/nonexistent/token";
  absl::StatusOr<PsClientOptions> made = MakePsClientOptions(config);
  ASSERT_FALSE(made.ok());
  EXPECT_THAT(Lines(made.status()),
              UnorderedElementsAre(
                  "--retry_window_s must be >= 0, got -1",
                  "--auth_token_file=/nonexistent/token: cannot read the file",
                  "--ps_hosts entries must be host:port, got 'nohostport'",
                  "--connections_per_shard must be in [0, 64] (0: by host), "
                  "got -1"));
  EXPECT_EQ(ClientConfigProblems(config).size(), 4u);
}

}  // namespace
}  // namespace pstrain
