// Taking a model away: real servers train, pstrain_export writes the model
// from the running servers and from their checkpoint directory (the two files
// must be identical), `worker --eval_only` evaluates the file with no
// servers, and a numpy script that parses the file by hand computes the
// same logits. Broken or mismatched model files are one line and exit 2.
#include <signal.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

using testing::BinaryPath;
using testing::ClusterOptions;
using testing::FinalJsonNumber;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::Process;
using testing::TestCluster;
using testing::TestDir;

constexpr char kPython[] = "/usr/bin/python3";

struct ProgramRun {
  int code = -1;
  std::string out, err;
};

ProgramRun RunProgram(const std::vector<std::string>& argv,
                      const std::string& dir, const std::string& name) {
  ProgramRun run;
  absl::StatusOr<std::unique_ptr<Process>> process =
      Process::Start(argv, dir, name);
  EXPECT_TRUE(process.ok()) << process.status();
  if (!process.ok()) return run;
  absl::StatusOr<int> code = (*process)->Wait(absl::Seconds(120));
  EXPECT_TRUE(code.ok()) << name << ": " << code.status();
  run.code = code.value_or(-1);
  run.out = (*process)->Stdout();
  run.err = (*process)->Stderr();
  return run;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  ASSERT_TRUE(out.good()) << path;
}

// Lines of `text` that contain `needle`.
int LinesWith(const std::string& text, const std::string& needle) {
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    n += absl::StrContains(line, needle);
  }
  return n;
}

// The MLP every test here trains or evaluates: 8 features, hidden 16,
// 3 classes; small blocks so every tensor is cut into blocks on both shards
// and the export must reassemble them.
std::vector<std::string> MlpFlags() {
  return {"--model=mlp",        "--hidden=16",     "--num_features=8",
          "--num_classes=3",    "--batch_size=32", "--block_elements=40",
          "--seed=5",           "--device=cpu",    "--log_every=0",
          "--test_examples=500"};
}

std::vector<std::string> With(std::vector<std::string> flags,
                              const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

std::vector<std::string> WorkerArgv(const std::vector<std::string>& flags) {
  return With({BinaryPath("worker/worker")}, flags);
}

// A held-out CSV (label, then 8 features) that numpy can read too.
std::string WriteEvalCsv(const std::string& path, int rows) {
  absl::BitGen random;
  std::string text;
  for (int i = 0; i < rows; ++i) {
    absl::StrAppend(&text, absl::Uniform(random, 0, 3));
    for (int f = 0; f < 8; ++f) {
      absl::StrAppend(&text, ",", absl::Gaussian<float>(random, 0, 1.5));
    }
    text += '\n';
  }
  WriteBytes(path, text);
  return path;
}

double Number(const std::string& out, const std::string& key) {
  absl::StatusOr<double> value = FinalJsonNumber(out, key);
  EXPECT_TRUE(value.ok()) << value.status() << "\n" << out;
  return value.value_or(-1);
}

TEST(ExportTest, MlpFromServersAndCheckpointMatchesNumpyLogits) {
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  const std::string dir = absl::StrCat(TestDir(), "/mlp");
  std::filesystem::create_directories(dir);
  options.server_flags = {absl::StrCat("--checkpoint_dir=", dir, "/ckpt"),
                          "--optimizer=adam", "--learning_rate=0.01"};
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, "export_mlp");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<std::string> train = With(MlpFlags(), {"--steps=40"});
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({train, train}, absl::Seconds(120));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  const double trained_accuracy = Number((*outputs)[0], "test_accuracy");

  const std::string exporter = BinaryPath("worker/pstrain_export");
  const std::string from_servers = absl::StrCat(dir, "/servers.safetensors");
  ProgramRun exported =
      RunProgram({exporter, "--ps_hosts=" + (*cluster)->PsHosts(),
                  "--output=" + from_servers},
                 dir, "export_servers");
  ASSERT_EQ(exported.code, 0) << exported.err;
  EXPECT_THAT(exported.out, HasSubstr("at step 40"));

  // Servers stopped: each writes its final checkpoint and is gone.
  ASSERT_TRUE((*cluster)->StopServer(0).ok());
  ASSERT_TRUE((*cluster)->StopServer(1).ok());
  const std::string from_checkpoint = absl::StrCat(dir, "/ckpt.safetensors");
  exported =
      RunProgram({exporter, absl::StrCat("--checkpoint_dir=", dir, "/ckpt"),
                  "--output=" + from_checkpoint},
                 dir, "export_checkpoint");
  ASSERT_EQ(exported.code, 0) << exported.err;
  const std::string bytes = ReadBytes(from_servers);
  ASSERT_FALSE(bytes.empty());
  EXPECT_EQ(bytes, ReadBytes(from_checkpoint))
      << "the running servers and their checkpoint hold the same model";

  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes, from_servers);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_NE(file->Find("fc0/weight"), nullptr);
  EXPECT_EQ(file->Find("fc0/weight")->shape, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(file->Find("fc1/bias")->shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(file->metadata.at("step"), "40");

  // The file alone, no servers: the same held-out accuracy as the training
  // worker's final evaluation of the same model and data.
  ProgramRun evaluated = RunProgram(
      WorkerArgv(
          With(MlpFlags(), {"--eval_only", "--model_file=" + from_servers})),
      dir, "eval_synthetic");
  ASSERT_EQ(evaluated.code, 0) << evaluated.err;
  EXPECT_NEAR(Number(evaluated.out, "test_accuracy"), trained_accuracy, 1e-4);
  EXPECT_EQ(Number(evaluated.out, "test_examples"), 500);

  // Logits on a CSV, as CSV and as .npy, against numpy's.
  const std::string csv = WriteEvalCsv(absl::StrCat(dir, "/eval.csv"), 77);
  std::vector<std::string> logits_files;
  for (const char* ext : {".csv", ".npy"}) {
    const std::string logits = absl::StrCat(dir, "/logits", ext);
    evaluated = RunProgram(
        WorkerArgv(With(MlpFlags(),
                        {"--eval_only", "--model_file=" + from_checkpoint,
                         "--data=csv", "--train_file=" + csv,
                         "--test_file=" + csv, "--logits_file=" + logits})),
        dir, absl::StrCat("eval_", ext + 1));
    ASSERT_EQ(evaluated.code, 0) << evaluated.err;
    EXPECT_EQ(Number(evaluated.out, "test_examples"), 77);
    logits_files.push_back(logits);
  }
  ProgramRun numpy =
      RunProgram({kPython, BinaryPath("tests/export_check.py"), from_servers,
                  csv, logits_files[0], logits_files[1]},
                 dir, "numpy");
  EXPECT_EQ(numpy.code, 0) << numpy.out << numpy.err;
  std::cout << numpy.out;
}

// The README's first export, from the servers of a sync job still
// training: its two shards are a step apart about as often as not when
// read, and the exporter (an observer, no member to skip with) reads again
// at the next step, which both shards answer as it completes. Failed every
// time before (the observer took the workers' skip path).
TEST(ExportTest, FromTheServersOfARunningSyncJob) {
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  const std::string dir = absl::StrCat(TestDir(), "/running");
  std::filesystem::create_directories(dir);
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, "export_running");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  // Long enough to outlast the exports below; stopped by SIGTERM after.
  const std::vector<std::string> train = With(MlpFlags(), {"--steps=1000000"});
  std::vector<std::unique_ptr<Process>> workers;
  for (int k = 0; k < 2; ++k) {
    absl::StatusOr<std::unique_ptr<Process>> worker =
        (*cluster)->StartWorker(k, 2, train);
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(std::move(*worker));
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  int64_t version = 0;
  while (version < 50 && absl::Now() < give_up) {
    absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    version = (*stats)[0].version();
    absl::SleepFor(absl::Milliseconds(20));  // polling the job; bounded
  }
  ASSERT_GE(version, 50) << "the job did not start";
  const std::string exporter = BinaryPath("worker/pstrain_export");
  int64_t last_step = 0;
  for (int i = 0; i < 5; ++i) {
    const std::string file = absl::StrCat(dir, "/export", i, ".safetensors");
    ProgramRun exported = RunProgram(
        {exporter, "--ps_hosts=" + (*cluster)->PsHosts(), "--output=" + file},
        dir, absl::StrCat("export_running_", i));
    ASSERT_EQ(exported.code, 0) << exported.err;
    absl::StatusOr<SafetensorsFile> parsed =
        ParseSafetensors(ReadBytes(file), file);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    int64_t step = 0;
    ASSERT_TRUE(absl::SimpleAtoi(parsed->metadata.at("step"), &step));
    EXPECT_GT(step, last_step) << "the job trains on between exports";
    last_step = step;
  }
  for (auto& worker : workers) {
    ASSERT_TRUE(worker->running()) << worker->Stderr();
    worker->Signal(SIGTERM);
    EXPECT_TRUE(worker->Wait(absl::Seconds(30)).ok());
  }
}

// A checkpoint whose shards' newest valid files are of different steps
// (shard 1's newest truncated here). While shard 0 still has a file of
// shard 1's step, the export takes it: the model of step 20, as exported
// when the job had just reached it. Once shard 0 has none, the export still
// writes the model, labelled with the oldest step, and says it mixes steps,
// naming the files.
TEST(ExportTest, ACheckpointOfShardsAtDifferentStepsIsOneStepsModelIfItCanBe) {
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 1;
  const std::string dir = absl::StrCat(TestDir(), "/mixed");
  std::filesystem::create_directories(dir);
  const std::string ckpt = dir + "/ckpt";
  // Only the final checkpoints: at step 20, then (restarted) at step 40.
  options.server_flags = {"--checkpoint_dir=" + ckpt,
                          "--checkpoint_every_steps=100000"};
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, "export_mixed");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto export_checkpoint = [&](const std::string& name) {
    const std::string file = absl::StrCat(dir, "/", name, ".safetensors");
    ProgramRun run =
        RunProgram({BinaryPath("worker/pstrain_export"),
                    "--checkpoint_dir=" + ckpt, "--output=" + file},
                   dir, name);
    return std::make_pair(run, ParseSafetensors(ReadBytes(file), file));
  };
  absl::StatusOr<SafetensorsFile> at_step_20;
  for (const char* steps : {"--steps=20", "--steps=40"}) {
    const std::vector<std::string> train = With(MlpFlags(), {steps});
    ASSERT_TRUE((*cluster)->RunWorkers({train}, absl::Seconds(120)).ok());
    ASSERT_TRUE((*cluster)->StopServer(0).ok());
    ASSERT_TRUE((*cluster)->StopServer(1).ok());
    if (std::string(steps) == "--steps=20") {
      auto [run, parsed] = export_checkpoint("at_step_20");
      ASSERT_EQ(run.code, 0) << run.err;
      at_step_20 = std::move(parsed);
      ASSERT_TRUE(at_step_20.ok()) << at_step_20.status();
      ASSERT_TRUE((*cluster)->RestartServer(0).ok());
      ASSERT_TRUE((*cluster)->RestartServer(1).ok());
    }
  }
  // A shard's checkpoint files, oldest first.
  auto files_of = [&](int shard) {
    std::vector<std::pair<int64_t, std::string>> files;
    for (const auto& entry : std::filesystem::directory_iterator(
             absl::StrCat(ckpt, "/shard-", shard, "-of-2"))) {
      std::string name = entry.path().filename().string();
      absl::string_view rest = name;
      int64_t sequence = 0;
      if (absl::ConsumePrefix(&rest, "ckpt-") &&
          absl::ConsumeSuffix(&rest, ".pstrain") &&
          absl::SimpleAtoi(rest, &sequence)) {
        files.emplace_back(sequence, entry.path().string());
      }
    }
    std::sort(files.begin(), files.end());
    return files;
  };
  // Every file of shard 1 but its first (the final one of step 20) cut
  // short: the job's end and the servers' stop each wrote one at step 40.
  const auto shard_1 = files_of(1);
  ASSERT_GE(shard_1.size(), 2u);
  for (size_t f = 1; f < shard_1.size(); ++f) {
    std::filesystem::resize_file(shard_1[f].second, 100);
  }
  {
    auto [run, parsed] = export_checkpoint("matched");
    ASSERT_EQ(run.code, 0) << run.err;
    EXPECT_THAT(run.err, HasSubstr("every shard's file of step 20 is restored "
                                   "instead"));
    EXPECT_THAT(run.err,
                Not(HasSubstr("the checkpoint's blocks are at steps")));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->metadata.at("step"), "20");
    ASSERT_EQ(parsed->tensors.size(), at_step_20->tensors.size());
    for (size_t t = 0; t < parsed->tensors.size(); ++t) {
      EXPECT_EQ(parsed->tensors[t].name, at_step_20->tensors[t].name);
      EXPECT_TRUE(parsed->tensors[t].data == at_step_20->tensors[t].data)
          << parsed->tensors[t].name << " differs from step 20's";
    }
  }
  // Shard 0's files of step 20 gone: only a mix is left.
  const auto shard_0 = files_of(0);
  ASSERT_GE(shard_0.size(), 2u);
  for (size_t f = 0; f + 1 < shard_0.size(); ++f) {
    std::filesystem::remove(shard_0[f].second);
  }
  auto [run, parsed] = export_checkpoint("mixed");
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_THAT(run.err, HasSubstr("the checkpoint's blocks are at steps"));
  EXPECT_THAT(run.err, HasSubstr("at steps 20 to 40 (sync"));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->metadata.at("step"), "20");
}

// A layer-list model (a small CNN over 4x4 one-channel "images") goes the
// same way: trained on the servers, exported, evaluated from the file alone.
TEST(ExportTest, ALayerModelEvaluatesFromItsFileAsTrained) {
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 1;
  const std::string dir = absl::StrCat(TestDir(), "/layers");
  std::filesystem::create_directories(dir);
  options.server_flags = {"--optimizer=adam", "--learning_rate=0.01"};
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, "export_layers");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<std::string> model = {
      "--model=layers",
      "--layers=conv:4:3:1:1,relu,maxpool:2,flatten,dense:3",
      "--num_features=16",
      "--num_classes=3",
      "--batch_size=32",
      "--block_elements=16",
      "--seed=5",
      "--device=cpu",
      "--log_every=0",
      "--test_examples=300"};
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({With(model, {"--steps=30"})}, absl::Seconds(120));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  const double trained_accuracy = Number((*outputs)[0], "test_accuracy");

  const std::string file = absl::StrCat(dir, "/cnn.safetensors");
  ProgramRun exported =
      RunProgram({BinaryPath("worker/pstrain_export"),
                  "--ps_hosts=" + (*cluster)->PsHosts(), "--output=" + file},
                 dir, "export_layers");
  ASSERT_EQ(exported.code, 0) << exported.err;
  ProgramRun evaluated = RunProgram(
      WorkerArgv(With(model, {"--eval_only", "--model_file=" + file})), dir,
      "eval_layers");
  ASSERT_EQ(evaluated.code, 0) << evaluated.err;
  EXPECT_NEAR(Number(evaluated.out, "test_accuracy"), trained_accuracy, 1e-4);

  // Another layer list does not load the file: one line naming the tensor.
  evaluated = RunProgram(
      WorkerArgv(With(model, {"--eval_only", "--model_file=" + file,
                              "--layers=conv:8:3:1:1,relu,maxpool:2,flatten,"
                              "dense:3"})),
      dir, "eval_other_layers");
  EXPECT_EQ(evaluated.code, 2) << evaluated.err;
  EXPECT_EQ(LinesWith(evaluated.err, "cnn.safetensors"), 1) << evaluated.err;
}

// 2 shards (of `replicas` each) with checkpoints under `dir`/ckpt, after a
// small CTR job (3 tables) has run on them.
absl::StatusOr<std::unique_ptr<TestCluster>> ClusterAfterACtrJob(
    const std::string& dir, const std::string& name, int replicas = 1) {
  ClusterOptions options;
  options.num_shards = 2;
  options.replicas = replicas;
  std::filesystem::create_directories(dir);
  options.server_flags = {absl::StrCat("--checkpoint_dir=", dir, "/ckpt")};
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, name);
  if (!cluster.ok()) return cluster.status();
  absl::StatusOr<std::vector<std::string>> outputs = (*cluster)->RunWorkers(
      {{"--model=ctr", "--ctr_data=synthetic", "--ctr_fields=3",
        "--ctr_dense=2", "--ctr_vocab=500", "--ctr_train_examples=4096",
        "--ctr_test_examples=512", "--embedding_dim=4", "--ctr_hidden=8",
        "--batch_size=64", "--block_elements=32", "--steps=15", "--log_every=0",
        "--device=cpu"}},
      absl::Seconds(120));
  if (!outputs.ok()) return outputs.status();
  return cluster;
}

TEST(ExportTest, SparseTablesFromServersComeFromACheckpointTheyWriteNow) {
  const std::string dir = absl::StrCat(TestDir(), "/ctr");
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      ClusterAfterACtrJob(dir, "export_ctr");
  ASSERT_TRUE(cluster.ok()) << cluster.status();

  const std::string exporter = BinaryPath("worker/pstrain_export");
  const std::string from_servers = absl::StrCat(dir, "/servers.safetensors");
  ProgramRun exported =
      RunProgram({exporter, "--ps_hosts=" + (*cluster)->PsHosts(),
                  "--output=" + from_servers},
                 dir, "export_servers");
  ASSERT_EQ(exported.code, 0) << exported.err;
  absl::StatusOr<SafetensorsFile> file = ReadSafetensorsFile(from_servers);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  const ModelSchema& schema = stats->front().schema();
  ASSERT_GT(schema.sparse_size(), 0);
  for (int t = 0; t < schema.sparse_size(); ++t) {
    const SparseTableSpec& table = schema.sparse(t);
    int64_t rows_on_servers = 0;
    for (const StatsResponse& shard : *stats) {
      rows_on_servers += shard.sparse(t).rows();
    }
    const SafetensorsTensor* ids = file->Find(table.name() + "/ids");
    const SafetensorsTensor* rows = file->Find(table.name() + "/rows");
    ASSERT_NE(ids, nullptr) << table.name();
    ASSERT_NE(rows, nullptr) << table.name();
    EXPECT_EQ(ids->dtype, SafetensorsDtype::kU64);
    EXPECT_EQ(ids->shape, (std::vector<int64_t>{rows_on_servers}));
    EXPECT_EQ(rows->shape,
              (std::vector<int64_t>{rows_on_servers, table.dim()}));
    const std::vector<uint64_t> id_values = ids->AsU64();
    EXPECT_TRUE(std::is_sorted(id_values.begin(), id_values.end()));
    EXPECT_GT(rows_on_servers, 0);
  }
  for (const DenseTensorSpec& dense : schema.dense()) {
    EXPECT_NE(file->Find(dense.name()), nullptr) << dense.name();
  }

  ASSERT_TRUE((*cluster)->StopServer(0).ok());
  ASSERT_TRUE((*cluster)->StopServer(1).ok());
  const std::string from_checkpoint = absl::StrCat(dir, "/ckpt.safetensors");
  exported =
      RunProgram({exporter, absl::StrCat("--checkpoint_dir=", dir, "/ckpt"),
                  "--output=" + from_checkpoint},
                 dir, "export_checkpoint");
  ASSERT_EQ(exported.code, 0) << exported.err;
  EXPECT_EQ(ReadBytes(from_servers), ReadBytes(from_checkpoint));
}

// A replicated job's export comes from each shard's primary, whichever
// replica that is: after shard 0's first replica died and its backup took
// over, the export is the same model. The dense tensors are the same to the
// bit, and so is every row the backup holds; the backup lacks only rows no
// push reached (the held-out evaluation pulled them, and a pull is not
// forwarded), which it makes with the same initial values when they are
// first asked for.
TEST(ExportTest, AReplicatedJobExportsFromEachShardsPrimary) {
  const std::string dir = absl::StrCat(TestDir(), "/replicated_ctr");
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      ClusterAfterACtrJob(dir, "export_replicated", /*replicas=*/2);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string exporter = BinaryPath("worker/pstrain_export");
  auto export_to = [&](const std::string& name) -> SafetensorsFile {
    const std::string path = absl::StrCat(dir, "/", name, ".safetensors");
    ProgramRun exported = RunProgram(
        {exporter, "--ps_hosts=" + (*cluster)->PsHosts(), "--output=" + path},
        dir, name);
    EXPECT_EQ(exported.code, 0) << exported.err;
    absl::StatusOr<SafetensorsFile> file = ReadSafetensorsFile(path);
    EXPECT_TRUE(file.ok()) << file.status();
    return file.ok() ? *file : SafetensorsFile();
  };
  const SafetensorsFile before = export_to("before");
  ASSERT_FALSE(before.tensors.empty());
  (*cluster)->KillReplica(0, 0);
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  absl::StatusOr<StatsResponse> backup;
  do {
    backup = (*cluster)->ReplicaStats(0, 1);
  } while ((!backup.ok() || backup->replica_role() != "primary") &&
           absl::Now() < give_up);
  ASSERT_TRUE(backup.ok()) << backup.status();
  ASSERT_EQ(backup->replica_role(), "primary");
  const SafetensorsFile after = export_to("after_failover");
  ASSERT_EQ(after.tensors.size(), before.tensors.size());
  for (const SafetensorsTensor& tensor : before.tensors) {
    if (absl::EndsWith(tensor.name, "/ids") ||
        absl::EndsWith(tensor.name, "/rows")) {
      continue;
    }
    const SafetensorsTensor* same = after.Find(tensor.name);
    ASSERT_NE(same, nullptr) << tensor.name;
    EXPECT_EQ(same->data, tensor.data) << tensor.name;
  }
  for (const std::string table : {"field0", "field1", "field2"}) {
    const std::vector<uint64_t> ids_before =
        before.Find(table + "/ids")->AsU64();
    const std::vector<float> rows_before =
        before.Find(table + "/rows")->AsF32();
    const std::vector<uint64_t> ids_after = after.Find(table + "/ids")->AsU64();
    const std::vector<float> rows_after = after.Find(table + "/rows")->AsF32();
    EXPECT_GT(ids_after.size(), ids_before.size() / 2) << table;
    for (size_t i = 0; i < ids_after.size(); ++i) {
      auto it =
          std::lower_bound(ids_before.begin(), ids_before.end(), ids_after[i]);
      ASSERT_TRUE(it != ids_before.end() && *it == ids_after[i])
          << table << " row " << ids_after[i] << " is only on the backup";
      const size_t j = it - ids_before.begin();
      for (int d = 0; d < 4; ++d) {
        EXPECT_EQ(rows_after[i * 4 + d], rows_before[j * 4 + d])
            << table << " row " << ids_after[i];
      }
    }
  }
}

// Delta export (--since) from running servers and --apply: the base model
// file plus the delta of what a second run of the job changed is the
// model's full export byte for byte, and the delta holds fewer rows; a
// delta applied to a base it was not taken from is refused, naming it.
TEST(ExportTest, ABaseAndItsDeltaAreTheModelExactly) {
  ClusterOptions options;
  options.num_shards = 2;
  const std::string dir = absl::StrCat(TestDir(), "/delta");
  std::filesystem::create_directories(dir);
  // Few rows a table, so rows are evicted between exports.
  options.server_flags = {absl::StrCat("--checkpoint_dir=", dir, "/ckpt"),
                          "--sparse_max_rows=100"};
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, "export_delta");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto train_to = [&](int steps) {
    absl::StatusOr<std::vector<std::string>> outputs = (*cluster)->RunWorkers(
        {{"--model=ctr", "--ctr_data=synthetic", "--ctr_fields=3",
          "--ctr_dense=2", "--ctr_vocab=5000", "--ctr_train_examples=4096",
          "--ctr_test_examples=512", "--embedding_dim=4", "--ctr_hidden=8",
          "--batch_size=64", "--block_elements=32",
          absl::StrCat("--steps=", steps), "--log_every=0", "--device=cpu"}},
        absl::Seconds(120));
    ASSERT_TRUE(outputs.ok()) << outputs.status();
  };
  const std::string exporter = BinaryPath("worker/pstrain_export");
  auto export_to = [&](const std::string& name, std::vector<std::string> more) {
    more.insert(more.begin(), {exporter, "--ps_hosts=" + (*cluster)->PsHosts(),
                               absl::StrCat("--output=", dir, "/", name)});
    return RunProgram(more, dir, name);
  };
  train_to(15);
  const std::string base = absl::StrCat(dir, "/base");
  ProgramRun run = export_to("base", {});
  ASSERT_EQ(run.code, 0) << run.err;
  train_to(18);  // the same job, three steps on
  run = export_to("full", {});
  ASSERT_EQ(run.code, 0) << run.err;
  std::filesystem::copy_file(base, base + "_without_marks");
  run = export_to("delta", {"--since=" + base});
  ASSERT_EQ(run.code, 0) << run.err;
  // The servers knew what changed since the base: its marks are beside it.
  EXPECT_TRUE(std::filesystem::exists(base + ".changes"));
  EXPECT_THAT(run.out, HasSubstr("exported the changes since"));
  EXPECT_THAT(run.out, HasSubstr("by the servers' change marks"));
  absl::StatusOr<SafetensorsFile> full =
      ReadSafetensorsFile(absl::StrCat(dir, "/full"));
  absl::StatusOr<SafetensorsFile> delta =
      ReadSafetensorsFile(absl::StrCat(dir, "/delta"));
  ASSERT_TRUE(full.ok() && delta.ok()) << full.status() << delta.status();
  EXPECT_EQ(delta->metadata["base_step"], "15");
  EXPECT_EQ(delta->metadata["step"], "18");
  const SafetensorsTensor* full_ids = full->Find("field0/ids");
  const SafetensorsTensor* delta_ids = delta->Find("field0/ids");
  ASSERT_NE(full_ids, nullptr);
  ASSERT_NE(delta_ids, nullptr);
  EXPECT_GT(delta_ids->NumElements(), 0);
  EXPECT_LT(delta_ids->NumElements(), full_ids->NumElements());
  const SafetensorsTensor* evicted = delta->Find("field0/deleted_ids");
  ASSERT_NE(evicted, nullptr);
  EXPECT_GT(evicted->NumElements(), 0);

  const std::string merged = absl::StrCat(dir, "/merged");
  run = RunProgram(
      {exporter, "--base=" + base, absl::StrCat("--apply=", dir, "/delta"),
       "--output=" + merged},
      dir, "apply");
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_EQ(ReadBytes(merged), ReadBytes(absl::StrCat(dir, "/full")));

  // Without the marks the delta comes from comparing whole models, and
  // gives the same model.
  run = export_to("compared", {"--since=" + base + "_without_marks"});
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_THAT(run.out, HasSubstr("by comparing the whole models"));
  run = RunProgram({exporter, "--base=" + base + "_without_marks",
                    absl::StrCat("--apply=", dir, "/compared"),
                    absl::StrCat("--output=", dir, "/merged_compared")},
                   dir, "apply_compared");
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_EQ(ReadBytes(absl::StrCat(dir, "/merged_compared")),
            ReadBytes(absl::StrCat(dir, "/full")));

  // A chain: the next delta is taken since the last one, from its marks.
  train_to(21);
  run = export_to("full21", {});
  ASSERT_EQ(run.code, 0) << run.err;
  run = export_to("delta2", {absl::StrCat("--since=", dir, "/delta")});
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_THAT(run.out, HasSubstr("(step 18) at step 21, by the servers' "
                                 "change marks"));
  run = RunProgram({exporter, "--base=" + base,
                    absl::StrCat("--apply=", dir, "/delta,", dir, "/delta2"),
                    "--output=" + merged},
                   dir, "apply_chain");
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_EQ(ReadBytes(merged), ReadBytes(absl::StrCat(dir, "/full21")));
  EXPECT_FALSE(std::filesystem::exists(merged + ".changes"));

  // A delta is a base only for the servers that gave its marks: without
  // them, refused with why, nothing written.
  std::filesystem::remove(absl::StrCat(dir, "/delta.changes"));
  run = export_to("delta3", {absl::StrCat("--since=", dir, "/delta")});
  EXPECT_EQ(run.code, 2) << run.err;
  EXPECT_THAT(run.err, HasSubstr("not a pstrain file"));
  EXPECT_THAT(run.err, HasSubstr("no change marks beside it"));
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(dir, "/delta3")));

  // Applied to the full model instead of its base: refused, one line.
  run = RunProgram({exporter, absl::StrCat("--base=", dir, "/full"),
                    absl::StrCat("--apply=", dir, "/delta"),
                    absl::StrCat("--output=", dir, "/wrong")},
                   dir, "apply_wrong");
  EXPECT_EQ(run.code, 2) << run.err;
  EXPECT_THAT(run.err, HasSubstr("was taken from a base at step 15, this "
                                 "model is at step 18"));
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(dir, "/wrong")));
}

TEST(ExportTest, SparseTablesNeedTheServersCheckpointDir) {
  ClusterOptions options;
  const std::string dir = absl::StrCat(TestDir(), "/ctr_no_dir");
  std::filesystem::create_directories(dir);
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, "export_ctr_no_dir");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE(
      (*cluster)
          ->RunWorkers({{"--model=ctr", "--ctr_data=synthetic",
                         "--ctr_fields=2", "--ctr_vocab=100",
                         "--ctr_train_examples=512", "--ctr_test_examples=64",
                         "--steps=2", "--log_every=0", "--device=cpu"}},
                       absl::Seconds(60))
          .ok());
  ProgramRun exported =
      RunProgram({BinaryPath("worker/pstrain_export"),
                  "--ps_hosts=" + (*cluster)->PsHosts(),
                  absl::StrCat("--output=", dir, "/m.safetensors")},
                 dir, "export");
  EXPECT_EQ(exported.code, 2);
  EXPECT_THAT(exported.err, HasSubstr("--checkpoint_dir"));
}

// A model file that fits MlpFlags(), built here, and broken in every way a
// file on disk can be.
class BadModelFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(TestDir(), "/bad");
    std::filesystem::create_directories(dir_);
    const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
        {"fc0/weight", {8, 16}},
        {"fc0/bias", {16}},
        {"fc1/weight", {16, 3}},
        {"fc1/bias", {3}}};
    for (const auto& [name, shape] : shapes) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      good_.tensors.push_back(
          SafetensorsTensor::F32(name, shape, std::vector<float>(n, 0.01f)));
    }
  }

  std::string Write(const std::string& name, const std::string& bytes) {
    const std::string path = absl::StrCat(dir_, "/", name, ".safetensors");
    WriteBytes(path, bytes);
    return path;
  }
  std::string Write(const std::string& name, const SafetensorsFile& file) {
    return Write(name, *SerializeSafetensors(file));
  }

  // Runs the worker's evaluation of `path` and expects exit 2 with exactly
  // one line naming the file and containing `what`.
  void ExpectRefused(const std::string& path, const std::string& what,
                     const std::vector<std::string>& extra_flags = {}) {
    ProgramRun run = RunProgram(
        WorkerArgv(
            With(With(MlpFlags(), {"--eval_only", "--model_file=" + path}),
                 extra_flags)),
        dir_, "eval");
    EXPECT_EQ(run.code, 2) << run.err;
    EXPECT_EQ(LinesWith(run.err, path), 1) << run.err;
    EXPECT_THAT(run.err, HasSubstr(what));
    EXPECT_EQ(run.out.find("\"event\":\"final\""), std::string::npos);
  }

  std::string dir_;
  SafetensorsFile good_;
};

TEST_F(BadModelFileTest, TheGoodFileEvaluates) {
  ProgramRun run = RunProgram(
      WorkerArgv(With(MlpFlags(),
                      {"--eval_only", "--model_file=" + Write("good", good_)})),
      dir_, "eval_good");
  EXPECT_EQ(run.code, 0) << run.err;
}

TEST_F(BadModelFileTest, TruncatedFile) {
  std::string bytes = *SerializeSafetensors(good_);
  bytes.resize(bytes.size() - 5);
  ExpectRefused(Write("truncated", bytes), "truncated");
}

TEST_F(BadModelFileTest, HeaderLengthPastTheEnd) {
  std::string bytes = *SerializeSafetensors(good_);
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(bytes.data(), &huge, 8);
  ExpectRefused(Write("long_header", bytes), "header length says");
}

TEST_F(BadModelFileTest, HeaderNotJson) {
  std::string bytes = *SerializeSafetensors(good_);
  bytes[9] = '[';  // {"__me... -> {[__me...
  ExpectRefused(Write("not_json", bytes), "not JSON");
}

TEST_F(BadModelFileTest, OffsetsOutOfRange) {
  const std::string header =
      R"({"fc0/weight":{"dtype":"F32","shape":[8,16],"data_offsets":[0,512]}})";
  std::string bytes(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  bytes += header + std::string(100, '\0');
  ExpectRefused(Write("offsets", bytes), "past the data");
}

TEST_F(BadModelFileTest, TensorMissing) {
  SafetensorsFile file = good_;
  file.tensors.pop_back();
  ExpectRefused(Write("missing", file), "tensor 'fc1/bias' is missing");
}

TEST_F(BadModelFileTest, ShapeOfAnotherModel) {
  ExpectRefused(Write("shape", good_),
                "tensor 'fc0/weight' has shape [8, 16] but this model needs "
                "[8, 12]",
                {"--hidden=12"});
}

TEST_F(BadModelFileTest, NoSuchFile) {
  ExpectRefused(absl::StrCat(dir_, "/absent.safetensors"), "cannot open");
}

TEST_F(BadModelFileTest, FlagsThatOnlyMeanSomethingWithEvalOnly) {
  const std::string good = Write("good", good_);
  ProgramRun run = RunProgram(
      WorkerArgv(
          With(MlpFlags(), {"--ps_hosts=127.0.0.1:1", "--model_file=" + good})),
      dir_, "no_eval_only");
  EXPECT_EQ(run.code, 2) << run.err;
  EXPECT_THAT(run.err, HasSubstr("--model_file is only read with --eval_only"));
  run = RunProgram(
      WorkerArgv(With(MlpFlags(), {"--eval_only", "--model_file=" + good,
                                   "--logits_file=out.txt"})),
      dir_, "bad_logits_name");
  EXPECT_EQ(run.code, 2) << run.err;
  EXPECT_THAT(run.err, HasSubstr("--logits_file must end in .csv or .npy"));
}

TEST_F(BadModelFileTest, ExporterRefusesAnEmptyCheckpointDir) {
  const std::string empty = absl::StrCat(dir_, "/empty_ckpt");
  std::filesystem::create_directories(empty);
  ProgramRun run = RunProgram(
      {BinaryPath("worker/pstrain_export"), "--checkpoint_dir=" + empty,
       absl::StrCat("--output=", dir_, "/x.safetensors")},
      dir_, "export_empty");
  EXPECT_EQ(run.code, 2) << run.err;
  EXPECT_EQ(LinesWith(run.err, empty), 1) << run.err;
}

}  // namespace
}  // namespace pstrain
