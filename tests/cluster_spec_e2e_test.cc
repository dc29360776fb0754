// The cluster description end to end: a ps_server configured by a
// --cluster_spec file and a worker by $PSTRAIN_CLUSTER train together with
// no job flags of their own; a flag given explicitly wins over the spec;
// a bad spec is one line naming the field, exit 2.
#include <stdlib.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/http_util.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(60);

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = testing::TestDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// Sets $PSTRAIN_CLUSTER (or `variable`) for the processes started while it
// lives.
class ScopedClusterEnv {
 public:
  explicit ScopedClusterEnv(const std::string& json,
                            std::string variable = "PSTRAIN_CLUSTER")
      : variable_(std::move(variable)) {
    setenv(variable_.c_str(), json.c_str(), 1);
  }
  ~ScopedClusterEnv() { unsetenv(variable_.c_str()); }

 private:
  std::string variable_;
};

std::unique_ptr<testing::Process> Start(const std::string& binary,
                                        std::vector<std::string> flags,
                                        const std::string& name) {
  flags.insert(flags.begin(), testing::BinaryPath(binary));
  absl::StatusOr<std::unique_ptr<testing::Process>> process =
      testing::Process::Start(flags, testing::TestDir(), name);
  EXPECT_TRUE(process.ok()) << process.status();
  return process.ok() ? std::move(*process) : nullptr;
}

TEST(ClusterSpecE2eTest, SpecFileAndEnvironmentConfigureAJob) {
  const int port = testing::FreePort();
  const std::string ps = absl::StrCat("127.0.0.1:", port);
  const std::string spec = WriteFile(
      "job.json", absl::StrCat(R"({"ps": [")", ps, R"("], "workers": 1,
          "mode": "async", "task": {"type": "ps", "index": 0},
          "ps_flags": {"learning_rate": 0.2, "optimizer": "momentum"}})"));
  const std::string port_file = testing::TestDir() + "/spec_ps.port";
  auto server = Start("ps_server/ps_server",
                      {"--cluster_spec=" + spec, "--host=127.0.0.1",
                       "--port_file=" + port_file},
                      "spec_ps");
  ASSERT_NE(server, nullptr);
  absl::StatusOr<int> served = testing::WaitForPortFile(port_file, kTimeout);
  ASSERT_TRUE(served.ok()) << served.status() << server->Stderr();
  EXPECT_EQ(*served, port);  // the port came from "ps"[task.index]
  EXPECT_THAT(server->Stderr(),
              HasSubstr(absl::StrCat("from the cluster spec: --num_shards=1 "
                                     "--shard_id=0 --port=",
                                     port, " --num_workers=1 --mode=async")));
  EXPECT_THAT(server->Stderr(), HasSubstr("optimizer momentum"));

  std::unique_ptr<testing::Process> worker;
  {
    ScopedClusterEnv env(absl::StrCat(R"({"ps": [")", ps, R"("], "workers": 1,
        "task": {"type": "worker", "index": 0},
        "worker_flags": {"model": "softmax", "steps": 60}})"));
    worker = Start("worker/worker", {}, "spec_worker");
  }
  ASSERT_NE(worker, nullptr);
  absl::StatusOr<int> code = worker->Wait(kTimeout);
  ASSERT_TRUE(code.ok()) << code.status();
  ASSERT_EQ(*code, 0) << worker->Stderr();
  EXPECT_THAT(worker->Stderr(),
              HasSubstr(absl::StrCat("from the cluster spec: --ps_hosts=", ps,
                                     " --worker_id=0 --num_workers=1")));
  // The mode the servers report back is the spec's.
  EXPECT_THAT(worker->Stdout(), HasSubstr("\"mode\":\"async\""));
  EXPECT_THAT(worker->Stdout(), HasSubstr("\"steps\":60,"));
  absl::StatusOr<double> accuracy =
      testing::FinalJsonNumber(worker->Stdout(), "test_accuracy");
  ASSERT_TRUE(accuracy.ok()) << accuracy.status();
  EXPECT_GE(*accuracy, 0.6);
}

// The job as TensorFlow users describe it: each process gets TF_CONFIG
// with its own task, nothing else.
TEST(ClusterSpecE2eTest, TfConfigConfiguresAJob) {
  const int port = testing::FreePort();
  const std::string cluster = absl::StrCat(
      R"("cluster": {"ps": ["127.0.0.1:)", port,
      R"("], "chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})");
  const std::string port_file = testing::TestDir() + "/tf_ps.port";
  std::unique_ptr<testing::Process> server;
  {
    ScopedClusterEnv env(
        absl::StrCat("{", cluster, R"(, "task": {"type": "ps", "index": 0}})"),
        "TF_CONFIG");
    server = Start("ps_server/ps_server",
                   {"--host=127.0.0.1", "--port_file=" + port_file}, "tf_ps");
  }
  ASSERT_NE(server, nullptr);
  absl::StatusOr<int> served = testing::WaitForPortFile(port_file, kTimeout);
  ASSERT_TRUE(served.ok()) << served.status() << server->Stderr();
  EXPECT_EQ(*served, port);
  EXPECT_THAT(server->Stderr(),
              HasSubstr(absl::StrCat("from the cluster spec: --num_shards=1 "
                                     "--shard_id=0 --port=",
                                     port, " --num_workers=2")));
  // The chief is worker 0, TF's worker 0 is worker 1: together they train.
  std::vector<std::unique_ptr<testing::Process>> workers;
  for (const char* task : {R"({"type": "chief", "index": 0})",
                           R"({"type": "worker", "index": 0})"}) {
    ScopedClusterEnv env(absl::StrCat("{", cluster, R"(, "task": )", task, "}"),
                         "TF_CONFIG");
    workers.push_back(Start("worker/worker", {"--model=softmax", "--steps=30"},
                            absl::StrCat("tf_worker", workers.size())));
    ASSERT_NE(workers.back(), nullptr);
  }
  for (size_t k = 0; k < workers.size(); ++k) {
    absl::StatusOr<int> code = workers[k]->Wait(kTimeout);
    ASSERT_TRUE(code.ok()) << code.status();
    ASSERT_EQ(*code, 0) << workers[k]->Stderr();
    EXPECT_THAT(workers[k]->Stderr(),
                HasSubstr(absl::StrCat("--worker_id=", k, " --num_workers=2")));
    EXPECT_THAT(workers[k]->Stdout(), HasSubstr("\"steps\":30,"));
  }
}

TEST(ClusterSpecE2eTest, ExplicitFlagsWin) {
  const std::string spec = WriteFile(
      "override.json", R"({"ps": ["127.0.0.1:1", "127.0.0.1:2"], "workers": 3,
          "mode": "async", "task": {"type": "ps", "index": 1}})");
  const std::string port_file = testing::TestDir() + "/override.port";
  // --shard_id=0, --port=0 (any free one) and --mode=sync beat the spec;
  // --num_shards and --num_workers still come from it.
  auto server =
      Start("ps_server/ps_server",
            {"--cluster_spec=" + spec, "--host=127.0.0.1", "--port=0",
             "--shard_id=0", "--mode=sync", "--port_file=" + port_file},
            "override_ps");
  ASSERT_NE(server, nullptr);
  absl::StatusOr<int> served = testing::WaitForPortFile(port_file, kTimeout);
  ASSERT_TRUE(served.ok()) << served.status() << server->Stderr();
  EXPECT_NE(*served, 1);
  EXPECT_NE(*served, 2);
  const std::string log = server->Stderr();
  EXPECT_THAT(log, HasSubstr("from the cluster spec: --num_shards=2 "
                             "--num_workers=3\n"));
  EXPECT_THAT(log, HasSubstr("shard 0/2 listening"));
  EXPECT_THAT(log, HasSubstr("mode sync, 3 workers"));
}

TEST(ClusterSpecE2eTest, BadSpecIsOneLineNamingTheField) {
  struct Case {
    std::string binary;
    std::string env;
    std::vector<std::string> flags;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"worker/worker",
       R"({"ps": ["a:1"], "workers": "two"})",
       {},
       "cluster spec (PSTRAIN_CLUSTER): \"workers\": must be an integer >= 1, "
       "got \"two\""},
      {"worker/worker",
       R"({"ps": ["a:1"], "task": {"type": "ps", "index": 0}})",
       {},
       "\"task.type\": is \"ps\" but this is a worker"},
      {"ps_server/ps_server",
       "",
       {"--cluster_spec=/nonexistent/job.json"},
       "--cluster_spec=/nonexistent/job.json: cannot read the file"},
      {"ps_server/ps_server",
       R"({"ps": ["a:1", "b"]})",
       {},
       "\"ps[1]\": \"b\" is not host:port"},
      {"ps_server/ps_server",
       R"({"ps": ["a:1"], "ps_flags": {"learning_rat": 0.1}})",
       {},
       "\"ps_flags.learning_rat\": no such flag of ps_server"},
  };
  for (const Case& c : cases) {
    std::unique_ptr<testing::Process> process;
    {
      std::unique_ptr<ScopedClusterEnv> env;
      if (!c.env.empty()) env = std::make_unique<ScopedClusterEnv>(c.env);
      process = Start(c.binary, c.flags, "bad_spec");
    }
    ASSERT_NE(process, nullptr);
    absl::StatusOr<int> code = process->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 2) << c.expected;
    const std::string err = process->Stderr();
    const std::vector<std::string> lines =
        absl::StrSplit(err, '\n', absl::SkipEmpty());
    EXPECT_EQ(lines.size(), 1u) << err;
    EXPECT_THAT(err, HasSubstr(c.expected));
  }
}

}  // namespace
}  // namespace pstrain
