// The worker's --model=ctr path: CTR data, the sparse-table model, and its
// final JSON line. The binary's main parses the shared flags and hands over.
#ifndef PSTRAIN_WORKER_CTR_MAIN_H_
#define PSTRAIN_WORKER_CTR_MAIN_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "kernels/backend.h"
#include "worker/ps_client.h"
#include "worker/trainer.h"

namespace pstrain {

struct CtrWorkerContext {
  int worker_id = 0;
  int num_workers = 1;
  int64_t steps = 100;
  int64_t batch_size = 128;
  uint64_t seed = 1;
  int64_t block_elements = 1 << 17;
  std::string train_file, test_file;  // with --ctr_data=criteo|libsvm
  PsClient* client = nullptr;
  // async/ssp: how to connect an observer (worker id -1) that evaluates the
  // job's final model after this worker has left, and how long to wait for
  // the other workers to finish (TrainResult's rule, worker/trainer.h).
  const PsClientOptions* client_options = nullptr;
  absl::Duration final_model_timeout = absl::Seconds(120);
  kernels::Backend* backend = nullptr;
  std::function<void(const StepReport&)> on_step;
  // While the job waits for its workers (PsClient::AwaitJobStart).
  PsClient::StartWaitReport on_waiting;
  const std::atomic<bool>* stop = nullptr;
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

// Checks the CTR flags (exits 2 with one line per problem), loads the data,
// registers, trains, prints the final JSON line. Returns the exit code.
int RunCtrWorker(const CtrWorkerContext& context);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CTR_MAIN_H_
