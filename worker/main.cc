// worker: trains a model against the parameter servers.
//
//   worker --ps_hosts=ps0:5000,ps1:5000 --worker_id=0 --num_workers=4
//          --model=mlp --hidden=128,64 --steps=1000 --batch_size=64
//   worker --cluster_spec=job.json --worker_id=3 --metrics_csv=run.csv
//   worker --ps_hosts=... --data=fashion_mnist --epochs=15
//          --global_batch_size=128 --hidden=256,128 --eval_every_epochs=1
//
// Shows a progress bar on a terminal, or prints a progress line every
// --log_every steps otherwise, and at the end one JSON line
// ({"event":"final",...}) with the held-out evaluation. Optionally serves
// Prometheus metrics (--metrics_port) and writes one CSV row per step
// (--metrics_csv).
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/cli.h"
#include "common/cluster_spec.h"
#include "common/connection_check.h"
#include "common/grpc_tuning.h"
#include "common/metrics.h"
#include "common/protocol.h"
#include "common/run_output.h"
#include "common/status_text.h"
#include "common/tensor_codec.h"
#include "common/tls.h"
#include "common/tls_stream.h"
#include "glog/logging.h"
#include "kernels/backend.h"
#include "worker/connect_wait.h"
#include "worker/ctr_main.h"
#include "worker/data.h"
#include "worker/eval_only.h"
#include "worker/idx_data.h"
#include "worker/layers.h"
#include "worker/learning_watch.h"
#include "worker/model.h"
#include "worker/ps_client.h"
#include "worker/signal_watch.h"
#include "worker/step_output.h"
#include "worker/trainer.h"

ABSL_FLAG(std::string, cluster_spec, "",
          "JSON file describing the job ({\"ps\": [host:port...], "
          "\"workers\": N, \"max_workers\": M, \"task\": {\"type\": "
          "\"worker\", \"index\": i}, \"worker_flags\": {flag: value...}}); "
          "it sets --ps_hosts, --worker_id, --num_workers and the "
          "worker_flags unless given on the command line. Empty: the JSON in "
          "$PSTRAIN_CLUSTER, if set.");
ABSL_FLAG(std::string, ps_hosts, "",
          "Comma-separated host:port of every ps_server, in shard order.");
ABSL_FLAG(int, worker_id, 0, "This worker's index, in [0, num_workers).");
ABSL_FLAG(int, num_workers, 1, "Number of workers in the job.");
ABSL_FLAG(std::string, device, "auto",
          "Compute device: auto, cpu (GEMMs through OpenBLAS), cpu_reference "
          "(the exact CPU kernels the tests compare against) or cuda:N.");
ABSL_FLAG(std::string, precision, "fp32",
          "GEMM precision: fp32, or bf16 (bf16 inputs, fp32 accumulation; "
          "needs a CUDA device).");
ABSL_FLAG(std::string, model, "mlp",
          "softmax (multinomial logistic regression), mlp, probe (a "
          "diagnostic whose gradient is exactly 1: with SGD at learning rate "
          "1 every weight ends at minus the number of updates applied), or "
          "ctr (sparse embedding tables on the servers; see the --ctr_* "
          "flags), or layers (a model described by --layers, e.g. a CNN).");
ABSL_FLAG(int64_t, probe_elements, 1000, "Size of the probe model's tensor.");
// --model=layers (worker/layers.h has the grammar).
ABSL_FLAG(std::string, layers,
          "conv:16:3,relu,maxpool:2,conv:32:3,relu,maxpool:2,flatten,dense:64,"
          "relu,dense:10",
          "With --model=layers: the layer list, comma-separated: "
          "conv:OUT:K[:STRIDE[:PAD]], maxpool:K[:STRIDE], relu, flatten, "
          "dense:N; the last must output --num_classes values.");
ABSL_FLAG(std::string, input_shape, "",
          "With --model=layers: one example's HxWxC (NHWC), e.g. 28x28x1. "
          "Empty: a square 1-channel image when the feature count is a "
          "perfect square (784 -> 28x28x1), else flat.");
ABSL_FLAG(int, cpu_threads, 0,
          "Threads of the CPU GEMM (OpenBLAS); 0: every core this process "
          "may run on. Several processes on one machine: give each its "
          "share.");
ABSL_FLAG(std::string, hidden, "64",
          "Hidden layer sizes of the mlp, comma-separated.");
ABSL_FLAG(int64_t, steps, 300,
          "Training steps (global: every worker runs all of them). With "
          "--epochs, leave it out: --epochs sets the steps, and a --steps "
          "that disagrees is an error.");
ABSL_FLAG(int64_t, epochs, 0,
          "Train for this many passes over the training set (steps = epochs "
          "x the steps of one epoch, training examples / global batch, "
          "rounded down); 0: use --steps.");
ABSL_FLAG(int64_t, batch_size, 64,
          "Examples per step on this worker (the global batch is "
          "--num_workers times it); see --global_batch_size.");
ABSL_FLAG(int64_t, global_batch_size, 0,
          "Examples per step in the whole job, split evenly over the "
          "workers (each takes its contiguous slice); must be divisible by "
          "--num_workers. 0: --batch_size per worker.");
ABSL_FLAG(bool, shuffle, true,
          "Visit the training set in a new order every epoch: a permutation "
          "of the whole set from (--seed, epoch), the same for any number of "
          "workers. false: in file order.");
ABSL_FLAG(int64_t, eval_every_steps, 0,
          "Worker 0 evaluates the model on the held-out set every this many "
          "steps (0: not by steps): progress line, --metrics_csv and the "
          "pstrain_worker_test_* gauges.");
ABSL_FLAG(int64_t, eval_every_epochs, 0,
          "Worker 0 evaluates the model on the held-out set every this many "
          "epochs (0: not by epochs).");
ABSL_FLAG(double, target_accuracy, 0,
          "Held-out accuracy to reach: the final JSON reports the training "
          "time (evaluations left out) and step of the first evaluation at "
          "or above it as time_to_target_s / step_to_target (null: not "
          "reached). 0: none.");
ABSL_FLAG(int64_t, log_every, 50,
          "Steps between progress lines when stdout is not a terminal (0: no "
          "progress output at all).");
ABSL_FLAG(std::string, progress, "auto",
          "auto: a progress bar updated in place when stdout is a terminal, "
          "plain lines every --log_every steps otherwise; bar; lines.");
ABSL_FLAG(std::string, metrics_csv, "",
          "Write one row per step here: step,time_s,loss,train_accuracy,"
          "samples_per_sec,pull_ms,push_ms (bench/plot/plot_runs.sh plots "
          "them).");
ABSL_FLAG(int, metrics_port, 0,
          "Serve Prometheus metrics on http://<metrics_host>:PORT/metrics "
          "(0: off; -1: a free port, see --metrics_port_file).");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0",
          "Address the metrics endpoint listens on.");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the metrics port is written here once serving.");
ABSL_FLAG(double, metrics_linger_s, 0,
          "After training, keep serving the final metrics this long (or "
          "until SIGTERM) so a scraper sees them.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle the servers' certificates must chain to; setting "
          "any --tls_* flag turns TLS on (no --tls_ca: the system's roots).");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM client certificate for mutual TLS (with --tls_key).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name to expect in the servers' certificates instead of the host "
          "in --ps_hosts (e.g. when dialling an IP address).");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding the servers' shared token, sent as 'authorization: "
          "Bearer <token>' on every call.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the initial model and synthetic data.");
ABSL_FLAG(int64_t, block_elements, 1 << 17,
          "Dense tensors are cut into blocks of this many floats: the unit of "
          "transfer (one RPC carries about one block) and of consistency.");
ABSL_FLAG(std::string, data, "synthetic",
          "Training data: synthetic (generated), csv, libsvm, idx (MNIST-"
          "format image and label files, raw or .gz) or fashion_mnist (the "
          "IDX files in --dataset_dir).");
ABSL_FLAG(std::string, train_file, "",
          "Training file: csv/libsvm data, or with --data=idx the IDX images "
          "file (labels in --train_labels).");
ABSL_FLAG(std::string, test_file, "",
          "Held-out file, as --train_file (with --data=idx: --test_labels "
          "too).");
ABSL_FLAG(std::string, train_labels, "",
          "--data=idx: the IDX labels file of --train_file.");
ABSL_FLAG(std::string, test_labels, "",
          "--data=idx: the IDX labels file of --test_file.");
ABSL_FLAG(std::string, dataset_dir, "/usr/share/datasets/fashion-mnist",
          "--data=fashion_mnist: the directory of train-images-idx3-ubyte.gz "
          "and its three siblings (Debian package dataset-fashion-mnist).");
ABSL_FLAG(int64_t, num_features, 0,
          "Input features: synthetic data has this many (0: 32); files "
          "define it (0: take it from the file, else it must match).");
ABSL_FLAG(int64_t, num_classes, 0,
          "Number of classes. 0: synthetic 4; files: the largest training "
          "label + 1.");
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
ABSL_FLAG(bool, overlap_push, false,
          "Push each layer's gradient as soon as backward produces it (the "
          "last layer's first), from a push thread, while backward goes on. "
          "Pays where the worker has cores to spare while it computes (a GPU "
          "worker); where compute and the network share a few cores it "
          "costs (bench/results/distribution_cost.txt: 5-8% on 2 cores). "
          "false: one push after backward.");
ABSL_FLAG(bool, push_pull, true,
          "End each step with one PushPull call: this step's gradients go "
          "out and the next step's model comes back in one round trip per "
          "connection on the servers' data plane (over gRPC: a push, then a "
          "pull). The step report then counts the next step's pull in "
          "push_ms. Not used with --overlap_push. false: a push, and a pull "
          "at the start of the next step.");
ABSL_FLAG(bool, call_streams, true,
          "Send a push or pull that is one RPC (one shard, one block group) "
          "as a message on a long-lived stream of its connection instead of "
          "a unary call: a third less latency for small models. false: "
          "always unary.");
ABSL_FLAG(bool, data_plane, true,
          "Push and pull dense tensors over the servers' data plane (framed "
          "TCP beside gRPC; inside TLS with the --tls_* files when the "
          "servers have TLS) where they announce one: about 1.5-2x the "
          "throughput of gRPC for large tensors. false: gRPC only.");
ABSL_FLAG(bool, data_plane_ktls, false,
          "With TLS: let the kernel encrypt the data plane's records (kTLS) "
          "where it can; OpenSSL does otherwise. Logged once.");
ABSL_FLAG(double, heartbeat_interval_s, 2,
          "How often to renew this worker's lease on the servers (keep it "
          "well under their --worker_lease_s).");
ABSL_FLAG(double, retry_window_s, 120,
          "How long a failed pull or push is retried (server restarting, "
          "peers slow) before the worker gives up.");
ABSL_FLAG(int64_t, loss_check_steps, 100,
          "Warn once (training goes on) if this many steps after the first "
          "the training loss has not fallen below the first step's loss, "
          "naming the servers' optimizer and learning rate; NaN/Inf loss is "
          "warned at once. The final JSON says \"not_learning\". 0: only "
          "NaN/Inf.");
ABSL_FLAG(double, inject_duplicate_push_probability, 0,
          "Fault injection: resend a successful push with this probability "
          "(the servers must not apply it twice).");
ABSL_FLAG(int64_t, inject_step_delay_ms, 0,
          "Fault injection: make every step this much slower (a straggler).");
ABSL_FLAG(std::string, gradient_wire_type, "fp32",
          "Gradients on the wire: fp32, or fp16/bf16 to halve the bytes "
          "(servers decode to fp32), or topk: per block, only the "
          "--gradient_topk_fraction largest-magnitude elements, the rest "
          "carried into the next push (error feedback). Sparse-table rows "
          "always go as fp32 under topk.");
ABSL_FLAG(double, gradient_topk_fraction, 0.01,
          "With --gradient_wire_type=topk: the fraction of each block's "
          "elements a push sends, in (0, 1].");
ABSL_FLAG(bool, eval_only, false,
          "Evaluate --model_file on the held-out set (the data flags as for "
          "training) with no servers, print the final JSON line and exit.");
ABSL_FLAG(std::string, model_file, "",
          "With --eval_only: a model file written by pstrain_export "
          "(safetensors).");
ABSL_FLAG(std::string, logits_file, "",
          "With --eval_only: write the held-out logits here, .csv (one row "
          "per example) or .npy.");

namespace pstrain {
namespace {

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
  std::unique_ptr<ExampleSource> train, test;  // test may be null
  double synthetic_best_accuracy = -1;         // synthetic data only
};

// Reads the training and held-out data named by the flags. Every problem is
// reported here, before the worker registers anything with the servers.
absl::StatusOr<Data> LoadData() {
  const std::string source = absl::GetFlag(FLAGS_data);
  const int64_t num_features = absl::GetFlag(FLAGS_num_features);
  int64_t num_classes = absl::GetFlag(FLAGS_num_classes);
  Data data;
  if (source == "synthetic") {
    SyntheticOptions options;
    options.num_features = num_features > 0 ? num_features : 32;
    options.num_classes = num_classes > 0 ? num_classes : 4;
    options.label_noise = absl::GetFlag(FLAGS_label_noise);
    options.seed = absl::GetFlag(FLAGS_seed);
    const int64_t train_examples = absl::GetFlag(FLAGS_train_examples);
    absl::StatusOr<Dataset> train =
        MakeSyntheticClassification(options, 0, train_examples, {0, 1});
    if (!train.ok()) return train.status();
    absl::StatusOr<Dataset> test = MakeSyntheticClassification(
        options, train_examples, absl::GetFlag(FLAGS_test_examples), {0, 1});
    if (!test.ok()) return test.status();
    data.synthetic_best_accuracy = SyntheticBestAccuracy(options);
    data.train = std::make_unique<InMemorySource>(std::move(*train));
    data.test = std::make_unique<InMemorySource>(std::move(*test));
    return data;
  }
  std::string train_file = absl::GetFlag(FLAGS_train_file);
  std::string test_file = absl::GetFlag(FLAGS_test_file);
  std::string train_labels = absl::GetFlag(FLAGS_train_labels);
  std::string test_labels = absl::GetFlag(FLAGS_test_labels);
  if (source == "fashion_mnist") {
    absl::StatusOr<IdxDataset> found =
        FindIdxDataset(absl::GetFlag(FLAGS_dataset_dir));
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
  return data;
}

// The command line, for FlagGiven.
std::vector<std::string> command_line;

// Whether `name` was set on the command line or by the cluster spec (its
// default, then, is no answer to "did the user ask for this value?").
bool FlagGiven(const std::string& name,
               const std::vector<FlagSetting>& from_spec) {
  for (const std::string& arg : command_line) {
    absl::string_view flag = arg;
    if (!absl::ConsumePrefix(&flag, "--")) absl::ConsumePrefix(&flag, "-");
    if (flag == name || absl::StartsWith(flag, name + "=")) return true;
  }
  for (const FlagSetting& setting : from_spec) {
    if (setting.name == name) return true;
  }
  return false;
}

// The per-worker batch from --global_batch_size or --batch_size.
absl::StatusOr<int64_t> WorkerBatch(int num_workers,
                                    const std::vector<FlagSetting>& from_spec) {
  const int64_t batch_size = absl::GetFlag(FLAGS_batch_size);
  const int64_t global = absl::GetFlag(FLAGS_global_batch_size);
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
  if (FlagGiven("batch_size", from_spec) &&
      batch_size * num_workers != global) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--batch_size=", batch_size, " and --global_batch_size=", global,
        " disagree (", num_workers, " workers x ", batch_size, " = ",
        batch_size * num_workers, "): give one of them"));
  }
  return global / num_workers;
}

// Training steps from --epochs or --steps.
absl::StatusOr<int64_t> TrainingSteps(
    int64_t steps_per_epoch, const std::vector<FlagSetting>& from_spec) {
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int64_t epochs = absl::GetFlag(FLAGS_epochs);
  if (epochs == 0) return steps;
  const int64_t from_epochs = epochs * steps_per_epoch;
  if (FlagGiven("steps", from_spec) && steps != from_epochs) {
    return absl::InvalidArgumentError(
        absl::StrCat("--steps=", steps, " contradicts --epochs=", epochs, " (",
                     epochs, " epochs of ", steps_per_epoch,
                     " steps = ", from_epochs, " steps): give one of them"));
  }
  return from_epochs;
}

// A data flag that the chosen --data would not read: an error rather than
// silently training on something else.
std::vector<absl::Status> CheckDataFlags(const std::string& source) {
  std::vector<absl::Status> checks;
  const std::pair<const char*, std::string> files[] = {
      {"train_file", absl::GetFlag(FLAGS_train_file)},
      {"test_file", absl::GetFlag(FLAGS_test_file)},
      {"train_labels", absl::GetFlag(FLAGS_train_labels)},
      {"test_labels", absl::GetFlag(FLAGS_test_labels)}};
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
    if (absl::GetFlag(FLAGS_train_file).empty()) {
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
  return checks;
}

absl::Status CheckPort(const char* flag, int port, int minimum) {
  if (port >= minimum && port <= 65535) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--", flag, " must be in [", minimum, ", 65535], got ", port));
}

int Main(int argc, char** argv) {
  command_line.assign(argv + 1, argv + argc);
  absl::StatusOr<std::vector<FlagSetting>> from_spec = ApplyClusterSpec(
      ClusterRole::kWorker, absl::GetFlag(FLAGS_cluster_spec), argc, argv);
  ExitOnFlagErrors({from_spec.status()});
  if (!from_spec->empty()) {
    std::vector<std::string> applied;
    for (const FlagSetting& f : *from_spec) {
      applied.push_back(absl::StrCat("--", f.name, "=", f.value));
    }
    LOG(INFO) << "from the cluster spec: " << absl::StrJoin(applied, " ");
  }
  const int worker_id = absl::GetFlag(FLAGS_worker_id);
  const int num_workers = absl::GetFlag(FLAGS_num_workers);
  const std::string model_name = absl::GetFlag(FLAGS_model);
  const std::string source = absl::GetFlag(FLAGS_data);
  std::vector<absl::Status> checks;
  // --eval_only: evaluates a model file with no servers (worker/eval_only.h).
  const EvalOnlyOptions eval_only{
      absl::GetFlag(FLAGS_eval_only), absl::GetFlag(FLAGS_model_file),
      absl::GetFlag(FLAGS_logits_file), absl::GetFlag(FLAGS_batch_size)};
  for (absl::Status& s : CheckEvalOnlyFlags(eval_only, model_name)) {
    checks.push_back(std::move(s));
  }
  if (absl::GetFlag(FLAGS_ps_hosts).empty() && !eval_only.eval_only) {
    checks.push_back(absl::InvalidArgumentError(
        "--ps_hosts is required (host:port of every ps_server)"));
  }
  checks.push_back(CheckAtLeast("num_workers", num_workers, 1));
  if (worker_id < 0 || worker_id >= num_workers) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--worker_id must be in [0, --num_workers=", num_workers,
                     "), got ", worker_id)));
  }
  if (model_name != "softmax" && model_name != "mlp" && model_name != "probe" &&
      model_name != "ctr" && model_name != "layers") {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--model must be softmax, mlp, probe or ctr, or layers "
                     "(with --layers), got '",
                     model_name, "'")));
  }
  if (model_name == "layers") {
    checks.push_back(ParseLayerList(absl::GetFlag(FLAGS_layers)).status());
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
  if (source != "synthetic" && source != "csv" && source != "libsvm" &&
      source != "idx" && source != "fashion_mnist") {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--data must be synthetic, csv, libsvm, idx or "
                     "fashion_mnist, got '",
                     source, "'")));
  }
  if (model_name != "ctr") {  // the CTR model reads --ctr_data's files
    for (absl::Status& check : CheckDataFlags(source)) {
      checks.push_back(std::move(check));
    }
  }
  checks.push_back(CheckAtLeast("steps", absl::GetFlag(FLAGS_steps), 1));
  checks.push_back(CheckAtLeast("epochs", absl::GetFlag(FLAGS_epochs), 0));
  checks.push_back(
      CheckAtLeast("batch_size", absl::GetFlag(FLAGS_batch_size), 1));
  checks.push_back(CheckAtLeast("global_batch_size",
                                absl::GetFlag(FLAGS_global_batch_size), 0));
  checks.push_back(CheckAtLeast("eval_every_steps",
                                absl::GetFlag(FLAGS_eval_every_steps), 0));
  checks.push_back(CheckAtLeast("eval_every_epochs",
                                absl::GetFlag(FLAGS_eval_every_epochs), 0));
  const double target_accuracy = absl::GetFlag(FLAGS_target_accuracy);
  if (!(target_accuracy >= 0 && target_accuracy <= 1)) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--target_accuracy must be in [0, 1], got ", target_accuracy)));
  }
  checks.push_back(
      CheckAtLeast("num_features", absl::GetFlag(FLAGS_num_features), 0));
  absl::StatusOr<int64_t> worker_batch =
      num_workers >= 1 ? WorkerBatch(num_workers, *from_spec)
                       : absl::StatusOr<int64_t>(1);
  checks.push_back(worker_batch.status());
  checks.push_back(
      CheckAtLeast("log_every", absl::GetFlag(FLAGS_log_every), 0));
  checks.push_back(
      CheckAtLeast("block_elements", absl::GetFlag(FLAGS_block_elements), 1));
  if (absl::GetFlag(FLAGS_num_classes) != 0) {
    checks.push_back(
        CheckAtLeast("num_classes", absl::GetFlag(FLAGS_num_classes), 2));
  }
  checks.push_back(
      CheckAtLeast("rpc_timeout_s", absl::GetFlag(FLAGS_rpc_timeout_s), 0.001));
  checks.push_back(CheckAtLeast("connect_timeout_s",
                                absl::GetFlag(FLAGS_connect_timeout_s), 0.001));
  const int max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  if (max_message_mb < 1 || max_message_mb > 2047) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--max_message_mb must be in [1, 2047], got ", max_message_mb)));
  }
  const std::string progress = absl::GetFlag(FLAGS_progress);
  if (progress != "auto" && progress != "bar" && progress != "lines") {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--progress must be auto, bar or lines, got '", progress, "'")));
  }
  const int metrics_port = absl::GetFlag(FLAGS_metrics_port);
  checks.push_back(CheckPort("metrics_port", metrics_port, -1));
  checks.push_back(CheckAtLeast("metrics_linger_s",
                                absl::GetFlag(FLAGS_metrics_linger_s), 0));
  absl::StatusOr<std::unique_ptr<MetricsCsv>> csv;
  if (!absl::GetFlag(FLAGS_metrics_csv).empty()) {
    csv = MetricsCsv::Open(absl::GetFlag(FLAGS_metrics_csv));
    checks.push_back(csv.status());
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(
          {absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
           absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_server_name)});
  checks.push_back(credentials.status());
  absl::StatusOr<std::string> auth_token =
      ReadAuthToken(absl::GetFlag(FLAGS_auth_token_file));
  checks.push_back(auth_token.status());
  const absl::StatusOr<GrpcTuning> grpc_tuning = GrpcTuningFromFlags();
  checks.push_back(grpc_tuning.status());
  PsClientOptions client_options;
  if (grpc_tuning.ok()) client_options.grpc_tuning = *grpc_tuning;
  if (credentials.ok()) client_options.credentials = *credentials;
  absl::StatusOr<std::shared_ptr<const TlsContext>> data_plane_tls =
      TlsContext::ForClient(
          {absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
           absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_server_name)},
          absl::GetFlag(FLAGS_data_plane_ktls));
  // Its files were checked above; a failure here is already reported.
  if (credentials.ok() && data_plane_tls.ok()) {
    client_options.data_plane_tls = *data_plane_tls;
  } else if (credentials.ok()) {
    checks.push_back(data_plane_tls.status());
  }
  if (auth_token.ok()) client_options.auth_token = *auth_token;
  client_options.hosts = absl::StrSplit(absl::GetFlag(FLAGS_ps_hosts), ',');
  client_options.rpc_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_rpc_timeout_s));
  client_options.connect_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s));
  client_options.max_message_bytes = max_message_mb << 20;
  client_options.connections_per_shard =
      absl::GetFlag(FLAGS_connections_per_shard);
  client_options.call_streams = absl::GetFlag(FLAGS_call_streams);
  client_options.data_plane = absl::GetFlag(FLAGS_data_plane);
  const double topk_fraction = absl::GetFlag(FLAGS_gradient_topk_fraction);
  if (!(topk_fraction > 0 && topk_fraction <= 1)) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--gradient_topk_fraction must be in (0, 1], got ", topk_fraction)));
  }
  client_options.gradient_topk_fraction = topk_fraction;
  client_options.heartbeat_interval =
      absl::Seconds(absl::GetFlag(FLAGS_heartbeat_interval_s));
  client_options.retry_window =
      absl::Seconds(absl::GetFlag(FLAGS_retry_window_s));
  client_options.inject_duplicate_push_probability = duplicate_probability;
  // SIGTERM/SIGINT: training finishes the step in hand, leaves the job and
  // reports; a wait ends within a second (SignalWatch).
  static std::atomic<bool> stop_requested{false};
  // Where a retry shows itself on the progress bar, once there is one.
  static std::atomic<StepOutput*> wait_display{nullptr};
  client_options.on_retry = [](const std::string& line) {
    if (StepOutput* output = wait_display.load()) output->ShowWait(line);
  };
  const absl::StatusOr<DataType> wire_type =
      ParseWireType(absl::GetFlag(FLAGS_gradient_wire_type));
  checks.push_back(wire_type.status());
  if (wire_type.ok()) client_options.gradient_wire_type = *wire_type;

  absl::StatusOr<std::unique_ptr<PsClient>> client =
      PsClient::Create(client_options);
  if (!absl::GetFlag(FLAGS_ps_hosts).empty()) checks.push_back(client.status());
  ExitOnFlagErrors(checks);
  // The data comes before anything that logs or talks to the servers: a bad
  // file or a batch that does not fit is one line and exit 2, and the
  // servers never hear of this worker.
  const int64_t batch_size = *worker_batch;
  absl::StatusOr<Data> data = absl::UnknownError("not loaded");
  absl::StatusOr<EpochPlan> plan = absl::UnknownError("not planned");
  absl::StatusOr<int64_t> steps = absl::UnknownError("not counted");
  if (model_name != "ctr") {
    data = LoadData();
    ExitOnFlagErrors({data.status()});
    EpochPlan::Options plan_options;
    plan_options.num_examples = data->train->size();
    plan_options.worker_batch = batch_size;
    plan_options.num_workers = num_workers;
    plan_options.worker_index = worker_id;
    plan = EpochPlan::Create(plan_options);
    ExitOnFlagErrors({plan.status()});
    steps = TrainingSteps(plan->steps_per_epoch(), *from_spec);
    ExitOnFlagErrors({steps.status()});
  }
  std::unique_ptr<MetricsEndpoint> metrics_endpoint;
  std::unique_ptr<WorkerMetrics> metrics;
  if (metrics_port != 0) {
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> started =
        MetricsEndpoint::Start(absl::GetFlag(FLAGS_metrics_host),
                               std::max(metrics_port, 0),
                               absl::GetFlag(FLAGS_metrics_port_file));
    if (!started.ok()) {
      LOG(ERROR) << started.status();
      return 1;
    }
    metrics_endpoint = std::move(*started);
    metrics = std::make_unique<WorkerMetrics>(metrics_endpoint->registry(),
                                              worker_id);
    LOG(INFO) << "metrics on http://" << absl::GetFlag(FLAGS_metrics_host)
              << ":" << metrics_endpoint->port() << "/metrics";
  }
  // Checked one at a time from here: each may log or do real work.
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::CreateBackend(kernels::BackendOptions{
          absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_precision),
          absl::GetFlag(FLAGS_cpu_threads)});
  ExitOnFlagErrors({backend.status()});
  // Lives as long as the process: its thread does.
  SignalWatch* const signal_watch = new SignalWatch(&stop_requested);
  signal_watch->Start();
  if (model_name == "ctr") {  // sparse embedding tables: worker/ctr_main.h
    const bool ctr_bar =
        progress == "bar" || (progress == "auto" && isatty(STDOUT_FILENO) == 1);
    StepOutput ctr_output(worker_id, ctr_bar, absl::GetFlag(FLAGS_log_every),
                          csv.ok() ? std::move(*csv) : nullptr, metrics.get());
    CtrWorkerContext ctr;
    ctr.worker_id = worker_id;
    ctr.num_workers = num_workers;
    ctr.steps = absl::GetFlag(FLAGS_steps);
    ctr.batch_size = absl::GetFlag(FLAGS_batch_size);
    ctr.seed = absl::GetFlag(FLAGS_seed);
    ctr.block_elements = absl::GetFlag(FLAGS_block_elements);
    ctr.train_file = absl::GetFlag(FLAGS_train_file);
    ctr.test_file = absl::GetFlag(FLAGS_test_file);
    ctr.client = client->get();
    ctr.client_options = &client_options;
    ctr.final_model_timeout = absl::Seconds(absl::GetFlag(FLAGS_rpc_timeout_s));
    ctr.backend = backend->get();
    ctr.on_step = [&ctr_output](const StepReport& r) { ctr_output.OnStep(r); };
    ctr.on_waiting = [&ctr_output](const JobStart& waiting) {
      ctr_output.OnWaitingForWorkers(waiting);
    };
    ctr.stop = &stop_requested;
    // Waits show themselves and end on a signal as the dense worker's do.
    wait_display = &ctr_output;
    signal_watch->Add(client->get());
    absl::Cleanup quiet = [signal_watch] {
      signal_watch->Quiet();
      wait_display = nullptr;
    };
    ctr.register_model = [&](const ModelSchema& schema) {
      return RegisterShowingWait(**client, client_options, ctr_output, schema,
                                 num_workers, worker_id);
    };
    ctr.on_steps_done = [signal_watch] { signal_watch->Quiet(); };
    ctr.stopped_while_waiting = [&](const std::string& waiting_for,
                                    const absl::Status& status) {
      return StoppedWhileWaiting(*signal_watch, ctr_output, **client, worker_id,
                                 waiting_for, status);
    };
    ctr_output.Start(0);
    const int code = RunCtrWorker(ctr);
    ctr_output.Finish();
    return code;
  }
  if (data->synthetic_best_accuracy >= 0) {
    LOG(INFO) << "synthetic task: best achievable accuracy "
              << data->synthetic_best_accuracy;
  }
  LOG(INFO) << "worker " << worker_id << "/" << num_workers << " on "
            << (*backend)->Name() << ": " << data->train->size()
            << " training examples ("
            << data->train->resident_bytes() / 1048576.0 << " MiB held), "
            << (data->test != nullptr ? data->test->size() : 0) << " held out; "
            << data->train->num_features() << " features, "
            << data->train->num_classes() << " classes; global batch "
            << plan->global_batch() << " (" << batch_size << " per worker), "
            << *steps << " steps = "
            << static_cast<double>(*steps) / plan->steps_per_epoch()
            << " epochs of " << plan->steps_per_epoch() << " steps";

  absl::StatusOr<std::unique_ptr<Model>> model;
  if (model_name == "layers") {  // a bad list or shape is a flag error
    model = CreateLayerModelFromFlags(
        backend->get(), absl::GetFlag(FLAGS_layers),
        absl::GetFlag(FLAGS_input_shape), data->train->num_features(),
        data->train->num_classes(), batch_size);
    ExitOnFlagErrors({model.status()});
  } else if (model_name == "probe") {
    model =
        CreateProbeModel(backend->get(), absl::GetFlag(FLAGS_probe_elements));
  } else {
    model =
        CreateMlp(backend->get(), data->train->num_features(),
                  model_name == "softmax" ? std::vector<int64_t>{} : *hidden,
                  data->train->num_classes(), batch_size);
  }
  if (!model.ok()) {
    LOG(ERROR) << "cannot build the model: " << model.status();
    return 1;
  }
  if (eval_only.eval_only) {
    return RunEvalOnly(eval_only, **model, **backend, data->test.get());
  }
  ModelSchema schema;
  schema.set_seed(absl::GetFlag(FLAGS_seed));
  schema.set_block_elements(absl::GetFlag(FLAGS_block_elements));
  for (const DenseTensorSpec& spec : (*model)->Params()) {
    *schema.add_dense() = spec;
  }
  const bool bar =
      progress == "bar" || (progress == "auto" && isatty(STDOUT_FILENO) == 1);
  StepOutput output(worker_id, bar, absl::GetFlag(FLAGS_log_every),
                    csv.ok() ? std::move(*csv) : nullptr, metrics.get());
  wait_display = &output;
  signal_watch->Add(client->get());
  // Before the clients go, on every path: the watch must not touch them.
  absl::Cleanup quiet = [signal_watch] {
    signal_watch->Quiet();
    wait_display = nullptr;  // before `output` goes
  };
  // A signal during a wait: leave the job if this worker may have joined
  // it, and exit with one line saying what it waited for.
  auto interrupted = [&](const std::string& waiting_for,
                         const absl::Status& status) {
    return StoppedWhileWaiting(*signal_watch, output, **client, worker_id,
                               waiting_for, status);
  };
  absl::StatusOr<Registration> registration = RegisterShowingWait(
      **client, client_options, output, schema, num_workers, worker_id);
  if (!registration.ok() && signal_watch->signal_number() != 0) {
    return interrupted("to reach the servers and register the model",
                       registration.status());
  }
  if (!registration.ok()) {
    LOG(ERROR) << "cannot register the model: " << registration.status();
    // Waiting for servers, gRPC reports any cause as the deadline passing.
    // (A server that refuses this worker's transport fails fast instead,
    // with its cause: PsClient::Register.)
    if (absl::IsDeadlineExceeded(registration.status())) {
      for (const std::string& host : client_options.hosts) {
        const std::string cause = DiagnoseConnection(
            host, client_options.credentials != nullptr, absl::Seconds(2));
        if (!cause.empty()) LOG(ERROR) << "likely cause: " << cause;
      }
    }
    return 1;
  }
  // sync computes its first step while the job waits for its workers
  // (TrainerOptions::await_job_start); ssp waits here, before any step.
  absl::Status job_start = absl::OkStatus();
  auto await_job_start = [&]() {
    job_start = (*client)->AwaitJobStart(
        [&output](const JobStart& w) { output.OnWaitingForWorkers(w); },
        &stop_requested);
    return job_start;
  };
  auto job_did_not_start = [&]() {
    if (signal_watch->signal_number() != 0 && absl::IsCancelled(job_start)) {
      return interrupted("for the job's other workers to register", job_start);
    }
    output.Finish();
    LOG(ERROR) << "the job did not start: " << job_start;
    (*client)->Leave().IgnoreError();
    return 1;
  };
  if (registration->mode != "sync" && !await_job_start().ok()) {
    return job_did_not_start();
  }
  if (registration->start_step > 0) {
    LOG(INFO) << "joining a running job at step " << registration->start_step;
  }
  // async/ssp: the final model is pulled as an observer, after this worker
  // has left (a pull as a worker would rejoin the job).
  std::unique_ptr<PsClient> observer;
  if (registration->mode != "sync") {
    absl::StatusOr<std::unique_ptr<PsClient>> created =
        PsClient::CreateObserver(client_options, schema, num_workers);
    if (!created.ok() && signal_watch->signal_number() != 0) {
      return interrupted("to connect the observer for the final model",
                         created.status());
    }
    if (!created.ok()) {
      LOG(ERROR) << "cannot connect the observer for the final model: "
                 << created.status();
      return 1;
    }
    observer = std::move(*created);
    signal_watch->Add(observer.get());
  }
  // Declared after the observer: runs before it is destroyed.
  absl::Cleanup quiet_observer = [signal_watch] { signal_watch->Quiet(); };

  TrainerOptions options;
  options.worker_id = worker_id;
  options.num_workers = num_workers;
  options.steps = *steps;
  options.batch_size = batch_size;
  options.shuffle = absl::GetFlag(FLAGS_shuffle);
  options.overlap_push = absl::GetFlag(FLAGS_overlap_push);
  options.push_pull = absl::GetFlag(FLAGS_push_pull);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.periodic_evaluation = worker_id == 0;
  options.eval_every_steps = absl::GetFlag(FLAGS_eval_every_steps);
  options.eval_every_epochs = absl::GetFlag(FLAGS_eval_every_epochs);
  options.target_accuracy = target_accuracy;
  options.final_model_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_rpc_timeout_s));
  options.observer = observer.get();
  LearningWatch learning_watch(absl::GetFlag(FLAGS_loss_check_steps),
                               registration->optimizer,
                               registration->learning_rate);
  int64_t last_step = registration->start_step;
  options.on_step = [&](const StepReport& r) {
    last_step = r.step;
    const std::string warning = learning_watch.OnStep(r.step, r.loss);
    if (!warning.empty()) {
      output.Finish();  // the warning gets a line of its own
      LOG(WARNING) << "worker " << worker_id << ": " << warning;
    }
    output.OnStep(r);
  };
  options.on_steps_done = [signal_watch] { signal_watch->Quiet(); };
  options.start_step = registration->start_step;
  options.stop = &stop_requested;
  if (registration->mode == "sync") options.await_job_start = await_job_start;
  options.step_delay =
      absl::Milliseconds(absl::GetFlag(FLAGS_inject_step_delay_ms));
  output.Start(registration->start_step);
  absl::StatusOr<TrainResult> result =
      Train(options, registration->mode, **client, **model, **backend,
            *data->train, data->test.get());
  if (!job_start.ok()) return job_did_not_start();
  if (!result.ok() && signal_watch->signal_number() != 0 &&
      absl::IsCancelled(result.status())) {
    return interrupted(
        absl::StrCat("on the servers after step ", last_step, " of ", *steps),
        result.status());
  }
  output.Finish();
  if (!result.ok()) {
    LOG(ERROR) << "training failed: " << result.status();
    return 1;
  }
  result->not_learning = learning_watch.fired();
  std::printf(
      "%s\n",
      FinalJson(*result, worker_id, num_workers, (*backend)->Name()).c_str());
  std::fflush(stdout);
  const double linger_s = absl::GetFlag(FLAGS_metrics_linger_s);
  if (metrics_endpoint != nullptr && linger_s > 0 && !stop_requested) {
    LOG(INFO) << "serving the final metrics for " << linger_s
              << " s (SIGTERM ends it)";
    const absl::Time until = absl::Now() + absl::Seconds(linger_s);
    while (absl::Now() < until && !stop_requested) {
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  pstrain::InitProgram(argc, argv,
                       "worker: trains a model against the parameter servers");
  pstrain::CatchTerminationSignals();
  return pstrain::Main(argc, argv);
}
