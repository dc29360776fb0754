#include "worker/eval_only.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/cli.h"
#include "common/partition.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "worker/model_file.h"

namespace pstrain {
namespace {

bool IsCsv(const std::string& path) { return absl::EndsWith(path, ".csv"); }
bool IsNpy(const std::string& path) { return absl::EndsWith(path, ".npy"); }

}  // namespace

std::vector<absl::Status> CheckEvalOnlyFlags(const EvalOnlyOptions& options,
                                             const std::string& model_name) {
  std::vector<absl::Status> problems;
  if (!options.eval_only) {
    for (const auto& [flag, value] :
         {std::pair<const char*, const std::string*>{"model_file",
                                                     &options.model_file},
          {"logits_file", &options.logits_file}}) {
      if (!value->empty()) {
        problems.push_back(absl::InvalidArgumentError(
            absl::StrCat("--", flag,
                         " is only read with --eval_only (training starts "
                         "from the servers' model, not from a file)")));
      }
    }
    return problems;
  }
  if (options.model_file.empty()) {
    problems.push_back(absl::InvalidArgumentError(
        "--eval_only needs --model_file (a file written by pstrain_export)"));
  }
  if (model_name != "mlp" && model_name != "softmax" &&
      model_name != "layers") {
    problems.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--eval_only evaluates --model=mlp, softmax or layers, got '",
        model_name, "'")));
  }
  if (!options.logits_file.empty() && !IsCsv(options.logits_file) &&
      !IsNpy(options.logits_file)) {
    problems.push_back(absl::InvalidArgumentError(
        absl::StrCat("--logits_file must end in .csv or .npy, got '",
                     options.logits_file, "'")));
  }
  return problems;
}

std::string LogitsCsv(const std::vector<float>& logits, int64_t classes) {
  std::string out;
  for (size_t i = 0; i < logits.size(); ++i) {
    absl::StrAppendFormat(&out, "%.9g", logits[i]);
    out += (i + 1) % classes == 0 ? '\n' : ',';
  }
  return out;
}

std::string LogitsNpy(const std::vector<float>& logits, int64_t classes) {
  // NPY format 1.0: magic, version, a little-endian uint16 header length,
  // then a Python dict literal padded with spaces and a newline so the data
  // starts on a 64-byte boundary.
  std::string header = absl::StrFormat(
      "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }",
      static_cast<int64_t>(logits.size()) / classes, classes);
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  out += header;
  out.append(reinterpret_cast<const char*>(logits.data()),
             logits.size() * sizeof(float));
  return out;
}

absl::StatusOr<EvalOnlyResult> EvaluateModelFile(const EvalOnlyOptions& options,
                                                 Model& model,
                                                 kernels::Backend& backend,
                                                 const ExampleSource* test) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<std::vector<float>>> host_params =
      LoadModelFile(options.model_file, model.Params());
  if (!host_params.ok()) return host_params.status();
  if (test == nullptr || test->size() == 0) {
    return absl::FailedPreconditionError(
        "--eval_only needs a held-out set (--test_file, or --data=synthetic "
        "with --test_examples > 0)");
  }
  std::vector<kernels::DeviceArray<float>> device_params;
  std::vector<const float*> params;
  for (const std::vector<float>& values : *host_params) {
    absl::StatusOr<kernels::DeviceArray<float>> array =
        kernels::DeviceArray<float>::Create(&backend, values.size());
    if (!array.ok()) return array.status();
    if (absl::Status s =
            backend.CopyToDevice(values.data(), array->data(), array->bytes());
        !s.ok()) {
      return s;
    }
    params.push_back(array->data());
    device_params.push_back(std::move(*array));
  }
  const int64_t max_batch = options.batch_size;
  const int64_t num_features = test->num_features();
  std::vector<float> host_features(max_batch * num_features);
  std::vector<int32_t> host_labels(max_batch);
  std::vector<int64_t> indices;
  absl::StatusOr<kernels::DeviceArray<float>> features =
      kernels::DeviceArray<float>::Create(&backend, max_batch * num_features);
  if (!features.ok()) return features.status();
  absl::StatusOr<kernels::DeviceArray<int32_t>> labels =
      kernels::DeviceArray<int32_t>::Create(&backend, max_batch);
  if (!labels.ok()) return labels.status();

  const bool want_logits = !options.logits_file.empty();
  std::vector<float> all_logits;
  BatchResult total;
  for (int64_t first = 0; first < test->size(); first += max_batch) {
    const int64_t rows = std::min(max_batch, test->size() - first);
    indices.resize(rows);
    std::iota(indices.begin(), indices.end(), first);
    absl::Status s =
        test->Gather(indices, host_features.data(), host_labels.data());
    if (s.ok()) {
      s = backend.CopyToDevice(host_features.data(), features->data(),
                               rows * num_features * sizeof(float));
    }
    if (s.ok()) {
      s = backend.CopyToDevice(host_labels.data(), labels->data(),
                               rows * sizeof(int32_t));
    }
    if (!s.ok()) return s;
    const DeviceBatch batch{rows, features->data(), labels->data()};
    absl::StatusOr<BatchResult> result = model.Evaluate(params, batch);
    if (!result.ok()) return result.status();
    total.loss_sum += result->loss_sum;
    total.num_correct += result->num_correct;
    total.rows += result->rows;
    if (want_logits) {
      absl::StatusOr<std::vector<float>> logits = model.Logits(params, batch);
      if (!logits.ok()) return logits.status();
      all_logits.insert(all_logits.end(), logits->begin(), logits->end());
    }
  }
  if (want_logits) {
    const int64_t classes =
        static_cast<int64_t>(all_logits.size()) / total.rows;
    const std::string bytes = IsNpy(options.logits_file)
                                  ? LogitsNpy(all_logits, classes)
                                  : LogitsCsv(all_logits, classes);
    if (absl::Status s = WriteFileAtomically(options.logits_file, bytes);
        !s.ok()) {
      return s;
    }
    LOG(INFO) << "wrote the logits of " << total.rows << " examples x "
              << classes << " classes to " << options.logits_file;
  }
  EvalOnlyResult result;
  result.test_examples = total.rows;
  result.test_loss = total.loss_sum / total.rows;
  result.test_accuracy = static_cast<double>(total.num_correct) / total.rows;
  result.wall_time_s = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

std::string EvalOnlyJson(const EvalOnlyResult& result,
                         const EvalOnlyOptions& options,
                         const std::string& device) {
  nlohmann::ordered_json line;
  line["event"] = "final";
  line["mode"] = "eval_only";
  line["model_file"] = options.model_file;
  line["device"] = device;
  line["test_loss"] = result.test_loss;
  line["test_accuracy"] = result.test_accuracy;
  line["test_examples"] = result.test_examples;
  line["wall_time_s"] = result.wall_time_s;
  return line.dump();
}

int RunEvalOnly(const EvalOnlyOptions& options, Model& model,
                kernels::Backend& backend, const ExampleSource* test) {
  absl::StatusOr<EvalOnlyResult> result =
      EvaluateModelFile(options, model, backend, test);
  if (absl::IsInvalidArgument(result.status()) ||
      absl::IsFailedPrecondition(result.status()) ||
      absl::IsNotFound(result.status()) || absl::IsDataLoss(result.status())) {
    ExitOnFlagErrors({result.status()});  // the user's file or flags: exit 2
  }
  if (!result.ok()) {
    LOG(ERROR) << "evaluation failed: " << result.status();
    return 1;
  }
  std::printf("%s\n", EvalOnlyJson(*result, options, backend.Name()).c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace pstrain
