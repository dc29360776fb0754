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
// worker/worker_config.h, and Main below is the run, stage by stage
// (worker/worker_run.h).
#include <memory>

#include "absl/status/statusor.h"
#include "common/cli.h"
#include "glog/logging.h"
#include "kernels/backend.h"
#include "worker/eval_only.h"
#include "worker/worker_config.h"
#include "worker/worker_data.h"
#include "worker/worker_flags.h"
#include "worker/worker_run.h"

namespace pstrain {
namespace {

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
    return TrainCtrAndReport(*config, *servers, **backend, *output->steps,
                             stopping);
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
