#include "worker/worker_data.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/idx_data.h"

namespace pstrain {
namespace {

// Reads the training and held-out data named by the configuration.
absl::Status ReadData(const WorkerConfig& config, TrainingData& data) {
  const DataConfig& spec = config.data;
  const std::string& source = spec.source;
  const int64_t num_features = spec.num_features;
  int64_t num_classes = spec.num_classes;
  if (source == "synthetic") {
    SyntheticOptions options;
    options.num_features = num_features > 0 ? num_features : 32;
    options.num_classes = num_classes > 0 ? num_classes : 4;
    options.label_noise = spec.label_noise;
    options.seed = config.seed;
    const int64_t train_examples = spec.train_examples;
    absl::StatusOr<Dataset> train =
        MakeSyntheticClassification(options, 0, train_examples, {0, 1});
    if (!train.ok()) return train.status();
    absl::StatusOr<Dataset> test = MakeSyntheticClassification(
        options, train_examples, spec.test_examples, {0, 1});
    if (!test.ok()) return test.status();
    data.synthetic_best_accuracy = SyntheticBestAccuracy(options);
    data.train = std::make_unique<InMemorySource>(std::move(*train));
    data.test = std::make_unique<InMemorySource>(std::move(*test));
    return absl::OkStatus();
  }
  std::string train_file = spec.train_file;
  std::string test_file = spec.test_file;
  std::string train_labels = spec.train_labels;
  std::string test_labels = spec.test_labels;
  if (source == "fashion_mnist") {
    absl::StatusOr<IdxDataset> found = FindIdxDataset(spec.dataset_dir);
    if (!found.ok()) {
      return absl::Status(
          found.status().code(),
          absl::StrCat("--dataset_dir: ", found.status().message()));
    }
    train_file = found->train_images;
    train_labels = found->train_labels;
    test_file = found->test_images;
    test_labels = found->test_labels;
  }
  // Reads one file pair; `features` and `classes` 0 mean infer.
  auto read =
      [&](const std::string& path, const std::string& labels, int64_t features,
          int64_t classes) -> absl::StatusOr<std::unique_ptr<ExampleSource>> {
    if (source == "idx" || source == "fashion_mnist") {
      return OpenIdx(path, labels, classes);
    }
    absl::StatusOr<Dataset> read =
        source == "csv" ? ReadCsv(path, features, classes, {0, 1})
                        : ReadLibsvm(path, features, classes, {0, 1});
    if (!read.ok()) return read.status();
    return std::make_unique<InMemorySource>(std::move(*read));
  };
  absl::StatusOr<std::unique_ptr<ExampleSource>> train =
      read(train_file, train_labels, num_features, num_classes);
  if (!train.ok()) return train.status();
  data.train = std::move(*train);
  if (num_features > 0 && data.train->num_features() != num_features) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_features=", num_features, " but ", train_file, " has ",
        data.train->num_features(), " features per example (0 infers it)"));
  }
  if (!test_file.empty()) {
    absl::StatusOr<std::unique_ptr<ExampleSource>> test =
        read(test_file, test_labels, data.train->num_features(),
             data.train->num_classes());
    if (!test.ok()) return test.status();
    if ((*test)->num_features() != data.train->num_features()) {
      return absl::InvalidArgumentError(
          absl::StrCat(test_file, ": ", (*test)->num_features(),
                       " features per example, but the training data (",
                       train_file, ") has ", data.train->num_features()));
    }
    data.test = std::move(*test);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TrainingData> LoadTrainingData(const WorkerConfig& config) {
  absl::StatusOr<int64_t> batch_size = WorkerBatchSize(config);
  if (!batch_size.ok()) return batch_size.status();
  TrainingData data;
  data.batch_size = *batch_size;
  if (absl::Status read = ReadData(config, data); !read.ok()) return read;
  EpochPlan::Options plan_options;
  plan_options.num_examples = data.train->size();
  plan_options.worker_batch = data.batch_size;
  plan_options.num_workers = config.num_workers;
  plan_options.worker_index = config.worker_id;
  absl::StatusOr<EpochPlan> plan = EpochPlan::Create(plan_options);
  if (!plan.ok()) return plan.status();
  data.global_batch = plan->global_batch();
  data.steps_per_epoch = plan->steps_per_epoch();
  absl::StatusOr<int64_t> steps =
      TrainingSteps(config.training, data.steps_per_epoch);
  if (!steps.ok()) return steps.status();
  data.steps = *steps;
  return data;
}

}  // namespace pstrain
