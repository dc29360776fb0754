#include "worker/worker_config.h"

#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "common/learning_rates.h"
#include "common/run_output.h"
#include "worker/ctr_data.h"
#include "worker/layers.h"

namespace pstrain {
namespace {

using Problems = std::vector<absl::Status>;

// Who this worker is, and whether it has servers to talk to.
void CheckJob(const WorkerConfig& config, Problems& checks) {
  if (config.client.hosts.empty() && !config.eval.eval_only) {
    checks.push_back(absl::InvalidArgumentError(
        "--ps_hosts is required (host:port of every ps_server)"));
  }
  checks.push_back(CheckAtLeast("num_workers", config.num_workers, 1));
  if (config.worker_id < 0 || config.worker_id >= config.num_workers) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--worker_id must be in [0, --num_workers=", config.num_workers,
        "), got ", config.worker_id)));
  }
}

void CheckModel(const ModelConfig& model, Problems& checks) {
  const std::string& name = model.name;
  if (name != "softmax" && name != "mlp" && name != "probe" && name != "ctr" &&
      name != "layers") {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--model must be softmax, mlp, probe or ctr, or layers "
                     "(with --layers), got '",
                     name, "'")));
  }
  if (name == "layers") checks.push_back(ParseLayerList(model.layers).status());
  // A layer list given with another --model would be silently ignored.
  if (name != "layers" && model.layers != ModelConfig().layers) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--layers is read only with --model=layers, got --model=", name)));
  }
  checks.push_back(ParseHidden(model.hidden).status());
  checks.push_back(CheckAtLeast("block_elements", model.block_elements, 0));
}

// A data flag that the chosen --data would not read: an error rather than
// silently training on something else.
void CheckDataFiles(const DataConfig& data, Problems& checks) {
  const std::string& source = data.source;
  const std::pair<const char*, std::string> files[] = {
      {"train_file", data.train_file},
      {"test_file", data.test_file},
      {"train_labels", data.train_labels},
      {"test_labels", data.test_labels}};
  for (const auto& [flag, value] : files) {
    if (value.empty()) continue;
    const bool labels = absl::EndsWith(flag, "_labels");
    if (source == "synthetic" || source == "fashion_mnist") {
      checks.push_back(absl::InvalidArgumentError(absl::StrCat(
          "--", flag, "=", value, " is not read with --data=", source,
          ": set --data=", labels ? "idx" : "csv, libsvm or idx",
          " for your files",
          source == "fashion_mnist"
              ? " (or --dataset_dir for another MNIST-layout directory)"
              : "")));
    } else if (labels && source != "idx") {
      checks.push_back(absl::InvalidArgumentError(absl::StrCat(
          "--", flag, " is only read with --data=idx (got --data=", source,
          ")")));
    }
  }
  if (source == "csv" || source == "libsvm" || source == "idx") {
    if (data.train_file.empty()) {
      checks.push_back(absl::InvalidArgumentError(
          absl::StrCat("--data=", source, " needs --train_file")));
    }
  }
  if (source == "idx") {
    for (int pair = 0; pair < 2; ++pair) {
      const auto& images = files[pair];
      const auto& labels = files[pair + 2];
      if (images.second.empty() != labels.second.empty()) {
        checks.push_back(absl::InvalidArgumentError(absl::StrCat(
            "--data=idx: --", images.first, " (images) and --", labels.first,
            " (labels) go together; give both or neither")));
      }
    }
  }
}

void CheckData(const WorkerConfig& config, Problems& checks) {
  const DataConfig& data = config.data;
  const std::string& source = data.source;
  if (source != "synthetic" && source != "csv" && source != "libsvm" &&
      source != "idx" && source != "fashion_mnist") {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--data must be synthetic, csv, libsvm, idx or "
                     "fashion_mnist, got '",
                     source, "'")));
  }
  // The CTR model reads --ctr_data's files.
  if (config.model.name != "ctr") CheckDataFiles(data, checks);
  checks.push_back(CheckAtLeast("num_features", data.num_features, 0));
  if (data.num_classes != 0) {
    checks.push_back(CheckAtLeast("num_classes", data.num_classes, 2));
  }
}

void CheckTraining(const WorkerConfig& config, Problems& checks) {
  const TrainingConfig& training = config.training;
  checks.push_back(CheckAtLeast("steps", training.steps, 1));
  checks.push_back(CheckAtLeast("epochs", training.epochs, 0));
  checks.push_back(CheckAtLeast("batch_size", training.batch_size, 1));
  checks.push_back(
      CheckAtLeast("global_batch_size", training.global_batch_size, 0));
  if (config.num_workers >= 1) {
    checks.push_back(WorkerBatchSize(config).status());
  }
  checks.push_back(
      CheckAtLeast("inject_step_delay_ms", training.inject_step_delay_ms, 0));
  checks.push_back(CheckAtLeast("trace_steps", training.trace_steps, 0));
  if (training.pipeline_step != "by_host" &&
      training.pipeline_step != "always" && training.pipeline_step != "never") {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--pipeline_step must be by_host, always or never, got '",
                     training.pipeline_step, "'")));
  }
  // The total steps are known once the data is (--epochs): cosine's check
  // against the warmup waits for them (worker_run.cc).
  LrSchedule schedule = training.lr_schedule;
  schedule.total_steps = schedule.warmup_steps + 1;
  for (absl::Status& problem : LrScheduleProblems(schedule)) {
    checks.push_back(std::move(problem));
  }
  checks.push_back(CheckAtLeast("inject_crash_before_push_step",
                                training.inject_crash_before_push_step, -1));
  checks.push_back(CheckAtLeast("inject_crash_after_step",
                                training.inject_crash_after_step, -1));
  checks.push_back(CheckAtLeast("inject_sigterm_after_step",
                                training.inject_sigterm_after_step, -1));
  checks.push_back(CheckAtLeast("inject_sigterm_before_push_step",
                                training.inject_sigterm_before_push_step, -1));
  checks.push_back(CheckAtLeast("inject_sigterm_in_backward_step",
                                training.inject_sigterm_in_backward_step, -1));
  checks.push_back(CheckAtLeast("inject_backward_pause_ms",
                                training.inject_backward_pause_ms, 0));
}

void CheckEval(const WorkerConfig& config, Problems& checks) {
  const EvalConfig& eval = config.eval;
  // --eval_only evaluates a model file with no servers (worker/eval_only.h).
  for (absl::Status& s :
       CheckEvalOnlyFlags(EvalOnlyOptionsOf(config), config.model.name)) {
    checks.push_back(std::move(s));
  }
  checks.push_back(CheckAtLeast("eval_every_steps", eval.eval_every_steps, 0));
  checks.push_back(
      CheckAtLeast("eval_every_epochs", eval.eval_every_epochs, 0));
  if (!(eval.target_accuracy >= 0 && eval.target_accuracy <= 1)) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--target_accuracy must be in [0, 1], got ", eval.target_accuracy)));
  }
}

void CheckOutput(const OutputConfig& output, Problems& checks) {
  checks.push_back(CheckAtLeast("log_every", output.log_every, 0));
  if (output.progress != "auto" && output.progress != "bar" &&
      output.progress != "lines") {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--progress must be auto, bar or lines, got '", output.progress, "'")));
  }
  checks.push_back(CheckPort("metrics_port", output.metrics_port, -1));
  checks.push_back(
      CheckAtLeast("metrics_linger_s", output.metrics_linger_s, 0));
  // Created (with its header) as the worker would; the worker opens it
  // again, empty, when it starts its output.
  if (!output.metrics_csv.empty()) {
    checks.push_back(MetricsCsv::Open(output.metrics_csv).status());
  }
}

// The servers check every field at registration; these are the mistakes
// worth one clear line before any work.
void CheckCtr(const WorkerConfig& config, Problems& checks) {
  const CtrConfig& ctr = config.ctr;
  const TrainingConfig& training = config.training;
  if (training.inject_crash_before_push_step >= 0 ||
      training.inject_crash_after_step >= 0 ||
      training.inject_sigterm_in_backward_step >= 0 ||
      training.inject_backward_pause_ms > 0) {
    checks.push_back(absl::InvalidArgumentError(
        "--inject_crash_before_push_step, --inject_crash_after_step, "
        "--inject_sigterm_in_backward_step and --inject_backward_pause_ms "
        "are for the dense models' training loop; --model=ctr does not run "
        "them"));
  }
  if (ctr.data != "synthetic" && ctr.data != "criteo" && ctr.data != "libsvm") {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--ctr_data must be synthetic, criteo or libsvm, got '",
                     ctr.data, "'")));
  }
  if (ctr.data != "synthetic" && config.data.train_file.empty()) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--ctr_data=", ctr.data, " needs --train_file")));
  }
  if (ctr.embedding_dim < 1 || ctr.hidden < 1) {
    checks.push_back(absl::InvalidArgumentError(
        "--embedding_dim and --ctr_hidden must be >= 1"));
  }
  if (ctr.embedding_max_bytes < 0) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--embedding_max_bytes must be >= 0 (0: no budget), got ",
                     ctr.embedding_max_bytes)));
  }
  checks.push_back(CtrFieldVocab(ctr).status());
  if (!ctr.embedding_mode.empty() && ctr.embedding_mode != "async") {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--embedding_mode must be empty (the servers' --mode) or async, got '",
        ctr.embedding_mode, "'")));
  }
  const std::string& optimizer = ctr.sparse_optimizer;
  if (optimizer != "sgd" && optimizer != "adagrad" && optimizer != "adam" &&
      optimizer != "ftrl") {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--sparse_optimizer must be sgd, adagrad, adam or ftrl, "
                     "got '",
                     optimizer, "'")));
  }
  // As the servers get them: float32 (SparseOptimizer's fields). FTRL's
  // rate is --ftrl_alpha; it reads no --sparse_learning_rate.
  const float rate = static_cast<float>(EffectiveLearningRate(
      ctr.sparse_learning_rate, DefaultSparseLearningRate(optimizer)));
  const float alpha = static_cast<float>(ctr.ftrl_alpha);
  if (!(rate > 0 || optimizer == "ftrl") || !(alpha > 0)) {
    checks.push_back(absl::InvalidArgumentError(
        "--sparse_learning_rate and --ftrl_alpha must be positive"));
  }
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> CtrFieldVocab(const CtrConfig& ctr) {
  std::vector<int64_t> vocab;
  if (ctr.cardinalities.empty()) return vocab;
  if (ctr.cardinalities == "criteo") {
    vocab.assign(std::begin(kCriteoKaggleCardinalities),
                 std::end(kCriteoKaggleCardinalities));
  } else {
    for (absl::string_view part : absl::StrSplit(ctr.cardinalities, ',')) {
      int64_t n = 0;
      if (!absl::SimpleAtoi(part, &n) || n < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--ctr_cardinalities must be criteo or positive integers joined "
            "by ',', got '",
            ctr.cardinalities, "'"));
      }
      vocab.push_back(n);
    }
  }
  if (static_cast<int>(vocab.size()) != ctr.fields) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ctr_cardinalities=", ctr.cardinalities, " names ",
                     vocab.size(), " fields but --ctr_fields=", ctr.fields));
  }
  return vocab;
}

absl::Status ValidateWorkerConfig(const WorkerConfig& config) {
  Problems checks;
  CheckJob(config, checks);
  CheckModel(config.model, checks);
  CheckData(config, checks);
  CheckTraining(config, checks);
  CheckEval(config, checks);
  CheckOutput(config.output, checks);
  for (absl::Status& problem : ClientConfigProblems(config.client)) {
    checks.push_back(std::move(problem));
  }
  if (config.model.name == "ctr") CheckCtr(config, checks);
  return JoinProblems(checks);
}

EvalOnlyOptions EvalOnlyOptionsOf(const WorkerConfig& config) {
  return {config.eval.eval_only, config.eval.model_file,
          config.eval.logits_file, config.training.batch_size};
}

absl::StatusOr<std::vector<int64_t>> ParseHidden(const std::string& text) {
  std::vector<int64_t> sizes;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t size = 0;
    if (!absl::SimpleAtoi(part, &size) || size < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--hidden must be positive integers separated by commas, got '", text,
          "'"));
    }
    sizes.push_back(size);
  }
  return sizes;
}

absl::StatusOr<int64_t> WorkerBatchSize(const WorkerConfig& config) {
  const int num_workers = config.num_workers;
  const int64_t batch_size = config.training.batch_size;
  const int64_t global = config.training.global_batch_size;
  if (global == 0) return batch_size;
  if (global % num_workers != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--global_batch_size=", global,
        " is not divisible by --num_workers=", num_workers,
        ": every worker takes an equal slice of each global "
        "batch (sync training then equals one process with the global "
        "batch); pick a multiple of ",
        num_workers));
  }
  if (config.training.batch_size_given && batch_size * num_workers != global) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--batch_size=", batch_size, " and --global_batch_size=", global,
        " disagree (", num_workers, " workers x ", batch_size, " = ",
        batch_size * num_workers, "): give one of them"));
  }
  return global / num_workers;
}

absl::StatusOr<int64_t> TrainingSteps(const TrainingConfig& training,
                                      int64_t steps_per_epoch) {
  const int64_t steps = training.steps;
  const int64_t epochs = training.epochs;
  if (epochs == 0) return steps;
  const int64_t from_epochs = epochs * steps_per_epoch;
  if (training.steps_given && steps != from_epochs) {
    return absl::InvalidArgumentError(
        absl::StrCat("--steps=", steps, " contradicts --epochs=", epochs, " (",
                     epochs, " epochs of ", steps_per_epoch,
                     " steps = ", from_epochs, " steps): give one of them"));
  }
  return from_epochs;
}

}  // namespace pstrain
