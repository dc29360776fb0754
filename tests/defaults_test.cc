// Defaults that train and defaults that are safe (issue 29): each dense
// optimizer gets its own default learning rate, logged at start and told to
// workers; Adam with no rate trains Fashion-MNIST; a job whose loss does not
// fall is said once and trains on; a server reachable from the network in
// plaintext with no token says so at start.
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kOpenPort[] = "in plaintext with no token: anyone who can";

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos;
       at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

std::unique_ptr<testing::TestCluster> Start(
    const std::vector<std::string>& server_flags, const std::string& name) {
  testing::ClusterOptions options;
  options.server_flags = server_flags;
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? std::move(*cluster) : nullptr;
}

TEST(OpenPortTest, EveryInterfaceInPlaintextWithoutTokenWarnsOnce) {
  auto cluster = Start({"--host=0.0.0.0"}, "open_port");
  ASSERT_NE(cluster, nullptr);
  // The port file is written after the warning: it is in the log by now.
  const std::string log = cluster->server(0).Stderr();
  EXPECT_EQ(Count(log, kOpenPort), 1) << log;
  EXPECT_THAT(log, HasSubstr("push gradients into the model"));
  EXPECT_THAT(log, HasSubstr("--host=127.0.0.1"));
  EXPECT_THAT(log, HasSubstr("--auth_token_file"));
  EXPECT_THAT(log, HasSubstr("--tls_cert/--tls_key"));
}

TEST(OpenPortTest, LoopbackIsQuiet) {
  auto cluster = Start({}, "loopback_port");  // the harness binds 127.0.0.1
  ASSERT_NE(cluster, nullptr);
  EXPECT_THAT(cluster->server(0).Stderr(), Not(HasSubstr(kOpenPort)));
}

TEST(OpenPortTest, ATokenClosesIt) {
  const std::string token = testing::TestDir() + "/token";
  std::ofstream(token) << "s3cret-token-for-the-test\n";
  auto cluster =
      Start({"--host=0.0.0.0", "--auth_token_file=" + token}, "token_port");
  ASSERT_NE(cluster, nullptr);
  EXPECT_THAT(cluster->server(0).Stderr(), Not(HasSubstr(kOpenPort)));
}

TEST(LearningRateTest, EachOptimizerLogsTheRateInEffect) {
  auto adam = Start({"--optimizer=adam"}, "adam_default");
  ASSERT_NE(adam, nullptr);
  EXPECT_THAT(adam->server(0).Stderr(),
              HasSubstr("optimizer adam, learning rate 0.001 (adam's default, "
                        "as in torch.optim.Adam and keras Adam; "
                        "--learning_rate sets it)"));
  auto sgd = Start({"--optimizer=sgd", "--learning_rate=0.2"}, "sgd_given");
  ASSERT_NE(sgd, nullptr);
  EXPECT_THAT(sgd->server(0).Stderr(),
              HasSubstr("optimizer sgd, learning rate 0.2 (--learning_rate)"));
}

// The case: --optimizer=adam with no rate used to train to chance.
// The full setting: 2 epochs of the MLP 784-256-128-10, global batch 128.
TEST(LearningRateTest, AdamWithNoRateTrainsFashionMnist) {
  if (!std::ifstream("/usr/share/datasets/fashion-mnist/"
                     "train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  auto cluster = Start({"--optimizer=adam"}, "adam_fashion");
  ASSERT_NE(cluster, nullptr);
  absl::StatusOr<std::vector<std::string>> out = cluster->RunWorkers(
      {{"--data=fashion_mnist", "--model=mlp", "--hidden=256,128",
        "--global_batch_size=128", "--epochs=2", "--log_every=0",
        "--device=cpu", "--cpu_threads=1"}},
      absl::Seconds(120));
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<double> accuracy =
      testing::FinalJsonNumber(out->at(0), "test_accuracy");
  ASSERT_TRUE(accuracy.ok()) << accuracy.status() << out->at(0);
  EXPECT_GE(*accuracy, 0.85) << out->at(0);
  EXPECT_THAT(out->at(0), HasSubstr("\"not_learning\":false"));
}

// The probe model's loss is 0 at every step: it never falls below its first
// value. One warning, naming what the servers run; training goes on.
TEST(NotLearningTest, AFlatLossIsSaidOnceAndTrainingGoesOn) {
  auto cluster = Start({}, "not_learning");
  ASSERT_NE(cluster, nullptr);
  absl::StatusOr<std::unique_ptr<testing::Process>> worker =
      cluster->StartWorker(0, 1,
                           {"--model=probe", "--steps=60",
                            "--loss_check_steps=20", "--log_every=0"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> code = (*worker)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << (*worker)->Stderr();
  const std::string err = (*worker)->Stderr();
  EXPECT_EQ(Count(err, "has not fallen below its first value"), 1) << err;
  EXPECT_THAT(err, HasSubstr("the servers' optimizer sgd at learning rate "
                             "0.1"));
  const std::string out = (*worker)->Stdout();
  EXPECT_THAT(out, HasSubstr("\"not_learning\":true"));
  EXPECT_THAT(out, HasSubstr("\"steps_run\":60"));

  // The job resumed at step 60 (a worker started again): it starts from a
  // trained model, whose loss need not fall; only NaN/Inf is watched.
  absl::StatusOr<std::unique_ptr<testing::Process>> resumed =
      cluster->StartWorker(0, 1,
                           {"--model=probe", "--steps=120",
                            "--loss_check_steps=20", "--log_every=0"});
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  code = (*resumed)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << (*resumed)->Stderr();
  const std::string resumed_out = (*resumed)->Stdout();
  EXPECT_THAT(resumed_out, HasSubstr("\"start_step\":60"));
  EXPECT_THAT(resumed_out, HasSubstr("\"not_learning\":false"));
  EXPECT_EQ(Count((*resumed)->Stderr(), "has not fallen below"), 0);
}

}  // namespace
}  // namespace pstrain
