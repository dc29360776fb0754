// The Prometheus endpoints of a real ps_server and worker, scraped over HTTP
// during and after a short job: the names exist and the values agree with
// what the job did (and with the shard's own Stats).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/http_util.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;
using testing::HttpGet;
using testing::MetricValue;
using testing::WaitForPortFile;

constexpr absl::Duration kTimeout = absl::Seconds(60);

const std::map<std::string, std::string> kShard0 = {{"shard", "0"}};
const std::map<std::string, std::string> kWorker0 = {{"worker", "0"}};

std::map<std::string, std::string> Rpc(const std::string& method,
                                       const std::string& code = "") {
  std::map<std::string, std::string> labels = {
      {"service", "pstrain.ParameterServer"}, {"method", method}};
  if (!code.empty()) labels["code"] = code;
  return labels;
}

std::string Scrape(int port) {
  absl::StatusOr<testing::HttpResponse> response = HttpGet(port, "/metrics");
  EXPECT_TRUE(response.ok()) << response.status();
  if (!response.ok()) return "";
  EXPECT_EQ(response->status, 200);
  EXPECT_THAT(response->headers, HasSubstr("text/plain; version=0.0.4"));
  return response->body;
}

// The value, or a failure naming what was missing (then -1).
double Value(const std::string& page, const std::string& name,
             const std::map<std::string, std::string>& labels) {
  absl::StatusOr<double> value = MetricValue(page, name, labels);
  EXPECT_TRUE(value.ok()) << value.status();
  return value.ok() ? *value : -1;
}

// Waits until the worker printed its final JSON line (it then lingers,
// serving its last metrics).
absl::Status WaitForFinalLine(testing::Process& worker) {
  const absl::Time deadline = absl::Now() + kTimeout;
  while (worker.Stdout().find("{\"event\":\"final\"") == std::string::npos) {
    if (!worker.running()) {
      return absl::InternalError(
          absl::StrCat("worker exited early:\n", worker.Stderr()));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError("no final line from the worker");
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::OkStatus();
}

TEST(MetricsTest, ServerAndWorkerCountWhatTheJobDid) {
  const std::string dir = testing::TestDir() + "/metrics_job";
  testing::ClusterOptions options;
  options.server_flags = {"--metrics_port=-1", "--metrics_host=127.0.0.1",
                          "--metrics_port_file=" + dir + "/ps0.metrics_port",
                          "--learning_rate=1"};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "metrics_job");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<int> server_port =
      WaitForPortFile(dir + "/ps0.metrics_port", kTimeout);
  ASSERT_TRUE(server_port.ok()) << server_port.status();

  // Before any worker: the shard's gauges are there, at zero.
  std::string page = Scrape(*server_port);
  EXPECT_EQ(Value(page, "pstrain_shard_model_registered", kShard0), 0);
  EXPECT_EQ(Value(page, "pstrain_shard_info",
                  {{"shard", "0"}, {"num_shards", "1"}, {"mode", "sync"}}),
            1);
  absl::StatusOr<testing::HttpResponse> missing =
      HttpGet(*server_port, "/nothing");
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ(missing->status, 404);

  // The probe model is one block, pushed in one RPC per step: every count
  // below is exact.
  constexpr int kSteps = 30;
  constexpr int kBatch = 16;
  const std::string csv = dir + "/run.csv";
  absl::StatusOr<std::unique_ptr<testing::Process>> worker =
      (*cluster)->StartWorker(
          0, 1,
          {"--model=probe", "--probe_elements=1000",
           absl::StrCat("--steps=", kSteps),
           absl::StrCat("--batch_size=", kBatch), "--metrics_port=-1",
           "--metrics_host=127.0.0.1",
           "--metrics_port_file=" + dir + "/worker0.metrics_port",
           "--metrics_linger_s=60", "--metrics_csv=" + csv,
           "--inject_step_delay_ms=5", "--eval_every_steps=10"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> worker_port =
      WaitForPortFile(dir + "/worker0.metrics_port", kTimeout);
  ASSERT_TRUE(worker_port.ok()) << worker_port.status();
  ASSERT_TRUE(WaitForFinalLine(**worker).ok()) << (*worker)->Stderr();

  page = Scrape(*worker_port);
  EXPECT_EQ(Value(page, "pstrain_worker_step", kWorker0), kSteps);
  EXPECT_EQ(Value(page, "pstrain_worker_steps", kWorker0), kSteps);
  EXPECT_EQ(Value(page, "pstrain_worker_examples_total", kWorker0),
            kSteps * kBatch);
  EXPECT_EQ(Value(page, "pstrain_worker_pull_duration_seconds_count", kWorker0),
            kSteps);
  EXPECT_EQ(Value(page, "pstrain_worker_push_duration_seconds_count", kWorker0),
            kSteps);
  EXPECT_EQ(
      Value(page, "pstrain_worker_compute_duration_seconds_count", kWorker0),
      kSteps);
  EXPECT_EQ(Value(page, "pstrain_worker_network_wait_seconds_count", kWorker0),
            kSteps);
  // No embedding tables in the probe model: the row counters are there, 0.
  EXPECT_EQ(Value(page, "pstrain_worker_sparse_rows_pulled_total", kWorker0),
            0);
  EXPECT_EQ(Value(page, "pstrain_worker_sparse_cache_hits_total", kWorker0), 0);
  // The injected 5 ms a step counts as compute, not as network wait.
  EXPECT_GE(
      Value(page, "pstrain_worker_compute_duration_seconds_sum", kWorker0),
      kSteps * 0.005);
  // Every step sleeps 5 ms on purpose.
  EXPECT_GE(Value(page, "pstrain_worker_step_duration_seconds_sum", kWorker0),
            kSteps * 0.005);
  const double rate =
      Value(page, "pstrain_worker_samples_per_second", kWorker0);
  EXPECT_GT(rate, 0);
  EXPECT_LT(rate, kBatch / 0.005);  // no faster than the injected delay allows
  // The probe classifies nothing: its held-out accuracy is exactly 0.
  EXPECT_EQ(Value(page, "pstrain_worker_test_accuracy", kWorker0), 0);
  EXPECT_EQ(Value(page, "pstrain_worker_pull_duration_seconds_bucket",
                  {{"worker", "0"}, {"le", "+Inf"}}),
            kSteps);

  page = Scrape(*server_port);
  const double pushes =
      Value(page, "pstrain_server_rpcs_total", Rpc("Push", "OK"));
  EXPECT_EQ(pushes, kSteps);
  EXPECT_EQ(Value(page, "pstrain_shard_blocks_applied_total", kShard0), pushes);
  EXPECT_EQ(Value(page, "pstrain_shard_version", kShard0), kSteps);
  EXPECT_EQ(
      Value(page, "pstrain_server_rpc_duration_seconds_count", Rpc("Push")),
      kSteps);
  // Every pull of a step plus the final one.
  const double pulls =
      Value(page, "pstrain_server_rpcs_total", Rpc("Pull", "OK"));
  EXPECT_GE(pulls, kSteps);
  EXPECT_EQ(Value(page, "pstrain_shard_pulls_served_total", kShard0), pulls);
  // 1000 floats each way per step, plus framing.
  EXPECT_GE(Value(page, "pstrain_server_request_bytes_total", Rpc("Push")),
            kSteps * 4000.0);
  EXPECT_GE(Value(page, "pstrain_server_response_bytes_total", Rpc("Pull")),
            pulls * 4000.0);
  EXPECT_EQ(
      Value(page, "pstrain_server_rpcs_total", Rpc("RegisterModel", "OK")), 1);
  EXPECT_EQ(Value(page, "pstrain_shard_model_registered", kShard0), 1);
  EXPECT_EQ(Value(page, "pstrain_shard_elements", kShard0), 1000);
  EXPECT_EQ(Value(page, "pstrain_shard_waiting_pulls", kShard0), 0);
  EXPECT_EQ(Value(page, "pstrain_shard_blocks_duplicate_total", kShard0), 0);
  EXPECT_EQ(Value(page, "pstrain_shard_requests_rejected_total", kShard0), 0);
  EXPECT_EQ(Value(page, "pstrain_shard_late_gradients_dropped_total", kShard0),
            0);
  // The same numbers as the shard's own Stats().
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->at(0).blocks_applied(), pushes);

  // The CSV: a header and one row per step, steps in order, time growing.
  std::ifstream in(csv);
  std::stringstream text;
  text << in.rdbuf();
  const std::vector<std::string> rows =
      absl::StrSplit(text.str(), '\n', absl::SkipEmpty());
  ASSERT_EQ(rows.size(), kSteps + 1u) << text.str();
  EXPECT_EQ(rows[0],
            "step,time_s,loss,train_accuracy,samples_per_sec,pull_ms,push_ms,"
            "test_loss,test_accuracy,compute_ms,network_wait");
  double last_time = -1;
  for (int i = 1; i <= kSteps; ++i) {
    const std::vector<std::string> cells = absl::StrSplit(rows[i], ',');
    ASSERT_EQ(cells.size(), 11u) << rows[i];
    EXPECT_EQ(cells[0], absl::StrCat(i));
    // Held-out columns only on the rows of an evaluation (every 10 steps).
    EXPECT_EQ(cells[8].empty(), i % 10 != 0) << rows[i];
    // Every step computes, and waits on the network for part of the step.
    EXPECT_GT(std::stod(cells[9]), 0) << rows[i];
    const double network_wait = std::stod(cells[10]);
    EXPECT_GE(network_wait, 0) << rows[i];
    EXPECT_LE(network_wait, 1) << rows[i];
    const double time = std::stod(cells[1]);
    EXPECT_GT(time, last_time);
    last_time = time;
  }

  // SIGTERM ends the lingering at once, with a clean exit.
  (*worker)->Signal(SIGTERM);
  absl::StatusOr<int> code = (*worker)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << (*worker)->Stderr();
}

TEST(MetricsTest, AsyncJobReportsLossAndStaleness) {
  const std::string dir = testing::TestDir() + "/metrics_async";
  testing::ClusterOptions options;
  options.mode = "async";
  options.num_workers = 2;
  options.server_flags = {"--metrics_port=-1", "--metrics_host=127.0.0.1",
                          "--metrics_port_file=" + dir + "/ps0.metrics_port",
                          "--learning_rate=0.2"};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "metrics_async");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::unique_ptr<testing::Process>> workers;
  for (int k = 0; k < 2; ++k) {
    absl::StatusOr<std::unique_ptr<testing::Process>> worker =
        (*cluster)->StartWorker(
            k, 2,
            // Long enough (>= 3 s) that the two workers overlap even when
            // a loaded machine starts the second one late: staleness needs
            // pushes computed while the other worker moved the model.
            {"--model=softmax", "--steps=300", "--inject_step_delay_ms=10",
             "--metrics_port=-1", "--metrics_host=127.0.0.1",
             absl::StrCat("--metrics_port_file=", dir, "/worker", k,
                          ".metrics_port"),
             "--metrics_linger_s=60"});
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(std::move(*worker));
  }
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(WaitForFinalLine(*workers[k]).ok()) << workers[k]->Stderr();
    absl::StatusOr<int> port = WaitForPortFile(
        absl::StrCat(dir, "/worker", k, ".metrics_port"), kTimeout);
    ASSERT_TRUE(port.ok()) << port.status();
    const std::string page = Scrape(*port);
    const std::map<std::string, std::string> me = {{"worker", absl::StrCat(k)}};
    EXPECT_EQ(Value(page, "pstrain_worker_step", me), 300);
    const double loss = Value(page, "pstrain_worker_loss", me);
    EXPECT_GT(loss, 0);
    EXPECT_LT(loss, 1.386);  // below chance (ln 4) after training
    const double accuracy = Value(page, "pstrain_worker_train_accuracy", me);
    EXPECT_GE(accuracy, 0.4);
    EXPECT_LE(accuracy, 1);
  }
  absl::StatusOr<int> server_port =
      WaitForPortFile(dir + "/ps0.metrics_port", kTimeout);
  ASSERT_TRUE(server_port.ok()) << server_port.status();
  const std::string page = Scrape(*server_port);
  EXPECT_EQ(Value(page, "pstrain_shard_info",
                  {{"shard", "0"}, {"num_shards", "1"}, {"mode", "async"}}),
            1);
  // Two workers pushing into one model: some gradients were computed on a
  // model that had moved on since the pull.
  EXPECT_GE(Value(page, "pstrain_shard_staleness_max", kShard0), 1);
  EXPECT_GT(Value(page, "pstrain_shard_staleness_mean", kShard0), 0);
  EXPECT_GE(Value(page, "pstrain_server_rpcs_total", Rpc("Push", "OK")), 300);
  for (auto& worker : workers) worker->Signal(SIGTERM);
  for (auto& worker : workers) {
    absl::StatusOr<int> code = worker->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0);
  }
}

TEST(WorkerOutputTest, ProgressBarOrLines) {
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start({}, "worker_output");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  // A bar (what a terminal gets): one line redrawn with \r, then the final
  // JSON line on a line of its own.
  absl::StatusOr<std::vector<std::string>> out =
      (*cluster)->RunWorkers({{"--model=softmax", "--steps=40",
                               "--progress=bar", "--inject_step_delay_ms=5"}},
                             kTimeout);
  ASSERT_TRUE(out.ok()) << out.status();
  const std::string& bar = (*out)[0];
  EXPECT_THAT(bar, HasSubstr("\r["));
  EXPECT_THAT(bar, HasSubstr("] 40/40 100%  loss "));
  EXPECT_THAT(bar,
              HasSubstr(" samples/s  ETA 0:00\033[K\n{\"event\":\"final\""));
  EXPECT_EQ(std::count(bar.begin(), bar.end(), '\n'), 2) << bar;

  // Lines (what a log file gets): one every --log_every steps.
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> second =
      testing::TestCluster::Start({}, "worker_output_lines");
  ASSERT_TRUE(second.ok()) << second.status();
  out = (*second)->RunWorkers(
      {{"--model=softmax", "--steps=40", "--progress=lines", "--log_every=10"}},
      kTimeout);
  ASSERT_TRUE(out.ok()) << out.status();
  const std::string& lines = (*out)[0];
  EXPECT_EQ(lines.find('\r'), std::string::npos);
  for (int step : {10, 20, 30, 40}) {
    EXPECT_THAT(lines,
                HasSubstr(absl::StrCat("worker 0 step ", step, "/40 loss ")));
  }
  EXPECT_EQ(std::count(lines.begin(), lines.end(), '\n'), 5) << lines;
}

// Clients name the method of a call, before any authentication: names the
// server does not have all count as one "unknown" method, so however many
// are sent, /metrics keeps the series it started with.
TEST(MetricsTest, MadeUpMethodNamesDoNotGrowTheMetrics) {
  const std::string dir = testing::TestDir() + "/metrics_bound";
  const std::string token_file = dir + "/token";
  ASSERT_EQ(std::system(
                ("mkdir -p " + dir + " && echo secret >" + token_file).c_str()),
            0);
  testing::ClusterOptions options;
  options.server_flags = {"--metrics_port=-1", "--metrics_host=127.0.0.1",
                          "--metrics_port_file=" + dir + "/ps0.metrics_port",
                          "--auth_token_file=" + token_file};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "metrics_bound");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<int> port =
      WaitForPortFile(dir + "/ps0.metrics_port", kTimeout);
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string before = Scrape(*port);

  grpc::GenericStub stub(grpc::CreateChannel(
      (*cluster)->HostList()[0], grpc::InsecureChannelCredentials()));
  constexpr int kCalls = 300;
  for (int i = 0; i < kCalls; ++i) {
    // Half look like call streams of made-up methods.
    const std::string method =
        absl::StrCat("/evil.Service", i, "/Method", i, i % 2 ? "Stream" : "");
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    grpc::ByteBuffer request, response;
    grpc::Slice empty("");
    request = grpc::ByteBuffer(&empty, 1);
    // 1.51's generic stub has only the callback form; the deadline above
    // bounds the wait.
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                   [&done](grpc::Status s) { done.set_value(std::move(s)); });
    const grpc::Status status = done.get_future().get();
    ASSERT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << method;
  }

  const std::string after = Scrape(*port);
  // Not EXPECT_THAT: on failure the page is megabytes.
  EXPECT_FALSE(absl::StrContains(after, "evil"))
      << "made-up methods got series: /metrics is " << after.size()
      << " bytes, was " << before.size();
  EXPECT_EQ(Value(after, "pstrain_server_rpcs_total",
                  {{"service", "unknown"},
                   {"method", "unknown"},
                   {"code", "UNIMPLEMENTED"}}),
            kCalls);
  // The same lines as before the calls, give or take values: process_*
  // and the counts change, no series is added.
  auto series = [](const std::string& page) {
    int lines = 0;
    for (absl::string_view line : absl::StrSplit(page, '\n')) {
      if (!line.empty() && line[0] != '#') ++lines;
    }
    return lines;
  };
  EXPECT_EQ(series(after), series(before));
}

TEST(MetricsTest, ProcessAndBuildInfo) {
  const std::string dir = testing::TestDir() + "/metrics_process";
  testing::ClusterOptions options;
  options.server_flags = {"--metrics_port=-1", "--metrics_host=127.0.0.1",
                          "--metrics_port_file=" + dir + "/ps0.metrics_port"};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "metrics_process");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<int> port =
      WaitForPortFile(dir + "/ps0.metrics_port", kTimeout);
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string page = Scrape(*port);
  // A running gRPC server holds megabytes and a handful of descriptors.
  EXPECT_GT(Value(page, "process_resident_memory_bytes", {}), 1e6);
  EXPECT_GT(Value(page, "process_virtual_memory_bytes", {}), 1e6);
  EXPECT_GE(Value(page, "process_cpu_seconds_total", {}), 0);
  EXPECT_GT(Value(page, "process_open_fds", {}), 3);
  EXPECT_GT(Value(page, "process_max_fds", {}), 0);
  const double started = Value(page, "process_start_time_seconds", {});
  const double now = absl::ToUnixSeconds(absl::Now());
  EXPECT_LE(started, now + 1);
  EXPECT_GT(started, now - 600);  // started by this test
  EXPECT_THAT(page, HasSubstr("pstrain_build_info{binary=\"ps_server\""));
  EXPECT_THAT(page, HasSubstr("protocol_version=\"1\""));
}

}  // namespace
}  // namespace pstrain
