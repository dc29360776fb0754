#include "common/cluster_spec.h"

#include <cstdlib>
#include <fstream>
#include <map>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

// Flags of the same names as the binaries', for ApplyClusterSpec.
ABSL_FLAG(std::string, ps_hosts, "", "test");
ABSL_FLAG(int, worker_id, 0, "test");
ABSL_FLAG(int, num_workers, 1, "test");
ABSL_FLAG(bool, verbose_thing, false, "test");

namespace pstrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

constexpr char kFull[] = R"({
  "ps": ["ps0:5000", "10.0.0.2:5001"],
  "workers": 4, "max_workers": 6, "mode": "async",
  "task": {"type": "ps", "index": 1}
})";

TEST(ParseClusterSpecTest, ReadsEveryField) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(kFull, "test");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(spec->ps, ElementsAre("ps0:5000", "10.0.0.2:5001"));
  EXPECT_EQ(spec->workers, 4);
  EXPECT_EQ(spec->max_workers, 6);
  EXPECT_EQ(spec->mode, "async");
  EXPECT_EQ(spec->task_type, "ps");
  EXPECT_EQ(spec->task_index, 1);
}

TEST(ParseClusterSpecTest, OnlyPsIsRequired) {
  absl::StatusOr<ClusterSpec> spec =
      ParseClusterSpec(R"({"ps": ["[::1]:7"]})", "test");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->workers, 0);
  EXPECT_EQ(spec->task_type, "");
}

struct BadCase {
  const char* json;
  const char* expected;
};

class ParseClusterSpecErrorTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(ParseClusterSpecErrorTest, NamesTheField) {
  absl::StatusOr<ClusterSpec> spec =
      ParseClusterSpec(GetParam().json, "PSTRAIN_CLUSTER");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr("cluster spec (PSTRAIN_CLUSTER)"));
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr(GetParam().expected));
}

INSTANTIATE_TEST_SUITE_P(
    Errors, ParseClusterSpecErrorTest,
    ::testing::Values(
        BadCase{"{", "not JSON"}, BadCase{"[1]", "must be a JSON object"},
        BadCase{"{}", "\"ps\": is required"},
        BadCase{R"({"ps": []})", "\"ps\": must be a non-empty array"},
        BadCase{R"({"ps": "a:1"})", "\"ps\": must be a non-empty array"},
        BadCase{R"({"ps": [5]})", "\"ps[0]\": must be a \"host:port\""},
        BadCase{R"({"ps": ["a:1", "b"]})", "\"ps[1]\": \"b\" is not host:port"},
        BadCase{R"({"ps": ["a:0"]})", "\"ps[0]\": \"a:0\" is not host:port"},
        BadCase{R"({"ps": [":80"]})", "\"ps[0]\""},
        BadCase{R"({"ps": ["a:1"], "workers": "two"})",
                "\"workers\": must be an integer >= 1, got \"two\""},
        BadCase{R"({"ps": ["a:1"], "workers": 2.5})", "\"workers\""},
        BadCase{R"({"ps": ["a:1"], "workers": 0})", "\"workers\""},
        BadCase{R"({"ps": ["a:1"], "workers": 3, "max_workers": 2})",
                "\"max_workers\": must be >= \"workers\" (3)"},
        BadCase{R"({"ps": ["a:1"], "mode": "bulk"})",
                "\"mode\": must be \"sync\", \"async\" or \"ssp\""},
        BadCase{R"({"ps": ["a:1"], "wokers": 2})", "\"wokers\": unknown field"},
        BadCase{R"({"ps": ["a:1"], "task": 3})", "\"task\": must be an object"},
        BadCase{R"({"ps": ["a:1"], "task": {"type": "chief", "index": 0}})",
                "\"task.type\": must be \"ps\" or \"worker\""},
        BadCase{R"({"ps": ["a:1"], "task": {"type": "ps", "index": -1}})",
                "\"task.index\": must be an integer >= 0"},
        BadCase{R"({"ps": ["a:1"], "task": {"type": "ps"}})",
                "\"task\": needs both"},
        BadCase{
            R"({"ps": ["a:1"], "task": {"type": "ps", "index": 0, "x": 1}})",
            "\"task.x\": unknown field"},
        BadCase{R"({"ps": ["a:1"], "task": {"type": "ps", "index": 1}})",
                "\"task.index\": ps task 1 out of range"},
        BadCase{R"({"ps": ["a:1"], "workers": 2, "task": {"type": "worker",
                "index": 2}})",
                "\"task.index\": worker task 2 out of range"},
        BadCase{R"({"ps": ["a:1|b:2", "c:3"]})",
                "\"ps[1]\": lists 1 replica(s), \"a:1|b:2\" another number"},
        BadCase{R"({"ps": ["a:1|b"]})", "\"ps[0]\": \"b\" is not host:port"},
        BadCase{R"({"ps": ["a:1"], "worker_flags": ["--model=mlp"]})",
                "\"worker_flags\": must be an object of flag values"},
        BadCase{R"({"ps": ["a:1"], "ps_flags": {"learning_rate": [1]}})",
                "\"ps_flags.learning_rate\": must be a string, number or "
                "boolean"}));

TEST(ParseClusterSpecTest, FlagMapsKeepTheirValues) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(
      R"({"ps": ["a:1"], "ps_flags": {"learning_rate": 0.05, "optimizer":
          "adam"}, "worker_flags": {"steps": 1000, "verbose_thing": true}})",
      "test");
  ASSERT_TRUE(spec.ok()) << spec.status();
  using Pair = std::pair<std::string, std::string>;
  EXPECT_THAT(spec->ps_flags,
              UnorderedElementsAre(Pair("learning_rate", "0.05"),
                                   Pair("optimizer", "adam")));
  EXPECT_THAT(spec->worker_flags,
              UnorderedElementsAre(Pair("steps", "1000"),
                                   Pair("verbose_thing", "true")));
}

std::map<std::string, std::string> AsMap(
    const std::vector<FlagSetting>& settings) {
  std::map<std::string, std::string> map;
  for (const FlagSetting& s : settings) map[s.name] = s.value;
  return map;
}

std::string NoCurrent(const std::string&) { return "0"; }

TEST(FlagsFromClusterSpecTest, PsTakesItsShardAndPort) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(kFull, "test");
  ASSERT_TRUE(spec.ok());
  absl::StatusOr<std::vector<FlagSetting>> flags =
      FlagsFromClusterSpec(ClusterRole::kPs, *spec, {}, NoCurrent);
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(AsMap(*flags),
            (std::map<std::string, std::string>{{"num_shards", "2"},
                                                {"shard_id", "1"},
                                                {"port", "5001"},
                                                {"num_workers", "4"},
                                                {"max_workers", "6"},
                                                {"mode", "async"}}));
}

TEST(FlagsFromClusterSpecTest, ExplicitFlagsWinAndDecideThePort) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(kFull, "test");
  ASSERT_TRUE(spec.ok());
  // --shard_id=0 given: the task's index 1 is not used, the port is shard
  // 0's; --mode given: not taken from the spec.
  absl::StatusOr<std::vector<FlagSetting>> flags = FlagsFromClusterSpec(
      ClusterRole::kPs, *spec, {"shard_id", "mode"},
      [](const std::string& name) { return name == "shard_id" ? "0" : "?"; });
  ASSERT_TRUE(flags.ok()) << flags.status();
  const auto map = AsMap(*flags);
  EXPECT_EQ(map.count("shard_id"), 0u);
  EXPECT_EQ(map.count("mode"), 0u);
  EXPECT_EQ(map.at("port"), "5000");
}

TEST(FlagsFromClusterSpecTest, PsWithoutTaskUsesItsShardIdFlag) {
  absl::StatusOr<ClusterSpec> spec =
      ParseClusterSpec(R"({"ps": ["a:1", "b:2"], "workers": 2})", "test");
  ASSERT_TRUE(spec.ok());
  absl::StatusOr<std::vector<FlagSetting>> flags =
      FlagsFromClusterSpec(ClusterRole::kPs, *spec, {"shard_id"},
                           [](const std::string&) { return "1"; });
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(AsMap(*flags),
            (std::map<std::string, std::string>{
                {"num_shards", "2"}, {"port", "2"}, {"num_workers", "2"}}));
}

TEST(FlagsFromClusterSpecTest, ReplicatedPsTakesItsReplicaSet) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(
      R"({"ps": ["a:1|b:2", "c:3|d:4"], "workers": 2,
          "task": {"type": "ps", "index": 1, "replica": 1}})",
      "test");
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<std::vector<FlagSetting>> flags =
      FlagsFromClusterSpec(ClusterRole::kPs, *spec, {}, NoCurrent);
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(AsMap(*flags),
            (std::map<std::string, std::string>{{"num_shards", "2"},
                                                {"shard_id", "1"},
                                                {"replicas", "2"},
                                                {"replica_index", "1"},
                                                {"replica_hosts", "c:3,d:4"},
                                                {"port", "4"},
                                                {"num_workers", "2"}}));
  // Workers list every replica set as it is.
  absl::StatusOr<std::vector<FlagSetting>> worker =
      FlagsFromClusterSpec(ClusterRole::kWorker, *spec, {"worker_id"},
                           [](const std::string&) { return "0"; });
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(AsMap(*worker).at("ps_hosts"), "a:1|b:2,c:3|d:4");
}

TEST(FlagsFromClusterSpecTest, WorkerTakesHostsIdAndCount) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(
      R"({"ps": ["a:1", "b:2"], "workers": 2, "max_workers": 4,
          "task": {"type": "worker", "index": 1}})",
      "test");
  ASSERT_TRUE(spec.ok());
  absl::StatusOr<std::vector<FlagSetting>> flags =
      FlagsFromClusterSpec(ClusterRole::kWorker, *spec, {}, NoCurrent);
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(
      AsMap(*flags),
      (std::map<std::string, std::string>{
          {"ps_hosts", "a:1,b:2"}, {"worker_id", "1"}, {"num_workers", "2"}}));
}

TEST(FlagsFromClusterSpecTest, ElasticWorkerBeyondWorkersCountsItself) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(
      R"({"ps": ["a:1"], "workers": 2, "max_workers": 4,
          "task": {"type": "worker", "index": 3}})",
      "test");
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<std::vector<FlagSetting>> flags =
      FlagsFromClusterSpec(ClusterRole::kWorker, *spec, {}, NoCurrent);
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(AsMap(*flags).at("num_workers"), "4");
}

TEST(FlagsFromClusterSpecTest, TaskOfTheOtherRoleIsAnError) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(kFull, "x.json");
  ASSERT_TRUE(spec.ok());
  absl::StatusOr<std::vector<FlagSetting>> flags =
      FlagsFromClusterSpec(ClusterRole::kWorker, *spec, {}, NoCurrent);
  ASSERT_FALSE(flags.ok());
  EXPECT_THAT(std::string(flags.status().message()),
              HasSubstr("cluster spec (x.json): \"task.type\": is \"ps\" but "
                        "this is a worker"));
  // With its own --worker_id the spec's other task does not matter.
  EXPECT_TRUE(FlagsFromClusterSpec(ClusterRole::kWorker, *spec, {"worker_id"},
                                   NoCurrent)
                  .ok());
}

TEST(FlagsFromClusterSpecTest, FlagMapsAreAppliedButNotOverDerivedOnes) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(
      R"({"ps": ["a:1"], "worker_flags": {"model": "mlp", "steps": 7}})",
      "test");
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<std::vector<FlagSetting>> flags =
      FlagsFromClusterSpec(ClusterRole::kWorker, *spec, {"steps"}, NoCurrent);
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(AsMap(*flags), (std::map<std::string, std::string>{
                               {"ps_hosts", "a:1"}, {"model", "mlp"}}));
  spec = ParseClusterSpec(R"({"ps": ["a:1"], "worker_flags": {"ps_hosts":
                              "b:2"}})",
                          "test");
  ASSERT_TRUE(spec.ok()) << spec.status();
  flags = FlagsFromClusterSpec(ClusterRole::kWorker, *spec, {}, NoCurrent);
  ASSERT_FALSE(flags.ok());
  EXPECT_THAT(
      std::string(flags.status().message()),
      HasSubstr("\"worker_flags.ps_hosts\": is set by the spec itself"));
}

TEST(FlagsOnCommandLineTest, FindsEveryForm) {
  const char* argv[] = {"prog", "--a=1",    "-b=2",
                        "--c",  "3",        "--noverbose_thing",
                        "--",   "--after=1"};
  EXPECT_THAT(FlagsOnCommandLine(8, const_cast<char**>(argv)),
              UnorderedElementsAre("a", "b", "c", "verbose_thing"));
}

TEST(ApplyClusterSpecTest, SetsFlagsNotOnTheCommandLine) {
  const std::string path =
      std::string(std::getenv("TEST_TMPDIR")) + "/apply.json";
  std::ofstream(path) << R"({"ps": ["h:9", "i:10"], "workers": 3,
                             "task": {"type": "worker", "index": 2}})";
  const char* argv[] = {"worker", "--num_workers=5"};
  absl::SetFlag(&FLAGS_num_workers, 5);  // as the parse would have
  absl::StatusOr<std::vector<FlagSetting>> applied =
      ApplyClusterSpec(ClusterRole::kWorker, path, 2, const_cast<char**>(argv));
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(absl::GetFlag(FLAGS_ps_hosts), "h:9,i:10");
  EXPECT_EQ(absl::GetFlag(FLAGS_worker_id), 2);
  EXPECT_EQ(absl::GetFlag(FLAGS_num_workers), 5);
}

TEST(ApplyClusterSpecTest, FallsBackToTheEnvironment) {
  setenv(kClusterSpecEnv, R"({"ps": ["env:1"]})", 1);
  const char* argv[] = {"worker"};
  absl::StatusOr<std::vector<FlagSetting>> applied =
      ApplyClusterSpec(ClusterRole::kWorker, "", 1, const_cast<char**>(argv));
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(absl::GetFlag(FLAGS_ps_hosts), "env:1");
  setenv(kClusterSpecEnv, R"({"ps": ["env:1"], "oops": 1})", 1);
  applied =
      ApplyClusterSpec(ClusterRole::kWorker, "", 1, const_cast<char**>(argv));
  ASSERT_FALSE(applied.ok());
  EXPECT_THAT(std::string(applied.status().message()),
              HasSubstr("cluster spec (PSTRAIN_CLUSTER): \"oops\""));
  unsetenv(kClusterSpecEnv);
  applied =
      ApplyClusterSpec(ClusterRole::kWorker, "", 1, const_cast<char**>(argv));
  ASSERT_TRUE(applied.ok());
  EXPECT_THAT(*applied, IsEmpty());
}

TEST(TfConfigTest, ReadsClusterAndTask) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(
      R"({"cluster": {"ps": ["ps0:2222", "ps1:2222"],
                      "worker": ["w0:2222", "w1:2222", "w2:2222"]},
          "task": {"type": "worker", "index": 2},
          "environment": "cloud", "rpc_layer": "grpc"})",
      "TF_CONFIG");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(spec->ps, ElementsAre("ps0:2222", "ps1:2222"));
  EXPECT_EQ(spec->workers, 3);
  EXPECT_EQ(spec->task_type, "worker");
  EXPECT_EQ(spec->task_index, 2);
  spec = ParseClusterSpec(R"({"cluster": {"ps": ["ps0:2222"]},
                              "task": {"type": "ps", "index": 0},
                              "mode": "async"})",
                          "TF_CONFIG");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->task_type, "ps");
  EXPECT_EQ(spec->workers, 0);
  EXPECT_EQ(spec->mode, "async");  // pstrain's keys beside "cluster"
}

// TensorFlow's chief is worker 0; the workers come after it.
TEST(TfConfigTest, ChiefIsWorkerZero) {
  constexpr char kCluster[] =
      R"("cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"],
                     "ps": ["p:1"]})";
  absl::StatusOr<ClusterSpec> chief = ParseClusterSpec(
      absl::StrCat("{", kCluster,
                   R"(, "task": {"type": "chief", "index": 0}})"),
      "TF_CONFIG");
  ASSERT_TRUE(chief.ok()) << chief.status();
  EXPECT_EQ(chief->workers, 3);
  EXPECT_EQ(chief->task_type, "worker");
  EXPECT_EQ(chief->task_index, 0);
  absl::StatusOr<ClusterSpec> worker = ParseClusterSpec(
      absl::StrCat("{", kCluster,
                   R"(, "task": {"type": "worker", "index": 1}})"),
      "TF_CONFIG");
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->task_index, 2);
}

TEST(TfConfigTest, ErrorsNameTheField) {
  const std::pair<const char*, const char*> kCases[] = {
      {R"({"cluster": {"worker": ["w:1"]}})", "\"cluster.ps\": is required"},
      {R"({"cluster": {"ps": ["nohost"]}})", "\"cluster.ps[0]\""},
      {R"({"cluster": {"ps": ["p:1"], "evaluator": ["e:1"]}})",
       "\"cluster.evaluator\": unknown job"},
      {R"({"cluster": {"ps": ["p:1"]}, "task": {"type": "evaluator",
           "index": 0}})",
       "\"task.type\": must be \"ps\" or \"worker\""},
      {R"({"cluster": {"ps": ["p:1"], "worker": ["w:1"]},
           "task": {"type": "worker", "index": 1}})",
       "\"task.index\": worker task 1 out of range"},
      {R"({"cluster": {"ps": ["p:1"]}, "rpc_layer": "grpc+verbs"})",
       "\"rpc_layer\": pstrain speaks \"grpc\" only"},
      {R"({"cluster": {"ps": ["p:1"]}, "ps": ["q:1"]})",
       "\"ps\": comes from \"cluster\""},
      {R"({"cluster": ["p:1"]})", "\"cluster\": must be an object"},
  };
  for (const auto& [json, expected] : kCases) {
    absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(json, "TF_CONFIG");
    ASSERT_FALSE(spec.ok()) << json;
    EXPECT_THAT(std::string(spec.status().message()),
                HasSubstr(absl::StrCat("cluster spec (TF_CONFIG): ", expected)))
        << json;
  }
}

TEST(ApplyClusterSpecTest, ReadsTfConfigWhenPstrainClusterIsUnset) {
  unsetenv(kClusterSpecEnv);
  setenv(kTfConfigEnv,
         R"({"cluster": {"ps": ["tf0:1", "tf1:1"], "worker": ["a:1", "b:1"]},
             "task": {"type": "worker", "index": 1}})",
         1);
  const char* argv[] = {"worker"};
  absl::StatusOr<std::vector<FlagSetting>> applied =
      ApplyClusterSpec(ClusterRole::kWorker, "", 1, const_cast<char**>(argv));
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(absl::GetFlag(FLAGS_ps_hosts), "tf0:1,tf1:1");
  EXPECT_EQ(absl::GetFlag(FLAGS_worker_id), 1);
  EXPECT_EQ(absl::GetFlag(FLAGS_num_workers), 2);
  // PSTRAIN_CLUSTER, when set, wins.
  setenv(kClusterSpecEnv, R"({"ps": ["mine:1"]})", 1);
  applied =
      ApplyClusterSpec(ClusterRole::kWorker, "", 1, const_cast<char**>(argv));
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(absl::GetFlag(FLAGS_ps_hosts), "mine:1");
  unsetenv(kClusterSpecEnv);
  unsetenv(kTfConfigEnv);
}

TEST(ApplyClusterSpecTest, UnknownFlagInAFlagMapIsNamed) {
  setenv(kClusterSpecEnv, R"({"ps": ["a:1"], "worker_flags": {"modle": "x"}})",
         1);
  const char* argv[] = {"worker"};
  absl::StatusOr<std::vector<FlagSetting>> applied =
      ApplyClusterSpec(ClusterRole::kWorker, "", 1, const_cast<char**>(argv));
  unsetenv(kClusterSpecEnv);
  ASSERT_FALSE(applied.ok());
  EXPECT_THAT(std::string(applied.status().message()),
              HasSubstr("\"worker_flags.modle\": no such flag of worker"));
}

TEST(ApplyClusterSpecTest, MissingFileIsAnError) {
  const char* argv[] = {"worker"};
  absl::StatusOr<std::vector<FlagSetting>> applied =
      ApplyClusterSpec(ClusterRole::kWorker, "/nonexistent/spec.json", 1,
                       const_cast<char**>(argv));
  ASSERT_FALSE(applied.ok());
  EXPECT_THAT(std::string(applied.status().message()),
              HasSubstr("--cluster_spec=/nonexistent/spec.json"));
}

}  // namespace
}  // namespace pstrain
