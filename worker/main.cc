// worker: trains a model against the parameter servers.
//
//   worker --ps_hosts=ps0:5000,ps1:5000 --worker_id=0 --num_workers=4
//          --model=mlp --hidden=128,64 --steps=1000 --batch_size=64
//
// Prints a progress line every --log_every steps and, at the end, one JSON
// line ({"event":"final",...}) with the held-out evaluation.
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "common/protocol.h"
#include "glog/logging.h"
#include "kernels/backend.h"
#include "worker/data.h"
#include "worker/model.h"
#include "worker/ps_client.h"
#include "worker/trainer.h"

ABSL_FLAG(std::string, ps_hosts, "",
          "Comma-separated host:port of every ps_server, in shard order.");
ABSL_FLAG(int, worker_id, 0, "This worker's index, in [0, num_workers).");
ABSL_FLAG(int, num_workers, 1, "Number of workers in the job.");
ABSL_FLAG(std::string, device, "auto", "Compute device: auto, cpu or cuda:N.");
ABSL_FLAG(std::string, precision, "fp32",
          "GEMM precision: fp32, or bf16 (bf16 inputs, fp32 accumulation; "
          "needs a CUDA device).");
ABSL_FLAG(std::string, model, "mlp",
          "softmax (multinomial logistic regression), mlp, or probe (a "
          "diagnostic whose gradient is exactly 1: with SGD at learning rate "
          "1 every weight ends at minus the number of updates applied).");
ABSL_FLAG(int64_t, probe_elements, 1000, "Size of the probe model's tensor.");
ABSL_FLAG(std::string, hidden, "64",
          "Hidden layer sizes of the mlp, comma-separated.");
ABSL_FLAG(int64_t, steps, 300, "Training steps.");
ABSL_FLAG(int64_t, batch_size, 64, "Examples per step on this worker.");
ABSL_FLAG(int64_t, log_every, 50, "Steps between progress lines (0: none).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the initial model and synthetic data.");
ABSL_FLAG(int64_t, block_elements, 1 << 17,
          "Dense tensors are cut into blocks of this many floats: the unit of "
          "transfer (one RPC carries about one block) and of consistency.");
ABSL_FLAG(std::string, data, "synthetic",
          "Training data: synthetic, csv or libsvm.");
ABSL_FLAG(std::string, train_file, "", "Training file (csv/libsvm).");
ABSL_FLAG(std::string, test_file, "", "Held-out file (csv/libsvm).");
ABSL_FLAG(int64_t, num_features, 32,
          "Input features (synthetic; for files 0 infers it).");
ABSL_FLAG(int64_t, num_classes, 4, "Number of classes.");
ABSL_FLAG(double, label_noise, 0.05, "Synthetic: share of random labels.");
ABSL_FLAG(int64_t, train_examples, 32768,
          "Synthetic: training examples in the whole job.");
ABSL_FLAG(int64_t, test_examples, 4096, "Synthetic: held-out examples.");
ABSL_FLAG(double, rpc_timeout_s, 120,
          "Deadline of each pull/push (a sync pull waits for all workers).");
ABSL_FLAG(double, connect_timeout_s, 60,
          "How long to wait for the servers to come up.");
ABSL_FLAG(int, max_message_mb, pstrain::kDefaultMaxMessageBytes >> 20,
          "Largest message sent or received, in MiB.");
ABSL_FLAG(int, connections_per_shard, 4,
          "TCP connections to each ps_server; a shard's RPCs are spread over "
          "them.");
ABSL_FLAG(double, heartbeat_interval_s, 2,
          "How often to renew this worker's lease on the servers (keep it "
          "well under their --worker_lease_s).");
ABSL_FLAG(double, retry_window_s, 120,
          "How long a failed pull or push is retried (server restarting, "
          "peers slow) before the worker gives up.");
ABSL_FLAG(double, inject_duplicate_push_probability, 0,
          "Fault injection: resend a successful push with this probability "
          "(the servers must not apply it twice).");
ABSL_FLAG(int64_t, inject_step_delay_ms, 0,
          "Fault injection: make every step this much slower (a straggler).");
ABSL_FLAG(std::string, gradient_wire_type, "fp32",
          "Gradients on the wire: fp32, or fp16/bf16 to halve the bytes "
          "(servers decode to fp32).");

namespace pstrain {
namespace {

absl::Status CheckAtLeast(const char* flag, double value, double minimum) {
  if (value >= minimum) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be >= ", minimum, ", got ", value));
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

struct Data {
  Dataset train, test;
};

absl::StatusOr<Data> LoadData(ShardSpec shard) {
  const std::string source = absl::GetFlag(FLAGS_data);
  const int64_t num_classes = absl::GetFlag(FLAGS_num_classes);
  Data data;
  if (source == "synthetic") {
    SyntheticOptions options;
    options.num_features = absl::GetFlag(FLAGS_num_features);
    options.num_classes = num_classes;
    options.label_noise = absl::GetFlag(FLAGS_label_noise);
    options.seed = absl::GetFlag(FLAGS_seed);
    const int64_t train_examples = absl::GetFlag(FLAGS_train_examples);
    absl::StatusOr<Dataset> train =
        MakeSyntheticClassification(options, 0, train_examples, shard);
    if (!train.ok()) return train.status();
    absl::StatusOr<Dataset> test = MakeSyntheticClassification(
        options, train_examples, absl::GetFlag(FLAGS_test_examples), {0, 1});
    if (!test.ok()) return test.status();
    LOG(INFO) << "synthetic task: best achievable accuracy "
              << SyntheticBestAccuracy(options);
    data.train = std::move(*train);
    data.test = std::move(*test);
    return data;
  }
  auto read = [&](const std::string& path, ShardSpec s,
                  int64_t features) -> absl::StatusOr<Dataset> {
    if (source == "csv") return ReadCsv(path, features, num_classes, s);
    return ReadLibsvm(path, features, num_classes, s);
  };
  const std::string train_file = absl::GetFlag(FLAGS_train_file);
  absl::StatusOr<Dataset> train =
      read(train_file, shard, absl::GetFlag(FLAGS_num_features));
  if (!train.ok()) return train.status();
  data.train = std::move(*train);
  const std::string test_file = absl::GetFlag(FLAGS_test_file);
  if (!test_file.empty()) {
    absl::StatusOr<Dataset> test =
        read(test_file, {0, 1}, data.train.num_features);
    if (!test.ok()) return test.status();
    data.test = std::move(*test);
  }
  return data;
}

int Main() {
  const int worker_id = absl::GetFlag(FLAGS_worker_id);
  const int num_workers = absl::GetFlag(FLAGS_num_workers);
  const std::string model_name = absl::GetFlag(FLAGS_model);
  const std::string source = absl::GetFlag(FLAGS_data);
  std::vector<absl::Status> checks;
  if (absl::GetFlag(FLAGS_ps_hosts).empty()) {
    checks.push_back(absl::InvalidArgumentError(
        "--ps_hosts is required (host:port of every ps_server)"));
  }
  checks.push_back(CheckAtLeast("num_workers", num_workers, 1));
  if (worker_id < 0 || worker_id >= num_workers) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--worker_id must be in [0, --num_workers=", num_workers,
                     "), got ", worker_id)));
  }
  if (model_name != "softmax" && model_name != "mlp" && model_name != "probe") {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--model must be softmax, mlp or probe, got '", model_name, "'")));
  }
  checks.push_back(CheckAtLeast("heartbeat_interval_s",
                                absl::GetFlag(FLAGS_heartbeat_interval_s), 0));
  checks.push_back(
      CheckAtLeast("retry_window_s", absl::GetFlag(FLAGS_retry_window_s), 0));
  checks.push_back(CheckAtLeast("inject_step_delay_ms",
                                absl::GetFlag(FLAGS_inject_step_delay_ms), 0));
  const double duplicate_probability =
      absl::GetFlag(FLAGS_inject_duplicate_push_probability);
  if (!(duplicate_probability >= 0 && duplicate_probability <= 1)) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--inject_duplicate_push_probability must be in [0, 1], "
                     "got ",
                     duplicate_probability)));
  }
  absl::StatusOr<std::vector<int64_t>> hidden =
      ParseHidden(absl::GetFlag(FLAGS_hidden));
  checks.push_back(hidden.status());
  if (source != "synthetic" && source != "csv" && source != "libsvm") {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--data must be synthetic, csv or libsvm, got '", source, "'")));
  }
  if (source != "synthetic" && absl::GetFlag(FLAGS_train_file).empty()) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--data=", source, " needs --train_file")));
  }
  checks.push_back(CheckAtLeast("steps", absl::GetFlag(FLAGS_steps), 1));
  checks.push_back(
      CheckAtLeast("batch_size", absl::GetFlag(FLAGS_batch_size), 1));
  checks.push_back(
      CheckAtLeast("log_every", absl::GetFlag(FLAGS_log_every), 0));
  checks.push_back(
      CheckAtLeast("block_elements", absl::GetFlag(FLAGS_block_elements), 1));
  checks.push_back(
      CheckAtLeast("num_classes", absl::GetFlag(FLAGS_num_classes), 2));
  checks.push_back(
      CheckAtLeast("rpc_timeout_s", absl::GetFlag(FLAGS_rpc_timeout_s), 0.001));
  checks.push_back(CheckAtLeast("connect_timeout_s",
                                absl::GetFlag(FLAGS_connect_timeout_s), 0.001));
  const int max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  if (max_message_mb < 1 || max_message_mb > 2047) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--max_message_mb must be in [1, 2047], got ", max_message_mb)));
  }
  PsClientOptions client_options;
  client_options.hosts = absl::StrSplit(absl::GetFlag(FLAGS_ps_hosts), ',');
  client_options.rpc_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_rpc_timeout_s));
  client_options.connect_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s));
  client_options.max_message_bytes = max_message_mb << 20;
  client_options.connections_per_shard =
      absl::GetFlag(FLAGS_connections_per_shard);
  client_options.heartbeat_interval =
      absl::Seconds(absl::GetFlag(FLAGS_heartbeat_interval_s));
  client_options.retry_window =
      absl::Seconds(absl::GetFlag(FLAGS_retry_window_s));
  client_options.inject_duplicate_push_probability = duplicate_probability;
  const std::string wire_type = absl::GetFlag(FLAGS_gradient_wire_type);
  if (wire_type == "fp32") {
    client_options.gradient_wire_type = FLOAT32;
  } else if (wire_type == "fp16") {
    client_options.gradient_wire_type = FLOAT16;
  } else if (wire_type == "bf16") {
    client_options.gradient_wire_type = BFLOAT16;
  } else {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--gradient_wire_type must be fp32, fp16 or bf16, got '",
                     wire_type, "'")));
  }
  absl::StatusOr<std::unique_ptr<PsClient>> client =
      PsClient::Create(client_options);
  if (!absl::GetFlag(FLAGS_ps_hosts).empty()) checks.push_back(client.status());
  ExitOnFlagErrors(checks);
  // Checked one at a time from here: each may log or do real work.
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::CreateBackend(kernels::BackendOptions{
          absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_precision)});
  ExitOnFlagErrors({backend.status()});
  absl::StatusOr<Data> data = LoadData({worker_id, num_workers});
  ExitOnFlagErrors({data.status()});
  LOG(INFO) << "worker " << worker_id << "/" << num_workers << " on "
            << (*backend)->Name() << ": " << data->train.size()
            << " training examples in this shard, " << data->test.size()
            << " held out";

  const int64_t batch_size = absl::GetFlag(FLAGS_batch_size);
  absl::StatusOr<std::unique_ptr<Model>> model =
      model_name == "probe"
          ? CreateProbeModel(backend->get(),
                             absl::GetFlag(FLAGS_probe_elements))
          : CreateMlp(
                backend->get(), data->train.num_features,
                model_name == "softmax" ? std::vector<int64_t>{} : *hidden,
                absl::GetFlag(FLAGS_num_classes), batch_size);
  if (!model.ok()) {
    LOG(ERROR) << "cannot build the model: " << model.status();
    return 1;
  }
  ModelSchema schema;
  schema.set_seed(absl::GetFlag(FLAGS_seed));
  schema.set_block_elements(absl::GetFlag(FLAGS_block_elements));
  for (const DenseTensorSpec& spec : (*model)->Params()) {
    *schema.add_dense() = spec;
  }
  absl::StatusOr<Registration> registration =
      (*client)->Register(schema, num_workers, worker_id);
  if (!registration.ok()) {
    LOG(ERROR) << "cannot register the model: " << registration.status();
    return 1;
  }
  if (registration->start_step > 0) {
    LOG(INFO) << "joining a running job at step " << registration->start_step;
  }

  TrainerOptions options;
  options.worker_id = worker_id;
  options.num_workers = num_workers;
  options.steps = absl::GetFlag(FLAGS_steps);
  options.batch_size = batch_size;
  const int64_t log_every = absl::GetFlag(FLAGS_log_every);
  double window_examples = 0, window_seconds = 0, window_loss = 0;
  int64_t window_correct_steps = 0;
  double window_accuracy = 0;
  options.on_step = [&](const StepReport& r) {
    window_examples += r.examples;
    window_seconds += r.step_seconds;
    window_loss += r.loss;
    window_accuracy += r.train_accuracy;
    ++window_correct_steps;
    if (log_every <= 0 || (r.step % log_every != 0 && r.step != r.steps)) {
      return;
    }
    std::printf(
        "worker %d step %lld/%lld loss %.4f train_acc %.3f samples/s %.0f\n",
        worker_id, static_cast<long long>(r.step),
        static_cast<long long>(r.steps), window_loss / window_correct_steps,
        window_accuracy / window_correct_steps,
        window_examples / std::max(window_seconds, 1e-9));
    std::fflush(stdout);
    window_examples = window_seconds = window_loss = window_accuracy = 0;
    window_correct_steps = 0;
  };
  options.start_step = registration->start_step;
  // SIGTERM/SIGINT: finish the step in hand, leave the job, report.
  static std::atomic<bool> stop_requested{false};
  std::thread([] {
    const int signal_number = WaitForTerminationSignal();
    LOG(INFO) << "signal " << signal_number
              << ": stopping after this step and leaving the job";
    stop_requested = true;
  }).detach();
  options.stop = &stop_requested;
  options.step_delay =
      absl::Milliseconds(absl::GetFlag(FLAGS_inject_step_delay_ms));
  absl::StatusOr<TrainResult> result =
      Train(options, registration->mode, **client, **model, **backend,
            data->train, data->test);
  if (!result.ok()) {
    LOG(ERROR) << "training failed: " << result.status();
    return 1;
  }
  std::printf(
      "%s\n",
      FinalJson(*result, worker_id, num_workers, (*backend)->Name()).c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  pstrain::InitProgram(argc, argv,
                       "worker: trains a model against the parameter servers");
  // Before any thread starts, so signals reach only the waiting thread.
  pstrain::BlockTerminationSignals();
  return pstrain::Main();
}
