#include "common/handler_threads.h"

#include <algorithm>
#include <iterator>
#include <system_error>
#include <utility>

namespace pstrain {

HandlerThreads::HandlerThreads(int max_threads, absl::Duration idle_exit)
    : max_threads_(std::max(1, max_threads)), idle_exit_(idle_exit) {}

HandlerThreads::~HandlerThreads() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    // A thread that ends moves its own handle to ended_ as its last step
    // under mu_; joining it below waits for the rest of its return.
    mu_.Await(absl::Condition(
        +[](Threads* running) { return running->empty(); }, &running_));
  }
  JoinEnded();
}

void HandlerThreads::Run(std::function<void()> handler) {
  JoinEnded();
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(handler));
  if (idle_ >= static_cast<int>(queue_.size()) ||
      static_cast<int>(running_.size()) >= max_threads_) {
    return;
  }
  running_.emplace_back();
  const Threads::iterator self = std::prev(running_.end());
  // The new thread reads `self` only under mu_, held here until the handle
  // is in place.
  *self = std::thread([this, self] { Loop(self); });
  peak_ = std::max(peak_, static_cast<int>(running_.size()));
}

bool HandlerThreads::TryRun(std::function<void()> handler) {
  JoinEnded();
  absl::MutexLock lock(&mu_);
  if (idle_ > static_cast<int>(queue_.size())) {
    queue_.push_back(std::move(handler));
    return true;
  }
  if (static_cast<int>(running_.size()) >= max_threads_) return false;
  running_.emplace_back();
  const Threads::iterator self = std::prev(running_.end());
  try {
    *self = std::thread([this, self] { Loop(self); });
  } catch (const std::system_error&) {  // a process or cgroup limit
    running_.erase(self);
    return false;
  }
  queue_.push_back(std::move(handler));
  peak_ = std::max(peak_, static_cast<int>(running_.size()));
  return true;
}

void HandlerThreads::Loop(Threads::iterator self) {
  absl::MutexLock lock(&mu_);
  while (true) {
    ++idle_;
    const auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !queue_.empty() || stopping_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), idle_exit_);
    --idle_;
    if (queue_.empty()) break;  // idle too long, or stopping with no work
    std::function<void()> handler = std::move(queue_.front());
    queue_.pop_front();
    mu_.Unlock();
    handler();
    handler = nullptr;  // what it holds goes before the lock is taken
    mu_.Lock();
  }
  ended_.push_back(std::move(*self));
  running_.erase(self);
}

void HandlerThreads::JoinEnded() {
  std::vector<std::thread> ended;
  {
    absl::MutexLock lock(&mu_);
    ended.swap(ended_);
  }
  for (std::thread& t : ended) t.join();
}

int HandlerThreads::threads() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(running_.size());
}

int HandlerThreads::peak_threads() const {
  absl::MutexLock lock(&mu_);
  return peak_;
}

}  // namespace pstrain
