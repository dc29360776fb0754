#include "worker/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/consistency_mode.h"
#include "common/partition.h"
#include "glog/logging.h"
#include "worker/step_overlap.h"

namespace pstrain {
namespace {

// The model's parameters and gradients, in host memory (for the wire) and
// in backend memory (for compute).
struct ParameterBuffers {
  std::vector<std::vector<float>> host_params, host_grads;
  std::vector<kernels::DeviceArray<float>> device_params, device_grads;
  // What the client pulls into and pushes from: the backend's arrays when
  // the backend computes in host memory (no staging copies), else
  // host_params and host_grads.
  bool staged = true;
  std::vector<float*> pull_into;
  std::vector<const float*> push_from;

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
    staged = !backend.MemoryIsHost();
    pull_into =
        staged ? Pointers<float>(host_params) : Pointers<float>(device_params);
    push_from = staged ? Pointers<const float>(host_grads)
                       : Pointers<const float>(device_grads);
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
    // Unstaged, the pull writes arrays the backend may still be reading.
    if (!staged) {
      if (absl::Status s = backend.Synchronize(); !s.ok()) return s;
    }
    absl::StatusOr<int64_t> at = client.Pull(step, pull_into);
    if (!at.ok()) return at.status();
    if (absl::Status s = ParamsToDevice(backend); !s.ok()) return s;
    return at;
  }

  // Pushes push_from as `step` and pulls step + 1 (PsClient::PushPull).
  // Call after GradsToHost, which also waits for the backend.
  absl::StatusOr<PsClient::PushPullResult> PushPullToDevice(
      PsClient& client, int64_t step, kernels::Backend& backend) {
    absl::StatusOr<PsClient::PushPullResult> done =
        client.PushPull(step, push_from, step + 1, pull_into);
    if (!done.ok()) return done.status();
    if (absl::Status s = ParamsToDevice(backend); !s.ok()) return s;
    return done;
  }

  // Makes push_from hold the gradients computed in device_grads.
  absl::Status GradsToHost(kernels::Backend& backend) {
    if (!staged) return backend.Synchronize();
    for (size_t i = 0; i < host_grads.size(); ++i) {
      absl::Status copied =
          backend.CopyToHost(device_grads[i].data(), host_grads[i].data(),
                             device_grads[i].bytes());
      if (!copied.ok()) return copied;
    }
    return absl::OkStatus();
  }

  absl::Status ParamsToDevice(kernels::Backend& backend) {
    if (!staged) return absl::OkStatus();
    for (size_t i = 0; i < host_params.size(); ++i) {
      absl::Status copied =
          backend.CopyToDevice(host_params[i].data(), device_params[i].data(),
                               device_params[i].bytes());
      if (!copied.ok()) return copied;
    }
    return absl::OkStatus();
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
                                     const ExampleSource& test,
                                     int64_t max_batch, BatchBuffers& batch) {
  BatchResult total;
  std::vector<int64_t> indices;
  for (int64_t first = 0; first < test.size(); first += max_batch) {
    const int64_t rows = std::min(max_batch, test.size() - first);
    indices.resize(rows);
    std::iota(indices.begin(), indices.end(), first);
    if (absl::Status s = test.Gather(indices, batch.host_features.data(),
                                     batch.host_labels.data());
        !s.ok()) {
      return s;
    }
    absl::StatusOr<DeviceBatch> device =
        batch.Upload(rows, test.num_features(), backend);
    if (!device.ok()) return device.status();
    absl::StatusOr<BatchResult> result = model.Evaluate(params, *device);
    if (!result.ok()) return result.status();
    total.loss_sum += result->loss_sum;
    total.num_correct += result->num_correct;
    total.rows += result->rows;
  }
  return total;
}

// Fault injection: dies as kill -9 would, with nothing flushed or sent.
[[noreturn]] void CrashNow(const char* when, int64_t step) {
  LOG(WARNING) << "fault injection: SIGKILL at step " << step << ", " << when;
  google::FlushLogFiles(google::GLOG_INFO);
  kill(getpid(), SIGKILL);
  std::abort();  // not reached
}

}  // namespace

int64_t PeakRssBytes() {
  std::ifstream status("/proc/self/status");
  std::string text;
  while (std::getline(status, text)) {
    absl::string_view line = text;
    int64_t kib = 0;
    if (absl::ConsumePrefix(&line, "VmHWM:") &&
        absl::SimpleAtoi(
            absl::StripSuffix(absl::StripAsciiWhitespace(line), " kB"), &kib)) {
      return kib * 1024;
    }
  }
  return 0;
}

absl::StatusOr<TrainResult> Train(const TrainerOptions& options,
                                  ConsistencyMode mode, PsClient& client,
                                  Model& model, kernels::Backend& backend,
                                  const ExampleSource& train,
                                  const ExampleSource* test) {
  EpochPlan::Options plan_options;
  plan_options.num_examples = train.size();
  plan_options.worker_batch = options.batch_size;
  plan_options.num_workers = options.num_workers;
  plan_options.worker_index = options.worker_id;
  plan_options.shuffle = options.shuffle;
  plan_options.seed = options.seed;
  absl::StatusOr<EpochPlan> plan = EpochPlan::Create(plan_options);
  if (!plan.ok()) return plan.status();
  const int64_t steps_per_epoch = plan->steps_per_epoch();

  ParameterBuffers buffers;
  if (absl::Status s = buffers.Allocate(model, backend); !s.ok()) return s;
  BatchBuffers batch;
  if (absl::Status s =
          batch.Allocate(options.batch_size, train.num_features(), backend);
      !s.ok()) {
    return s;
  }
  const std::vector<const float*> params =
      ParameterBuffers::Pointers<const float>(buffers.device_params);
  const std::vector<float*> grads =
      ParameterBuffers::Pointers<float>(buffers.device_grads);

  TrainResult result;
  result.mode = mode;
  result.start_step = options.start_step;
  result.steps_per_epoch = steps_per_epoch;
  const bool have_test = test != nullptr && test->size() > 0;
  absl::Duration evaluation_time = absl::ZeroDuration();
  // Moved on by the start wait (TrainerOptions::await_job_start).
  absl::Time start = absl::Now();
  // Evaluates the parameters in backend memory; notes the first time the
  // target is reached (training time: evaluations left out).
  auto evaluate = [&](int64_t at_step) -> absl::StatusOr<BatchResult> {
    const absl::Time eval_start = absl::Now();
    absl::StatusOr<BatchResult> evaluation =
        Evaluate(model, backend, params, *test, options.batch_size, batch);
    if (!evaluation.ok()) return evaluation.status();
    const double accuracy =
        static_cast<double>(evaluation->num_correct) / evaluation->rows;
    // Only the evaluating worker times the target: the others see just the
    // final model, whose time says nothing about when the target was met.
    if (options.periodic_evaluation && options.target_accuracy > 0 &&
        result.step_to_target < 0 && accuracy >= options.target_accuracy) {
      result.step_to_target = at_step;
      result.time_to_target_s =
          absl::ToDoubleSeconds(eval_start - start - evaluation_time);
    }
    evaluation_time += absl::Now() - eval_start;
    return evaluation;
  };
  auto evaluation_due = [&](int64_t step) {
    if (!options.periodic_evaluation || !have_test) return false;
    return (options.eval_every_steps > 0 &&
            step % options.eval_every_steps == 0) ||
           (options.eval_every_epochs > 0 &&
            step % (options.eval_every_epochs * steps_per_epoch) == 0);
  };

  BatchResult window;
  int64_t last_evaluated_step = -1;
  BatchResult last_evaluation;
  // Its push thread only where it is used.
  std::optional<OverlappedPush> overlapped_push;
  if (options.overlap_push) {
    overlapped_push.emplace(client, backend, grads, buffers.host_grads);
  }
  BatchPrefetcher prefetcher(*plan, train, options.batch_size);
  int64_t step = options.start_step;
  if (step < options.steps) prefetcher.Prefetch(step);
  // Where the last step's PushPull left the model in backend memory (the
  // step it is at): this step needs no pull of its own.
  std::optional<int64_t> pulled_ahead;
  while (step < options.steps) {
    absl::Duration compute_time;
    absl::Time step_start = absl::Now();
    const bool await_start_after_push =
        options.await_job_start != nullptr && step == options.start_step;
    if (options.stop != nullptr && options.stop->load()) {
      result.stopped_early = true;
      break;
    }
    const absl::Time pull_start = absl::Now();
    absl::StatusOr<int64_t> at =
        pulled_ahead.has_value() ? absl::StatusOr<int64_t>(*pulled_ahead)
                                 : buffers.PullToDevice(client, step, backend);
    pulled_ahead.reset();
    if (!at.ok()) return at.status();
    const absl::Duration pull_time = absl::Now() - pull_start;
    if (*at > step) {  // the job went on without this worker: catch up
      result.steps_skipped += *at - step;
      step = *at;
      if (step >= options.steps) break;
    }
    if (step == options.crash_before_push_step) {
      CrashNow("before its push", step);
    }
    if (options.learning_rate_at) {
      client.SetGroupRates({options.learning_rate_at(step)});
    }
    // The step fixes the examples, so a worker that joins late or catches
    // up takes exactly the slice a single process would have used.
    const absl::Time compute_start = absl::Now();
    if (absl::Status s =
            prefetcher.Take(step, batch.host_features, batch.host_labels);
        !s.ok()) {
      return s;
    }
    absl::StatusOr<DeviceBatch> device_batch =
        batch.Upload(options.batch_size, train.num_features(), backend);
    if (!device_batch.ok()) return device_batch.status();
    if (step + 1 < options.steps) prefetcher.Prefetch(step + 1);
    absl::StatusOr<BatchResult> batch_result;
    absl::Duration push_time, push_wait;
    absl::StatusOr<PsClient::PushResult> pushed;
    if (overlapped_push.has_value()) {
      // Each tensor goes to the servers as backward issues its gradient;
      // the first error stops the reports (the step fails below).
      absl::Status ready_status;
      overlapped_push->Start(step);
      batch_result =
          model.ComputeGradients(params, *device_batch, grads, [&](int tensor) {
            if (ready_status.ok())
              ready_status = overlapped_push->Ready(tensor);
          });
      if (options.step_delay > absl::ZeroDuration()) {
        absl::SleepFor(options.step_delay);
      }
      const absl::Time wait_start = absl::Now();
      pushed = overlapped_push->Finish();
      push_wait = absl::Now() - wait_start;
      compute_time = wait_start - compute_start;
      push_time = overlapped_push->push_time();
      if (!batch_result.ok()) return batch_result.status();
      if (!ready_status.ok()) return ready_status;
    } else {
      batch_result = model.ComputeGradients(params, *device_batch, grads);
      if (!batch_result.ok()) return batch_result.status();
      if (absl::Status s = buffers.GradsToHost(backend); !s.ok()) return s;
      if (options.step_delay > absl::ZeroDuration()) {
        absl::SleepFor(options.step_delay);
      }
      const absl::Time push_start = absl::Now();
      compute_time = push_start - compute_start;
      if (options.push_pull && step + 1 < options.steps &&
          !await_start_after_push) {
        absl::StatusOr<PsClient::PushPullResult> done =
            buffers.PushPullToDevice(client, step, backend);
        if (!done.ok()) return done.status();
        pushed = done->pushed;
        pulled_ahead = done->pulled_step;
      } else {
        pushed = client.Push(step, buffers.push_from);
      }
      push_time = push_wait = absl::Now() - push_start;
    }
    if (!pushed.ok()) return pushed.status();
    if (await_start_after_push) {
      const absl::Time wait_start = absl::Now();
      if (absl::Status s = options.await_job_start(); !s.ok()) return s;
      const absl::Duration waited = absl::Now() - wait_start;
      start += waited;
      step_start += waited;
    }
    result.compute_seconds += absl::ToDoubleSeconds(compute_time);
    result.network_wait_seconds += absl::ToDoubleSeconds(pull_time + push_wait);
    if (step == options.crash_after_step) {
      CrashNow("after its exchange", step);
    }
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
    const absl::Time step_end = absl::Now();
    StepReport report;
    if (evaluation_due(step)) {
      // sync: the model after exactly `step` updates (waits for the other
      // workers' gradients); async: the servers' current model.
      // The PushPull that ended the step already brought that model.
      if (!pulled_ahead.has_value()) {
        const absl::Time eval_pull_start = absl::Now();
        absl::StatusOr<int64_t> pulled =
            buffers.PullToDevice(client, step, backend);
        if (!pulled.ok()) return pulled.status();
        evaluation_time += absl::Now() - eval_pull_start;
      }
      absl::StatusOr<BatchResult> evaluation = evaluate(step);
      if (!evaluation.ok()) return evaluation.status();
      ++result.evaluations;
      last_evaluated_step = step;
      last_evaluation = *evaluation;
      report.evaluated = true;
      report.test_loss = evaluation->loss_sum / evaluation->rows;
      report.test_accuracy =
          static_cast<double>(evaluation->num_correct) / evaluation->rows;
    }
    if (options.on_step) {
      report.step = step;
      report.steps = options.steps;
      report.loss = batch_result->loss_sum / batch_result->rows;
      report.train_accuracy =
          static_cast<double>(batch_result->num_correct) / batch_result->rows;
      report.examples = batch_result->rows;
      report.step_seconds = absl::ToDoubleSeconds(step_end - step_start);
      report.pull_seconds = absl::ToDoubleSeconds(pull_time);
      report.push_seconds = absl::ToDoubleSeconds(push_time);
      report.compute_seconds = absl::ToDoubleSeconds(compute_time);
      report.network_wait_seconds =
          absl::ToDoubleSeconds(pull_time + push_wait);
      report.epoch = step / steps_per_epoch;
      options.on_step(report);
    }
  }
  if (options.on_steps_done) options.on_steps_done();
  if (window.rows > 0) {
    result.final_loss = window.loss_sum / window.rows;
    result.train_accuracy =
        static_cast<double>(window.num_correct) / window.rows;
  }
  result.steps = options.steps;
  result.epochs = static_cast<double>(step) / steps_per_epoch;
  result.wall_time_s = absl::ToDoubleSeconds(absl::Now() - start);
  result.evaluation_seconds = absl::ToDoubleSeconds(evaluation_time);
  result.samples_per_sec =
      result.steps_run * options.batch_size /
      std::max(result.wall_time_s - result.evaluation_seconds, 1e-9);
  result.injected_duplicate_pushes = client.injected_duplicate_pushes();

  // The job's final model, then leave so nobody waits for this worker.
  if (mode == ConsistencyMode::kSync) {
    // Pull(steps) waits for every member's last gradient; a worker stopping
    // early takes the step it reached.
    absl::StatusOr<int64_t> final_step = buffers.PullToDevice(
        client, result.stopped_early ? step : options.steps, backend);
    if (!final_step.ok()) return final_step.status();
    // Every step this worker ran is complete now: count the short ones.
    absl::StatusOr<int64_t> steps_short = client.StepsShort();
    if (!steps_short.ok()) return steps_short.status();
    result.steps_short = *steps_short;
    if (absl::Status s = client.Leave(); !s.ok()) return s;
    result.final_model = "sync_step";
  } else {
    // Leave first: the others' wait below counts this worker as done. The
    // pull then goes through the observer, which does not rejoin the job.
    if (absl::Status s = client.Leave(); !s.ok()) return s;
    PsClient& reader = options.observer != nullptr ? *options.observer : client;
    result.final_model = reader.AwaitFinalModel(
        options.num_workers * options.steps, options.final_model_timeout);
    absl::StatusOr<int64_t> final_step =
        buffers.PullToDevice(reader, options.steps, backend);
    if (!final_step.ok()) return final_step.status();
  }
  if (have_test) {
    BatchResult evaluation;
    if (mode == ConsistencyMode::kSync &&
        last_evaluated_step == options.steps && !result.stopped_early) {
      evaluation = last_evaluation;  // the same model, evaluated already
    } else {
      absl::StatusOr<BatchResult> final_evaluation = evaluate(step);
      if (!final_evaluation.ok()) return final_evaluation.status();
      evaluation = *final_evaluation;
    }
    result.test_examples = evaluation.rows;
    result.test_loss = evaluation.loss_sum / evaluation.rows;
    result.test_accuracy =
        static_cast<double>(evaluation.num_correct) / evaluation.rows;
  }
  result.peak_rss_bytes = PeakRssBytes();
  return result;
}

std::string FinalJson(const TrainResult& r, int worker_id, int num_workers,
                      const std::string& device) {
  // Not reached (or no target): null, which a JSON reader keeps apart from 0.
  const std::string time_to_target =
      r.step_to_target < 0 ? "null"
                           : absl::StrFormat("%.3f", r.time_to_target_s);
  const std::string step_to_target =
      r.step_to_target < 0 ? "null" : absl::StrCat(r.step_to_target);
  return absl::StrFormat(
      "{\"event\":\"final\",\"mode\":\"%s\",\"worker_id\":%d,"
      "\"num_workers\":%d,\"device\":\"%s\",\"steps\":%d,"
      "\"epochs\":%.3f,\"steps_per_epoch\":%d,"
      "\"final_loss\":%.6f,\"train_accuracy\":%.4f,\"test_loss\":%.6f,"
      "\"test_accuracy\":%.4f,\"test_examples\":%d,\"final_model\":\"%s\","
      "\"time_to_target_s\":%s,\"step_to_target\":%s,\"evaluations\":%d,"
      "\"evaluation_s\":%.3f,\"samples_per_sec\":%.1f,"
      "\"wall_time_s\":%.3f,\"compute_s\":%.3f,\"network_wait_s\":%.3f,"
      "\"network_wait_share\":%.3f,\"peak_rss_mb\":%.1f,\"start_step\":%d,"
      "\"steps_run\":%d,"
      "\"steps_skipped\":%d,\"steps_short\":%d,"
      "\"duplicate_blocks\":%d,\"late_blocks\":%d,"
      "\"injected_duplicate_pushes\":%d,\"stopped_early\":%s,"
      "\"not_learning\":%s}",
      ConsistencyModeName(r.mode), worker_id, num_workers, device, r.steps,
      r.epochs, r.steps_per_epoch, r.final_loss, r.train_accuracy, r.test_loss,
      r.test_accuracy, r.test_examples, r.final_model, time_to_target,
      step_to_target, r.evaluations, r.evaluation_seconds, r.samples_per_sec,
      r.wall_time_s, r.compute_seconds, r.network_wait_seconds,
      r.network_wait_seconds /
          std::max(r.wall_time_s - r.evaluation_seconds, 1e-9),
      r.peak_rss_bytes / 1048576.0, r.start_step, r.steps_run, r.steps_skipped,
      r.steps_short, r.duplicate_blocks, r.late_blocks,
      r.injected_duplicate_pushes, r.stopped_early ? "true" : "false",
      r.not_learning ? "true" : "false");
}

}  // namespace pstrain
