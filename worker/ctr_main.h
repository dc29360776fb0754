// The worker's --model=ctr path: CTR data, the sparse-table model, and its
// final JSON line. The binary's Main validates the configuration (CTR's
// part included: worker/worker_config.h) and hands over.
#ifndef PSTRAIN_WORKER_CTR_MAIN_H_
#define PSTRAIN_WORKER_CTR_MAIN_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "kernels/backend.h"
#include "worker/client/graceful_stop.h"
#include "worker/client/ps_client.h"
#include "worker/trainer.h"
#include "worker/worker_config.h"

namespace pstrain {

struct CtrWorkerContext {
  // What to train: worker_id, num_workers, seed, training.steps,
  // training.batch_size, model.block_elements, data.train_file and
  // data.test_file (with --ctr_data=criteo|libsvm), and ctr. Validated
  // (ValidateWorkerConfig).
  const WorkerConfig* config = nullptr;
  PsClient* client = nullptr;
  // async/ssp: how to connect an observer (worker id -1) that evaluates the
  // job's final model after this worker has left; it waits
  // client.rpc_timeout_s for the other workers to finish (TrainResult's
  // rule, worker/trainer.h).
  const PsClientOptions* client_options = nullptr;
  kernels::Backend* backend = nullptr;
  std::function<void(const StepReport&)> on_step;
  // While the job waits for its workers (PsClient::AwaitJobStart).
  PsClient::StartWaitReport on_waiting;
  const std::atomic<bool>* stop = nullptr;
  // Optional (TrainerOptions has the same).
  GracefulStop* graceful_stop = nullptr;
  // Optional. Registers (instead of client->Register), showing the wait.
  std::function<absl::StatusOr<Registration>(const ModelSchema&)>
      register_model;
  // Optional. Called once the steps are over (TrainerOptions has the same).
  std::function<void()> on_steps_done;
  // Optional. A wait ended CANCELLED after `stop` was set (a signal):
  // leaves, says what it waited for, returns the exit code.
  std::function<int(const std::string& waiting_for, const absl::Status&)>
      stopped_while_waiting;
};

// Loads the data (exits 2 with one line for a file that does not read),
// registers, trains, prints the final JSON line. Returns the exit code.
int RunCtrWorker(const CtrWorkerContext& context);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CTR_MAIN_H_
