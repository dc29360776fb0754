#include "ps_server/step_intervals.h"

#include <algorithm>
#include <array>

namespace pstrain {

void StepIntervals::Saw(absl::Span<const int64_t> steps,
                        absl::Span<const absl::Time> made) {
  int64_t step = -1;
  absl::Time when;
  for (size_t i = 0; i < steps.size() && i < made.size(); ++i) {
    if (steps[i] > step) {
      step = steps[i];
      when = made[i];
    }
  }
  absl::MutexLock lock(&mu_);
  if (step <= newest_step_) return;
  if (newest_step_ >= 0 && when > newest_made_) {
    intervals_.push_back((when - newest_made_) / (step - newest_step_));
    if (intervals_.size() > kSteps) intervals_.pop_front();
  }
  newest_step_ = step;
  newest_made_ = when;
}

absl::Duration StepIntervals::Median() const {
  absl::MutexLock lock(&mu_);
  if (intervals_.empty()) return absl::ZeroDuration();
  std::array<absl::Duration, kSteps> sorted;
  const auto end =
      std::copy(intervals_.begin(), intervals_.end(), sorted.begin());
  const auto median = sorted.begin() + (end - sorted.begin() - 1) / 2;
  std::nth_element(sorted.begin(), median, end);
  return *median;
}

absl::Duration StepIntervals::HalfStep(absl::Duration shortest,
                                       absl::Duration longest) const {
  return std::clamp(Median() / 2, shortest, longest);
}

}  // namespace pstrain
