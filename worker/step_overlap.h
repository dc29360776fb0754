// What the training loop runs beside the compute thread, so that the network
// and the data work while forward and backward do:
//   - OverlappedPush sends each tensor's gradient as soon as backward
//     reports it ready (the last layer's first), from a push thread;
//   - BatchPrefetcher gathers the next step's batch from a data thread.
// The compute thread hands work over and later waits for it; nothing here
// waits without a bound other than the RPC deadlines PsClient already has.
#ifndef PSTRAIN_WORKER_STEP_OVERLAP_H_
#define PSTRAIN_WORKER_STEP_OVERLAP_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "worker/client/ps_client.h"
#include "worker/data.h"
#include "worker/serial_worker.h"

namespace pstrain {

// Pushes one step's gradient tensor by tensor from a push thread. PsClient
// is not thread-safe: between Start and Finish only the push thread may use
// the client, so the compute thread must not pull or push in between.
class OverlappedPush {
 public:
  // device_grads[i] (backend memory) is copied to host_grads[i] (sized to
  // the tensor) when tensor i is ready; both outlive this object.
  OverlappedPush(PsClient& client, kernels::Backend& backend,
                 const std::vector<float*>& device_grads,
                 std::vector<kernels::HostArray<float>>& host_grads);

  void Start(int64_t step);
  // On the compute thread: tensor i's gradient is issued on the backend.
  // Copies it to host memory (waiting for the backend) and queues its push;
  // tensors that become ready while a push is in flight go together in the
  // next one.
  absl::Status Ready(int tensor);
  // Waits until every ready tensor is pushed. The first error of the step,
  // or what the servers said of its blocks.
  absl::StatusOr<PsClient::PushResult> Finish();
  // Of the last finished step: from its first push starting to its last
  // one ending (the network's time, overlapping compute).
  absl::Duration push_time() const { return push_time_; }

 private:
  void PushPending();

  PsClient& client_;
  kernels::Backend& backend_;
  const std::vector<float*> device_grads_;
  std::vector<kernels::HostArray<float>>& host_grads_;
  std::vector<const float*> host_pointers_;  // host_grads_'s, for Push

  absl::Mutex mu_;
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int> pending_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  PsClient::PushResult result_ ABSL_GUARDED_BY(mu_);
  absl::Time first_push_start_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time last_push_end_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration push_time_ = absl::ZeroDuration();
  SerialWorker pusher_;  // last: destroyed (drained) first
};

// Gathers the batch of the next step on a data thread while the current
// one computes. All of the plan's and the source's use goes through here
// (EpochPlan is not thread-safe).
class BatchPrefetcher {
 public:
  // `rows`: the plan's worker batch.
  BatchPrefetcher(EpochPlan& plan, const ExampleSource& source, int64_t rows);

  // Starts gathering step `step`'s batch into the spare buffers.
  void Prefetch(int64_t step);
  // Step `step`'s batch in `features` / `labels` (one batch each): swapped
  // in when prefetched, else gathered now.
  absl::Status Take(int64_t step, std::vector<float>& features,
                    std::vector<int32_t>& labels);

 private:
  EpochPlan& plan_;
  const ExampleSource& source_;
  // Written only by the data thread between Prefetch and the Drain in Take.
  std::vector<float> spare_features_;
  std::vector<int32_t> spare_labels_;
  int64_t spare_step_ = -1;
  absl::Status spare_status_;
  SerialWorker data_thread_;  // last: destroyed (drained) first
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_STEP_OVERLAP_H_
