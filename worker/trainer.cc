#include "worker/trainer.h"

#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/partition.h"

namespace pstrain {
namespace {

// The model's parameters and gradients, in host memory (for the wire) and
// in backend memory (for compute).
struct ParameterBuffers {
  std::vector<std::vector<float>> host_params, host_grads;
  std::vector<kernels::DeviceArray<float>> device_params, device_grads;

  absl::Status Allocate(const Model& model, kernels::Backend& backend) {
    for (const DenseTensorSpec& spec : model.Params()) {
      const int64_t n = NumElements(spec);
      host_params.emplace_back(n);
      host_grads.emplace_back(n);
      for (auto* device : {&device_params, &device_grads}) {
        absl::StatusOr<kernels::DeviceArray<float>> array =
            kernels::DeviceArray<float>::Create(&backend, n);
        if (!array.ok()) return array.status();
        device->push_back(std::move(*array));
      }
    }
    return absl::OkStatus();
  }

  template <typename T, typename Array>
  static std::vector<T*> Pointers(Array& arrays) {
    std::vector<T*> out;
    for (auto& a : arrays) out.push_back(a.data());
    return out;
  }

  // Returns the step the pulled model is at (see PsClient::Pull).
  absl::StatusOr<int64_t> PullToDevice(PsClient& client, int64_t step,
                                       kernels::Backend& backend) {
    absl::StatusOr<int64_t> at =
        client.Pull(step, Pointers<float>(host_params));
    if (!at.ok()) return at.status();
    for (size_t i = 0; i < host_params.size(); ++i) {
      absl::Status copied =
          backend.CopyToDevice(host_params[i].data(), device_params[i].data(),
                               device_params[i].bytes());
      if (!copied.ok()) return copied;
    }
    return at;
  }
};

// A host batch and its copy in backend memory.
struct BatchBuffers {
  std::vector<float> host_features;
  std::vector<int32_t> host_labels;
  kernels::DeviceArray<float> features;
  kernels::DeviceArray<int32_t> labels;

  absl::Status Allocate(int64_t rows, int64_t num_features,
                        kernels::Backend& backend) {
    host_features.resize(rows * num_features);
    host_labels.resize(rows);
    absl::StatusOr<kernels::DeviceArray<float>> f =
        kernels::DeviceArray<float>::Create(&backend, rows * num_features);
    if (!f.ok()) return f.status();
    absl::StatusOr<kernels::DeviceArray<int32_t>> l =
        kernels::DeviceArray<int32_t>::Create(&backend, rows);
    if (!l.ok()) return l.status();
    features = std::move(*f);
    labels = std::move(*l);
    return absl::OkStatus();
  }

  absl::StatusOr<DeviceBatch> Upload(int64_t rows, int64_t num_features,
                                     kernels::Backend& backend) {
    absl::Status s = backend.CopyToDevice(host_features.data(), features.data(),
                                          rows * num_features * sizeof(float));
    if (s.ok()) {
      s = backend.CopyToDevice(host_labels.data(), labels.data(),
                               rows * sizeof(int32_t));
    }
    if (!s.ok()) return s;
    return DeviceBatch{rows, features.data(), labels.data()};
  }
};

absl::StatusOr<BatchResult> Evaluate(Model& model, kernels::Backend& backend,
                                     const std::vector<const float*>& params,
                                     const Dataset& test, int64_t max_batch,
                                     BatchBuffers& batch) {
  BatchResult total;
  for (int64_t first = 0; first < test.size(); first += max_batch) {
    const int64_t rows = std::min(max_batch, test.size() - first);
    std::copy_n(test.features.begin() + first * test.num_features,
                rows * test.num_features, batch.host_features.begin());
    std::copy_n(test.labels.begin() + first, rows, batch.host_labels.begin());
    absl::StatusOr<DeviceBatch> device =
        batch.Upload(rows, test.num_features, backend);
    if (!device.ok()) return device.status();
    absl::StatusOr<BatchResult> result = model.Evaluate(params, *device);
    if (!result.ok()) return result.status();
    total.loss_sum += result->loss_sum;
    total.num_correct += result->num_correct;
    total.rows += result->rows;
  }
  return total;
}

}  // namespace

absl::StatusOr<TrainResult> Train(const TrainerOptions& options,
                                  const std::string& mode, PsClient& client,
                                  Model& model, kernels::Backend& backend,
                                  const Dataset& train, const Dataset& test) {
  if (train.size() == 0) {
    return absl::FailedPreconditionError(
        "this worker's shard of the training data is empty");
  }
  ParameterBuffers buffers;
  if (absl::Status s = buffers.Allocate(model, backend); !s.ok()) return s;
  BatchBuffers batch;
  if (absl::Status s =
          batch.Allocate(options.batch_size, train.num_features, backend);
      !s.ok()) {
    return s;
  }
  const std::vector<const float*> params =
      ParameterBuffers::Pointers<const float>(buffers.device_params);
  const std::vector<float*> grads =
      ParameterBuffers::Pointers<float>(buffers.device_grads);
  const std::vector<const float*> host_grads =
      ParameterBuffers::Pointers<const float>(buffers.host_grads);

  TrainResult result;
  result.mode = mode;
  result.start_step = options.start_step;
  BatchCursor cursor(&train);
  BatchResult window;
  const absl::Time start = absl::Now();
  int64_t step = options.start_step;
  while (step < options.steps) {
    const absl::Time step_start = absl::Now();
    if (options.stop != nullptr && options.stop->load()) {
      result.stopped_early = true;
      break;
    }
    cursor.Next(options.batch_size, batch.host_features.data(),
                batch.host_labels.data());
    absl::StatusOr<DeviceBatch> device_batch =
        batch.Upload(options.batch_size, train.num_features, backend);
    if (!device_batch.ok()) return device_batch.status();
    const absl::Time pull_start = absl::Now();
    absl::StatusOr<int64_t> at = buffers.PullToDevice(client, step, backend);
    if (!at.ok()) return at.status();
    const absl::Duration pull_time = absl::Now() - pull_start;
    if (*at > step) {  // the job went on without this worker: catch up
      result.steps_skipped += *at - step;
      step = *at;
      if (step >= options.steps) break;
    }
    absl::StatusOr<BatchResult> batch_result =
        model.ComputeGradients(params, *device_batch, grads);
    if (!batch_result.ok()) return batch_result.status();
    for (size_t i = 0; i < grads.size(); ++i) {
      if (absl::Status s =
              backend.CopyToHost(grads[i], buffers.host_grads[i].data(),
                                 buffers.device_grads[i].bytes());
          !s.ok()) {
        return s;
      }
    }
    if (options.step_delay > absl::ZeroDuration()) {
      absl::SleepFor(options.step_delay);
    }
    const absl::Time push_start = absl::Now();
    absl::StatusOr<PsClient::PushResult> pushed = client.Push(step, host_grads);
    if (!pushed.ok()) return pushed.status();
    const absl::Duration push_time = absl::Now() - push_start;
    result.duplicate_blocks += pushed->blocks_duplicate;
    result.late_blocks += pushed->blocks_late;
    ++result.steps_run;
    ++step;

    // The final loss and accuracy average the last tenth of the job.
    if (step > options.steps - std::max<int64_t>(1, options.steps / 10)) {
      window.loss_sum += batch_result->loss_sum;
      window.num_correct += batch_result->num_correct;
      window.rows += batch_result->rows;
    }
    if (options.on_step) {
      const absl::Time now = absl::Now();
      StepReport report;
      report.step = step;
      report.steps = options.steps;
      report.loss = batch_result->loss_sum / batch_result->rows;
      report.train_accuracy =
          static_cast<double>(batch_result->num_correct) / batch_result->rows;
      report.examples = batch_result->rows;
      report.step_seconds = absl::ToDoubleSeconds(now - step_start);
      report.pull_seconds = absl::ToDoubleSeconds(pull_time);
      report.push_seconds = absl::ToDoubleSeconds(push_time);
      options.on_step(report);
    }
  }
  if (window.rows > 0) {
    result.final_loss = window.loss_sum / window.rows;
    result.train_accuracy =
        static_cast<double>(window.num_correct) / window.rows;
  }
  result.steps = options.steps;
  result.wall_time_s = absl::ToDoubleSeconds(absl::Now() - start);
  result.samples_per_sec = result.steps_run * options.batch_size /
                           std::max(result.wall_time_s, 1e-9);
  result.injected_duplicate_pushes = client.injected_duplicate_pushes();

  // The model after the last update (sync: waits for every member's last
  // gradient; a worker stopping early takes the step it reached), then
  // leave so nobody waits for this worker.
  absl::StatusOr<int64_t> final_step = buffers.PullToDevice(
      client, result.stopped_early ? step : options.steps, backend);
  if (!final_step.ok()) return final_step.status();
  if (absl::Status s = client.Leave(); !s.ok()) return s;
  if (test.size() > 0) {
    absl::StatusOr<BatchResult> evaluation =
        Evaluate(model, backend, params, test, options.batch_size, batch);
    if (!evaluation.ok()) return evaluation.status();
    result.test_examples = evaluation->rows;
    result.test_loss = evaluation->loss_sum / evaluation->rows;
    result.test_accuracy =
        static_cast<double>(evaluation->num_correct) / evaluation->rows;
  }
  return result;
}

std::string FinalJson(const TrainResult& r, int worker_id, int num_workers,
                      const std::string& device) {
  return absl::StrFormat(
      "{\"event\":\"final\",\"mode\":\"%s\",\"worker_id\":%d,"
      "\"num_workers\":%d,\"device\":\"%s\",\"steps\":%d,"
      "\"final_loss\":%.6f,\"train_accuracy\":%.4f,\"test_loss\":%.6f,"
      "\"test_accuracy\":%.4f,\"test_examples\":%d,\"samples_per_sec\":%.1f,"
      "\"wall_time_s\":%.3f,\"start_step\":%d,\"steps_run\":%d,"
      "\"steps_skipped\":%d,\"duplicate_blocks\":%d,\"late_blocks\":%d,"
      "\"injected_duplicate_pushes\":%d,\"stopped_early\":%s}",
      r.mode, worker_id, num_workers, device, r.steps, r.final_loss,
      r.train_accuracy, r.test_loss, r.test_accuracy, r.test_examples,
      r.samples_per_sec, r.wall_time_s, r.start_step, r.steps_run,
      r.steps_skipped, r.duplicate_blocks, r.late_blocks,
      r.injected_duplicate_pushes, r.stopped_early ? "true" : "false");
}

}  // namespace pstrain
