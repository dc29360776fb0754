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
#include "absl/types/span.h"

namespace pstrain {

// The median of the last kSteps steps' times (the lower middle of an even
// count). A pause (an evaluation, a checkpoint, a worker's restart) is one
// long interval among short ones and moves the median by nothing; a job
// that slows for good moves it within a few steps. Thread-safe.
class StepIntervals {
 public:
  static constexpr size_t kSteps = 5;

  // Steps first seen together (a send's records), each with when it was
  // made: the newest of them counts. A step no newer than the newest seen
  // before is ignored; one after a gap gives the gap's mean step.
  void Saw(absl::Span<const int64_t> steps, absl::Span<const absl::Time> made);
  // Zero until two steps were seen.
  absl::Duration Median() const;
  // Half the median step, within [shortest, longest]; `shortest` until the
  // median is known.
  absl::Duration HalfStep(absl::Duration shortest,
                          absl::Duration longest) const;

 private:
  mutable absl::Mutex mu_;
  int64_t newest_step_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time newest_made_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Duration> intervals_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_STEP_INTERVALS_H_
