#include "worker/client/graceful_stop.h"

#include <algorithm>

namespace pstrain {

absl::Duration GracefulStop::GraceAfter(absl::Duration step_work) {
  return std::clamp(2 * step_work, absl::Milliseconds(400), absl::Seconds(5));
}

void GracefulStop::SetStepWork(absl::Duration step_work) {
  absl::MutexLock lock(&mu_);
  grace_ = GraceAfter(step_work);
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
  mu_.AwaitWithTimeout(absl::Condition(&quiet_), grace_);
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

}  // namespace pstrain
