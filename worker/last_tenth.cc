#include "worker/last_tenth.h"

#include <algorithm>

namespace pstrain {

void LastTenth::Add(int64_t step_done, const BatchResult& batch) {
  if (step_done > steps_ - std::max<int64_t>(1, steps_ / 10)) {
    job_tail_.loss_sum += batch.loss_sum;
    job_tail_.num_correct += batch.num_correct;
    job_tail_.rows += batch.rows;
  }
  recent_.push_back(batch);
  if (static_cast<int64_t>(recent_.size()) > kMaxKept) recent_.pop_front();
}

BatchResult LastTenth::Sums(int64_t steps_run) const {
  if (job_tail_.rows > 0) return job_tail_;
  const int64_t n =
      std::min<int64_t>({static_cast<int64_t>(recent_.size()),
                         std::max<int64_t>(1, steps_run / 10), kMaxKept});
  BatchResult sums;
  for (auto it = recent_.end() - n; it != recent_.end(); ++it) {
    sums.loss_sum += it->loss_sum;
    sums.num_correct += it->num_correct;
    sums.rows += it->rows;
  }
  return sums;
}

}  // namespace pstrain
