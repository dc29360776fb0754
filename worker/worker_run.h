// The stages of a worker's run once its configuration is validated, in the
// order Main (worker/main.cc) calls them: where the run is shown and
// counted, signals, the connection to the servers, the model, and training
// (dense here, CTR in worker/ctr_main.h) through to the final JSON line.
// Each stage that can fail returns what failed; Main picks the exit code.
#ifndef PSTRAIN_WORKER_WORKER_RUN_H_
#define PSTRAIN_WORKER_WORKER_RUN_H_

#include <atomic>
#include <memory>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "kernels/backend.h"
#include "worker/client/ps_client.h"
#include "worker/model.h"
#include "worker/signal_watch.h"
#include "worker/step_output.h"
#include "worker/worker_config.h"
#include "worker/worker_data.h"

namespace pstrain {

// Where the run is shown and counted.
struct RunOutput {
  std::unique_ptr<MetricsEndpoint> endpoint;  // with --metrics_port
  std::unique_ptr<WorkerMetrics> metrics;     // served by `endpoint`
  std::unique_ptr<StepOutput> steps;          // bar or lines, CSV, metrics
};

// Opens --metrics_csv (failing, it exits 2 as a flag error would) and starts
// the Prometheus endpoint (--metrics_port: its failure is returned).
absl::StatusOr<RunOutput> StartOutput(const WorkerConfig& config);

// SIGINT/SIGTERM from here on: `requested` turns true and `watch` cuts
// waits short (worker/signal_watch.h). Both live as long as the process.
struct Stopping {
  std::atomic<bool>* requested = nullptr;
  SignalWatch* watch = nullptr;
};
Stopping WatchForSignals();

// The client of the servers; its retries show on the progress bar while a
// training stage runs.
struct ServerConnection {
  PsClientOptions options;
  std::unique_ptr<PsClient> client;
};
absl::StatusOr<ServerConnection> ConnectToServers(const ClientConfig& config);

// --model=ctr: the sparse model (worker/ctr_main.h), trained and reported.
// Returns the exit code.
int TrainCtrAndReport(const WorkerConfig& config, ServerConnection& servers,
                      kernels::Backend& backend, StepOutput& output,
                      const Stopping& stopping);

// One log line: this worker, its backend, its data and its steps.
void LogRunPlan(const WorkerConfig& config, const TrainingData& data,
                const kernels::Backend& backend);

// The dense model --model names, sized for `data` and this worker's batch.
// A --layers list or --input_shape that does not fit the data exits 2, as a
// flag error.
absl::StatusOr<std::unique_ptr<Model>> BuildModel(const WorkerConfig& config,
                                                  const TrainingData& data,
                                                  kernels::Backend& backend);

// Registers `model` with the servers, trains it with the job's other
// workers, evaluates the final model, prints the final JSON line and serves
// the final metrics for --metrics_linger_s. Returns the exit code (128 +
// the signal when one stopped a wait).
int TrainAndReport(const WorkerConfig& config, const TrainingData& data,
                   Model& model, kernels::Backend& backend,
                   ServerConnection& servers, RunOutput& output,
                   const Stopping& stopping);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_WORKER_RUN_H_
