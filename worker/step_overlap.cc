#include "worker/step_overlap.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace pstrain {

OverlappedPush::OverlappedPush(
    PsClient& client, kernels::Backend& backend,
    const std::vector<float*>& device_grads,
    std::vector<kernels::HostArray<float>>& host_grads)
    : client_(client),
      backend_(backend),
      device_grads_(device_grads),
      host_grads_(host_grads) {
  for (const kernels::HostArray<float>& host : host_grads_) {
    host_pointers_.push_back(host.data());
  }
}

void OverlappedPush::Start(int64_t step) {
  absl::MutexLock lock(&mu_);
  step_ = step;
  pending_.clear();
  status_ = absl::OkStatus();
  result_ = {};
  first_push_start_ = absl::InfiniteFuture();
  last_push_end_ = absl::InfinitePast();
}

absl::Status OverlappedPush::Ready(int tensor) {
  if (tensor < 0 || tensor >= static_cast<int>(host_grads_.size())) {
    return absl::InternalError(absl::StrCat("gradient of tensor ", tensor,
                                            " reported ready; the "
                                            "model has ",
                                            host_grads_.size()));
  }
  kernels::HostArray<float>& host = host_grads_[tensor];
  if (absl::Status s =
          backend_.CopyToHost(device_grads_[tensor], host.data(), host.bytes());
      !s.ok()) {
    return s;
  }
  {
    absl::MutexLock lock(&mu_);
    pending_.push_back(tensor);
  }
  pusher_.Schedule([this] { PushPending(); });
  return absl::OkStatus();
}

void OverlappedPush::PushPending() {
  std::vector<int> tensors;
  int64_t step = 0;
  {
    absl::MutexLock lock(&mu_);
    // An earlier closure took them with its own; or the step already
    // failed, and what is left is not worth sending.
    if (pending_.empty() || !status_.ok()) return;
    tensors.swap(pending_);
    step = step_;
    first_push_start_ = std::min(first_push_start_, absl::Now());
  }
  absl::StatusOr<PsClient::PushResult> pushed =
      client_.Push(step, host_pointers_, tensors);
  absl::MutexLock lock(&mu_);
  last_push_end_ = absl::Now();
  if (!pushed.ok()) {
    if (status_.ok()) status_ = pushed.status();
    return;
  }
  result_.blocks_duplicate += pushed->blocks_duplicate;
  result_.blocks_late += pushed->blocks_late;
}

absl::StatusOr<PsClient::PushResult> OverlappedPush::Finish() {
  pusher_.Drain();
  absl::MutexLock lock(&mu_);
  push_time_ = last_push_end_ > first_push_start_
                   ? last_push_end_ - first_push_start_
                   : absl::ZeroDuration();
  if (!status_.ok()) return status_;
  return result_;
}

BatchPrefetcher::BatchPrefetcher(EpochPlan& plan, const ExampleSource& source,
                                 int64_t rows)
    : plan_(plan),
      source_(source),
      spare_features_(rows * source.num_features()),
      spare_labels_(rows) {}

void BatchPrefetcher::Prefetch(int64_t step) {
  data_thread_.Schedule([this, step] {
    spare_step_ = step;
    spare_status_ =
        source_.Gather(plan_.WorkerIndices(step), spare_features_.data(),
                       spare_labels_.data());
  });
}

absl::Status BatchPrefetcher::Take(int64_t step, std::vector<float>& features,
                                   std::vector<int32_t>& labels) {
  data_thread_.Drain();
  if (spare_step_ != step) {  // not prefetched (first step, or a catch-up)
    Prefetch(step);
    data_thread_.Drain();
  }
  spare_step_ = -1;
  if (!spare_status_.ok()) return spare_status_;
  features.swap(spare_features_);
  labels.swap(spare_labels_);
  return absl::OkStatus();
}

}  // namespace pstrain
