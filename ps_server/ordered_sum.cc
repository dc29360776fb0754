#include "ps_server/ordered_sum.h"

#include <utility>

namespace pstrain {

std::string GradientBufferPool::Take() {
  absl::MutexLock lock(&mu_);
  if (free_.empty()) return std::string();
  std::string buffer = std::move(free_.back());
  free_.pop_back();
  return buffer;
}

void GradientBufferPool::Give(std::string buffer) {
  CountHeld(-static_cast<int64_t>(buffer.size()));
  buffer.clear();
  absl::MutexLock lock(&mu_);
  free_.push_back(std::move(buffer));
}

void GradientBufferPool::CountHeld(int64_t bytes) {
  const int64_t now = held_bytes_.fetch_add(bytes) + bytes;
  int64_t peak = peak_held_bytes_.load();
  while (now > peak && !peak_held_bytes_.compare_exchange_weak(peak, now)) {
  }
}

}  // namespace pstrain
