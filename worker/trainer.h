// The worker's training loop: pull (step) -> forward/backward on the
// backend -> push (step), with held-out evaluations along the way, then the
// job's final model (see Train) evaluated on the held-out set.
#ifndef PSTRAIN_WORKER_TRAINER_H_
#define PSTRAIN_WORKER_TRAINER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/consistency_mode.h"
#include "kernels/backend.h"
#include "worker/client/graceful_stop.h"
#include "worker/client/ps_client.h"
#include "worker/data.h"
#include "worker/model.h"

namespace pstrain {

// What one step did, for progress output and metrics.
struct StepReport {
  int64_t step = 0;  // steps done (1-based)
  int64_t steps = 0;
  double loss = 0;            // this step's batch mean
  double train_accuracy = 0;  // this step's batch
  int64_t examples = 0;
  double step_seconds = 0;  // wall time of the step, pull to push
  double pull_seconds = 0;  // waiting for the pull (sync: for the step)
  // From the first push RPC of the step to the last one's answer; with
  // overlap_push most of it runs during backward. With push_pull it
  // includes the next step's pull (whose pull_seconds is then 0).
  double push_seconds = 0;
  double compute_seconds = 0;  // batch, forward and backward
  // The step's time blocked on the network: the pull, the pushes still in
  // flight once backward was done, and the pipelined forward's wait for
  // its values.
  double network_wait_seconds = 0;
  // Set when the model after this step was evaluated on the held-out set.
  bool evaluated = false;
  double test_loss = 0;
  double test_accuracy = 0;
  int64_t epoch = 0;  // epochs completed (steps / steps_per_epoch, floored)
  // Sparse rows of the step (CTR): those pulled from the servers, and those
  // the row cache served (--sparse_cache_steps) with the bytes that saved.
  int64_t sparse_rows_pulled = 0;
  int64_t sparse_cache_hits = 0;
  int64_t sparse_cache_bytes_saved = 0;
};

struct TrainerOptions {
  int worker_id = 0;
  int num_workers = 1;
  int64_t start_step = 0;  // a worker (re)joining a running job starts late
  int64_t steps = 100;
  int64_t batch_size = 64;  // this worker's; the model's max_batch
  // The data order (worker/data.h EpochPlan): a new permutation of the
  // whole training set every epoch, from (seed, epoch), or none.
  bool shuffle = true;
  uint64_t seed = 1;
  // Held-out evaluation of the pulled model every this many steps and/or
  // epochs (0: never); only where `periodic_evaluation` is set (worker 0:
  // every worker would compute the same number in sync mode).
  bool periodic_evaluation = false;
  int64_t eval_every_steps = 0;
  int64_t eval_every_epochs = 0;
  // Accuracy whose first attainment (periodic or final evaluation, on the
  // worker with `periodic_evaluation`) is reported as time_to_target_s /
  // step_to_target; <= 0: none.
  double target_accuracy = 0;
  // async/ssp: after leaving, how long to wait for the other workers to
  // finish before evaluating the servers' model (see Train).
  absl::Duration final_model_timeout = absl::Seconds(120);
  // async/ssp: a client registered as an observer (worker id -1), to pull
  // the final model without rejoining the job. Null: `client` is used.
  PsClient* observer = nullptr;
  // Push each tensor's gradient as backward produces it, from a push
  // thread (worker/step_overlap.h); false: one push after backward.
  bool overlap_push = false;
  // Without overlap_push: end each step with one PsClient::PushPull (this
  // step's push and the next step's pull, one round trip per connection
  // on the data plane) instead of a Push, leaving the next step no pull.
  bool push_pull = true;
  // A sync step as a pipeline (--pipeline_step; trainer.cc,
  // StepRunner::RunPipelined): never; always; or by host, where a shard's
  // data plane goes to another host when the first step starts.
  enum class Pipeline { kNever, kByHost, kAlways };
  Pipeline pipeline_step = Pipeline::kByHost;
  // Called after every step (on the training thread).
  std::function<void(const StepReport&)> on_step;
  // The servers' rate at each step (--lr_schedule), carried by the step's
  // pushes; null: the servers' own.
  std::function<double(int64_t step)> learning_rate_at;
  // The pipelined step: steps [10, 10 + trace_steps) print their
  // timeline, one JSON line each ("event":"step_trace"; README, "The
  // pipelined step"). 0: none.
  int64_t trace_steps = 0;
  // Fault injection: extra time per step, as a straggler would take.
  absl::Duration step_delay = absl::ZeroDuration();
  // Fault injection: SIGKILL this process once the model of this step is
  // pulled (before anything of it is pushed) / once this step's exchange
  // returned. -1: never.
  int64_t crash_before_push_step = -1;
  int64_t crash_after_step = -1;
  // Fault injection: SIGTERM to this process once this step's exchange
  // returned; the loop then stops as for a signal (needs `stop`). -1: never.
  int64_t sigterm_after_step = -1;
  // ... once this step's model is pulled, before any of it is pushed.
  int64_t sigterm_before_push_step = -1;
  // ... once this step's first gradients are ready; the step goes on and
  // pushes whole.
  int64_t sigterm_in_backward_step = -1;
  // Fault injection: every step's backward pauses this long once its first
  // gradients are ready (with the pipelined step they have left).
  absl::Duration backward_pause = absl::ZeroDuration();
  // Set (e.g. by SIGTERM) to stop after the current step and leave the job.
  const std::atomic<bool>* stop = nullptr;
  // Told when a step that will push begins, and once it has pushed, its
  // own time (GracefulStop): a signal's grace. Null: none.
  GracefulStop* graceful_stop = nullptr;
  // sync: waits until every expected worker has registered
  // (PsClient::AwaitJobStart), called once, after this worker's first push
  // and before its next pull. The servers hold that step until every member
  // has pushed, so a worker computes it while the others are still coming
  // and the job's first step ends a few ms after the last one registers.
  // The wait is not training time. Null: the caller waited before Train.
  std::function<absl::Status()> await_job_start;
  // Called once the steps are over (done, or stopped), before the final
  // model is pulled and evaluated: a signal then no longer cuts calls
  // short (see worker/signal_watch.h). A sync worker stopped by a signal:
  // once it has the step it reached, which may never complete.
  std::function<void()> on_steps_done;
};

struct TrainResult {
  ConsistencyMode mode = ConsistencyMode::kSync;
  int64_t steps = 0;
  double final_loss = 0;  // mean training loss over the last 10% of steps
  double train_accuracy = 0;
  double test_loss = 0;
  double test_accuracy = 0;
  int64_t test_examples = 0;
  // Where the final model came from: "sync_step" (Pull(steps)), "all_done"
  // (async/ssp: every worker finished), "quiet" (async/ssp: the servers
  // stopped changing short of every worker's steps: one stopped early).
  std::string final_model;
  // The servers' copy of that model (PsClient::SecureFinalState); summary
  // "unknown" when it is not every worker's final model (final_model
  // "quiet"/"timeout").
  FinalState final_state;
  int64_t evaluations = 0;        // periodic ones
  double evaluation_seconds = 0;  // time spent in them
  double time_to_target_s = -1;   // training time, evaluations excluded
  int64_t step_to_target = -1;
  int64_t steps_per_epoch = 0;
  double epochs = 0;  // of the training set, by the job's global batches
  int64_t peak_rss_bytes = 0;
  // Whether the backend casts tensors for the wire (bf16 staging, not the
  // client on the host): see ParameterBuffers in trainer.cc.
  bool cast_on_device = false;
  double samples_per_sec = 0;
  double wall_time_s = 0;
  // Summed over the steps: see StepReport. Their share of the training
  // time (evaluations excluded) is what distribution costs.
  double compute_seconds = 0;
  double network_wait_seconds = 0;
  int64_t start_step = 0;
  int64_t steps_run = 0;      // steps this worker computed
  int64_t steps_skipped = 0;  // sync: steps the job finished without it
  // sync: steps the job completed with fewer than num_workers gradients
  // (a lapsed member, --replicas_to_aggregate, --min_workers).
  int64_t steps_short = 0;
  int64_t duplicate_blocks = 0;  // pushes the servers had already received
  int64_t late_blocks = 0;       // sync: gradients for a finished step
  int64_t injected_duplicate_pushes = 0;
  bool stopped_early = false;
  // Its steps ran as a pipeline (--pipeline_step), which sums the first
  // layer block by block: a model of its own, not the plain step's bits.
  bool pipelined = false;
  // Pipelined: the time from each step's last value in to its first
  // gradient ready, when the links idle (the pipeline's fill and drain).
  double fill_gap_seconds = 0;
  // The steps past the first ten (the first pulls, a device's first
  // kernels), and their time: what a step costs once the job runs, the
  // figure to hold against an exchange alone.
  int64_t steady_steps = 0;
  double steady_step_seconds = 0;
  // The worker's LearningWatch warned: the loss did not fall in time or
  // became NaN/Inf (set by the caller, which feeds the watch).
  bool not_learning = false;
};

// Fault injection (--inject_sigterm_after_step, _before_push_step): sends
// this process SIGTERM at `step`, and waits (up to 10 s) until the signal
// watch has set `stop`, so that the loop stops at its next check as for a
// real signal.
void InjectSigterm(const std::atomic<bool>* stop, int64_t step);

// Trains `model` against the servers behind `client` (already registered as
// this worker, in mode `mode`) on this worker's slices of `train`'s global
// batches, leaves the job, and evaluates the job's final model on `test`
// (may be null): in sync mode the model after `steps` updates; in async and
// ssp mode the servers' model once every worker has finished (their Stats
// show no member left and every worker's updates applied), so that every
// worker reports the same number.
absl::StatusOr<TrainResult> Train(const TrainerOptions& options,
                                  ConsistencyMode mode, PsClient& client,
                                  Model& model, kernels::Backend& backend,
                                  const ExampleSource& train,
                                  const ExampleSource* test);

// This process's peak resident memory (VmHWM), 0 where unknown.
int64_t PeakRssBytes();

// The one-line JSON summary a script reads: {"event":"final",...}.
std::string FinalJson(const TrainResult& result, int worker_id, int num_workers,
                      const std::string& device);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_TRAINER_H_
