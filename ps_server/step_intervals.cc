#include "ps_server/step_intervals.h"

#include <algorithm>
#include <array>

namespace pstrain {

void StepIntervals::Saw(int64_t step, absl::Time seen) {
  absl::MutexLock lock(&mu_);
  if (step <= newest_step_) return;
  if (newest_step_ >= 0 && seen > newest_seen_) {
    intervals_.push_back((seen - newest_seen_) / (step - newest_step_));
    if (intervals_.size() > kSteps) intervals_.pop_front();
  }
  newest_step_ = step;
  newest_seen_ = seen;
}

absl::Duration StepIntervals::Median() const {
  absl::MutexLock lock(&mu_);
  if (intervals_.empty()) return absl::ZeroDuration();
  std::array<absl::Duration, kSteps> sorted;
  const auto end =
      std::copy(intervals_.begin(), intervals_.end(), sorted.begin());
  const auto median = sorted.begin() + (end - sorted.begin()) / 2;
  std::nth_element(sorted.begin(), median, end);
  return *median;
}

}  // namespace pstrain
