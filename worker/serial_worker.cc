#include "worker/serial_worker.h"

#include <utility>

namespace pstrain {

SerialWorker::SerialWorker() : thread_([this] { Loop(); }) {}

SerialWorker::~SerialWorker() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void SerialWorker::Schedule(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(work));
}

void SerialWorker::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](SerialWorker* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
        return self->queue_.empty() && !self->running_;
      },
      this));
}

void SerialWorker::Loop() {
  while (true) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](SerialWorker* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return !self->queue_.empty() || self->stop_;
          },
          this));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      work = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    work();
    absl::MutexLock lock(&mu_);
    running_ = false;
  }
}

}  // namespace pstrain
