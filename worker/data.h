// Training data for the worker: a deterministic synthetic classification task,
// readers for CSV and LIBSVM text files (IDX: worker/idx_data.h), and the
// order a job visits them in. Training takes examples by global index from an
// ExampleSource in the order of an EpochPlan: one permutation of the whole
// training set per epoch, from (seed, epoch), cut into global batches, of
// which worker k of W takes the k-th contiguous slice. So the workers' j-th
// batches together are exactly a single process's j-th global batch, for
// any W (the sync contract). The text readers can also keep one shard
// (examples i with i % n == k) of a file.
#ifndef PSTRAIN_WORKER_DATA_H_
#define PSTRAIN_WORKER_DATA_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace pstrain {

struct Dataset {
  int64_t num_features = 0;
  int64_t num_classes = 0;
  std::vector<float> features;  // [size(), num_features], row-major
  std::vector<int32_t> labels;  // each in [0, num_classes)

  int64_t size() const { return static_cast<int64_t>(labels.size()); }
};

// Which examples of a source this process keeps.
struct ShardSpec {
  int index = 0;
  int count = 1;
};

// InvalidArgument unless 0 <= index < count.
absl::Status ValidateShard(const ShardSpec& shard);
// Whether example `example_index` of a source belongs to `shard`.
bool InShard(int64_t example_index, const ShardSpec& shard);
// InvalidArgument unless examples [first_index, first_index + count) of a
// generated source can be numbered (both >= 0, no overflow).
absl::Status ValidateExampleRange(int64_t first_index, int64_t count);

// A linear "teacher" task with a known achievable accuracy: x ~ N(0, I),
// label = argmax(T x) for a teacher matrix T drawn from `seed`; with
// probability label_noise the label is replaced by a uniformly random class.
// Example i is a pure function of (seed, i), so data is identical whichever
// worker generates it. The best achievable accuracy is
// (1 - label_noise) + label_noise / num_classes.
struct SyntheticOptions {
  int64_t num_features = 32;
  int64_t num_classes = 4;
  double label_noise = 0.05;
  uint64_t seed = 1;
};

// Examples [first_index, first_index + count) of the synthetic stream, of
// which this shard keeps its own (by global index).
absl::StatusOr<Dataset> MakeSyntheticClassification(
    const SyntheticOptions& options, int64_t first_index, int64_t count,
    ShardSpec shard);

double SyntheticBestAccuracy(const SyntheticOptions& options);

// CSV: one example per line, the label first (an integer in
// [0, num_classes)), then num_features numbers. A first line that does not
// parse as numbers is taken as a header and skipped. num_features == 0 means
// infer it from the first example; num_classes == 0 means infer it (largest
// label read + 1, at least 2). Errors name the file and line.
absl::StatusOr<Dataset> ReadCsv(const std::string& path, int64_t num_features,
                                int64_t num_classes, ShardSpec shard);

// LIBSVM / SVMlight: "label index:value index:value ..." with 1-based,
// increasing indices; "# comments" ignored. Labels are integers in
// [0, num_classes); with num_classes == 2, -1/+1 are read as 0/1.
// num_features == 0 means infer it (the largest index in the file);
// num_classes == 0 as for ReadCsv. Errors name the file and line.
absl::StatusOr<Dataset> ReadLibsvm(const std::string& path,
                                   int64_t num_features, int64_t num_classes,
                                   ShardSpec shard);

// Cycles through a dataset in order, batch after batch, wrapping around
// (benchmarks; training uses EpochPlan).
class BatchCursor {
 public:
  explicit BatchCursor(const Dataset* data) : data_(data) {}

  // Copies the next `rows` examples (wrapping) into the outputs, sized
  // rows * num_features and rows.
  void Next(int64_t rows, float* features, int32_t* labels);

 private:
  const Dataset* data_;
  int64_t position_ = 0;
};

// Random access to a labelled data set, so that any worker can take any
// example of the global per-epoch permutation. Implementations are safe to
// read from several threads.
class ExampleSource {
 public:
  virtual ~ExampleSource() = default;
  virtual int64_t size() const = 0;
  virtual int64_t num_features() const = 0;
  // The number of classes: given, or inferred from the labels.
  virtual int64_t num_classes() const = 0;
  // Writes examples indices[r] (each in [0, size())) to row r of `features`
  // ([indices.size(), num_features], row-major) and `labels`.
  virtual absl::Status Gather(absl::Span<const int64_t> indices,
                              float* features, int32_t* labels) const = 0;
  // Bytes this process holds for the data set (for the memory figures).
  virtual int64_t resident_bytes() const = 0;
};

// A data set held whole in memory as floats (synthetic, CSV, LIBSVM).
class InMemorySource : public ExampleSource {
 public:
  explicit InMemorySource(Dataset data) : data_(std::move(data)) {}
  int64_t size() const override { return data_.size(); }
  int64_t num_features() const override { return data_.num_features; }
  int64_t num_classes() const override { return data_.num_classes; }
  absl::Status Gather(absl::Span<const int64_t> indices, float* features,
                      int32_t* labels) const override;
  int64_t resident_bytes() const override;

 private:
  Dataset data_;
};

// The largest label + 1 (at least 2): the class count a data set implies.
int64_t InferNumClasses(absl::Span<const int32_t> labels);

// A permutation of [0, size) that is a pure function of (seed, epoch, size)
// (Fisher-Yates driven by a counter-based hash): every worker computes the
// same one without talking to the others.
std::vector<int64_t> EpochPermutation(int64_t size, uint64_t seed,
                                      int64_t epoch);

// Which examples worker `worker_index` of `num_workers` trains on at each
// global step. Epoch e visits EpochPermutation(size, seed, e) (or 0..size-1
// in order without shuffle) in global batches of worker_batch * num_workers
// examples; the last size % global_batch examples of each epoch's order are
// left out, so every step has a full batch (with shuffling, different ones
// each epoch). Worker k takes rows [k * worker_batch, (k + 1) * worker_batch)
// of each global batch.
class EpochPlan {
 public:
  struct Options {
    int64_t num_examples = 0;
    int64_t worker_batch = 1;
    int num_workers = 1;
    int worker_index = 0;
    bool shuffle = true;
    uint64_t seed = 1;
  };
  // InvalidArgument when the global batch does not fit in the data set
  // (no full step per epoch) or the worker index is out of range.
  static absl::StatusOr<EpochPlan> Create(const Options& options);

  int64_t global_batch() const {
    return options_.worker_batch * options_.num_workers;
  }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  // The examples of this worker at 0-based global step `step`
  // (worker_batch of them); valid until the next call.
  absl::Span<const int64_t> WorkerIndices(int64_t step);

 private:
  explicit EpochPlan(const Options& options);

  Options options_;
  int64_t steps_per_epoch_ = 0;
  int64_t epoch_ = -1;  // the epoch `order_` belongs to
  std::vector<int64_t> order_;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_DATA_H_
