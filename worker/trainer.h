// The worker's training loop: pull (step) -> forward/backward on the
// backend -> push (step), then a final pull and a held-out evaluation.
#ifndef PSTRAIN_WORKER_TRAINER_H_
#define PSTRAIN_WORKER_TRAINER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "worker/data.h"
#include "worker/model.h"
#include "worker/ps_client.h"

namespace pstrain {

// What one step did, for progress output and metrics.
struct StepReport {
  int64_t step = 0;  // steps done (1-based)
  int64_t steps = 0;
  double loss = 0;            // this step's batch mean
  double train_accuracy = 0;  // this step's batch
  int64_t examples = 0;
  double step_seconds = 0;  // wall time of the step, pull to push
  double pull_seconds = 0;
  double push_seconds = 0;
};

struct TrainerOptions {
  int worker_id = 0;
  int num_workers = 1;
  int64_t start_step = 0;  // a worker (re)joining a running job starts late
  int64_t steps = 100;
  int64_t batch_size = 64;  // this worker's; the model's max_batch
  // Called after every step (on the training thread).
  std::function<void(const StepReport&)> on_step;
  // Fault injection: extra time per step, as a straggler would take.
  absl::Duration step_delay = absl::ZeroDuration();
  // Set (e.g. by SIGTERM) to stop after the current step and leave the job.
  const std::atomic<bool>* stop = nullptr;
};

struct TrainResult {
  std::string mode;
  int64_t steps = 0;
  double final_loss = 0;  // mean training loss over the last 10% of steps
  double train_accuracy = 0;
  double test_loss = 0;
  double test_accuracy = 0;
  int64_t test_examples = 0;
  double samples_per_sec = 0;
  double wall_time_s = 0;
  int64_t start_step = 0;
  int64_t steps_run = 0;         // steps this worker computed
  int64_t steps_skipped = 0;     // sync: steps the job finished without it
  int64_t duplicate_blocks = 0;  // pushes the servers had already received
  int64_t late_blocks = 0;       // sync: gradients for a finished step
  int64_t injected_duplicate_pushes = 0;
  bool stopped_early = false;
};

// Trains `model` against the servers behind `client` (already registered as
// this worker, in mode `mode`), leaves the job, and evaluates the final
// model on `test` (may be empty).
absl::StatusOr<TrainResult> Train(const TrainerOptions& options,
                                  const std::string& mode, PsClient& client,
                                  Model& model, kernels::Backend& backend,
                                  const Dataset& train, const Dataset& test);

// The one-line JSON summary a script reads: {"event":"final",...}.
std::string FinalJson(const TrainResult& result, int worker_id, int num_workers,
                      const std::string& device);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_TRAINER_H_
