// A click-through-rate model whose embedding tables live sharded on the
// parameter servers: each step pulls only the rows its batch touches and
// pushes only their gradients.
//
//   field f's ids -> mean embedding bag E_f [batch, dim]   (sparse table f)
//   h = relu(sum_f E_f W1_f + dense W1_dense + b1)         (dense tensors)
//   logits = h W2 + b2, two classes; softmax cross-entropy on them is the
//   logistic loss of the score logit_1 - logit_0.
//
// The first layer is a sum of per-field products rather than one product of
// the concatenated bags: the same function, with no concatenation op.
#ifndef PSTRAIN_WORKER_CTR_TRAINER_H_
#define PSTRAIN_WORKER_CTR_TRAINER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/consistency_mode.h"
#include "kernels/backend.h"
#include "proto/ps.pb.h"
#include "worker/client/graceful_stop.h"
#include "worker/client/ps_client.h"
#include "worker/ctr_data.h"
#include "worker/trainer.h"

namespace pstrain {

struct CtrModelOptions {
  int num_fields = 0;
  int num_dense = 0;
  int64_t dim = 8;
  int64_t hidden = 32;
  uint64_t seed = 1;
  int64_t block_elements = 1 << 17;
  InitSpec embedding_init;  // rows are created with it on the servers
  SparseOptimizer sparse_optimizer;
  int64_t table_max_bytes = 0;  // each table's budget per server; 0: none
  std::string table_mode;       // each table's SparseTableSpec.mode
};

// The model's schema: dense layers and one sparse table per field
// (CtrTableName(f)).
ModelSchema CtrSchema(const CtrModelOptions& options);

struct CtrTrainerOptions {
  int worker_id = 0;
  int num_workers = 1;
  int64_t start_step = 0;
  int64_t steps = 100;
  int64_t batch_size = 128;
  std::function<void(const StepReport&)> on_step;
  const std::atomic<bool>* stop = nullptr;
  // Optional (TrainerOptions has the same).
  GracefulStop* graceful_stop = nullptr;
  // Fault injection: SIGTERM once this step is pushed (InjectSigterm).
  int64_t sigterm_after_step = -1;
  // ... once this step's model is pulled, before any of it is pushed.
  int64_t sigterm_before_push_step = -1;
  // async/ssp: a client registered as an observer (worker id -1) that reads
  // the final model once every worker has finished, waiting up to
  // final_model_timeout; null: `client` reads it, after leaving.
  PsClient* observer = nullptr;
  absl::Duration final_model_timeout = absl::Seconds(120);
  // Called once the steps are over, before the final evaluation (a sync
  // worker stopped by a signal: once it has the step it reached).
  std::function<void()> on_steps_done;
  // The servers' rate for the dense layers at each step (--lr_schedule),
  // carried by the step's pushes; null: their own. The tables keep their
  // optimizer's rate.
  std::function<double(int64_t)> learning_rate_at;
  // Async tables (--embedding_mode=async, or --mode=async): the table lane
  // (--embedding_prefetch), a thread that pulls the next batch's rows while
  // this one trains and pushes a step's rows while the dense exchange runs.
  // A step's rows then hold this worker's own pushes through two steps
  // before and every worker's through four (without the lane: every
  // worker's through the step before). The job's last step moves its rows
  // in line, before its dense gradient, so every worker evaluates one model.
  // False, or tables in the sync step: pull, train, push, one after another.
  bool table_lane = true;
  // Fault injection (--inject_step_delay_ms): each step this much slower,
  // before its push, as a straggler's.
  absl::Duration step_delay = absl::ZeroDuration();
};

struct CtrResult {
  ConsistencyMode mode = ConsistencyMode::kSync;
  int64_t steps = 0;
  int64_t steps_run = 0;
  double final_loss = 0;  // training logloss over the last tenth of steps
  double auc = 0;         // held out
  double logloss = 0;     // held out
  int64_t test_examples = 0;
  double samples_per_sec = 0;
  double wall_time_s = 0;
  int64_t rows_pulled = 0;  // sparse rows moved: the job never moves a table
  int64_t rows_pushed = 0;
  // Training's rows that came from the servers (with --sparse_cache_steps:
  // those the row cache did not have), and the cache's hits.
  int64_t rows_from_servers = 0;
  int64_t cache_hits = 0;
  int64_t cache_bytes_saved = 0;
  // The table lane's (CtrTrainerOptions::table_lane) time at work, and how
  // much of it the training thread waited for; 0 without the lane.
  double table_lane_seconds = 0;
  double table_lane_wait_seconds = 0;
  // sync: steps completed with fewer than num_workers gradients.
  int64_t steps_short = 0;
  bool stopped_early = false;
  // Which model the held-out figures are of, as TrainResult::final_model:
  // "sync_step", or how the async/ssp wait ended ("all_done", "quiet",
  // "timeout").
  std::string final_model;
  // The servers' copy of that model, as TrainResult::final_state.
  FinalState final_state;
};

// Trains against servers that `client` is registered with (CtrSchema, as
// this worker), leaves the job, and evaluates on `test` (may be empty).
absl::StatusOr<CtrResult> TrainCtr(const CtrModelOptions& model,
                                   const CtrTrainerOptions& options,
                                   ConsistencyMode mode, PsClient& client,
                                   kernels::Backend& backend,
                                   const CtrDataset& train,
                                   const CtrDataset& test);

// The final JSON line; `true_auc`/`true_logloss` are those of the data's
// ground truth when known (synthetic data), else NaN (omitted).
std::string CtrFinalJson(const CtrResult& result, int worker_id,
                         int num_workers, const std::string& device,
                         double true_auc, double true_logloss);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CTR_TRAINER_H_
