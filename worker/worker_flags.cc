#include "worker/worker_flags.h"

#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/cluster_spec.h"
#include "common/transport/grpc_tuning.h"
#include "glog/logging.h"
#include "worker/client/client_options.h"

namespace {

// Every flag's default is the config's (the struct is the one place that
// says what a worker does when not told).
const pstrain::WorkerConfig& Default() {
  static const pstrain::WorkerConfig* const config = new pstrain::WorkerConfig;
  return *config;
}

}  // namespace

// The job: who this worker is (WorkerConfig's first fields).
ABSL_FLAG(std::string, cluster_spec, "",
          "JSON file describing the job ({\"ps\": [host:port...], "
          "\"workers\": N, \"max_workers\": M, \"task\": {\"type\": "
          "\"worker\", \"index\": i}, \"worker_flags\": {flag: value...}}); "
          "it sets --ps_hosts, --worker_id, --num_workers and the "
          "worker_flags unless given on the command line. Empty: the JSON in "
          "$PSTRAIN_CLUSTER, if set.");
ABSL_FLAG(int, worker_id, Default().worker_id,
          "This worker's index, in [0, num_workers).");
ABSL_FLAG(int, num_workers, Default().num_workers,
          "Number of workers in the job.");
ABSL_FLAG(uint64_t, seed, Default().seed,
          "Seed of the initial model and synthetic data.");

// Reaching the servers: ClientConfig, one flag per option of
// worker/client/client_options.h (the Python binding's keywords are the same
// list).
ABSL_FLAG(std::string, ps_hosts, "",
          "Comma-separated host:port of every ps_server, in shard order.");
#define PSTRAIN_CLIENT_FLAG(type, name, member, help) \
  ABSL_FLAG(type, name, Default().client.member, help);
PSTRAIN_CLIENT_OPTIONS(PSTRAIN_CLIENT_FLAG)
#undef PSTRAIN_CLIENT_FLAG

// The data (DataConfig).
ABSL_FLAG(std::string, data, Default().data.source,
          "Training data: synthetic (generated), csv, libsvm, idx (MNIST-"
          "format image and label files, raw or .gz) or fashion_mnist (the "
          "IDX files in --dataset_dir).");
ABSL_FLAG(std::string, train_file, Default().data.train_file,
          "Training file: csv/libsvm data, or with --data=idx the IDX images "
          "file (labels in --train_labels).");
ABSL_FLAG(std::string, test_file, Default().data.test_file,
          "Held-out file, as --train_file (with --data=idx: --test_labels "
          "too).");
ABSL_FLAG(std::string, train_labels, Default().data.train_labels,
          "--data=idx: the IDX labels file of --train_file.");
ABSL_FLAG(std::string, test_labels, Default().data.test_labels,
          "--data=idx: the IDX labels file of --test_file.");
ABSL_FLAG(std::string, dataset_dir, Default().data.dataset_dir,
          "--data=fashion_mnist: the directory of train-images-idx3-ubyte.gz "
          "and its three siblings (Debian package dataset-fashion-mnist).");
ABSL_FLAG(int64_t, num_features, Default().data.num_features,
          "Input features: synthetic data has this many (0: 32); files "
          "define it (0: take it from the file, else it must match).");
ABSL_FLAG(int64_t, num_classes, Default().data.num_classes,
          "Number of classes. 0: synthetic 4; files: the largest training "
          "label + 1.");
ABSL_FLAG(double, label_noise, Default().data.label_noise,
          "Synthetic: share of random labels.");
ABSL_FLAG(int64_t, train_examples, Default().data.train_examples,
          "Synthetic: training examples in the whole job.");
ABSL_FLAG(int64_t, test_examples, Default().data.test_examples,
          "Synthetic: held-out examples.");

// The model and where it computes (ModelConfig).
ABSL_FLAG(std::string, model, Default().model.name,
          "softmax (multinomial logistic regression), mlp, probe (a "
          "diagnostic whose gradient is exactly 1: with SGD at learning rate "
          "1 every weight ends at minus the number of updates applied), or "
          "ctr (sparse embedding tables on the servers; see the --ctr_* "
          "flags), or layers (a model described by --layers, e.g. a CNN).");
ABSL_FLAG(std::string, hidden, Default().model.hidden,
          "Hidden layer sizes of the mlp, comma-separated.");
// With --model=layers: worker/layers.h has the grammar.
ABSL_FLAG(std::string, layers, Default().model.layers,
          "With --model=layers: the layer list, comma-separated: "
          "conv:OUT:K[:STRIDE[:PAD]], maxpool:K[:STRIDE], relu, flatten, "
          "dense:N; the last must output --num_classes values.");
ABSL_FLAG(std::string, input_shape, Default().model.input_shape,
          "With --model=layers: one example's HxWxC (NHWC), e.g. 28x28x1. "
          "Empty: a square 1-channel image when the feature count is a "
          "perfect square (784 -> 28x28x1), else flat.");
ABSL_FLAG(int64_t, probe_elements, Default().model.probe_elements,
          "Size of the probe model's tensor.");
ABSL_FLAG(bool, probe_check_pulls, Default().model.probe_check_pulls,
          "Probe model, sync, --device=cpu: every step fails unless the "
          "values it pulled are all the same (for replication tests: a "
          "block read at the wrong step shows).");
ABSL_FLAG(std::string, device, Default().model.backend.device,
          "Compute device: auto, cpu (GEMMs through OpenBLAS), cpu_reference "
          "(the exact CPU kernels the tests compare against), cpu_staged "
          "(cpu, staged through host copies as on a GPU: for tests) or "
          "cuda:N.");
ABSL_FLAG(std::string, precision, Default().model.backend.precision,
          "GEMM precision: fp32, or bf16 (bf16 inputs, fp32 accumulation; "
          "needs a CUDA device).");
ABSL_FLAG(int, cpu_threads, Default().model.backend.cpu_threads,
          "Threads of the CPU GEMM (OpenBLAS); 0: every core this process "
          "may run on. Several processes on one machine: give each its "
          "share.");
ABSL_FLAG(int64_t, block_elements, Default().model.block_elements,
          "Dense tensors are cut into blocks of this many floats: the unit of "
          "transfer (one RPC carries about one block) and of consistency. "
          "0: picked from the model's size, 8192 to 131072, about 16 "
          "blocks (common/partition.h).");

// The training loop (TrainingConfig).
ABSL_FLAG(int64_t, steps, Default().training.steps,
          "Training steps (global: every worker runs all of them). With "
          "--epochs, leave it out: --epochs sets the steps, and a --steps "
          "that disagrees is an error.");
ABSL_FLAG(int64_t, epochs, Default().training.epochs,
          "Train for this many passes over the training set (steps = epochs "
          "x the steps of one epoch, training examples / global batch, "
          "rounded down); 0: use --steps.");
ABSL_FLAG(int64_t, batch_size, Default().training.batch_size,
          "Examples per step on this worker (the global batch is "
          "--num_workers times it); see --global_batch_size.");
ABSL_FLAG(int64_t, global_batch_size, Default().training.global_batch_size,
          "Examples per step in the whole job, split evenly over the "
          "workers (each takes its contiguous slice); must be divisible by "
          "--num_workers. 0: --batch_size per worker.");
ABSL_FLAG(bool, shuffle, Default().training.shuffle,
          "Visit the training set in a new order every epoch: a permutation "
          "of the whole set from (--seed, epoch), the same for any number of "
          "workers. false: in file order.");
ABSL_FLAG(bool, overlap_push, Default().training.overlap_push,
          "Push each layer's gradient as soon as backward produces it (the "
          "last layer's first), from a push thread, while backward goes on. "
          "Pays where the worker has cores to spare while it computes (a GPU "
          "worker); where compute and the network share a few cores it "
          "costs (bench/results/distribution_cost.txt: 5-8% on 2 cores). "
          "false: one push after backward.");
ABSL_FLAG(std::string, pipeline_step, Default().training.pipeline_step,
          "A sync step as a pipeline: each block group's gradient leaves as "
          "backward makes it (the last layers' first, then the first "
          "layer's block by block) and the next forward reads the first "
          "layer's weight block by block as its values come back. For CPU "
          "workers of models whose first layer is dense (others run the "
          "plain step); on 1 Gbit/s links a 2 x 2 MLP step went from 1.28x "
          "to 1.11-1.18x the link-bound ideal. On a GPU any layer model "
          "streams, a parameter whole (1.07-1.25x the plain step's samples/s "
          "on an H200). by_host: when a shard's data plane is on another "
          "host as the first step starts, or the worker stages through a "
          "device (for a CPU worker on one host only the CPU binds, and the "
          "pipeline's hand-offs cost it); always; never: compute, then one "
          "PushPull.");
ABSL_FLAG(bool, push_pull, Default().training.push_pull,
          "End each step with one PushPull call: this step's gradients go "
          "out and the next step's model comes back in one round trip per "
          "connection on the servers' data plane (over gRPC: a push, then a "
          "pull). The step report then counts the next step's pull in "
          "push_ms. Not used with --overlap_push. false: a push, and a pull "
          "at the start of the next step.");
ABSL_FLAG(int64_t, loss_check_steps, Default().training.loss_check_steps,
          "Warn once (training goes on) if this many steps after the first "
          "the training loss has not fallen below the first step's loss, "
          "naming the servers' optimizer and learning rate; NaN/Inf loss is "
          "warned at once. The final JSON says \"not_learning\". 0: only "
          "NaN/Inf.");
ABSL_FLAG(std::string, lr_schedule, Default().training.lr_schedule.kind,
          "The servers' learning rate over the job, carried by every push: "
          "constant, step (times --lr_step_gamma every --lr_step_size steps, "
          "torch's StepLR) or cosine (to 0 at the last step, torch's "
          "CosineAnnealingLR), after --warmup_steps.");
ABSL_FLAG(int64_t, warmup_steps, Default().training.lr_schedule.warmup_steps,
          "Steps of linear warmup: the rate rises from lr / N to lr.");
ABSL_FLAG(int64_t, lr_step_size, Default().training.lr_schedule.step_size,
          "--lr_schedule=step: steps between decays.");
ABSL_FLAG(double, lr_step_gamma, Default().training.lr_schedule.gamma,
          "--lr_schedule=step: the factor of each decay.");
ABSL_FLAG(int64_t, trace_steps, Default().training.trace_steps,
          "The pipelined step: steps 10 to 10 + N - 1 each print their "
          "timeline as a JSON line (\"event\":\"step_trace\": when forward "
          "asked for each parameter and had it, when each gradient was made, "
          "copied out and free to leave, and when its values came back; "
          "microseconds from the step's start). 0: none.");
ABSL_FLAG(int64_t, inject_step_delay_ms,
          Default().training.inject_step_delay_ms,
          "Fault injection: make every step this much slower (a straggler).");
ABSL_FLAG(int64_t, inject_crash_before_push_step,
          Default().training.inject_crash_before_push_step,
          "Fault injection: once this step's model is pulled, before any of "
          "its gradient is pushed, the worker kills itself with SIGKILL (as "
          "kill -9 would). -1: never.");
ABSL_FLAG(int64_t, inject_crash_after_step,
          Default().training.inject_crash_after_step,
          "Fault injection: once this step's exchange has returned (its "
          "gradient applied on every shard), the worker kills itself with "
          "SIGKILL. -1: never.");
ABSL_FLAG(int64_t, inject_sigterm_after_step,
          Default().training.inject_sigterm_after_step,
          "Fault injection: once this step's exchange has returned, the "
          "worker sends itself SIGTERM (as a stopping launcher would) and "
          "stops before its next step. -1: never.");
ABSL_FLAG(int64_t, inject_sigterm_before_push_step,
          Default().training.inject_sigterm_before_push_step,
          "Fault injection: once this step's model is pulled, before any of "
          "its gradient is pushed, the worker sends itself SIGTERM and stops "
          "without pushing it. -1: never.");
ABSL_FLAG(int64_t, inject_sigterm_in_backward_step,
          Default().training.inject_sigterm_in_backward_step,
          "Fault injection: once this step's first gradients are ready, the "
          "worker sends itself SIGTERM; it pushes the step whole, then "
          "stops. -1: never.");
ABSL_FLAG(int64_t, inject_backward_pause_ms,
          Default().training.inject_backward_pause_ms,
          "Fault injection: every step's backward pauses this long once its "
          "first gradients are ready (with the pipelined step they have "
          "left), as a big model's backward would take.");

// Evaluation (EvalConfig).
ABSL_FLAG(int64_t, eval_every_steps, Default().eval.eval_every_steps,
          "Worker 0 evaluates the model on the held-out set every this many "
          "steps (0: not by steps): progress line, --metrics_csv and the "
          "pstrain_worker_test_* gauges.");
ABSL_FLAG(int64_t, eval_every_epochs, Default().eval.eval_every_epochs,
          "Worker 0 evaluates the model on the held-out set every this many "
          "epochs (0: not by epochs).");
ABSL_FLAG(double, target_accuracy, Default().eval.target_accuracy,
          "Held-out accuracy to reach: the final JSON reports the training "
          "time (evaluations left out) and step of the first evaluation at "
          "or above it as time_to_target_s / step_to_target (null: not "
          "reached). 0: none.");
ABSL_FLAG(bool, eval_only, Default().eval.eval_only,
          "Evaluate --model_file on the held-out set (the data flags as for "
          "training) with no servers, print the final JSON line and exit.");
ABSL_FLAG(std::string, model_file, Default().eval.model_file,
          "With --eval_only: a model file written by pstrain_export "
          "(safetensors).");
ABSL_FLAG(std::string, logits_file, Default().eval.logits_file,
          "With --eval_only: write the held-out logits here, .csv (one row "
          "per example) or .npy.");

// Progress and metrics (OutputConfig).
ABSL_FLAG(int64_t, log_every, Default().output.log_every,
          "Steps between progress lines when stdout is not a terminal (0: no "
          "progress output at all).");
ABSL_FLAG(std::string, progress, Default().output.progress,
          "auto: a progress bar updated in place when stdout is a terminal, "
          "plain lines every --log_every steps otherwise; bar; lines.");
ABSL_FLAG(std::string, metrics_csv, Default().output.metrics_csv,
          "Write one row per step here: step,time_s,loss,train_accuracy,"
          "samples_per_sec,pull_ms,push_ms (bench/plot/plot_runs.sh plots "
          "them).");
ABSL_FLAG(int, metrics_port, Default().output.metrics_port,
          "Serve Prometheus metrics on http://<metrics_host>:PORT/metrics "
          "(0: off; -1: a free port, see --metrics_port_file).");
ABSL_FLAG(std::string, metrics_host, Default().output.metrics_host,
          "Address the metrics endpoint listens on.");
ABSL_FLAG(std::string, metrics_port_file, Default().output.metrics_port_file,
          "If set, the metrics port is written here once serving.");
ABSL_FLAG(double, metrics_linger_s, Default().output.metrics_linger_s,
          "After training, keep serving the final metrics this long (or "
          "until SIGTERM) so a scraper sees them.");

// --model=ctr (CtrConfig; worker/ctr_main.h).
ABSL_FLAG(std::string, ctr_data, Default().ctr.data,
          "--model=ctr data: synthetic (a hidden ground-truth model, so the "
          "achievable AUC is known), criteo (TSV) or libsvm.");
ABSL_FLAG(int, ctr_fields, Default().ctr.fields,
          "Categorical fields (synthetic, criteo).");
ABSL_FLAG(int, ctr_dense, Default().ctr.dense,
          "Dense features (synthetic, criteo).");
ABSL_FLAG(int64_t, ctr_vocab, Default().ctr.vocab,
          "Synthetic: ids per field (Zipf).");
ABSL_FLAG(std::string, ctr_cardinalities, Default().ctr.cardinalities,
          "Synthetic: each field's ids, in place of --ctr_vocab: criteo (the "
          "26 fields of Criteo's Kaggle set, 3 to 10 million values; with "
          "--ctr_fields=26) or a comma-separated list, one per field.");
ABSL_FLAG(int64_t, ctr_train_examples, Default().ctr.train_examples,
          "Synthetic: training examples in the whole job.");
ABSL_FLAG(int64_t, ctr_test_examples, Default().ctr.test_examples,
          "Synthetic: held-out examples.");
ABSL_FLAG(int64_t, embedding_dim, Default().ctr.embedding_dim,
          "Embedding row size.");
ABSL_FLAG(int64_t, embedding_max_bytes, Default().ctr.embedding_max_bytes,
          "Each CTR table's memory budget on each server, in bytes: at it "
          "the server evicts the least recently used rows; registration "
          "refuses a budget below one row or over --max_shard_memory_gb. "
          "0: none.");
ABSL_FLAG(std::string, embedding_mode, Default().ctr.embedding_mode,
          "How the servers apply the CTR tables' pushes: empty (the "
          "servers' --mode) or async (each push on arrival, pulls never "
          "wait: with sync servers, sync dense layers and async tables).");
ABSL_FLAG(bool, embedding_prefetch, Default().ctr.embedding_prefetch,
          "Async CTR tables (--embedding_mode=async or --mode=async): pull "
          "the next batch's rows while this one trains and push a step's "
          "rows beside the dense exchange, on a second thread. A step's "
          "rows then hold this worker's pushes up to 2 steps old and the "
          "others' up to 4 (false: every worker's up to the step before).");
ABSL_FLAG(int64_t, ctr_hidden, Default().ctr.hidden,
          "Hidden units of the CTR model's MLP.");
ABSL_FLAG(std::string, sparse_optimizer, Default().ctr.sparse_optimizer,
          "Row updates on the servers: sgd, adagrad, adam (lazy) or ftrl.");
ABSL_FLAG(double, sparse_learning_rate, Default().ctr.sparse_learning_rate,
          "Sparse optimizer rate (not ftrl's: see --ftrl_alpha). 0 (the "
          "default): the optimizer's own default, as PyTorch and Keras users "
          "know it: adagrad 0.01 (torch.optim.Adagrad), adam 0.001 "
          "(torch.optim.SparseAdam and keras Adam), sgd 0.01 (keras SGD). "
          "The rate in effect is logged at start.");
ABSL_FLAG(double, adagrad_initial_accumulator,
          Default().ctr.adagrad_initial_accumulator, "Adagrad's start.");
ABSL_FLAG(double, ftrl_alpha, Default().ctr.ftrl_alpha,
          "FTRL-proximal alpha, ftrl's learning rate (keras Ftrl's "
          "learning_rate defaults to 0.001; this keeps the 0.05 pstrain has "
          "always used).");
ABSL_FLAG(double, ftrl_beta, Default().ctr.ftrl_beta, "FTRL-proximal beta.");
ABSL_FLAG(double, ftrl_l1, Default().ctr.ftrl_l1, "FTRL-proximal L1.");
ABSL_FLAG(double, ftrl_l2, Default().ctr.ftrl_l2, "FTRL-proximal L2.");
ABSL_FLAG(double, embedding_init_scale, Default().ctr.embedding_init_scale,
          "Rows start uniform in [-scale, scale] (deterministic per id).");

namespace pstrain {

absl::StatusOr<WorkerConfig> WorkerConfigFromFlags(int argc, char** argv) {
  absl::StatusOr<std::vector<FlagSetting>> from_spec = ApplyClusterSpec(
      ClusterRole::kWorker, absl::GetFlag(FLAGS_cluster_spec), argc, argv);
  if (!from_spec.ok()) return from_spec.status();
  if (!from_spec->empty()) {
    std::vector<std::string> applied;
    for (const FlagSetting& f : *from_spec) {
      applied.push_back(absl::StrCat("--", f.name, "=", f.value));
    }
    LOG(INFO) << "from the cluster spec: " << absl::StrJoin(applied, " ");
  }
  // Set on the command line or by the cluster spec: its default, then, is
  // no answer to "did the user ask for this value?".
  std::set<std::string> given = FlagsOnCommandLine(argc, argv);
  for (const FlagSetting& f : *from_spec) given.insert(f.name);

  WorkerConfig c;
  c.worker_id = absl::GetFlag(FLAGS_worker_id);
  c.num_workers = absl::GetFlag(FLAGS_num_workers);
  c.seed = absl::GetFlag(FLAGS_seed);

  ClientConfig& client = c.client;
  const std::string ps_hosts = absl::GetFlag(FLAGS_ps_hosts);
  if (!ps_hosts.empty()) client.hosts = absl::StrSplit(ps_hosts, ',');
#define PSTRAIN_READ_CLIENT_FLAG(type, name, member, help) \
  client.member = absl::GetFlag(FLAGS_##name);
  PSTRAIN_CLIENT_OPTIONS(PSTRAIN_READ_CLIENT_FLAG)
#undef PSTRAIN_READ_CLIENT_FLAG
  client.grpc_tuning = GrpcTuningFlagValues();

  DataConfig& data = c.data;
  data.source = absl::GetFlag(FLAGS_data);
  data.train_file = absl::GetFlag(FLAGS_train_file);
  data.test_file = absl::GetFlag(FLAGS_test_file);
  data.train_labels = absl::GetFlag(FLAGS_train_labels);
  data.test_labels = absl::GetFlag(FLAGS_test_labels);
  data.dataset_dir = absl::GetFlag(FLAGS_dataset_dir);
  data.num_features = absl::GetFlag(FLAGS_num_features);
  data.num_classes = absl::GetFlag(FLAGS_num_classes);
  data.label_noise = absl::GetFlag(FLAGS_label_noise);
  data.train_examples = absl::GetFlag(FLAGS_train_examples);
  data.test_examples = absl::GetFlag(FLAGS_test_examples);

  ModelConfig& model = c.model;
  model.name = absl::GetFlag(FLAGS_model);
  model.hidden = absl::GetFlag(FLAGS_hidden);
  model.layers = absl::GetFlag(FLAGS_layers);
  model.input_shape = absl::GetFlag(FLAGS_input_shape);
  model.probe_elements = absl::GetFlag(FLAGS_probe_elements);
  model.probe_check_pulls = absl::GetFlag(FLAGS_probe_check_pulls);
  model.backend = {absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_precision),
                   absl::GetFlag(FLAGS_cpu_threads)};
  model.block_elements = absl::GetFlag(FLAGS_block_elements);

  TrainingConfig& training = c.training;
  training.steps = absl::GetFlag(FLAGS_steps);
  training.epochs = absl::GetFlag(FLAGS_epochs);
  training.batch_size = absl::GetFlag(FLAGS_batch_size);
  training.global_batch_size = absl::GetFlag(FLAGS_global_batch_size);
  training.steps_given = given.count("steps") > 0;
  training.batch_size_given = given.count("batch_size") > 0;
  training.shuffle = absl::GetFlag(FLAGS_shuffle);
  training.overlap_push = absl::GetFlag(FLAGS_overlap_push);
  training.push_pull = absl::GetFlag(FLAGS_push_pull);
  training.pipeline_step = absl::GetFlag(FLAGS_pipeline_step);
  training.loss_check_steps = absl::GetFlag(FLAGS_loss_check_steps);
  training.trace_steps = absl::GetFlag(FLAGS_trace_steps);
  training.inject_step_delay_ms = absl::GetFlag(FLAGS_inject_step_delay_ms);
  training.lr_schedule.kind = absl::GetFlag(FLAGS_lr_schedule);
  training.lr_schedule.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  training.lr_schedule.step_size = absl::GetFlag(FLAGS_lr_step_size);
  training.lr_schedule.gamma = absl::GetFlag(FLAGS_lr_step_gamma);
  training.inject_crash_before_push_step =
      absl::GetFlag(FLAGS_inject_crash_before_push_step);
  training.inject_crash_after_step =
      absl::GetFlag(FLAGS_inject_crash_after_step);
  training.inject_sigterm_after_step =
      absl::GetFlag(FLAGS_inject_sigterm_after_step);
  training.inject_sigterm_before_push_step =
      absl::GetFlag(FLAGS_inject_sigterm_before_push_step);
  training.inject_sigterm_in_backward_step =
      absl::GetFlag(FLAGS_inject_sigterm_in_backward_step);
  training.inject_backward_pause_ms =
      absl::GetFlag(FLAGS_inject_backward_pause_ms);

  EvalConfig& eval = c.eval;
  eval.eval_every_steps = absl::GetFlag(FLAGS_eval_every_steps);
  eval.eval_every_epochs = absl::GetFlag(FLAGS_eval_every_epochs);
  eval.target_accuracy = absl::GetFlag(FLAGS_target_accuracy);
  eval.eval_only = absl::GetFlag(FLAGS_eval_only);
  eval.model_file = absl::GetFlag(FLAGS_model_file);
  eval.logits_file = absl::GetFlag(FLAGS_logits_file);

  OutputConfig& output = c.output;
  output.log_every = absl::GetFlag(FLAGS_log_every);
  output.progress = absl::GetFlag(FLAGS_progress);
  output.metrics_csv = absl::GetFlag(FLAGS_metrics_csv);
  output.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  output.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  output.metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  output.metrics_linger_s = absl::GetFlag(FLAGS_metrics_linger_s);

  CtrConfig& ctr = c.ctr;
  ctr.data = absl::GetFlag(FLAGS_ctr_data);
  ctr.fields = absl::GetFlag(FLAGS_ctr_fields);
  ctr.dense = absl::GetFlag(FLAGS_ctr_dense);
  ctr.vocab = absl::GetFlag(FLAGS_ctr_vocab);
  ctr.cardinalities = absl::GetFlag(FLAGS_ctr_cardinalities);
  ctr.train_examples = absl::GetFlag(FLAGS_ctr_train_examples);
  ctr.test_examples = absl::GetFlag(FLAGS_ctr_test_examples);
  ctr.embedding_dim = absl::GetFlag(FLAGS_embedding_dim);
  ctr.embedding_max_bytes = absl::GetFlag(FLAGS_embedding_max_bytes);
  ctr.embedding_mode = absl::GetFlag(FLAGS_embedding_mode);
  ctr.embedding_prefetch = absl::GetFlag(FLAGS_embedding_prefetch);
  ctr.hidden = absl::GetFlag(FLAGS_ctr_hidden);
  ctr.sparse_optimizer = absl::GetFlag(FLAGS_sparse_optimizer);
  ctr.sparse_learning_rate = absl::GetFlag(FLAGS_sparse_learning_rate);
  ctr.adagrad_initial_accumulator =
      absl::GetFlag(FLAGS_adagrad_initial_accumulator);
  ctr.ftrl_alpha = absl::GetFlag(FLAGS_ftrl_alpha);
  ctr.ftrl_beta = absl::GetFlag(FLAGS_ftrl_beta);
  ctr.ftrl_l1 = absl::GetFlag(FLAGS_ftrl_l1);
  ctr.ftrl_l2 = absl::GetFlag(FLAGS_ftrl_l2);
  ctr.embedding_init_scale = absl::GetFlag(FLAGS_embedding_init_scale);
  return c;
}

}  // namespace pstrain
