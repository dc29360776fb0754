// Says when a job is not learning, so that a wrong learning rate (the one
// shared default that sent Adam to chance, issue 29) costs a glance at the
// log rather than a whole run. Training goes on either way: the watch only
// speaks, once.
#ifndef PSTRAIN_WORKER_LEARNING_WATCH_H_
#define PSTRAIN_WORKER_LEARNING_WATCH_H_

#include <cstdint>
#include <string>
#include <vector>

namespace pstrain {

class LearningWatch {
 public:
  // `patience`: steps after this worker's first one by which the training
  // loss must have fallen below that first step's loss (0: only NaN/Inf is
  // watched). `optimizer` and `learning_rate`: what the servers apply
  // (empty / 0 when they did not say), named in the warning.
  LearningWatch(int64_t patience, std::string optimizer, double learning_rate);

  // Feeds one step's mean batch loss. Returns the warning the first time
  // the job looks stuck (the loss is NaN or Inf, or `patience` steps after
  // the first the mean of the recent losses is not below 90% of the first
  // one), else "".
  std::string OnStep(int64_t step, double loss);

  // Whether a warning was given.
  bool fired() const { return fired_; }

 private:
  std::string Warning(const std::string& what) const;

  const int64_t patience_;
  const std::string optimizer_;
  const double learning_rate_;
  bool fired_ = false;
  bool have_first_ = false;
  bool fall_checked_ = false;  // the loss fell in time
  int64_t first_step_ = 0;
  double first_loss_ = 0;
  // The last few losses: one batch's loss is noisy, their mean less so.
  std::vector<double> recent_;
  size_t next_ = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_LEARNING_WATCH_H_
