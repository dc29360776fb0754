// The order a sync step's gradients are summed in: worker id, whatever order
// they arrive in. Float addition is not associative, so a sum taken in
// arrival order makes the same job give a different model on every run once
// three or more gradients meet. Here worker w's gradient is added as soon
// as every lower id's has been (the usual case when pushes arrive about in
// order, and no copy is made); one that comes earlier is held, copied, until
// its turn or until the step completes, when the held ones are added in id
// order. Addition is commutative, though: g1 + g0 is g0 + g1 to the bit, so
// worker 1's gradient never waits for worker 0's (with two workers nothing
// is ever held). The result is the sum over the step's contributors taken in
// ascending worker id: independent of arrival order, transport, shard count
// and block size (the order is per element), and of retries (a repeat is
// refused before it gets here).
//
// Memory: a held gradient is one block's (or one sparse push's) bytes as
// they came over the wire. At most num_workers - 1 are held per block, and
// only while the step waits for a lower id; GradientBufferPool reuses their
// buffers, so a steady job allocates none after its first steps.
#ifndef PSTRAIN_PS_SERVER_ORDERED_SUM_H_
#define PSTRAIN_PS_SERVER_ORDERED_SUM_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace pstrain {

// Contributions of one sync step, in the order of the workers' ids. `Held`
// is what an early contribution keeps until its turn. Not thread-safe: the
// caller holds the lock of the block or table the step belongs to.
template <typename Held>
class InWorkerOrder {
 public:
  // Whether `worker`'s contribution, arriving now, is next in worker order:
  // then the caller adds it to the sum and calls Added(); otherwise it
  // Hold()s it.
  bool IsNext(int worker) const {
    return worker == next_ || (worker == 1 && next_ == 0 && !one_added_);
  }

  // `worker`'s contribution (IsNext) was added: adds, by add(Held&), each
  // held one whose turn has now come, and returns them for reuse through
  // `release`.
  template <typename Add, typename Release>
  void Added(int worker, Add add, Release release) {
    if (worker == 1 && next_ == 0) {  // before worker 0's, which commutes
      one_added_ = true;
      return;
    }
    next_ = worker + 1;
    if (next_ == 1 && one_added_) next_ = 2;
    while (!held_.empty() && held_.front().first == next_) {
      add(held_.front().second);
      release(std::move(held_.front().second));
      held_.erase(held_.begin());
      ++next_;
    }
  }

  // Keeps `worker`'s early contribution until its turn.
  void Hold(int worker, Held held) {
    auto at = std::lower_bound(
        held_.begin(), held_.end(), worker,
        [](const std::pair<int, Held>& h, int w) { return h.first < w; });
    held_.emplace(at, worker, std::move(held));
  }

  // The step completed without some lower id: adds what is held, in worker
  // order, and starts the next step at worker 0.
  template <typename Add, typename Release>
  void AddRest(Add add, Release release) {
    for (auto& [worker, held] : held_) {
      add(held);
      release(std::move(held));
    }
    held_.clear();
    next_ = 0;
    one_added_ = false;
  }

  // Drops the step (a restored shard moving forward): what is held goes
  // back through `release` unused.
  template <typename Release>
  void Reset(Release release) {
    for (auto& [worker, held] : held_) release(std::move(held));
    held_.clear();
    next_ = 0;
    one_added_ = false;
  }

  size_t num_held() const { return held_.size(); }
  // No contribution of the step is in yet.
  bool AtStepStart() const {
    return next_ == 0 && !one_added_ && held_.empty();
  }

 private:
  int next_ = 0;
  bool one_added_ = false;  // worker 1's was added before worker 0's
  std::vector<std::pair<int, Held>> held_;  // ascending worker id
};

// Buffers for early gradients, shared by a shard's blocks: taken when a
// gradient must wait for its turn, given back once it is added. Kept, not
// freed, so that big buffers do not go back to the operating system after
// every step (page faults measured 1.2-1.4x on this machine kind).
// Thread-safe.
class GradientBufferPool {
 public:
  // An empty buffer (with the capacity of an earlier one where possible).
  std::string Take();
  void Give(std::string buffer);

  // Bytes of gradients held now, and the most ever held at once.
  int64_t held_bytes() const { return held_bytes_.load(); }
  int64_t peak_held_bytes() const { return peak_held_bytes_.load(); }
  // Counts `bytes` more (or, negative, fewer) as held: a taken buffer once
  // filled (Give uncounts it), or an early contribution kept elsewhere.
  void CountHeld(int64_t bytes);

 private:
  absl::Mutex mu_;
  std::vector<std::string> free_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> held_bytes_{0};
  std::atomic<int64_t> peak_held_bytes_{0};
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_ORDERED_SUM_H_
