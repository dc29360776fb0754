#include "worker/worker_run.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cli.h"
#include "common/consistency_mode.h"
#include "common/run_output.h"
#include "common/transport/connection_check.h"
#include "glog/logging.h"
#include "worker/connect_wait.h"
#include "worker/ctr_main.h"
#include "worker/layers.h"
#include "worker/learning_watch.h"
#include "worker/trainer.h"

namespace pstrain {
namespace {

// SIGTERM/SIGINT: training finishes the step in hand, leaves the job and
// reports; a wait is cut after the step's grace (SignalWatch).
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

}  // namespace

absl::StatusOr<RunOutput> StartOutput(const WorkerConfig& config) {
  const OutputConfig& wanted = config.output;
  RunOutput output;
  std::unique_ptr<MetricsCsv> csv;
  if (!wanted.metrics_csv.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsCsv>> opened =
        MetricsCsv::Open(wanted.metrics_csv);
    ExitOnFlagErrors({opened.status()});
    csv = std::move(*opened);
  }
  if (wanted.metrics_port != 0) {
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> started =
        MetricsEndpoint::Start(wanted.metrics_host,
                               std::max(wanted.metrics_port, 0),
                               wanted.metrics_port_file);
    if (!started.ok()) return started.status();
    output.endpoint = std::move(*started);
    output.metrics = std::make_unique<WorkerMetrics>(
        output.endpoint->registry(), config.worker_id);
    LOG(INFO) << "metrics on http://" << wanted.metrics_host << ":"
              << output.endpoint->port() << "/metrics";
  }
  const bool bar = wanted.progress == "bar" ||
                   (wanted.progress == "auto" && isatty(STDOUT_FILENO) == 1);
  output.steps =
      std::make_unique<StepOutput>(config.worker_id, bar, wanted.log_every,
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

int TrainCtrAndReport(const WorkerConfig& config, ServerConnection& servers,
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
  ctr.graceful_stop = signal_watch->graceful();
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
    return RegisterShowingWait(
        *client, servers.options, schema, num_workers, worker_id,
        [&output](const std::string& line) { output.ShowWait(line); });
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
    return CreateProbeModel(&backend, model.probe_elements,
                            model.probe_check_pulls);
  }
  absl::StatusOr<std::vector<int64_t>> hidden = ParseHidden(model.hidden);
  if (!hidden.ok()) return hidden.status();  // validated: not here
  return CreateMlp(&backend, data.train->num_features(),
                   model.name == "softmax" ? std::vector<int64_t>{} : *hidden,
                   data.train->num_classes(), data.batch_size);
}

namespace {

// The trainer's options from this worker's configuration and what the
// servers said at registration; the callbacks that need the caller's
// state are set by the caller.
TrainerOptions TrainerOptionsFor(const WorkerConfig& config,
                                 const TrainingData& data,
                                 const Registration& registration,
                                 const Stopping& stopping) {
  TrainerOptions options;
  options.worker_id = config.worker_id;
  options.num_workers = config.num_workers;
  options.steps = data.steps;
  options.batch_size = data.batch_size;
  options.shuffle = config.training.shuffle;
  options.overlap_push = config.training.overlap_push;
  options.push_pull = config.training.push_pull;
  options.pipeline_step = config.training.pipeline_step == "always"
                              ? TrainerOptions::Pipeline::kAlways
                          : config.training.pipeline_step == "never"
                              ? TrainerOptions::Pipeline::kNever
                              : TrainerOptions::Pipeline::kByHost;
  options.seed = config.seed;
  options.periodic_evaluation = config.worker_id == 0;
  options.eval_every_steps = config.eval.eval_every_steps;
  options.eval_every_epochs = config.eval.eval_every_epochs;
  options.target_accuracy = config.eval.target_accuracy;
  options.final_model_timeout = absl::Seconds(config.client.rpc_timeout_s);
  options.start_step = registration.start_step;
  options.stop = stopping.requested;
  options.graceful_stop = stopping.watch->graceful();
  options.trace_steps = config.training.trace_steps;
  options.step_delay = absl::Milliseconds(config.training.inject_step_delay_ms);
  options.crash_before_push_step =
      config.training.inject_crash_before_push_step;
  options.crash_after_step = config.training.inject_crash_after_step;
  options.sigterm_after_step = config.training.inject_sigterm_after_step;
  options.sigterm_before_push_step =
      config.training.inject_sigterm_before_push_step;
  options.sigterm_in_backward_step =
      config.training.inject_sigterm_in_backward_step;
  options.backward_pause =
      absl::Milliseconds(config.training.inject_backward_pause_ms);
  std::vector<absl::Status> problems;
  options.learning_rate_at =
      ScheduledRate(config.training.lr_schedule, data.steps,
                    registration.learning_rate, &problems);
  ExitOnFlagErrors(problems);
  return options;
}

}  // namespace

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
      client, servers.options, schema, num_workers, worker_id,
      [&output](const std::string& line) { output.ShowWait(line); });
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
  if (registration->mode != ConsistencyMode::kSync && !await_job_start().ok()) {
    return job_did_not_start();
  }
  if (registration->start_step > 0) {
    if (registration->resumes_in_place) {
      LOG(INFO) << "starting at step " << registration->start_step
                << " in the place of an earlier process of worker " << worker_id
                << ", whose pushes of every step before are in";
    } else {
      LOG(INFO) << "joining a running job at step " << registration->start_step;
    }
  }
  absl::StatusOr<std::unique_ptr<PsClient>> observer =
      PsClient::CreateFinalModelReader(registration->mode, servers.options,
                                       schema, num_workers);
  if (!observer.ok() && signal_watch->signal_number() != 0) {
    return interrupted("to connect the observer for the final model",
                       observer.status());
  }
  if (!observer.ok()) {
    LOG(ERROR) << "cannot connect the observer for the final model: "
               << observer.status();
    return 1;
  }
  if (*observer != nullptr) signal_watch->Add(observer->get());
  // Declared after the observer: runs before it is destroyed.
  absl::Cleanup quiet_observer = [signal_watch] { signal_watch->Quiet(); };

  TrainerOptions options =
      TrainerOptionsFor(config, data, *registration, stopping);
  options.observer = observer->get();
  // A worker that starts past step 0 (a resumed job, a late joiner) starts
  // from a trained model, whose loss need not fall by a tenth any more:
  // only NaN and Inf are watched (every resumed job said "not learning").
  LearningWatch learning_watch(
      registration->start_step > 0 ? 0 : config.training.loss_check_steps,
      registration->optimizer, registration->learning_rate);
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
  if (registration->mode == ConsistencyMode::kSync)
    options.await_job_start = await_job_start;
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

}  // namespace pstrain
