// Everything the worker binary is told, as one plain struct: who this
// worker is, how it reaches the servers, its data, its model, the training
// loop, evaluation and output. worker/worker_flags.h fills it from the
// flags (and a cluster spec); ValidateWorkerConfig checks it in one place.
// Each field's default is its flag's default: the flags take theirs from
// here (worker --helpfull lists them). Field names are the flags' names.
#ifndef PSTRAIN_WORKER_WORKER_CONFIG_H_
#define PSTRAIN_WORKER_WORKER_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/partition.h"
#include "kernels/backend.h"
#include "worker/client/client_config.h"
#include "worker/eval_only.h"
#include "worker/lr_schedule.h"

namespace pstrain {

// The training and held-out data of a dense model (--model=ctr reads
// CtrConfig's).
struct DataConfig {
  // synthetic, csv, libsvm, idx or fashion_mnist (--data).
  std::string source = "synthetic";
  // csv/libsvm files, or with idx the images files and their labels files.
  std::string train_file, test_file, train_labels, test_labels;
  // fashion_mnist: the directory of its four IDX files.
  std::string dataset_dir = "/usr/share/datasets/fashion-mnist";
  // 0: synthetic 32 / inferred from the file.
  int64_t num_features = 0;
  // 0: synthetic 4 / the largest training label + 1.
  int64_t num_classes = 0;
  // Synthetic data only.
  double label_noise = 0.05;
  int64_t train_examples = 32768;
  int64_t test_examples = 4096;
};

// The model and where it computes.
struct ModelConfig {
  // softmax, mlp, probe, ctr or layers (--model).
  std::string name = "mlp";
  // mlp: hidden layer sizes, comma-separated (ParseHidden).
  std::string hidden = "64";
  // layers: the layer list (worker/layers.h) and one example's HxWxC.
  std::string layers =
      "conv:16:3,relu,maxpool:2,conv:32:3,relu,maxpool:2,flatten,dense:64,"
      "relu,dense:10";
  std::string input_shape;
  // probe: its tensor's size, and whether each step checks the values it
  // was given are all the same (a sync job's are).
  int64_t probe_elements = 1000;
  bool probe_check_pulls = false;
  // --device, --precision, --cpu_threads.
  kernels::BackendOptions backend;
  // Dense tensors are cut into blocks of this many floats.
  int64_t block_elements = kBlockElementsByModel;
};

// The training loop.
struct TrainingConfig {
  // Global steps, or --epochs passes over the training set (0: steps).
  int64_t steps = 300;
  int64_t epochs = 0;
  // Examples per step on this worker, or in the whole job (0: batch_size
  // per worker).
  int64_t batch_size = 64;
  int64_t global_batch_size = 0;
  // Whether steps / batch_size were set (command line or cluster spec) and
  // not just defaults: a set one that disagrees with epochs /
  // global_batch_size is an error.
  bool steps_given = false;
  bool batch_size_given = false;
  // A new permutation of the training set every epoch.
  bool shuffle = true;
  // Push each layer's gradient as backward produces it.
  bool overlap_push = false;
  // End each step with one PushPull call.
  bool push_pull = true;
  // A sync step as a pipeline (--pipeline_step): by_host, always or never.
  std::string pipeline_step = "by_host";
  // The pipelined step's timeline of this many steps (--trace_steps).
  int64_t trace_steps = 0;
  // Steps after which a loss that has not fallen is warned about once.
  int64_t loss_check_steps = 100;
  // The servers' rate over the steps (--lr_schedule, --warmup_steps,
  // --lr_step_size, --lr_step_gamma); total_steps is the job's.
  LrSchedule lr_schedule;
  // Fault injection: extra time per step, in ms.
  int64_t inject_step_delay_ms = 0;
  // Fault injection: the process kills itself (SIGKILL) once it has pulled
  // this step, before pushing any of it / once this step's exchange has
  // returned. -1: never.
  int64_t inject_crash_before_push_step = -1;
  int64_t inject_crash_after_step = -1;
  // Fault injection: the process sends itself SIGTERM once this step's
  // exchange has returned, and stops as a signalled worker does. -1: never.
  int64_t inject_sigterm_after_step = -1;
  // ... once this step's model is pulled, before any of it is pushed.
  int64_t inject_sigterm_before_push_step = -1;
  // ... once this step's first gradients are ready: it goes on to push the
  // step whole.
  int64_t inject_sigterm_in_backward_step = -1;
  // Fault injection: every step's backward pauses this long once its first
  // gradients are ready (a big model's backward, on the clock).
  int64_t inject_backward_pause_ms = 0;
};

// Held-out evaluation: during training (worker 0), or of a model file with
// no servers (--eval_only).
struct EvalConfig {
  int64_t eval_every_steps = 0;
  int64_t eval_every_epochs = 0;
  // Held-out accuracy whose first attainment is reported; 0: none.
  double target_accuracy = 0;
  bool eval_only = false;
  std::string model_file;   // with eval_only: a safetensors file
  std::string logits_file;  // with eval_only: .csv or .npy, optional
};

// What the worker shows and writes while it runs.
struct OutputConfig {
  // Steps between progress lines (0: no progress output at all).
  int64_t log_every = 50;
  // auto, bar or lines.
  std::string progress = "auto";
  // One CSV row per step here (empty: none).
  std::string metrics_csv;
  // Prometheus metrics: 0 off, -1 a free port (written to
  // metrics_port_file), else the port.
  int metrics_port = 0;
  std::string metrics_host = "0.0.0.0";
  std::string metrics_port_file;
  // After training, keep serving the final metrics this long.
  double metrics_linger_s = 0;
};

// --model=ctr: sparse embedding tables on the servers (worker/ctr_main.h).
struct CtrConfig {
  // synthetic, criteo or libsvm (--ctr_data; files: DataConfig's
  // train_file and test_file).
  std::string data = "synthetic";
  int fields = 6;  // categorical fields (synthetic, criteo)
  int dense = 4;   // dense features (synthetic, criteo)
  // Synthetic only.
  int64_t vocab = 10000;
  // Each field's vocabulary: "" (vocab for every field), "criteo" (Criteo
  // Kaggle's 26 fields') or a comma-separated list, one per field.
  std::string cardinalities;
  int64_t train_examples = 65536;
  int64_t test_examples = 8192;
  int64_t embedding_dim = 8;
  int64_t hidden = 32;
  // Row updates on the servers: sgd, adagrad, adam or ftrl.
  std::string sparse_optimizer = "adagrad";
  // 0: the optimizer's own default (common/learning_rates.h).
  double sparse_learning_rate = 0;
  double adagrad_initial_accumulator = 0.1;
  double ftrl_alpha = 0.05;
  double ftrl_beta = 1.0;
  double ftrl_l1 = 0.0;
  double ftrl_l2 = 0.0;
  double embedding_init_scale = 0.05;
  // Each table's memory budget on each server, in bytes (SparseTableSpec.
  // max_bytes); 0: none.
  int64_t embedding_max_bytes = 0;
  // Each table's mode (SparseTableSpec.mode): "" the servers', or "async".
  std::string embedding_mode;
  // Async tables: their traffic beside the dense exchange (CtrTrainerOptions
  // ::table_lane).
  bool embedding_prefetch = true;
};

struct WorkerConfig {
  // This worker's index in [0, num_workers).
  int worker_id = 0;
  int num_workers = 1;
  // Of the initial model, the synthetic data and the data order.
  uint64_t seed = 1;
  ClientConfig client;
  DataConfig data;
  ModelConfig model;
  TrainingConfig training;
  EvalConfig eval;
  OutputConfig output;
  CtrConfig ctr;
};

// Every problem with `config`, at once: OK, or a status whose message has
// one line per problem in the words of the flag that sets it
// ("--steps must be >= 1, got 0"); ExitOnFlagErrors (common/cli.h) prints
// it. Files named by the config that must open before any work (TLS, the
// token, --metrics_csv) are opened here, as the worker would; data files
// are read later (LoadTrainingData), as they take time.
absl::Status ValidateWorkerConfig(const WorkerConfig& config);

// Each synthetic CTR field's vocabulary from --ctr_cardinalities (empty:
// --ctr_vocab for every field), or what is wrong with it.
absl::StatusOr<std::vector<int64_t>> CtrFieldVocab(const CtrConfig& ctr);

// The --eval_only part of `config`, as worker/eval_only.h takes it.
EvalOnlyOptions EvalOnlyOptionsOf(const WorkerConfig& config);

// The mlp's hidden sizes from "128,64".
absl::StatusOr<std::vector<int64_t>> ParseHidden(const std::string& text);

// This worker's batch, from global_batch_size or batch_size.
absl::StatusOr<int64_t> WorkerBatchSize(const WorkerConfig& config);

// Training steps from epochs (of `steps_per_epoch` steps) or steps.
absl::StatusOr<int64_t> TrainingSteps(const TrainingConfig& training,
                                      int64_t steps_per_epoch);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_WORKER_CONFIG_H_
