// Issue 41: the same sync job gives the same model, bit for bit, whatever
// order the workers' gradients reach the servers in. Every worker here
// delays each push by a random time (--inject_push_jitter_ms), so the
// arrival order differs from run to run; the servers must still sum each
// step's gradients in one fixed order (worker id), so that three runs export
// byte-identical safetensors files and print the same final loss and
// accuracy. Because the order is per element and per worker, the model must
// not depend on how the bytes travelled either: the number of shards, the
// block size, the data plane or gRPC, TLS and the connections per shard all
// give the reference's bytes.
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"

namespace pstrain {
namespace {

using testing::BinaryPath;
using testing::ClusterOptions;
using testing::FinalJsonNumber;
using testing::Process;
using testing::TestCluster;
using testing::TestDir;

// Long enough that any difference in a sum reaches the exported bits, short
// enough that 8 workers on 2 cores finish in seconds.
constexpr int kSteps = 30;

std::vector<std::string> MlpFlags() {
  return {"--model=mlp",
          "--hidden=32",
          "--num_features=16",
          "--num_classes=4",
          "--train_examples=2000",
          "--test_examples=256",
          "--global_batch_size=48",
          "--seed=7",
          absl::StrCat("--steps=", kSteps),
          "--log_every=0",
          "--device=cpu"};
}

std::vector<std::string> CtrFlags() {
  return {"--model=ctr",
          "--ctr_data=synthetic",
          "--ctr_fields=4",
          "--ctr_dense=2",
          "--ctr_vocab=300",
          "--ctr_train_examples=8192",
          "--ctr_test_examples=1024",
          "--embedding_dim=4",
          "--ctr_hidden=8",
          "--sparse_optimizer=adagrad",
          "--sparse_learning_rate=0.1",
          "--global_batch_size=96",
          "--seed=3",
          absl::StrCat("--steps=", kSteps),
          "--log_every=0",
          "--device=cpu"};
}

struct Job {
  int workers = 3;
  int shards = 1;
  bool ctr = false;
  bool tls = false;
  int block_elements = 64;
  std::vector<std::string> worker_flags;  // beyond the model's
};

// What a run leaves that must not depend on arrival order.
struct Outcome {
  std::string model;  // the exported safetensors file's bytes
  // Each tensor's name and values, without the file's metadata (which names
  // the schema, block size included).
  std::vector<std::pair<std::string, std::string>> tensors;
  // Per worker: its final JSON's quality fields, in a fixed order.
  std::vector<std::vector<double>> quality;
  // Per worker: whether its steps ran as a pipeline (its final JSON).
  std::vector<bool> pipelined;
  // Per worker: its stdout.
  std::vector<std::string> outputs;
  // Bytes of gradients the servers held because they came before a lower
  // worker id's (the most at once, over the shards): > 0 shows that the
  // arrival order was not the id order, so the test tested something.
  int64_t early_bytes_peak = 0;
};

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

std::string CertDir() {
  static const std::string* dir = [] {
    auto* made = new std::string(absl::StrCat(TestDir(), "/certs"));
    const absl::Status status = testing::MakeTestCerts(*made);
    EXPECT_TRUE(status.ok()) << status;
    return made;
  }();
  return *dir;
}

std::vector<std::string> ClientTlsFlags() {
  return {"--tls_ca=" + CertDir() + "/ca.pem",
          "--tls_cert=" + CertDir() + "/client.pem",
          "--tls_key=" + CertDir() + "/client.key"};
}

// Runs the job's workers on `cluster` with `flags` each and returns their
// stdout; the default runs them side by side, undisturbed.
using WorkerRunner = std::function<absl::StatusOr<std::vector<std::string>>(
    TestCluster& cluster, const std::vector<std::string>& flags)>;

absl::StatusOr<std::vector<std::string>> RunUndisturbed(
    int workers, TestCluster& cluster, const std::vector<std::string>& flags) {
  return cluster.RunWorkers(
      std::vector<std::vector<std::string>>(workers, flags),
      absl::Seconds(240));
}

Outcome RunJob(const Job& job, const std::string& name,
               const WorkerRunner& run_workers = nullptr) {
  Outcome outcome;
  const std::string dir = absl::StrCat(TestDir(), "/", name);
  std::filesystem::create_directories(dir);
  ClusterOptions options;
  options.num_shards = job.shards;
  options.num_workers = job.workers;
  options.mode = "sync";
  // Adam: its normalised step carries a difference in the last bit of a
  // gradient sum into the weights instead of damping it.
  options.server_flags = {"--optimizer=adam", "--learning_rate=0.01",
                          absl::StrCat("--checkpoint_dir=", dir, "/ckpt")};
  if (job.tls) {
    options.server_flags.push_back("--tls_cert=" + CertDir() + "/server.pem");
    options.server_flags.push_back("--tls_key=" + CertDir() + "/server.key");
    options.server_flags.push_back("--tls_client_ca=" + CertDir() + "/ca.pem");
  }
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return outcome;

  std::vector<std::string> flags = job.ctr ? CtrFlags() : MlpFlags();
  flags.push_back(absl::StrCat("--block_elements=", job.block_elements));
  flags.push_back("--inject_push_jitter_ms=4");
  flags.insert(flags.end(), job.worker_flags.begin(), job.worker_flags.end());
  if (job.tls) {
    for (const std::string& flag : ClientTlsFlags()) flags.push_back(flag);
  }
  absl::StatusOr<std::vector<std::string>> outputs =
      run_workers ? run_workers(**cluster, flags)
                  : RunUndisturbed(job.workers, **cluster, flags);
  EXPECT_TRUE(outputs.ok()) << outputs.status();
  if (!outputs.ok()) return outcome;
  const std::vector<std::string> keys =
      job.ctr ? std::vector<std::string>{"logloss", "auc"}
              : std::vector<std::string>{"final_loss", "train_accuracy",
                                         "test_loss", "test_accuracy"};
  outcome.outputs = *outputs;
  for (const std::string& out : *outputs) {
    outcome.pipelined.push_back(out.find("\"pipelined\":true") !=
                                std::string::npos);
    std::vector<double>& quality = outcome.quality.emplace_back();
    for (const std::string& key : keys) {
      absl::StatusOr<double> value = FinalJsonNumber(out, key);
      EXPECT_TRUE(value.ok()) << key << ": " << value.status() << "\n" << out;
      quality.push_back(value.value_or(-1));
    }
  }

  if (!job.tls) {  // the cluster's observer speaks plaintext
    absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    for (const StatsResponse& shard :
         stats.value_or(std::vector<StatsResponse>())) {
      outcome.early_bytes_peak += shard.early_gradient_bytes_peak();
      EXPECT_EQ(shard.early_gradient_bytes(), 0) << "left after the job";
    }
  }

  const std::string file = absl::StrCat(dir, "/model.safetensors");
  std::vector<std::string> argv = {BinaryPath("worker/pstrain_export"),
                                   "--ps_hosts=" + (*cluster)->PsHosts(),
                                   "--output=" + file};
  if (job.tls) {
    for (const std::string& flag : ClientTlsFlags()) argv.push_back(flag);
  }
  absl::StatusOr<std::unique_ptr<Process>> exporter =
      Process::Start(argv, dir, "export");
  EXPECT_TRUE(exporter.ok()) << exporter.status();
  if (!exporter.ok()) return outcome;
  absl::StatusOr<int> code = (*exporter)->Wait(absl::Seconds(60));
  EXPECT_TRUE(code.ok() && *code == 0)
      << code.status() << " " << code.value_or(-1) << "\n"
      << (*exporter)->Stderr();
  outcome.model = ReadBytes(file);
  EXPECT_FALSE(outcome.model.empty()) << file;
  absl::StatusOr<SafetensorsFile> parsed = ReadSafetensorsFile(file);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  if (parsed.ok()) {
    for (const SafetensorsTensor& tensor : parsed->tensors) {
      outcome.tensors.emplace_back(tensor.name, tensor.data);
    }
  }
  return outcome;
}

// The first byte where two exports differ, for a message a person can use.
std::string FirstDifference(const std::string& a, const std::string& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return absl::StrCat("sizes ", a.size(), " and ", b.size(),
                      ", first difference at byte ", i);
}

void ExpectSameOutcome(const Outcome& expected, const Outcome& actual,
                       const std::string& what) {
  EXPECT_TRUE(expected.model == actual.model)
      << what << ": the exported models differ ("
      << FirstDifference(expected.model, actual.model) << ")";
  EXPECT_EQ(expected.quality, actual.quality) << what;
}

// The same values in every tensor (the files' metadata may differ).
void ExpectSameTensors(const Outcome& expected, const Outcome& actual,
                       const std::string& what) {
  ASSERT_EQ(expected.tensors.size(), actual.tensors.size()) << what;
  ASSERT_FALSE(expected.tensors.empty()) << what;
  for (size_t t = 0; t < expected.tensors.size(); ++t) {
    EXPECT_EQ(expected.tensors[t].first, actual.tensors[t].first) << what;
    EXPECT_TRUE(expected.tensors[t].second == actual.tensors[t].second)
        << what << ": tensor " << expected.tensors[t].first << " differs";
  }
  EXPECT_EQ(expected.quality, actual.quality) << what;
}

// Three runs of `job` with jittered pushes: one model, one set of figures.
Outcome ExpectThreeRunsAgree(const Job& job, const std::string& name) {
  const Outcome first = RunJob(job, name + "_run0");
  int64_t early_bytes = first.early_bytes_peak;
  for (int run = 1; run < 3; ++run) {
    const Outcome again = RunJob(job, absl::StrCat(name, "_run", run));
    ExpectSameOutcome(first, again,
                      absl::StrCat(name, " run ", run, " against run 0"));
    early_bytes += again.early_bytes_peak;
  }
  EXPECT_GT(early_bytes, 0) << name
                            << ": every gradient came in worker order, so "
                               "the order was not put to the test";
  return first;
}

class WorkerCountTest : public ::testing::TestWithParam<int> {};

TEST_P(WorkerCountTest, ThreeRunsOnOneAndTwoShardsGiveOneModel) {
  const int workers = GetParam();
  const std::string name = absl::StrCat("w", workers);
  const Outcome one_shard = ExpectThreeRunsAgree({workers, 1}, name + "_s1");
  const Outcome two_shards = ExpectThreeRunsAgree({workers, 2}, name + "_s2");
  // The order is per element, so the shard count changes nothing either.
  ExpectSameOutcome(one_shard, two_shards,
                    absl::StrCat(workers, " workers on 1 and 2 shards"));
}

INSTANTIATE_TEST_SUITE_P(ReproducibleSync, WorkerCountTest,
                         ::testing::Values(3, 4, 8));

// However the bytes travel, each gives the reference's model, twice.
TEST(ReproducibleSyncTest, TransportsAndBlockSizesGiveTheSameModel) {
  const Outcome reference = RunJob({4, 2}, "transport_reference");
  struct Variant {
    std::string name;
    Job job;
  };
  std::vector<Variant> variants = {
      {"grpc_only", {4, 2, false, false, 64, {"--data_plane=false"}}},
      {"tls", {4, 2, false, true, 64, {}}},
      {"one_connection",
       {4, 2, false, false, 64, {"--connections_per_shard=1"}}},
      {"four_connections",
       {4,
        2,
        false,
        false,
        64,
        {"--connections_per_shard=4", "--data_requests_in_flight=4"}}},
  };
  for (const Variant& variant : variants) {
    for (int run = 0; run < 2; ++run) {
      ExpectSameOutcome(reference,
                        RunJob(variant.job, absl::StrCat(variant.name, run)),
                        absl::StrCat(variant.name, " run ", run));
    }
  }
  // Another block size: the same values (the file's metadata records the
  // block size, so its bytes differ there).
  const Job blocks_of_23 = {4, 2, false, false, 23, {}};
  for (int run = 0; run < 2; ++run) {
    ExpectSameTensors(reference,
                      RunJob(blocks_of_23, absl::StrCat("blocks_of_23_", run)),
                      absl::StrCat("blocks of 23, run ", run));
  }
}

// The pipelined step (--pipeline_step, a prototype): the next forward reads
// the first layer's weight block by block as its values come back, so it
// sums the layer in chunks (16 x 32 weights in blocks of 64: 8 chunks of 2
// rows) and rounds differently from one GEMM; but it is one model, run
// after run, whatever order the pushes arrive in, and it learns as the plain
// step does.
TEST(ReproducibleSyncTest, ThePipelinedStepGivesOneModel) {
  const Outcome plain = RunJob({3, 2}, "pipeline_plain");
  const Outcome pipelined = ExpectThreeRunsAgree(
      {3, 2, false, false, 64, {"--pipeline_step=always"}}, "pipelined");
  ASSERT_EQ(plain.quality.size(), pipelined.quality.size());
  for (size_t w = 0; w < plain.quality.size(); ++w) {
    ASSERT_EQ(plain.quality[w].size(), 4u);
    ASSERT_EQ(pipelined.quality[w].size(), 4u);
    // The test accuracy of the same steps, rounding aside.
    EXPECT_NEAR(plain.quality[w][3], pipelined.quality[w][3], 0.02)
        << "worker " << w;
  }
  // Not the plain step's bits: the chunks were summed apart (had the flag
  // done nothing, the two would agree to the bit).
  EXPECT_FALSE(plain.model == pipelined.model);
}

// The lines of `out` that are step timelines (--trace_steps).
std::vector<std::string> StepTraces(const std::string& out) {
  std::vector<std::string> traces;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StrContains(line, "\"event\":\"step_trace\"")) {
      traces.emplace_back(line);
    }
  }
  return traces;
}

// On a device (--device=cpu_staged stages as a GPU worker does) the
// pipelined step copies each parameter in whole as its values land and
// each gradient out as backward issues it, and computes each layer with one
// GEMM as the plain step does: the plain step's model to the bit, in
// float32 and with both ways in bf16 (cast on the device, the gradients
// streamed as 16-bit elements). It is a device worker's default
// (--pipeline_step=by_host), and --trace_steps prints its timeline.
TEST(ReproducibleSyncTest, ADevicesPipelinedStepGivesThePlainStepsModel) {
  for (const bool bf16 : {false, true}) {
    std::vector<std::string> flags = {"--device=cpu_staged"};
    if (bf16) {
      flags.push_back("--gradient_wire_type=bf16");
      flags.push_back("--parameter_wire_type=bf16");
    }
    const std::string name = bf16 ? "staged_bf16" : "staged_fp32";
    std::vector<std::string> plain_flags = flags, pipelined_flags = flags;
    plain_flags.push_back("--pipeline_step=never");
    pipelined_flags.push_back("--trace_steps=2");
    const Outcome plain =
        RunJob({3, 2, false, false, 64, plain_flags}, name + "_plain");
    const Outcome pipelined =
        RunJob({3, 2, false, false, 64, pipelined_flags}, name + "_pipelined");
    EXPECT_EQ(plain.pipelined, std::vector<bool>(3, false)) << name;
    EXPECT_EQ(pipelined.pipelined, std::vector<bool>(3, true)) << name;
    ExpectSameOutcome(plain, pipelined, name);
    for (const std::string& out : plain.outputs) {
      EXPECT_TRUE(StepTraces(out).empty()) << "no flag, no timeline";
      EXPECT_GT(FinalJsonNumber(out, "steady_step_ms").value_or(0), 0) << out;
    }
    for (const std::string& out : pipelined.outputs) {
      const std::vector<std::string> traces = StepTraces(out);
      ASSERT_EQ(traces.size(), 2u) << out;
      for (int i = 0; i < 2; ++i) {
        EXPECT_TRUE(
            absl::StrContains(traces[i], absl::StrCat("\"step\":", 10 + i)))
            << traces[i];
        // Forward asked for the first layer's weight and had it in device
        // memory; backward issued its gradient and had it copied out in
        // full (16 x 32 elements); groups left and their values landed.
        for (const char* event :
             {"\"w\",0,512]", "\"i\",0,512]", "\"g\",0,512]", "\"r\",0,512]",
              "\"B\"", "\"b\"", "\"e\"", "\"s\"", "\"p\""}) {
          EXPECT_TRUE(absl::StrContains(traces[i], event))
              << event << " in " << traces[i];
        }
      }
    }
  }
}

// Waits for `worker` and returns its stdout; an error unless it exited 0.
absl::StatusOr<std::string> Finish(Process& worker) {
  absl::StatusOr<int> code = worker.Wait(absl::Seconds(240));
  if (!code.ok()) return code.status();
  if (*code != 0) {
    return absl::InternalError(
        absl::StrCat("worker exited ", *code, ":\n", worker.Stderr()));
  }
  return worker.Stdout();
}

// Worker `victim` of the job dies as kill -9 would (the fault injection
// flag `crash_flag`, at a step of the test's choosing) and is started
// again at once with its usual flags, as a supervisor (Slurm's requeue, a
// Kubernetes restart) would.
WorkerRunner KillAndRestart(int workers, int victim,
                            const std::string& crash_flag) {
  return [=](TestCluster& cluster, const std::vector<std::string>& flags)
             -> absl::StatusOr<std::vector<std::string>> {
    std::vector<std::unique_ptr<Process>> running;
    for (int w = 0; w < workers; ++w) {
      std::vector<std::string> own = flags;
      if (w == victim) own.push_back(crash_flag);
      absl::StatusOr<std::unique_ptr<Process>> started =
          cluster.StartWorker(w, workers, own);
      if (!started.ok()) return started.status();
      running.push_back(std::move(*started));
    }
    absl::StatusOr<int> died = running[victim]->Wait(absl::Seconds(120));
    if (!died.ok()) return died.status();
    if (*died != 128 + SIGKILL) {
      return absl::InternalError(absl::StrCat("the victim exited ", *died,
                                              ", not by SIGKILL:\n",
                                              running[victim]->Stderr()));
    }
    absl::StatusOr<std::unique_ptr<Process>> again =
        cluster.StartWorker(victim, workers, flags);
    if (!again.ok()) return again.status();
    running[victim] = std::move(*again);
    std::vector<std::string> outputs;
    for (auto& worker : running) {
      absl::StatusOr<std::string> out = Finish(*worker);
      if (!out.ok()) return out.status();
      outputs.push_back(*out);
    }
    absl::StatusOr<std::vector<StatsResponse>> stats = cluster.Stats();
    if (!stats.ok()) return stats.status();
    for (const StatsResponse& shard : *stats) {
      if (shard.steps_short() != 0) {
        return absl::InternalError(
            absl::StrCat("shard ", shard.shard_id(), " completed ",
                         shard.steps_short(), " step(s) without a worker"));
      }
    }
    return outputs;
  };
}

// A worker killed (-9) and restarted within its lease takes its
// predecessor's place at the step it was at: the step waits for it, it
// recomputes the same gradient, and the model is the undisturbed one's.
TEST(ReproducibleSyncTest, AWorkerKilledAndRestartedChangesNothing) {
  const Job job = {3, 2};
  const Outcome reference = RunJob(job, "undisturbed");
  // Dead before its push of step 10: every shard still waits for it.
  ExpectSameOutcome(
      reference,
      RunJob(job, "killed_before_push",
             KillAndRestart(3, 2, "--inject_crash_before_push_step=10")),
      "worker 2 killed before pushing step 10, restarted");
  // Dead once step 15 was pushed everywhere: it resumes at step 16.
  ExpectSameOutcome(
      reference,
      RunJob(job, "killed_after_step",
             KillAndRestart(3, 1, "--inject_crash_after_step=15")),
      "worker 1 killed after step 15, restarted");
}

// A worker that died in the middle of a push (its step-0 gradient reached
// shard 0 but not shard 1) cannot recompute that step: shard 0 has moved on
// to step 1 with it. Its next process leaves and registers again, so shard
// 1's step 0 completes without it (short, counted) and nothing waits for a
// gradient that will never come; it starts at step 1.
TEST(ReproducibleSyncTest, AWorkerThatDiedMidPushRejoinsAtTheNextStep) {
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, "died_mid_push");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ModelSchema schema;
  schema.set_seed(1);
  schema.set_block_elements(4);
  for (const char* name : {"a", "b"}) {  // a on shard 0, b on shard 1
    DenseTensorSpec* tensor = schema.add_dense();
    tensor->set_name(name);
    tensor->add_shape(4);
    tensor->mutable_init()->set_kind(InitSpec::CONSTANT);
    tensor->mutable_init()->set_value(1.0f);
  }
  auto client = [&] {
    PsClientOptions client_options;
    client_options.hosts = (*cluster)->HostList();
    client_options.rpc_timeout = absl::Seconds(20);
    client_options.retry_window = absl::Seconds(20);
    return std::move(*PsClient::Create(client_options));
  };
  std::vector<std::unique_ptr<PsClient>> workers;
  for (int k = 0; k < 2; ++k) {
    workers.push_back(client());
    ASSERT_TRUE(workers[k]->Register(schema, 2, k).ok());
  }
  for (auto& worker : workers) ASSERT_TRUE(worker->AwaitJobStart().ok());
  std::vector<float> a(4), b(4), grad(4, 0.5f);
  for (auto& worker : workers)
    ASSERT_TRUE(worker->Pull(0, {a.data(), b.data()}).ok());
  ASSERT_TRUE(workers[0]->Push(0, {grad.data(), grad.data()}).ok());
  // Worker 1 gets only tensor a out (shard 0's step 0 completes), then dies.
  ASSERT_TRUE(
      workers[1]->Push(0, {grad.data(), grad.data()}, /*only=*/{0}).ok());
  workers[1].reset();
  workers[1] = client();
  absl::StatusOr<Registration> again = workers[1]->Register(schema, 2, 1);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->start_step, 1);
  // Nothing hangs: both pull step 1, which shard 1 reaches without worker 1.
  for (auto& worker : workers) {
    absl::StatusOr<int64_t> pulled = worker->Pull(1, {a.data(), b.data()});
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    EXPECT_EQ(*pulled, 1);
  }
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ((*stats)[0].steps_short(), 0);
  EXPECT_EQ((*stats)[1].steps_short(), 1);
}

// Stops every shard (each writes its final checkpoint) and starts it again
// from that checkpoint, as a job resumed later would be.
absl::Status RestartFromCheckpoints(TestCluster& cluster, int shards) {
  for (int shard = 0; shard < shards; ++shard) {
    if (absl::Status s = cluster.StopServer(shard); !s.ok()) return s;
  }
  for (int shard = 0; shard < shards; ++shard) {
    if (absl::Status s = cluster.RestartServer(shard); !s.ok()) return s;
    if (!absl::StrContains(cluster.server(shard).Stderr(), "restored")) {
      return absl::InternalError(
          absl::StrCat("shard ", shard, " did not restore its checkpoint:\n",
                       cluster.server(shard).Stderr()));
    }
  }
  return absl::OkStatus();
}

// The whole job stopped (servers with SIGTERM write a final checkpoint) and
// started again from the checkpoint: the model is the undisturbed one's.
// The CTR job too: a worker that starts at step 12 reads step 12's batch of
// its data (CtrBatchCursor::Seek), not its first batch again.
TEST(ReproducibleSyncTest, AJobResumedFromItsCheckpointChangesNothing) {
  for (const bool ctr : {false, true}) {
    const Job job = {3, 2, ctr};
    const std::string name = ctr ? "ctr_" : "";
    const Outcome reference = RunJob(job, name + "undisturbed_for_resume");
    const Outcome resumed = RunJob(
        job, name + "resumed",
        [](TestCluster& cluster, const std::vector<std::string>& flags)
            -> absl::StatusOr<std::vector<std::string>> {
          // The first 12 steps; the flags' --steps=30 comes first and the
          // last --steps wins.
          std::vector<std::string> first_part = flags;
          first_part.push_back("--steps=12");
          absl::StatusOr<std::vector<std::string>> first =
              RunUndisturbed(3, cluster, first_part);
          if (!first.ok()) return first.status();
          if (absl::Status s = RestartFromCheckpoints(cluster, 2); !s.ok()) {
            return s;
          }
          return RunUndisturbed(3, cluster, flags);
        });
    ExpectSameOutcome(
        reference, resumed,
        name + "stopped after step 12 and resumed from the checkpoint");
  }
}

// The whole job stopped by signals that reach its workers at different
// moments of a step, as a launcher's SIGTERMs, scancel or a deleted
// Kubernetes job deliver them: worker 0 stops after step 9, never pushing
// step 10, while workers 1 and 2 have pushed step 10 and wait for it. A
// worker that leaves stopping holds the step instead of having it
// completed short without it (LeaveRequest.stopping), so every shard stops
// at step 10 with no short step, and the job resumed from the servers'
// checkpoints computes step 10 whole: the undisturbed job's model. Before,
// step 10 completed without worker 0 the moment it left.
//
// How the workers of StopBySignalsThenResume are stopped.
struct SignalledStop {
  // Worker 0's own flags: how it SIGTERMs itself.
  std::vector<std::string> first = {"--inject_sigterm_after_step=9"};
  // Workers 1 and 2's own flags.
  std::vector<std::string> others;
  // Workers 1 and 2 SIGTERM themselves (by `others`); else the test sends
  // them SIGTERM once worker 0 has gone (they wait for a step it holds).
  bool others_stop_themselves = false;
  // Every flag of the stopped part (the resumed part runs without).
  std::vector<std::string> all;
  // The step every shard must stop at.
  int64_t at_step = 10;
};

// Runs 3 workers of which worker 0 SIGTERMs itself (by default after step
// 9: it never pushes step 10), stopped as `stop` says. Checks that every
// shard, dense blocks and embedding tables alike, stopped at
// `stop.at_step` with no short step; then stops the servers, restarts them
// from their checkpoints and runs the job to its end.
WorkerRunner StopBySignalsThenResume(const SignalledStop& stop) {
  return [stop](TestCluster& cluster, const std::vector<std::string>& flags)
             -> absl::StatusOr<std::vector<std::string>> {
    std::vector<std::unique_ptr<Process>> running;
    for (int w = 0; w < 3; ++w) {
      std::vector<std::string> own = flags;
      own.insert(own.end(), stop.all.begin(), stop.all.end());
      const std::vector<std::string>& extra = w == 0 ? stop.first : stop.others;
      own.insert(own.end(), extra.begin(), extra.end());
      absl::StatusOr<std::unique_ptr<Process>> started =
          cluster.StartWorker(w, 3, own);
      if (!started.ok()) return started.status();
      running.push_back(std::move(*started));
    }
    absl::StatusOr<int> first = running[0]->Wait(absl::Seconds(120));
    if (!first.ok()) return first.status();
    if (!stop.others_stop_themselves) {
      for (int w = 1; w < 3; ++w) running[w]->Signal(SIGTERM);
    }
    for (auto& worker : running) {
      absl::StatusOr<int> code = worker->Wait(absl::Seconds(60));
      if (!code.ok()) return code.status();
    }
    absl::StatusOr<std::vector<StatsResponse>> stats = cluster.Stats();
    if (!stats.ok()) return stats.status();
    for (const StatsResponse& shard : *stats) {
      bool at_step = shard.version() == stop.at_step;
      for (const auto& table : shard.sparse()) {
        at_step &= table.version() == stop.at_step;
      }
      if (!at_step || shard.steps_short() != 0) {
        return absl::InternalError(absl::StrCat(
            "a shard stopped at step ", shard.version(), " with ",
            shard.steps_short(),
            " short steps; every shard, and each of its tables, should stop "
            "at step ",
            stop.at_step, " with none:\n", shard.ShortDebugString(), "\n",
            running[0]->Stderr()));
      }
    }
    if (absl::Status s = RestartFromCheckpoints(cluster, 2); !s.ok()) return s;
    return RunUndisturbed(3, cluster, flags);
  };
}

// Signalled while they wait for step 10 (they pushed it), or between
// pulling step 10 and pushing it (a worker that sees its stop then does not
// push: worker 0 never will); the model is the undisturbed job's either way.
void ExpectStopsBySignalsChangeNothing(const Job& job,
                                       const std::string& name) {
  const Outcome reference = RunJob(job, name + "_undisturbed");
  ExpectSameOutcome(reference,
                    RunJob(job, name + "_waiting", StopBySignalsThenResume({})),
                    name + ": stopped by signals while waiting, resumed");
  SignalledStop before_push;
  before_push.others = {"--inject_sigterm_before_push_step=10"};
  before_push.others_stop_themselves = true;
  ExpectSameOutcome(
      reference,
      RunJob(job, name + "_before_push", StopBySignalsThenResume(before_push)),
      name + ": stopped by signals before pushing step 10, resumed");
}

TEST(ReproducibleSyncTest, AJobStoppedBySignalsAndResumedChangesNothing) {
  ExpectStopsBySignalsChangeNothing({3, 2}, "signals");
}

// The same with embedding tables: their sync steps are held alike.
TEST(ReproducibleSyncTest, ACtrJobStoppedBySignalsAndResumedChangesNothing) {
  ExpectStopsBySignalsChangeNothing({3, 2, /*ctr=*/true}, "ctr_signals");
}

// A signal that comes during backward lets the step in hand go in whole,
// however long backward takes: the stop's grace is twice the steps' own
// work. Each step's backward pauses 600 ms once its last layer's gradients
// have left (the pipelined step sends them during backward), and worker 0
// SIGTERMs itself at that moment of step 10: it pushes step 10 whole and
// stops; workers 1 and 2 push step 11 and wait for it. Every shard stops at
// step 11 with none short, and the job resumed is the undisturbed one.
// With a fixed 400 ms grace the interrupts cut worker 0's PushPull halfway
// and the shards stop at different steps. With 1500 ms the steps' grace
// (over 3 s) outlasts the servers' 2 s hold of a stopped worker's step:
// the hold follows the grace the stopping worker sends with its leave
// (LeaveRequest.stopping_grace_s); with 2 s, step 11 completed without
// worker 0 while the others still ended theirs (a short step).
TEST(ReproducibleSyncTest, ASignalDuringALongBackwardLetsTheStepGoInWhole) {
  const Job job = {3, 2, false, false, 64, {"--pipeline_step=always"}};
  const Outcome reference = RunJob(job, "long_backward_undisturbed");
  for (const int pause_ms : {600, 1500}) {
    SignalledStop in_backward;
    in_backward.first = {"--inject_sigterm_in_backward_step=10"};
    in_backward.all = {absl::StrCat("--inject_backward_pause_ms=", pause_ms)};
    in_backward.at_step = 11;
    ExpectSameOutcome(
        reference,
        RunJob(job, absl::StrCat("long_backward_stopped_", pause_ms),
               StopBySignalsThenResume(in_backward)),
        absl::StrCat("stopped by a signal during a backward of ", pause_ms,
                     " ms, resumed"));
  }
}

// Sparse rows: a row's gradients from several workers are summed in worker
// order too.
TEST(ReproducibleSyncTest, SparseTablesThreeWorkers) {
  Job job;
  job.workers = 3;
  job.shards = 2;
  job.ctr = true;
  ExpectThreeRunsAgree(job, "ctr_w3_s2");
}

}  // namespace
}  // namespace pstrain
