// The values of one dense block, shared with the pulls that are sending them.
//
// A pull takes a reference to the current values and hands that memory to
// gRPC as is: no copy per pull. An update must then not write memory a pull
// still holds, so a writer asks for Mutable(), which returns the current
// values when no pull holds them and otherwise first moves to the block's
// other buffer (a double buffer: copying the values there once). At steady
// state nothing is allocated: the two buffers take turns.
//
// Not thread-safe on its own: every call is made under the owning block's
// lock. A reference from Share() may be read without the lock for as long
// as it is held; the memory it points to never changes while it is held.
#ifndef PSTRAIN_PS_SERVER_BLOCK_VALUES_H_
#define PSTRAIN_PS_SERVER_BLOCK_VALUES_H_

#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include "absl/types/span.h"

namespace pstrain {

class BlockValues {
 public:
  using Ref = std::shared_ptr<const std::vector<float>>;

  BlockValues() : current_(std::make_shared<std::vector<float>>()) {}

  // Replaces the values (a fresh buffer: pulls holding the old ones keep
  // them).
  void Assign(std::vector<float> values) {
    current_ = std::make_shared<std::vector<float>>(std::move(values));
    spare_.reset();
  }

  // The current values, kept unchanged for as long as the reference lives.
  Ref Share() const { return current_; }

  // The current values for reading under the lock.
  absl::Span<const float> Read() const { return *current_; }
  size_t size() const { return current_->size(); }

  // The current values for writing: memory no pull holds. Copies them into
  // the other buffer first when a pull still holds the current one, and
  // then sets *copied (when given).
  absl::Span<float> Mutable(bool* copied = nullptr) {
    if (copied != nullptr) *copied = false;
    if (!HeldElsewhere(current_)) return absl::MakeSpan(*current_);
    std::shared_ptr<std::vector<float>> next;
    if (spare_ != nullptr && !HeldElsewhere(spare_)) {
      next = std::move(spare_);
    } else {
      next = std::make_shared<std::vector<float>>();
    }
    next->assign(current_->begin(), current_->end());
    spare_ = std::move(current_);
    current_ = std::move(next);
    if (copied != nullptr) *copied = true;
    return absl::MakeSpan(*current_);
  }

 private:
  // Whether a Share() reference other than ours is alive. References are
  // only taken under the block's lock (held here), so the count can only
  // fall while we look; seeing 1 means the last reader is gone, and the
  // fence orders its reads of the memory before our writes to it.
  static bool HeldElsewhere(const std::shared_ptr<std::vector<float>>& p) {
    if (p.use_count() > 1) return true;
    std::atomic_thread_fence(std::memory_order_acquire);
    return false;
  }

  std::shared_ptr<std::vector<float>> current_;
  // The previous buffer, reused once the pulls holding it are done.
  std::shared_ptr<std::vector<float>> spare_;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_BLOCK_VALUES_H_
