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
//
// The flags are worker/worker_flags.cc; what they configure is
// worker/worker_config.h, and Main below is the run, stage by stage.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cli.h"
#include "common/connection_check.h"
#include "common/metrics.h"
#include "common/run_output.h"
#include "glog/logging.h"
#include "kernels/backend.h"
#include "worker/connect_wait.h"
#include "worker/ctr_main.h"
#include "worker/eval_only.h"
#include "worker/layers.h"
#include "worker/learning_watch.h"
#include "worker/model.h"
#include "worker/ps_client.h"
#include "worker/signal_watch.h"
#include "worker/step_output.h"
#include "worker/trainer.h"
#include "worker/worker_config.h"
#include "worker/worker_data.h"
#include "worker/worker_flags.h"

namespace pstrain {
namespace {

// Where the run is shown and counted.
struct RunOutput {
  std::unique_ptr<MetricsEndpoint> endpoint;  // with --metrics_port
  std::unique_ptr<WorkerMetrics> metrics;     // served by `endpoint`
  std::unique_ptr<StepOutput> steps;          // bar or lines, CSV, metrics
};

// SIGINT/SIGTERM from here on: `requested` turns true and `watch` cuts
// waits short (worker/signal_watch.h). Both live as long as the process.
struct Stopping {
  std::atomic<bool>* requested = nullptr;
  SignalWatch* watch = nullptr;
};

// The client of the servers; its retries show on the progress bar while a
// training stage runs.
struct ServerConnection {
  PsClientOptions options;
  std::unique_ptr<PsClient> client;
};

// SIGTERM/SIGINT: training finishes the step in hand, leaves the job and
// reports; a wait ends within a second (SignalWatch).
std::atomic<bool> stop_requested{false};
// Where a retry shows itself on the progress bar, once there is one.
std::atomic<StepOutput*> wait_display{nullptr};

// The model's schema, to register with the servers.
ModelSchema SchemaOf(const WorkerConfig& config, Model& model) {
  ModelSchema schema;
  schema.set_seed(config.seed);
  schema.set_block_elements(config.model.block_elements);
  for (const DenseTensorSpec& spec : model.Params()) {
    *schema.add_dense() = spec;
  }
  return schema;
}

// Registration failed (not by a signal): says why, and for a server that
// never answered what the likely cause is.
void ReportRegistrationFailure(const absl::Status& status,
                               const PsClientOptions& options) {
  LOG(ERROR) << "cannot register the model: " << status;
  // Waiting for servers, gRPC reports any cause as the deadline passing.
  // (A server that refuses this worker's transport fails fast instead,
  // with its cause: PsClient::Register.)
  if (absl::IsDeadlineExceeded(status)) {
    for (const std::string& host : options.hosts) {
      const std::string cause = DiagnoseConnection(
          host, options.credentials != nullptr, absl::Seconds(2));
      if (!cause.empty()) LOG(ERROR) << "likely cause: " << cause;
    }
  }
}

// After training: keeps serving the final metrics for --metrics_linger_s
// (or until SIGTERM) so a scraper sees them.
void LingerForScrapers(const WorkerConfig& config, const RunOutput& output) {
  const double linger_s = config.output.metrics_linger_s;
  if (output.endpoint != nullptr && linger_s > 0 && !stop_requested) {
    LOG(INFO) << "serving the final metrics for " << linger_s
              << " s (SIGTERM ends it)";
    const absl::Time until = absl::Now() + absl::Seconds(linger_s);
    while (absl::Now() < until && !stop_requested) {
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
}

absl::StatusOr<RunOutput> StartOutput(const WorkerConfig& config) {
  const OutputConfig& flags = config.output;
  RunOutput output;
  std::unique_ptr<MetricsCsv> csv;
  if (!flags.metrics_csv.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsCsv>> opened =
        MetricsCsv::Open(flags.metrics_csv);
    ExitOnFlagErrors({opened.status()});
    csv = std::move(*opened);
  }
  if (flags.metrics_port != 0) {
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> started =
        MetricsEndpoint::Start(flags.metrics_host,
                               std::max(flags.metrics_port, 0),
                               flags.metrics_port_file);
    if (!started.ok()) return started.status();
    output.endpoint = std::move(*started);
    output.metrics = std::make_unique<WorkerMetrics>(
        output.endpoint->registry(), config.worker_id);
    LOG(INFO) << "metrics on http://" << flags.metrics_host << ":"
              << output.endpoint->port() << "/metrics";
  }
  const bool bar = flags.progress == "bar" ||
                   (flags.progress == "auto" && isatty(STDOUT_FILENO) == 1);
  output.steps =
      std::make_unique<StepOutput>(config.worker_id, bar, flags.log_every,
                                   std::move(csv), output.metrics.get());
  return output;
}

Stopping WatchForSignals() {
  Stopping stopping;
  stopping.requested = &stop_requested;
  // Lives as long as the process: its thread does.
  stopping.watch = new SignalWatch(&stop_requested);
  stopping.watch->Start();
  return stopping;
}

absl::StatusOr<ServerConnection> ConnectToServers(const ClientConfig& config) {
  ServerConnection servers;
  absl::StatusOr<PsClientOptions> options = MakePsClientOptions(config);
  if (!options.ok()) return options.status();
  servers.options = *std::move(options);
  servers.options.on_retry = [](const std::string& line) {
    if (StepOutput* output = wait_display.load()) output->ShowWait(line);
  };
  absl::StatusOr<std::unique_ptr<PsClient>> client =
      PsClient::Create(servers.options);
  if (!client.ok()) return client.status();
  servers.client = *std::move(client);
  return servers;
}

int TrainCtr(const WorkerConfig& config, ServerConnection& servers,
             kernels::Backend& backend, StepOutput& output,
             const Stopping& stopping) {
  PsClient* const client = servers.client.get();
  SignalWatch* const signal_watch = stopping.watch;
  const int worker_id = config.worker_id;
  const int num_workers = config.num_workers;
  CtrWorkerContext ctr;
  ctr.config = &config;
  ctr.client = client;
  ctr.client_options = &servers.options;
  ctr.backend = &backend;
  ctr.on_step = [&output](const StepReport& r) { output.OnStep(r); };
  ctr.on_waiting = [&output](const JobStart& waiting) {
    output.OnWaitingForWorkers(waiting);
  };
  ctr.stop = stopping.requested;
  // Waits show themselves and end on a signal as the dense worker's do.
  wait_display = &output;
  signal_watch->Add(client);
  absl::Cleanup quiet = [signal_watch] {
    signal_watch->Quiet();
    wait_display = nullptr;
  };
  ctr.register_model = [&](const ModelSchema& schema) {
    return RegisterShowingWait(*client, servers.options, output, schema,
                               num_workers, worker_id);
  };
  ctr.on_steps_done = [signal_watch] { signal_watch->Quiet(); };
  ctr.stopped_while_waiting = [&](const std::string& waiting_for,
                                  const absl::Status& status) {
    return StoppedWhileWaiting(*signal_watch, output, *client, worker_id,
                               waiting_for, status);
  };
  output.Start(0);
  const int code = RunCtrWorker(ctr);
  output.Finish();
  return code;
}

void LogRunPlan(const WorkerConfig& config, const TrainingData& data,
                const kernels::Backend& backend) {
  if (data.synthetic_best_accuracy >= 0) {
    LOG(INFO) << "synthetic task: best achievable accuracy "
              << data.synthetic_best_accuracy;
  }
  LOG(INFO) << "worker " << config.worker_id << "/" << config.num_workers
            << " on " << backend.Name() << ": " << data.train->size()
            << " training examples ("
            << data.train->resident_bytes() / 1048576.0 << " MiB held), "
            << (data.test != nullptr ? data.test->size() : 0) << " held out; "
            << data.train->num_features() << " features, "
            << data.train->num_classes() << " classes; global batch "
            << data.global_batch << " (" << data.batch_size << " per worker), "
            << data.steps << " steps = "
            << static_cast<double>(data.steps) / data.steps_per_epoch
            << " epochs of " << data.steps_per_epoch << " steps";
}

absl::StatusOr<std::unique_ptr<Model>> BuildModel(const WorkerConfig& config,
                                                  const TrainingData& data,
                                                  kernels::Backend& backend) {
  const ModelConfig& model = config.model;
  if (model.name == "layers") {  // a bad list or shape is a flag error
    absl::StatusOr<std::unique_ptr<Model>> layers = CreateLayerModelFromFlags(
        &backend, model.layers, model.input_shape, data.train->num_features(),
        data.train->num_classes(), data.batch_size);
    ExitOnFlagErrors({layers.status()});
    return layers;
  }
  if (model.name == "probe") {
    return CreateProbeModel(&backend, model.probe_elements);
  }
  absl::StatusOr<std::vector<int64_t>> hidden = ParseHidden(model.hidden);
  if (!hidden.ok()) return hidden.status();  // validated: not here
  return CreateMlp(&backend, data.train->num_features(),
                   model.name == "softmax" ? std::vector<int64_t>{} : *hidden,
                   data.train->num_classes(), data.batch_size);
}

int TrainAndReport(const WorkerConfig& config, const TrainingData& data,
                   Model& model, kernels::Backend& backend,
                   ServerConnection& servers, RunOutput& run_output,
                   const Stopping& stopping) {
  const int worker_id = config.worker_id;
  const int num_workers = config.num_workers;
  PsClient& client = *servers.client;
  StepOutput& output = *run_output.steps;
  SignalWatch* const signal_watch = stopping.watch;
  const ModelSchema schema = SchemaOf(config, model);
  wait_display = &output;
  signal_watch->Add(&client);
  // Before the clients go, on every path: the watch must not touch them.
  absl::Cleanup quiet = [signal_watch] {
    signal_watch->Quiet();
    wait_display = nullptr;  // before `output` goes
  };
  // A signal during a wait: leave the job if this worker may have joined
  // it, and exit with one line saying what it waited for.
  auto interrupted = [&](const std::string& waiting_for,
                         const absl::Status& status) {
    return StoppedWhileWaiting(*signal_watch, output, client, worker_id,
                               waiting_for, status);
  };
  absl::StatusOr<Registration> registration = RegisterShowingWait(
      client, servers.options, output, schema, num_workers, worker_id);
  if (!registration.ok() && signal_watch->signal_number() != 0) {
    return interrupted("to reach the servers and register the model",
                       registration.status());
  }
  if (!registration.ok()) {
    ReportRegistrationFailure(registration.status(), servers.options);
    return 1;
  }
  // sync computes its first step while the job waits for its workers
  // (TrainerOptions::await_job_start); ssp waits here, before any step.
  absl::Status job_start = absl::OkStatus();
  auto await_job_start = [&]() {
    job_start = client.AwaitJobStart(
        [&output](const JobStart& w) { output.OnWaitingForWorkers(w); },
        stopping.requested);
    return job_start;
  };
  auto job_did_not_start = [&]() {
    if (signal_watch->signal_number() != 0 && absl::IsCancelled(job_start)) {
      return interrupted("for the job's other workers to register", job_start);
    }
    output.Finish();
    LOG(ERROR) << "the job did not start: " << job_start;
    client.Leave().IgnoreError();
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
        PsClient::CreateObserver(servers.options, schema, num_workers);
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
  options.steps = data.steps;
  options.batch_size = data.batch_size;
  options.shuffle = config.training.shuffle;
  options.overlap_push = config.training.overlap_push;
  options.push_pull = config.training.push_pull;
  options.seed = config.seed;
  options.periodic_evaluation = worker_id == 0;
  options.eval_every_steps = config.eval.eval_every_steps;
  options.eval_every_epochs = config.eval.eval_every_epochs;
  options.target_accuracy = config.eval.target_accuracy;
  options.final_model_timeout = absl::Seconds(config.client.rpc_timeout_s);
  options.observer = observer.get();
  LearningWatch learning_watch(config.training.loss_check_steps,
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
  options.stop = stopping.requested;
  if (registration->mode == "sync") options.await_job_start = await_job_start;
  options.step_delay = absl::Milliseconds(config.training.inject_step_delay_ms);
  output.Start(registration->start_step);
  absl::StatusOr<TrainResult> result =
      Train(options, registration->mode, client, model, backend, *data.train,
            data.test.get());
  if (!job_start.ok()) return job_did_not_start();
  if (!result.ok() && signal_watch->signal_number() != 0 &&
      absl::IsCancelled(result.status())) {
    return interrupted(absl::StrCat("on the servers after step ", last_step,
                                    " of ", data.steps),
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
      FinalJson(*result, worker_id, num_workers, backend.Name()).c_str());
  std::fflush(stdout);
  LingerForScrapers(config, run_output);
  return 0;
}

int Main(int argc, char** argv) {
  // What to do: the flags (and a cluster spec), every problem at once.
  absl::StatusOr<WorkerConfig> config = WorkerConfigFromFlags(argc, argv);
  ExitOnFlagErrors({config.status()});
  ExitOnFlagErrors(ValidateWorkerConfig(*config));
  const bool ctr = config->model.name == "ctr";

  // The data comes before anything that logs or talks to the servers: a bad
  // file or a batch that does not fit is one line and exit 2, and the
  // servers never hear of this worker. (CTR reads its own: ctr_main.h.)
  absl::StatusOr<TrainingData> data =
      ctr ? TrainingData() : LoadTrainingData(*config);
  ExitOnFlagErrors({data.status()});

  // Progress, CSV and Prometheus metrics.
  absl::StatusOr<RunOutput> output = StartOutput(*config);
  if (!output.ok()) {
    LOG(ERROR) << output.status();
    return 1;
  }

  // Checked one at a time from here: each may log or do real work.
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::CreateBackend(config->model.backend);
  ExitOnFlagErrors({backend.status()});
  const Stopping stopping = WatchForSignals();

  // The servers (none for --eval_only).
  absl::StatusOr<ServerConnection> servers = ServerConnection();
  if (!config->eval.eval_only) servers = ConnectToServers(config->client);
  ExitOnFlagErrors({servers.status()});
  if (ctr) {  // sparse embedding tables: worker/ctr_main.h
    return TrainCtr(*config, *servers, **backend, *output->steps, stopping);
  }

  // The model, trained with the job's other workers or (--eval_only)
  // evaluated from a file.
  LogRunPlan(*config, *data, **backend);
  absl::StatusOr<std::unique_ptr<Model>> model =
      BuildModel(*config, *data, **backend);
  if (!model.ok()) {
    LOG(ERROR) << "cannot build the model: " << model.status();
    return 1;
  }
  if (config->eval.eval_only) {
    return RunEvalOnly(EvalOnlyOptionsOf(*config), **model, **backend,
                       data->test.get());
  }
  return TrainAndReport(*config, *data, **model, **backend, *servers, *output,
                        stopping);
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  pstrain::InitProgram(argc, argv,
                       "worker: trains a model against the parameter servers");
  pstrain::CatchTerminationSignals();
  return pstrain::Main(argc, argv);
}
