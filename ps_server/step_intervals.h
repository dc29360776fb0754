// The time between a job's steps, as a primary sees them in its step
// records: what its record senders linger by (ParameterServerService).
#ifndef PSTRAIN_PS_SERVER_STEP_INTERVALS_H_
#define PSTRAIN_PS_SERVER_STEP_INTERVALS_H_

#include <cstddef>
#include <cstdint>
#include <deque>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pstrain {

// The median of the last kSteps steps' times. A pause (an evaluation, a
// checkpoint, a worker's restart) is one long interval among short ones
// and moves the median by nothing; a job that slows for good moves it
// within a few steps. Thread-safe.
class StepIntervals {
 public:
  static constexpr size_t kSteps = 5;

  // Step `step` was first seen at `seen`. A step no newer than the newest
  // seen is ignored; one after a gap counts as that many equal steps.
  void Saw(int64_t step, absl::Time seen);
  // Zero until two steps were seen.
  absl::Duration Median() const;

 private:
  mutable absl::Mutex mu_;
  int64_t newest_step_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time newest_seen_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Duration> intervals_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_STEP_INTERVALS_H_
