// The worker's sparse machinery for one embedding table: de-duplicating a
// batch's ids (the rows to pull from the servers) and the embedding-bag layer
// over the pulled rows, forward and backward, on the compute backend.
//
// A step for one table (field f of a CtrDataset batch):
//   ExtractFieldBags(batch, f, &offsets, &ids);           // ctr_data.h
//   dedup.Run(ids, &unique);                 // pull unique.unique from servers
//   upload the pulled rows to `rows` [unique.size(), dim] on the backend
//   bag.SetBags(offsets, unique.index, unique.unique.size());
//   bag.Forward(rows, out);                  // out [num_bags, dim]
//   ... the model's backward fills dout [num_bags, dim] ...
//   bag.Backward(dout, grad_rows);           // grad_rows [unique.size(), dim]
//   copy grad_rows to the host, push them for unique.unique
// The gradient is already accumulated per unique id, so each touched row is
// pushed exactly once per step.
#ifndef PSTRAIN_WORKER_EMBEDDING_BAG_H_
#define PSTRAIN_WORKER_EMBEDDING_BAG_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "worker/unique_ids.h"

namespace pstrain {

// The embedding-bag layer for one table over rows pulled for a batch.
//
// Bags are CSR over occurrences: bag b holds occurrences
// [offsets[b], offsets[b + 1]), occurrence j refers to pulled row index[j].
//   forward:  out[b, :] = sum over j in bag b of w_j * rows[index[j], :]
//   backward: grad_rows[u, :] = sum over j with index[j] == u of
//             w_j * dout[bag(j), :]
// with w_j = 1 (kSum) or 1 / |bag(j)| (kMean). An empty bag gives a zero row
// (its mean is defined as 0) and contributes no gradient. Repeats of an id
// within or across bags simply add up.
//
// How it runs, with backend ops only (so it is the same code on CPU and
// CUDA, and never reads device memory on the host):
//   forward:  Fill(out, 0); Gather the occurrence rows into a workspace
//             [occurrences, dim]; Scale groups; ScatterAdd them into out by
//             bag.
//   backward: Fill(grad_rows, 0) (unless accumulating); Gather dout rows by
//             the occurrences' bags; Scale groups; ScatterAdd into grad_rows
//             by unique index.
// For kMean the host orders the occurrences by the size of their bag, so
// every run of equal weights 1/n is contiguous and takes one Scale. Cost per
// call: O(occurrences * dim) work and memory traffic, one upload of
// 16 bytes per occurrence (in SetBags), and at most one Scale launch per
// distinct bag size (none for kSum or single-id bags). A bag-averaging matrix
// and Gemm would cost O(bags * occurrences) in upload and flops instead.
// ScatterAdd on CUDA sums with atomics, so results can differ from run to run
// in the last bits where a bag or an id repeats; the CPU backend is exact.
//
// All memory (device workspace and host staging) is allocated in Create for
// at most max_bags bags and max_occurrences occurrences; SetBags, Forward and
// Backward do not allocate. Not thread-safe; one instance per table (or call
// SetBags again before reusing it for another table's bags).
class EmbeddingBag {
 public:
  enum class Mode { kSum, kMean };

  static absl::StatusOr<EmbeddingBag> Create(kernels::Backend* backend,
                                             Mode mode, int64_t dim,
                                             int64_t max_bags,
                                             int64_t max_occurrences);

  EmbeddingBag(EmbeddingBag&&) = default;
  EmbeddingBag& operator=(EmbeddingBag&&) = default;

  // Sets the batch's bags (host arrays): offsets [num_bags + 1] with
  // offsets[0] == 0, non-decreasing, ending at index.size(); every index in
  // [0, num_unique). Validated here on the host, so Forward and Backward
  // cannot fail on the device for bad indices. Uploads the plan; the host
  // arrays may be reused as soon as this returns. On error the previous plan
  // is gone and Forward/Backward fail until a successful SetBags.
  absl::Status SetBags(absl::Span<const int64_t> offsets,
                       absl::Span<const int64_t> index, int64_t num_unique);

  // rows: [num_unique, dim] backend memory; out: [num_bags, dim] backend
  // memory, overwritten.
  absl::Status Forward(const float* rows, float* out);

  // dout: [num_bags, dim]; grad_rows: [num_unique, dim], overwritten, or
  // added to when `accumulate` (e.g. two fields sharing a table).
  absl::Status Backward(const float* dout, float* grad_rows,
                        bool accumulate = false);

  Mode mode() const { return mode_; }
  int64_t dim() const { return dim_; }
  int64_t num_bags() const { return num_bags_; }
  int64_t num_occurrences() const { return num_occurrences_; }
  int64_t num_unique() const { return num_unique_; }

 private:
  // A run of occurrences [begin, begin + count) in the device order whose
  // weight is `scale` (!= 1).
  struct ScaleGroup {
    int64_t begin;
    int64_t count;
    float scale;
  };

  EmbeddingBag(kernels::Backend* backend, Mode mode, int64_t dim,
               int64_t max_bags, int64_t max_occurrences)
      : backend_(backend),
        mode_(mode),
        dim_(dim),
        max_bags_(max_bags),
        max_occurrences_(max_occurrences) {}

  absl::Status CheckReady(const char* op) const;
  absl::Status ScaleGroups(float* rows);

  kernels::Backend* backend_;
  Mode mode_;
  int64_t dim_;
  int64_t max_bags_;
  int64_t max_occurrences_;

  // The current plan; num_bags_ < 0 means none.
  int64_t num_bags_ = -1;
  int64_t num_occurrences_ = 0;
  int64_t num_unique_ = 0;
  std::vector<ScaleGroup> groups_;

  // The plan, staged on the host and uploaded in one copy: [occurrences]
  // unique indices, then [occurrences] bag ids, both in device order (for
  // kMean, occurrences sorted by the size of their bag); and the bag order.
  std::vector<int64_t> staging_;
  std::vector<int64_t> bag_order_;
  // Device: the uploaded plan (bag ids start at num_occurrences_) and the
  // gathered rows [max_occurrences, dim].
  kernels::DeviceArray<int64_t> plan_;
  kernels::DeviceArray<float> gathered_;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_EMBEDDING_BAG_H_
