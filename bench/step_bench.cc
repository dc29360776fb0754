// step_bench: the same training job on several backends: the exact CPU
// reference, the CPU with OpenBLAS, a GPU.
//
//   bazel run -c opt //bench:step_bench -- [--devices=cpu_reference,cpu,cuda:0]
//       [--hidden=1024,1024] [--batch_size=256] [--target_accuracy=0.9]
//   Fashion-MNIST-shaped (784 features, 10 classes) CNN:
//   bazel run -c opt //bench:step_bench -- --num_features=784
//       --num_classes=10 --model=layers --batch_size=128 --target_accuracy=0
//
// The job is the worker's model (worker/model.h: the MLP, or --model=layers
// with --layers, worker/layers.h) on the synthetic teacher task
// (worker/data.h), trained with plain SGD in this process: no parameter
// servers, so it measures compute alone (batch upload, forward, backward,
// update, and the one loss read-back per step), which is what the backend
// decides. Every backend starts from the same initial weights and sees the
// same batches, so their loss curves must agree to float tolerance; the
// largest relative difference is printed.
//
// Per backend: time per step (median of the timed steps, after warm-up),
// examples/s and, with --target_accuracy > 0, the training time (evaluation
// excluded) and steps until the held-out accuracy reaches it. Then the ratio
// CPU time / GPU time. Table, then one JSON line per backend and a summary.
// Without a GPU it measures the CPU alone and says why.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend.h"
#include "worker/data.h"
#include "worker/layers.h"
#include "worker/model.h"

ABSL_FLAG(std::string, devices, "cpu_reference,cpu,cuda:0",
          "Backends to compare, comma-separated (cpu_reference, cpu, auto, "
          "cuda:N); ratios are to the first. A GPU that is not there is "
          "reported and skipped.");
ABSL_FLAG(int, cpu_threads, 0,
          "Threads of the CPU GEMM (OpenBLAS); 0: every core this process may "
          "use.");
ABSL_FLAG(std::string, model, "mlp", "mlp (--hidden) or layers (--layers).");
ABSL_FLAG(std::string, layers,
          "conv:16:3,relu,maxpool:2,conv:32:3,relu,maxpool:2,flatten,dense:64,"
          "relu,dense:10",
          "With --model=layers: the layer list (worker/layers.h).");
ABSL_FLAG(std::string, input_shape, "",
          "With --model=layers: HxWxC of one example (empty: inferred).");
ABSL_FLAG(std::string, precision, "fp32",
          "GEMM precision of the GPU backends: fp32 or bf16.");
ABSL_FLAG(std::string, hidden, "1024,1024", "Hidden layer sizes.");
ABSL_FLAG(int64_t, num_features, 64, "Input features.");
ABSL_FLAG(int64_t, num_classes, 4, "Classes.");
ABSL_FLAG(int64_t, batch_size, 256, "Examples per step.");
ABSL_FLAG(int64_t, warmup_steps, 3, "Untimed steps first.");
ABSL_FLAG(int64_t, steps, 30, "Timed steps per backend.");
ABSL_FLAG(double, learning_rate, 0.1, "SGD learning rate.");
ABSL_FLAG(double, target_accuracy, 0.9,
          "Also train from scratch until the held-out accuracy reaches this "
          "(0: skip). The synthetic task's best is printed.");
ABSL_FLAG(int64_t, max_steps_to_target, 2000,
          "Give up on the target after this many steps.");
ABSL_FLAG(int64_t, eval_every, 25, "Steps between held-out evaluations.");
ABSL_FLAG(int64_t, train_examples, 65536, "Synthetic training examples.");
ABSL_FLAG(int64_t, test_examples, 4096, "Synthetic held-out examples.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the data and the initial weights.");

namespace pstrain {
namespace {

using kernels::Backend;
using kernels::DeviceArray;
using Clock = std::chrono::steady_clock;

void Check(const absl::Status& status, const std::string& what) {
  if (!status.ok()) {
    std::fprintf(stderr, "step_bench: %s: %s\n", what.c_str(),
                 status.ToString().c_str());
    std::exit(1);
  }
}

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Initial weights from the schema's init specs, drawn on the host from the
// seed: identical for every backend.
std::vector<std::vector<float>> InitialParams(const Model& model,
                                              uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<float>> params;
  for (const DenseTensorSpec& spec : model.Params()) {
    int64_t n = 1;
    for (int64_t d : spec.shape()) n *= d;
    std::vector<float> values(n, 0.0f);
    const InitSpec& init = spec.init();
    switch (init.kind()) {
      case InitSpec::UNIFORM: {
        std::uniform_real_distribution<float> dist(-init.scale(), init.scale());
        for (float& v : values) v = dist(rng);
        break;
      }
      case InitSpec::NORMAL: {
        std::normal_distribution<float> dist(0.0f, init.scale());
        for (float& v : values) v = dist(rng);
        break;
      }
      case InitSpec::CONSTANT:
        std::fill(values.begin(), values.end(), init.value());
        break;
      default:
        break;  // zeros
    }
    params.push_back(std::move(values));
  }
  return params;
}

struct Job {
  Dataset train, test;
  std::vector<int64_t> hidden;
};

struct Result {
  std::string device;
  std::string name;
  double step_seconds = 0;  // median
  double examples_per_second = 0;
  std::vector<double> losses;  // mean loss of each timed step
  double seconds_to_target = -1;
  int64_t steps_to_target = -1;
  double final_accuracy = 0;
};

// A model and its parameters, gradients and batch buffers on one backend.
class Trainer {
 public:
  Trainer(Backend* backend, const Job& job) : backend_(backend), job_(job) {
    const int64_t batch = absl::GetFlag(FLAGS_batch_size);
    absl::StatusOr<std::unique_ptr<Model>> model =
        absl::GetFlag(FLAGS_model) == "layers"
            ? CreateLayerModelFromFlags(backend, absl::GetFlag(FLAGS_layers),
                                        absl::GetFlag(FLAGS_input_shape),
                                        job.train.num_features,
                                        job.train.num_classes, batch)
            : CreateMlp(backend, job.train.num_features, job.hidden,
                        job.train.num_classes, batch);
    Check(model.status(), "creating the model");
    model_ = *std::move(model);
    for (const DenseTensorSpec& spec : model_->Params()) {
      int64_t n = 1;
      for (int64_t d : spec.shape()) n *= d;
      params_.push_back(Make<float>(n));
      grads_.push_back(Make<float>(n));
    }
    features_ = Make<float>(batch * job.train.num_features);
    labels_ = Make<int32_t>(batch);
    host_features_.resize(batch * job.train.num_features);
    host_labels_.resize(batch);
  }

  void Reset(uint64_t seed) {
    const std::vector<std::vector<float>> init = InitialParams(*model_, seed);
    for (size_t i = 0; i < init.size(); ++i) {
      Check(backend_->CopyToDevice(init[i].data(), params_[i].data(),
                                   params_[i].bytes()),
            "CopyToDevice");
    }
    cursor_ = BatchCursor(&job_.train);
  }

  // One SGD step; returns the batch's mean loss.
  double Step() {
    const int64_t batch = absl::GetFlag(FLAGS_batch_size);
    cursor_.Next(batch, host_features_.data(), host_labels_.data());
    Check(backend_->CopyToDevice(host_features_.data(), features_.data(),
                                 features_.bytes()),
          "CopyToDevice");
    Check(backend_->CopyToDevice(host_labels_.data(), labels_.data(),
                                 labels_.bytes()),
          "CopyToDevice");
    absl::StatusOr<BatchResult> result = model_->ComputeGradients(
        ConstPointers(), DeviceBatch{batch, features_.data(), labels_.data()},
        GradPointers());
    Check(result.status(), "ComputeGradients");
    const float lr = static_cast<float>(absl::GetFlag(FLAGS_learning_rate));
    for (size_t i = 0; i < params_.size(); ++i) {
      Check(backend_->Axpy(params_[i].size(), -lr, grads_[i].data(),
                           params_[i].data()),
            "Axpy");
    }
    return result->loss_sum / result->rows;
  }

  // Waits for the last step's update to finish (steps are otherwise
  // asynchronous after their loss read-back).
  void Sync() { Check(backend_->Synchronize(), "Synchronize"); }

  double TestAccuracy() {
    const int64_t batch = absl::GetFlag(FLAGS_batch_size);
    const Dataset& test = job_.test;
    int64_t correct = 0;
    for (int64_t first = 0; first < test.size(); first += batch) {
      const int64_t rows = std::min(batch, test.size() - first);
      Check(backend_->CopyToDevice(
                test.features.data() + first * test.num_features,
                features_.data(), rows * test.num_features * sizeof(float)),
            "CopyToDevice");
      Check(backend_->CopyToDevice(test.labels.data() + first, labels_.data(),
                                   rows * sizeof(int32_t)),
            "CopyToDevice");
      absl::StatusOr<BatchResult> result = model_->Evaluate(
          ConstPointers(), DeviceBatch{rows, features_.data(), labels_.data()});
      Check(result.status(), "Evaluate");
      correct += result->num_correct;
    }
    return static_cast<double>(correct) / std::max<int64_t>(test.size(), 1);
  }

 private:
  template <typename T>
  DeviceArray<T> Make(int64_t n) {
    absl::StatusOr<DeviceArray<T>> array = DeviceArray<T>::Create(backend_, n);
    Check(array.status(), "Allocate");
    return *std::move(array);
  }

  std::vector<const float*> ConstPointers() const {
    std::vector<const float*> out;
    for (const auto& p : params_) out.push_back(p.data());
    return out;
  }

  std::vector<float*> GradPointers() const {
    std::vector<float*> out;
    for (const auto& g : grads_) out.push_back(g.data());
    return out;
  }

  Backend* backend_;
  const Job& job_;
  std::unique_ptr<Model> model_;
  std::vector<DeviceArray<float>> params_, grads_;
  DeviceArray<float> features_;
  DeviceArray<int32_t> labels_;
  std::vector<float> host_features_;
  std::vector<int32_t> host_labels_;
  BatchCursor cursor_{nullptr};
};

Result Measure(const std::string& device, Backend* backend, const Job& job) {
  Result result;
  result.device = device;
  result.name = backend->Name();
  Trainer trainer(backend, job);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  trainer.Reset(seed);
  for (int64_t i = 0; i < absl::GetFlag(FLAGS_warmup_steps); ++i) {
    trainer.Step();
  }
  trainer.Sync();
  // The curve compared across backends starts from the initial weights.
  trainer.Reset(seed);
  std::vector<double> times;
  for (int64_t i = 0; i < absl::GetFlag(FLAGS_steps); ++i) {
    const Clock::time_point start = Clock::now();
    result.losses.push_back(trainer.Step());
    // Each step already waited for its loss; this adds the tail (the
    // weight update) so that a step's time covers all of its work.
    trainer.Sync();
    times.push_back(Seconds(start));
  }
  std::sort(times.begin(), times.end());
  result.step_seconds = times.empty() ? 0 : times[times.size() / 2];
  result.examples_per_second =
      absl::GetFlag(FLAGS_batch_size) / std::max(result.step_seconds, 1e-12);

  const double target = absl::GetFlag(FLAGS_target_accuracy);
  if (target > 0) {
    trainer.Reset(seed);
    double train_seconds = 0;
    const int64_t eval_every =
        std::max<int64_t>(1, absl::GetFlag(FLAGS_eval_every));
    for (int64_t step = 1; step <= absl::GetFlag(FLAGS_max_steps_to_target);
         ++step) {
      const Clock::time_point start = Clock::now();
      trainer.Step();
      if (step % eval_every == 0) trainer.Sync();
      train_seconds += Seconds(start);
      if (step % eval_every == 0) {
        result.final_accuracy = trainer.TestAccuracy();
        if (result.final_accuracy >= target) {
          result.seconds_to_target = train_seconds;
          result.steps_to_target = step;
          break;
        }
      }
    }
  }
  return result;
}

// The --hidden widths; false after naming the bad entry.
bool ParseHidden(std::vector<int64_t>* hidden) {
  for (absl::string_view width :
       absl::StrSplit(absl::GetFlag(FLAGS_hidden), ',', absl::SkipEmpty())) {
    int64_t w;
    if (!absl::SimpleAtoi(width, &w) || w < 1) {
      std::fprintf(stderr, "step_bench: bad --hidden entry '%s'\n",
                   std::string(width).c_str());
      return false;
    }
    hidden->push_back(w);
  }
  return true;
}

SyntheticOptions SyntheticFromFlags() {
  SyntheticOptions synthetic;
  synthetic.num_features = absl::GetFlag(FLAGS_num_features);
  synthetic.num_classes = absl::GetFlag(FLAGS_num_classes);
  synthetic.seed = absl::GetFlag(FLAGS_seed);
  return synthetic;
}

// The training set and, right after it in the same example stream, the
// held-out set: disjoint, and the same for every backend.
void MakeData(const SyntheticOptions& synthetic, Job* job) {
  const int64_t train_examples = absl::GetFlag(FLAGS_train_examples);
  absl::StatusOr<Dataset> train =
      MakeSyntheticClassification(synthetic, 0, train_examples, {});
  Check(train.status(), "training data");
  absl::StatusOr<Dataset> test = MakeSyntheticClassification(
      synthetic, train_examples, absl::GetFlag(FLAGS_test_examples), {});
  Check(test.status(), "held-out data");
  job->train = *std::move(train);
  job->test = *std::move(test);
}

// Every --devices entry that can be created, in order (the first is what
// the others are compared with). A GPU that is not there is skipped, so
// the same command line works on a host without one.
std::vector<Result> MeasureDevices(const Job& job) {
  std::vector<Result> results;
  for (absl::string_view device_view :
       absl::StrSplit(absl::GetFlag(FLAGS_devices), ',', absl::SkipEmpty())) {
    const std::string device(device_view);
    kernels::BackendOptions options;
    options.device = device;
    options.precision = absl::StartsWith(device, "cpu")
                            ? "fp32"
                            : absl::GetFlag(FLAGS_precision);
    options.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
    absl::StatusOr<std::unique_ptr<Backend>> backend =
        kernels::CreateBackend(options);
    if (!backend.ok()) {
      if (backend.status().code() == absl::StatusCode::kUnavailable) {
        std::printf("step_bench: skipping %s: %s\n", device.c_str(),
                    std::string(backend.status().message()).c_str());
        continue;
      }
      Check(backend.status(), device);
    }
    std::printf("step_bench: measuring %s ...\n", (*backend)->Name().c_str());
    std::fflush(stdout);
    results.push_back(Measure(device, backend->get(), job));
  }
  return results;
}

void PrintTable(const std::vector<Result>& results) {
  std::printf("\n%-40s %12s %12s %14s %10s %9s\n", "backend", "ms/step",
              "examples/s", "s to target", "steps", "test acc");
  for (const Result& r : results) {
    const bool reached = r.steps_to_target >= 0;
    const bool tried = absl::GetFlag(FLAGS_target_accuracy) > 0;
    std::printf(
        "%-40s %12.3f %12.0f %14s %10s %9s\n", r.name.c_str(),
        r.step_seconds * 1e3, r.examples_per_second,
        reached ? absl::StrFormat("%.2f", r.seconds_to_target).c_str()
                : (tried ? "not reached" : "-"),
        reached ? absl::StrCat(r.steps_to_target).c_str() : "-",
        tried ? absl::StrFormat("%.3f", r.final_accuracy).c_str() : "-");
  }
}

// Each backend against the first: the speed ratios, and how far its loss
// curve strays from the first's (they must agree, or the faster backend
// is not computing the same thing).
void PrintComparisons(const std::vector<Result>& results) {
  const Result& base = results.front();
  for (size_t i = 1; i < results.size(); ++i) {
    const Result& r = results[i];
    double worst = 0;
    for (size_t s = 0; s < std::min(base.losses.size(), r.losses.size()); ++s) {
      worst = std::max(worst, std::fabs(r.losses[s] - base.losses[s]) /
                                  std::max(std::fabs(base.losses[s]), 1e-12));
    }
    std::printf(
        "%s vs %s: step time ratio %.2fx; loss curves over %zu steps differ "
        "by at most %.2e (relative)\n",
        base.name.c_str(), r.name.c_str(),
        base.step_seconds / std::max(r.step_seconds, 1e-12), r.losses.size(),
        worst);
    if (base.seconds_to_target > 0 && r.seconds_to_target > 0) {
      std::printf("%s vs %s: time-to-target ratio %.2fx\n", base.name.c_str(),
                  r.name.c_str(), base.seconds_to_target / r.seconds_to_target);
    }
  }
  if (results.size() == 1) {
    std::printf(
        "(one backend only: no ratio; run on a host with a GPU for "
        "the comparison)\n");
  }
}

void PrintJson(const std::vector<Result>& results,
               const std::string& description) {
  const Result& base = results.front();
  for (const Result& r : results) {
    std::printf(
        "{\"bench\":\"step\",\"device\":\"%s\",\"backend\":\"%s\","
        "\"model\":\"%s\",\"batch_size\":%lld,\"ms_per_step\":%.4f,"
        "\"examples_per_s\":%.1f,\"speedup_vs_%s\":%.3f,"
        "\"seconds_to_target\":%.3f,\"steps_to_target\":%lld,"
        "\"target_accuracy\":%.4f,\"test_accuracy\":%.4f,"
        "\"final_loss\":%.6f}\n",
        r.device.c_str(), r.name.c_str(), description.c_str(),
        static_cast<long long>(absl::GetFlag(FLAGS_batch_size)),
        r.step_seconds * 1e3, r.examples_per_second, base.device.c_str(),
        base.step_seconds / std::max(r.step_seconds, 1e-12),
        r.seconds_to_target, static_cast<long long>(r.steps_to_target),
        absl::GetFlag(FLAGS_target_accuracy), r.final_accuracy,
        r.losses.empty() ? 0.0 : r.losses.back());
  }
}

int Run() {
  Job job;
  if (!ParseHidden(&job.hidden)) return 1;
  const SyntheticOptions synthetic = SyntheticFromFlags();
  MakeData(synthetic, &job);

  const bool layers = absl::GetFlag(FLAGS_model) == "layers";
  if (!layers && absl::GetFlag(FLAGS_model) != "mlp") {
    std::fprintf(stderr, "step_bench: --model must be mlp or layers\n");
    return 2;
  }
  const std::string description =
      layers ? absl::StrCat("layers ", absl::GetFlag(FLAGS_layers))
             : absl::StrCat("MLP hidden [", absl::GetFlag(FLAGS_hidden), "]");
  std::printf(
      "step_bench: %lld features -> %s -> %lld classes, batch %lld, SGD lr "
      "%g; synthetic task, best achievable accuracy %.3f\n",
      static_cast<long long>(synthetic.num_features), description.c_str(),
      static_cast<long long>(synthetic.num_classes),
      static_cast<long long>(absl::GetFlag(FLAGS_batch_size)),
      absl::GetFlag(FLAGS_learning_rate), SyntheticBestAccuracy(synthetic));

  const std::vector<Result> results = MeasureDevices(job);
  if (results.empty()) {
    std::fprintf(stderr, "step_bench: no backend could be measured\n");
    return 1;
  }
  PrintTable(results);
  PrintComparisons(results);
  std::printf("\n");
  PrintJson(results, description);
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Times the worker's training step on the CPU and GPU backends.");
  absl::ParseCommandLine(argc, argv);
  return pstrain::Run();
}
