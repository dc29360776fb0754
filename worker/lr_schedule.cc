#include "worker/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace pstrain {

std::vector<absl::Status> LrScheduleProblems(const LrSchedule& s) {
  std::vector<absl::Status> problems;
  if (s.kind != "constant" && s.kind != "step" && s.kind != "cosine") {
    problems.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--lr_schedule must be constant, step or cosine, got '", s.kind, "'")));
  }
  if (s.warmup_steps < 0) {
    problems.push_back(absl::InvalidArgumentError(
        absl::StrCat("--warmup_steps must be >= 0, got ", s.warmup_steps)));
  }
  if (s.kind == "step" && s.step_size < 1) {
    problems.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--lr_schedule=step needs --lr_step_size >= 1, got ", s.step_size)));
  }
  if (!(s.gamma > 0 && s.gamma <= 1)) {
    problems.push_back(absl::InvalidArgumentError(
        absl::StrCat("--lr_step_gamma must be in (0, 1], got ", s.gamma)));
  }
  if (s.kind == "cosine" && s.total_steps <= s.warmup_steps) {
    problems.push_back(absl::InvalidArgumentError(
        absl::StrCat("--lr_schedule=cosine needs more steps (", s.total_steps,
                     ") than --warmup_steps (", s.warmup_steps, ")")));
  }
  return problems;
}

bool Scheduled(const LrSchedule& s) {
  return s.kind != "constant" || s.warmup_steps > 0;
}

double LrFactor(const LrSchedule& s, int64_t step) {
  if (step < s.warmup_steps) {
    return static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  }
  const int64_t t = step - s.warmup_steps;
  if (s.kind == "step") {
    return std::pow(s.gamma, static_cast<double>(t / s.step_size));
  }
  if (s.kind == "cosine") {
    const double span = static_cast<double>(s.total_steps - s.warmup_steps);
    return 0.5 * (1 + std::cos(M_PI * std::min<double>(t, span) / span));
  }
  return 1.0;
}

std::function<double(int64_t)> ScheduledRate(
    LrSchedule schedule, int64_t total_steps, double servers_rate,
    std::vector<absl::Status>* problems) {
  schedule.total_steps = total_steps;
  if (!Scheduled(schedule)) return nullptr;
  std::vector<absl::Status> found = LrScheduleProblems(schedule);
  if (!(servers_rate > 0)) {
    found.push_back(absl::FailedPreconditionError(
        "--lr_schedule: the servers did not say their learning rate (a "
        "ps_server older than this worker)"));
  }
  if (!found.empty()) {
    problems->insert(problems->end(), found.begin(), found.end());
    return nullptr;
  }
  return [servers_rate, schedule](int64_t step) {
    return servers_rate * LrFactor(schedule, step);
  };
}

}  // namespace pstrain
