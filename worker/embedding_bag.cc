#include "worker/embedding_bag.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pstrain {
namespace {

using kernels::DeviceArray;

}  // namespace

absl::StatusOr<EmbeddingBag> EmbeddingBag::Create(kernels::Backend* backend,
                                                  Mode mode, int64_t dim,
                                                  int64_t max_bags,
                                                  int64_t max_occurrences) {
  if (backend == nullptr) {
    return absl::InvalidArgumentError("EmbeddingBag: backend is null");
  }
  if (mode != Mode::kSum && mode != Mode::kMean) {
    return absl::InvalidArgumentError("EmbeddingBag: unknown mode");
  }
  if (dim < 1 || max_bags < 0 || max_occurrences < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EmbeddingBag: need dim >= 1, max_bags >= 0, max_occurrences >= 0; "
        "got ",
        dim, ", ", max_bags, ", ", max_occurrences));
  }
  if (max_occurrences > std::numeric_limits<int64_t>::max() / 2 / dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EmbeddingBag: max_occurrences * dim overflows: ", max_occurrences,
        " * ", dim));
  }
  EmbeddingBag bag(backend, mode, dim, max_bags, max_occurrences);
  absl::StatusOr<DeviceArray<int64_t>> plan =
      DeviceArray<int64_t>::Create(backend, 2 * max_occurrences);
  if (!plan.ok()) return plan.status();
  bag.plan_ = *std::move(plan);
  absl::StatusOr<DeviceArray<float>> gathered =
      DeviceArray<float>::Create(backend, max_occurrences * dim);
  if (!gathered.ok()) return gathered.status();
  bag.gathered_ = *std::move(gathered);
  bag.staging_.resize(2 * max_occurrences);
  if (mode == Mode::kMean) {
    bag.bag_order_.reserve(max_bags);
    // Distinct non-empty bag sizes n_1 < n_2 < ... sum to at most
    // max_occurrences, so there are fewer than sqrt(2 max_occurrences) + 1.
    bag.groups_.reserve(static_cast<size_t>(std::sqrt(2.0 * max_occurrences)) +
                        2);
  }
  return bag;
}

absl::Status EmbeddingBag::SetBags(absl::Span<const int64_t> offsets,
                                   absl::Span<const int64_t> index,
                                   int64_t num_unique) {
  num_bags_ = -1;
  groups_.clear();
  const auto error = [](auto... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("EmbeddingBag::SetBags: ", parts...));
  };
  if (offsets.empty()) return error("offsets is empty (needs num_bags + 1)");
  const int64_t num_bags = static_cast<int64_t>(offsets.size()) - 1;
  const int64_t occurrences = static_cast<int64_t>(index.size());
  if (num_bags > max_bags_) {
    return error(num_bags, " bags is more than max_bags = ", max_bags_);
  }
  if (occurrences > max_occurrences_) {
    return error(occurrences, " occurrences is more than max_occurrences = ",
                 max_occurrences_);
  }
  if (num_unique < 0) return error("num_unique is negative: ", num_unique);
  if (offsets[0] != 0) return error("offsets[0] must be 0, got ", offsets[0]);
  for (int64_t b = 0; b < num_bags; ++b) {
    if (offsets[b + 1] < offsets[b]) {
      return error("offsets decrease at ", b + 1, ": ", offsets[b], " > ",
                   offsets[b + 1]);
    }
  }
  if (offsets[num_bags] != occurrences) {
    return error("offsets end at ", offsets[num_bags], " but index has ",
                 occurrences, " entries");
  }
  for (int64_t j = 0; j < occurrences; ++j) {
    if (index[j] < 0 || index[j] >= num_unique) {
      return error("index[", j, "] = ", index[j], " is outside [0, ",
                   num_unique, ")");
    }
  }

  int64_t* unique_index = staging_.data();
  int64_t* bag_of = staging_.data() + occurrences;
  if (mode_ == Mode::kSum) {
    std::copy(index.begin(), index.end(), unique_index);
    for (int64_t b = 0; b < num_bags; ++b) {
      std::fill(bag_of + offsets[b], bag_of + offsets[b + 1], b);
    }
  } else {
    // Equal weights 1/n must be contiguous to take one Scale each: order
    // the bags by size (ties by bag id, so the plan is deterministic).
    bag_order_.clear();
    for (int64_t b = 0; b < num_bags; ++b) {
      if (offsets[b + 1] > offsets[b]) bag_order_.push_back(b);
    }
    const auto size = [&](int64_t b) { return offsets[b + 1] - offsets[b]; };
    std::sort(bag_order_.begin(), bag_order_.end(), [&](int64_t a, int64_t b) {
      return size(a) != size(b) ? size(a) < size(b) : a < b;
    });
    int64_t j = 0;
    for (int64_t b : bag_order_) {
      const int64_t n = size(b);
      if (n > 1) {
        if (groups_.empty() ||
            groups_.back().begin + groups_.back().count != j ||
            groups_.back().scale != 1.0f / static_cast<float>(n)) {
          groups_.push_back({j, 0, 1.0f / static_cast<float>(n)});
        }
        groups_.back().count += n;
      }
      for (int64_t k = offsets[b]; k < offsets[b + 1]; ++k, ++j) {
        unique_index[j] = index[k];
        bag_of[j] = b;
      }
    }
  }
  if (occurrences > 0) {
    if (absl::Status s = backend_->CopyToDevice(
            staging_.data(), plan_.data(),
            2 * static_cast<size_t>(occurrences) * sizeof(int64_t));
        !s.ok()) {
      return s;
    }
  }
  num_bags_ = num_bags;
  num_occurrences_ = occurrences;
  num_unique_ = num_unique;
  return absl::OkStatus();
}

absl::Status EmbeddingBag::CheckReady(const char* op) const {
  if (num_bags_ < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "EmbeddingBag::", op, ": no bags set (SetBags failed or not called)"));
  }
  return absl::OkStatus();
}

absl::Status EmbeddingBag::ScaleGroups(float* rows) {
  for (const ScaleGroup& group : groups_) {
    if (absl::Status s = backend_->Scale(group.count * dim_, group.scale,
                                         rows + group.begin * dim_);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status EmbeddingBag::Forward(const float* rows, float* out) {
  if (absl::Status s = CheckReady("Forward"); !s.ok()) return s;
  if (absl::Status s = backend_->Fill(num_bags_ * dim_, 0.0f, out); !s.ok()) {
    return s;
  }
  if (num_occurrences_ == 0) return absl::OkStatus();
  const int64_t* unique_index = plan_.data();
  const int64_t* bag_of = plan_.data() + num_occurrences_;
  if (absl::Status s = backend_->Gather(num_occurrences_, dim_, num_unique_,
                                        rows, unique_index, gathered_.data());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ScaleGroups(gathered_.data()); !s.ok()) return s;
  return backend_->ScatterAdd(num_occurrences_, dim_, num_bags_,
                              gathered_.data(), bag_of, out);
}

absl::Status EmbeddingBag::Backward(const float* dout, float* grad_rows,
                                    bool accumulate) {
  if (absl::Status s = CheckReady("Backward"); !s.ok()) return s;
  if (!accumulate) {
    if (absl::Status s = backend_->Fill(num_unique_ * dim_, 0.0f, grad_rows);
        !s.ok()) {
      return s;
    }
  }
  if (num_occurrences_ == 0) return absl::OkStatus();
  const int64_t* unique_index = plan_.data();
  const int64_t* bag_of = plan_.data() + num_occurrences_;
  if (absl::Status s = backend_->Gather(num_occurrences_, dim_, num_bags_, dout,
                                        bag_of, gathered_.data());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ScaleGroups(gathered_.data()); !s.ok()) return s;
  return backend_->ScatterAdd(num_occurrences_, dim_, num_unique_,
                              gathered_.data(), unique_index, grad_rows);
}

}  // namespace pstrain
