// What a worker's final report averages (final_loss, train_accuracy): the
// last tenth of the job's steps. A job stopped early (SIGTERM, Ctrl-C)
// never reaches them; it averages the last tenth of the steps it ran
// instead, up to kMaxKept of them, rather than report zeros.
#ifndef PSTRAIN_WORKER_LAST_TENTH_H_
#define PSTRAIN_WORKER_LAST_TENTH_H_

#include <cstdint>
#include <deque>

#include "worker/model.h"

namespace pstrain {

class LastTenth {
 public:
  // The steps a stopped job may average over at most.
  static constexpr int64_t kMaxKept = 1000;

  // `steps`: the job's last step (its count of steps).
  explicit LastTenth(int64_t steps) : steps_(steps) {}

  // The batch of the step that brought the job to `step_done`.
  void Add(int64_t step_done, const BatchResult& batch);

  // The sums over the job's last tenth, or, when it stopped before that,
  // over the last tenth of the `steps_run` it ran (at least one step, at
  // most kMaxKept).
  BatchResult Sums(int64_t steps_run) const;

 private:
  const int64_t steps_;
  BatchResult job_tail_;
  std::deque<BatchResult> recent_;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_LAST_TENTH_H_
