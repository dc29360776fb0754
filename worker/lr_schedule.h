// The C++ worker's learning-rate schedule (--lr_schedule, --warmup_steps,
// --lr_step_size, --lr_step_gamma): the factor of the servers' rate
// (--learning_rate) at each step, as torch's schedulers give it. Every push
// carries the scheduled rate (PsClient::SetGroupRates); the servers' update
// of that step uses it, in every mode.
#ifndef PSTRAIN_WORKER_LR_SCHEDULE_H_
#define PSTRAIN_WORKER_LR_SCHEDULE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pstrain {

struct LrSchedule {
  // constant | step | cosine, after the warmup.
  std::string kind = "constant";
  // Steps of linear warmup: factor (t + 1) / warmup_steps for t below it.
  int64_t warmup_steps = 0;
  // step: the factor is lr_step_gamma^floor((t - warmup) / lr_step_size),
  // as torch's StepLR.
  int64_t step_size = 0;
  double gamma = 0.1;
  // cosine: 0.5 * (1 + cos(pi * (t - warmup) / (total_steps - warmup))),
  // as torch's CosineAnnealingLR (eta_min 0, T_max the steps left).
  int64_t total_steps = 0;
};

// Every problem with `schedule`, worded by the worker's flags.
std::vector<absl::Status> LrScheduleProblems(const LrSchedule& schedule);

// Whether the schedule changes the rate at all (constant, no warmup: no).
bool Scheduled(const LrSchedule& schedule);

// The factor of the base rate at step t (0-based).
double LrFactor(const LrSchedule& schedule, int64_t step);

// The servers' rate at each step of a job of `total_steps`: `servers_rate`
// (their learning rate, said at registration) times the schedule's factor.
// Null when the schedule changes nothing. Every problem (the schedule's
// against the job's length, or a servers_rate that is not > 0: a server
// older than the worker) goes to `problems`, and the result is then null.
std::function<double(int64_t)> ScheduledRate(
    LrSchedule schedule, int64_t total_steps, double servers_rate,
    std::vector<absl::Status>* problems);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_LR_SCHEDULE_H_
