// What a person or a log sees of a worker's steps: a progress bar redrawn in
// place, or a line every --log_every steps, plus the optional CSV row and
// Prometheus metrics of every step, all fed from the trainer's per-step
// report (worker/trainer.h StepReport).
#ifndef PSTRAIN_WORKER_STEP_OUTPUT_H_
#define PSTRAIN_WORKER_STEP_OUTPUT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "common/run_output.h"
#include "proto/ps.pb.h"
#include "worker/trainer.h"

namespace pstrain {

class StepOutput {
 public:
  // `bar`: a bar redrawn in place (a terminal) rather than lines;
  // `log_every` 0: no progress output at all. `csv` and `metrics` may be
  // null.
  StepOutput(int worker_id, bool bar, int64_t log_every,
             std::unique_ptr<MetricsCsv> csv, WorkerMetrics* metrics)
      : worker_id_(worker_id),
        bar_(bar),
        log_every_(log_every),
        csv_(std::move(csv)),
        metrics_(metrics) {}

  // Time 0 of the CSV and of the ETA; `start_step`: where this worker
  // joins (0 unless it joins a running job).
  void Start(int64_t start_step);

  void OnStep(const StepReport& r);

  // While the job waits for its workers (PsClient::AwaitJobStart): the bar
  // says for whom. Without a bar the client's log line says it.
  void OnWaitingForWorkers(const JobStart& waiting);

  // While the worker waits to reach a server (registration, a retry): the
  // bar shows the line the log has (shard, address, last error, time left).
  // Any thread: a push thread retries too.
  void ShowWait(const std::string& line);

  // Ends a bar left mid-line (a worker stopped early), so what follows
  // starts on a line of its own.
  void Finish();

 private:
  void ResetWindow();

  // Steps report on the training thread, retries on whichever thread
  // retries.
  absl::Mutex mu_;
  const int worker_id_;
  const bool bar_;
  const int64_t log_every_;
  std::unique_ptr<MetricsCsv> csv_;
  WorkerMetrics* const metrics_;
  absl::Time start_ = absl::Now(), last_draw_ = absl::Now();
  int64_t start_step_ = 0;
  double window_examples_ = 0, window_seconds_ = 0, window_loss_ = 0;
  double window_accuracy_ = 0;
  int64_t window_steps_ = 0;
  bool line_open_ = false;          // a bar is drawn and its line not ended
  double last_test_accuracy_ = -1;  // the last evaluation's; -1: none yet
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_STEP_OUTPUT_H_
