// Real data end to end, with real ps_server and worker processes: IDX files
// (raw and gzipped) train alike; bad data files and contradictory data flags
// stop the worker with exit 2 and one line before it registers anything;
// epochs and periodic evaluation are reported; every worker of an async or
// ssp job reports the same final model; Fashion-MNIST (when its Debian
// package is installed) trains end to end.
#include <zlib.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

constexpr int kSide = 4;  // images are kSide x kSide
constexpr int kClasses = 3;

std::string BigEndian(uint32_t value) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>(value >> (24 - 8 * i));
  return out;
}

// A learnable toy image set: class c lights up row c of the image (plus a
// little deterministic noise elsewhere).
struct IdxBytes {
  std::string images, labels;
};
IdxBytes ToyIdx(int count, int seed) {
  IdxBytes out;
  out.images =
      BigEndian(0x803) + BigEndian(count) + BigEndian(kSide) + BigEndian(kSide);
  out.labels = BigEndian(0x801) + BigEndian(count);
  for (int i = 0; i < count; ++i) {
    const int label = (i * 7 + seed) % kClasses;
    out.labels.push_back(static_cast<char>(label));
    for (int p = 0; p < kSide * kSide; ++p) {
      const int noise = (i * 31 + p * 17 + seed) % 60;
      out.images.push_back(
          static_cast<char>(p / kSide == label ? 200 + noise / 2 : noise));
    }
  }
  return out;
}

std::string Dir() { return testing::TestDir(); }

std::string WriteRaw(const std::string& name, const std::string& bytes) {
  const std::string path = Dir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  return path;
}

std::string WriteGzip(const std::string& name, const std::string& bytes) {
  const std::string path = Dir() + "/" + name;
  gzFile file = gzopen(path.c_str(), "wb");
  gzwrite(file, bytes.data(), bytes.size());
  gzclose(file);
  return path;
}

// The toy set as files: train (120 examples) and test (30), raw and .gz.
struct ToyFiles {
  std::string train_images, train_labels, test_images, test_labels;
};
ToyFiles WriteToy(bool gzip) {
  const IdxBytes train = ToyIdx(120, 1), test = ToyIdx(30, 2);
  auto write = gzip ? WriteGzip : WriteRaw;
  const std::string suffix = gzip ? ".gz" : "";
  return {write("train-images" + suffix, train.images),
          write("train-labels" + suffix, train.labels),
          write("test-images" + suffix, test.images),
          write("test-labels" + suffix, test.labels)};
}

std::vector<std::string> IdxFlags(const ToyFiles& files) {
  return {"--data=idx",
          "--train_file=" + files.train_images,
          "--train_labels=" + files.train_labels,
          "--test_file=" + files.test_images,
          "--test_labels=" + files.test_labels,
          "--model=mlp",
          "--hidden=8",
          "--global_batch_size=20",
          "--log_every=0",
          "--device=cpu"};
}

std::string FinalLine(const std::string& out) {
  const size_t at = out.rfind("{\"event\":\"final\"");
  return at == std::string::npos ? "" : out.substr(at);
}

// The value of "key" in a final JSON line, as text (numbers or null).
std::string JsonField(const std::string& out, const std::string& key) {
  const std::string line = FinalLine(out);
  const std::string quoted = absl::StrCat("\"", key, "\":");
  const size_t at = line.find(quoted);
  if (at == std::string::npos) return "<missing " + key + ">";
  const size_t start = at + quoted.size();
  return line.substr(start, line.find_first_of(",}", start) - start);
}

std::unique_ptr<testing::TestCluster> StartCluster(const std::string& name,
                                                   int shards, int workers,
                                                   const std::string& mode) {
  testing::ClusterOptions options;
  options.num_shards = shards;
  options.num_workers = workers;
  options.mode = mode;
  options.server_flags = {"--optimizer=adam", "--learning_rate=0.01"};
  // Loose enough that a fast ssp worker can finish well before a slow one.
  if (mode == "ssp") options.server_flags.push_back("--staleness=40");
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? std::move(*cluster) : nullptr;
}

TEST(RealDataTest, IdxTrainsAndRawEqualsGzip) {
  std::vector<std::string> outputs;
  for (bool gzip : {false, true}) {
    auto cluster = StartCluster(gzip ? "idx_gz" : "idx_raw", 1, 1, "sync");
    ASSERT_NE(cluster, nullptr);
    std::vector<std::string> flags = IdxFlags(WriteToy(gzip));
    flags.push_back("--epochs=5");
    absl::StatusOr<std::vector<std::string>> out =
        cluster->RunWorkers({flags}, absl::Seconds(60));
    ASSERT_TRUE(out.ok()) << out.status();
    outputs.push_back(out->at(0));
  }
  // 120 examples / global batch 20 = 6 steps an epoch.
  EXPECT_EQ(JsonField(outputs[0], "steps"), "30");
  EXPECT_EQ(JsonField(outputs[0], "test_examples"), "30");
  // Inferred from the files: 16 pixels, 3 classes; the toy task is easy.
  EXPECT_GE(std::stod(JsonField(outputs[0], "test_accuracy")), 0.9)
      << outputs[0];
  // Same pixels, same order, same model: gzip changes nothing.
  EXPECT_EQ(JsonField(outputs[0], "test_loss"),
            JsonField(outputs[1], "test_loss"));
  EXPECT_EQ(JsonField(outputs[0], "final_loss"),
            JsonField(outputs[1], "final_loss"));
}

// Bad data and data flags: exit 2, one line naming the file or flag, and
// the servers never saw a registration.
struct BadData {
  std::string what;
  std::vector<std::string> flags;
  std::string expected;
};

void PrintTo(const BadData& b, std::ostream* os) { *os << b.what; }

class BadDataTest : public ::testing::TestWithParam<BadData> {
 protected:
  static void SetUpTestSuite() {
    cluster_ = StartCluster("bad_data", 1, 1, "sync").release();
    WriteToy(false);
    const IdxBytes toy = ToyIdx(120, 1);
    WriteRaw("truncated-images", toy.images.substr(0, toy.images.size() - 5));
    WriteRaw("short-labels", ToyIdx(119, 1).labels);
    // Held-out images of another size: 2 x 5 pixels.
    WriteRaw("wide-images", BigEndian(0x803) + BigEndian(30) + BigEndian(2) +
                                BigEndian(5) + std::string(30 * 10, '\1'));
    // A gzip stream cut short, and one whose stored checksum is damaged.
    const std::string gz = [&] {
      const std::string path =
          WriteGzip("images-for-corruption.gz", toy.images);
      std::ifstream file(path, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(file), {});
    }();
    WriteRaw("cut-images.gz", gz.substr(0, gz.size() / 2));
    std::string damaged = gz;
    damaged[damaged.size() - 6] ^= 0x40;  // in the CRC of the trailer
    WriteRaw("damaged-images.gz", damaged);
    std::string csv;
    for (int i = 0; i < 20; ++i) absl::StrAppend(&csv, i % 10, ",1,2\n");
    WriteRaw("ten-classes.csv", csv);
  }
  static void TearDownTestSuite() { delete cluster_; }
  static testing::TestCluster* cluster_;
};
testing::TestCluster* BadDataTest::cluster_ = nullptr;

TEST_P(BadDataTest, ExitsTwoWithOneLineBeforeRegistering) {
  ASSERT_NE(cluster_, nullptr);
  const BadData& b = GetParam();
  std::vector<std::string> flags;
  for (const std::string& flag : b.flags) {
    flags.push_back(absl::StrReplaceAll(flag, {{"DIR", Dir()}}));
  }
  flags.push_back("--log_every=0");
  absl::StatusOr<std::unique_ptr<testing::Process>> worker =
      cluster_->StartWorker(0, 1, flags);
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> code = (*worker)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 2) << (*worker)->Stderr();
  const std::string err = (*worker)->Stderr();
  const std::vector<std::string> lines =
      absl::StrSplit(err, '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 1u) << err;
  EXPECT_NE(err.find(absl::StrReplaceAll(b.expected, {{"DIR", Dir()}})),
            std::string::npos)
      << err;
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_FALSE(stats->at(0).model_registered());
}

std::vector<std::string> Idx(const std::string& images,
                             const std::string& labels,
                             std::vector<std::string> more = {}) {
  std::vector<std::string> flags = {"--data=idx", "--train_file=DIR/" + images,
                                    "--train_labels=DIR/" + labels};
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadDataTest,
    ::testing::ValuesIn(std::vector<BadData>{
        {"MissingImages", Idx("nope", "train-labels"), "DIR/nope: cannot open"},
        {"TruncatedImages", Idx("truncated-images", "train-labels"),
         "DIR/truncated-images: truncated"},
        {"WrongMagic", Idx("train-labels", "train-labels"),
         "DIR/train-labels: not an IDX images file: magic number 0x00000801"},
        {"CountsDisagree", Idx("train-images", "short-labels"),
         "DIR/train-images: 120 images, but DIR/short-labels holds 119"},
        {"GzipCutShort", Idx("cut-images.gz", "train-labels"),
         "DIR/cut-images.gz: corrupt or truncated gzip"},
        {"GzipDamaged", Idx("damaged-images.gz", "train-labels"),
         "DIR/damaged-images.gz: corrupt or truncated gzip"},
        {"TestImagesOfAnotherSize",
         Idx("train-images", "train-labels",
             {"--test_file=DIR/wide-images", "--test_labels=DIR/test-labels"}),
         "DIR/wide-images: 10 features per example, but the training data"},
        {"LabelBeyondNumClasses",
         Idx("train-images", "train-labels", {"--num_classes=2"}),
         "DIR/train-labels: label 2 (example 1) is out of range [0, 2): set "
         "--num_classes"},
        {"CsvLabelBeyondNumClasses",
         {"--data=csv", "--train_file=DIR/ten-classes.csv", "--num_classes=4"},
         "label 4 is out of range [0, 4): set --num_classes"},
        {"TrainFileWithoutData",
         {"--train_file=DIR/ten-classes.csv"},
         "--train_file=DIR/ten-classes.csv is not read with --data=synthetic"},
        {"FashionMnistWithTrainFile",
         {"--data=fashion_mnist", "--train_file=DIR/train-images"},
         "is not read with --data=fashion_mnist"},
        {"ImagesWithoutLabels",
         {"--data=idx", "--train_file=DIR/train-images"},
         "--train_file (images) and --train_labels (labels) go together"},
        {"LabelsFlagWithCsv",
         {"--data=csv", "--train_file=DIR/ten-classes.csv",
          "--train_labels=DIR/train-labels"},
         "--train_labels is only read with --data=idx"},
        {"MissingDatasetDir",
         {"--data=fashion_mnist", "--dataset_dir=DIR/none"},
         "--dataset_dir: DIR/none: no readable train-images-idx3-ubyte"},
        {"GlobalBatchNotDivisible",
         {"--global_batch_size=33", "--num_workers=2"},
         "--global_batch_size=33 is not divisible by --num_workers=2"},
        {"BatchFlagsDisagree",
         {"--global_batch_size=64", "--batch_size=10"},
         "--batch_size=10 and --global_batch_size=64 disagree"},
        {"StepsContradictEpochs",
         Idx("train-images", "train-labels",
             {"--global_batch_size=20", "--epochs=2", "--steps=5"}),
         "--steps=5 contradicts --epochs=2 (2 epochs of 6 steps = 12 steps)"},
        {"GlobalBatchLargerThanData",
         Idx("train-images", "train-labels", {"--global_batch_size=128"}),
         "the global batch (128 examples) is larger than the training set "
         "(120 examples)"},
    }),
    [](const ::testing::TestParamInfo<BadData>& info) {
      return info.param.what;
    });

// Friction 1 and 2 of the issue: a CSV of any width and class count trains
// without --num_features or --num_classes.
TEST(RealDataTest, CsvInfersFeaturesAndClasses) {
  std::string csv = "label";
  for (int j = 0; j < 40; ++j) absl::StrAppend(&csv, ",f", j);
  csv += "\n";
  for (int i = 0; i < 200; ++i) {
    const int label = i % 10;
    absl::StrAppend(&csv, label);
    for (int j = 0; j < 40; ++j) absl::StrAppend(&csv, ",", j / 4 == label);
    csv += "\n";
  }
  const std::string path = WriteRaw("wide.csv", csv);
  auto cluster = StartCluster("csv_infer", 1, 1, "sync");
  ASSERT_NE(cluster, nullptr);
  absl::StatusOr<std::vector<std::string>> out = cluster->RunWorkers(
      {{"--data=csv", "--train_file=" + path, "--test_file=" + path,
        "--model=softmax", "--global_batch_size=50", "--epochs=20",
        "--log_every=0", "--device=cpu"}},
      absl::Seconds(60));
  ASSERT_TRUE(out.ok()) << out.status();
  // Ten classes, each its own block of features: learnable to 100%.
  EXPECT_GE(std::stod(JsonField(out->at(0), "test_accuracy")), 0.95)
      << out->at(0);
}

// --epochs sets the steps; --eval_every_epochs reports every epoch on the
// progress output and in the CSV; the target is met and reported.
TEST(RealDataTest, EpochsAndPeriodicEvaluation) {
  auto cluster = StartCluster("epochs", 1, 2, "sync");
  ASSERT_NE(cluster, nullptr);
  const std::string csv = Dir() + "/epochs.csv";
  const std::vector<std::string> common = {"--model=mlp",
                                           "--hidden=16",
                                           "--num_features=12",
                                           "--train_examples=1000",
                                           "--test_examples=500",
                                           "--global_batch_size=100",
                                           "--epochs=3",
                                           "--eval_every_epochs=1",
                                           "--target_accuracy=0.5",
                                           "--log_every=5",
                                           "--device=cpu"};
  std::vector<std::string> worker0 = common, worker1 = common;
  worker0.push_back("--metrics_csv=" + csv);
  absl::StatusOr<std::vector<std::string>> out =
      cluster->RunWorkers({worker0, worker1}, absl::Seconds(60));
  ASSERT_TRUE(out.ok()) << out.status();
  const std::string& first = out->at(0);
  EXPECT_EQ(JsonField(first, "steps"), "30");  // 3 epochs of 1000 / 100
  EXPECT_EQ(JsonField(first, "epochs"), "3.000");
  EXPECT_EQ(JsonField(first, "evaluations"), "3");
  EXPECT_EQ(JsonField(out->at(1), "evaluations"), "0");  // worker 0's job
  EXPECT_NE(JsonField(first, "step_to_target"), "null") << first;
  EXPECT_NE(JsonField(first, "time_to_target_s"), "null") << first;
  for (int epoch = 1; epoch <= 3; ++epoch) {
    EXPECT_TRUE(absl::StrContains(
        first,
        absl::StrCat("step ", epoch * 10, "/30 epoch ", epoch, " test_loss ")))
        << first;
  }
  // Both workers report the final model: the servers' after 30 steps.
  EXPECT_EQ(JsonField(first, "test_loss"), JsonField(out->at(1), "test_loss"));

  std::ifstream in(csv);
  std::stringstream text;
  text << in.rdbuf();
  const std::vector<std::string> rows =
      absl::StrSplit(text.str(), '\n', absl::SkipEmpty());
  ASSERT_EQ(rows.size(), 31u) << text.str();
  int evaluated_rows = 0;
  for (size_t i = 1; i < rows.size(); ++i) {
    const std::vector<std::string> cells = absl::StrSplit(rows[i], ',');
    ASSERT_EQ(cells.size(), 11u) << rows[i];
    if (cells[8].empty()) continue;
    ++evaluated_rows;
    EXPECT_EQ(std::stoi(cells[0]) % 10, 0) << rows[i];
  }
  EXPECT_EQ(evaluated_rows, 3);
  // The last evaluation is the final model's (sync: Pull(30)).
  const std::vector<std::string> last = absl::StrSplit(rows.back(), ',');
  EXPECT_EQ(std::stod(last[8]), std::stod(JsonField(first, "test_accuracy")));
}

// Async and ssp: workers finish at different times, yet every worker's
// final JSON reports one model, the servers' after all their updates.
class FinalModelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FinalModelTest, EveryWorkerReportsTheSameFinalModel) {
  const std::string mode = GetParam();
  auto cluster = StartCluster("final_" + mode, 2, 2, mode);
  ASSERT_NE(cluster, nullptr);
  constexpr int kSteps = 80;
  const std::vector<std::string> common = {"--model=mlp",
                                           "--hidden=16",
                                           "--num_features=12",
                                           "--batch_size=16",
                                           absl::StrCat("--steps=", kSteps),
                                           "--log_every=0",
                                           "--device=cpu"};
  std::vector<std::string> slow = common;
  // Worker 1 trains long after worker 0 is done: what worker 0 would see
  // at its own end is not the final model.
  slow.push_back("--inject_step_delay_ms=25");
  absl::StatusOr<std::vector<std::string>> out =
      cluster->RunWorkers({common, slow}, absl::Seconds(120));
  ASSERT_TRUE(out.ok()) << out.status();
  for (const std::string& worker : *out) {
    EXPECT_EQ(JsonField(worker, "final_model"), "\"all_done\"") << worker;
  }
  EXPECT_EQ(JsonField(out->at(0), "test_loss"),
            JsonField(out->at(1), "test_loss"));
  EXPECT_EQ(JsonField(out->at(0), "test_accuracy"),
            JsonField(out->at(1), "test_accuracy"));
  // Not vacuous: worker 0 finished well before worker 1 (ssp: 40 steps of
  // 25 ms at least).
  EXPECT_LT(std::stod(JsonField(out->at(0), "wall_time_s")) + 0.5,
            std::stod(JsonField(out->at(1), "wall_time_s")));
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  for (const StatsResponse& shard : *stats) {
    EXPECT_EQ(shard.version(), 2 * kSteps);
    EXPECT_EQ(shard.members(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, FinalModelTest,
                         ::testing::Values("async", "ssp"));

// The built-in data set, when its Debian package is installed.
TEST(RealDataTest, FashionMnistTrainsEndToEnd) {
  if (!std::ifstream("/usr/share/datasets/fashion-mnist/"
                     "train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  auto cluster = StartCluster("fashion", 1, 1, "sync");
  ASSERT_NE(cluster, nullptr);
  absl::StatusOr<std::vector<std::string>> out = cluster->RunWorkers(
      {{"--data=fashion_mnist", "--model=softmax", "--global_batch_size=128",
        "--steps=150", "--log_every=0", "--device=cpu"}},
      absl::Seconds(120));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(JsonField(out->at(0), "test_examples"), "10000");
  // Softmax regression passes 0.75 within a third of an epoch; chance: 0.1.
  EXPECT_GE(std::stod(JsonField(out->at(0), "test_accuracy")), 0.75)
      << out->at(0);
}

}  // namespace
}  // namespace pstrain
