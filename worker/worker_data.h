// A dense model's data as the configuration names it (worker/worker_config.h
// DataConfig): the training and held-out sets, and how this worker steps
// through them (its batch, the steps of an epoch, the steps to run).
// --model=ctr reads its own (worker/ctr_main.h).
#ifndef PSTRAIN_WORKER_WORKER_DATA_H_
#define PSTRAIN_WORKER_WORKER_DATA_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/data.h"
#include "worker/worker_config.h"

namespace pstrain {

struct TrainingData {
  std::unique_ptr<ExampleSource> train, test;  // test may be null
  double synthetic_best_accuracy = -1;         // synthetic data only
  int64_t batch_size = 0;                      // this worker's
  int64_t global_batch = 0;                    // the whole job's
  int64_t steps_per_epoch = 0;
  int64_t steps = 0;  // to train: --steps, or --epochs of steps_per_epoch
};

// Reads the training and held-out data and plans the steps. Every problem
// (a file that does not read, a global batch larger than the data, --steps
// that contradict --epochs) is reported here, before the worker registers
// anything with the servers: the first one, in words for the command line.
// `config` is validated (ValidateWorkerConfig).
absl::StatusOr<TrainingData> LoadTrainingData(const WorkerConfig& config);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_WORKER_DATA_H_
