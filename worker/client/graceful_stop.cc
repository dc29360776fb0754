#include "worker/client/graceful_stop.h"

#include <algorithm>

namespace pstrain {

absl::Duration GracefulStop::GraceAfter(absl::Duration step_work) {
  return std::clamp(2 * step_work, absl::Milliseconds(400), absl::Seconds(5));
}

void GracefulStop::NewJob() {
  absl::MutexLock lock(&mu_);
  work_measured_ = false;
  last_step_work_ = absl::ZeroDuration();
  grace_ = GraceAfter(absl::ZeroDuration());
}

void GracefulStop::StepWorkBegins() {
  absl::MutexLock lock(&mu_);
  if (work_measured_) return;
  grace_ = GraceAfter(absl::InfiniteDuration());
}

void GracefulStop::StepWorkDone(absl::Duration step_work) {
  absl::MutexLock lock(&mu_);
  work_measured_ = true;
  grace_ = GraceAfter(std::max(step_work, last_step_work_));
  last_step_work_ = step_work;
}

absl::Duration GracefulStop::grace() const {
  absl::MutexLock lock(&mu_);
  return grace_;
}

void GracefulStop::Add(PsClient* client) {
  absl::MutexLock lock(&mu_);
  clients_.insert(client);
}

void GracefulStop::Remove(PsClient* client) {
  absl::MutexLock lock(&mu_);
  clients_.erase(client);
}

void GracefulStop::InterruptAll() {
  // Under the lock: a client is not removed (and destroyed) meanwhile.
  absl::MutexLock lock(&mu_);
  for (PsClient* client : clients_) client->Interrupt();
}

void GracefulStop::InterruptAfterGrace() {
  absl::MutexLock lock(&mu_);
  const absl::Time signalled = absl::Now();
  absl::Time deadline = signalled + grace_;
  for (;;) {
    const absl::Duration seen = grace_;
    auto quiet_or_changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return quiet_ || grace_ != seen;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&quiet_or_changed), deadline) ||
        quiet_) {
      break;
    }
    // The step in hand told its time: the first step has pushed, and the
    // waits after it (for peers that stopped) are cut after its measured
    // grace, not the first step's longest one (the servers hold a stopped
    // step for the others' stop 2 s beyond the grace its worker left with).
    deadline = signalled + grace_;
  }
  while (!quiet_) {
    for (PsClient* client : clients_) client->Interrupt();
    mu_.AwaitWithTimeout(absl::Condition(&quiet_), absl::Milliseconds(100));
  }
}

void GracefulStop::Quiet() {
  absl::MutexLock lock(&mu_);
  quiet_ = true;
}

void GracefulStop::Arm() {
  absl::MutexLock lock(&mu_);
  quiet_ = false;
}

absl::Duration GraceOf(const GracefulStop* stop) {
  return stop != nullptr ? stop->grace() : absl::ZeroDuration();
}

}  // namespace pstrain
