// Training data for the worker: a deterministic synthetic classification task
// and readers for CSV and LIBSVM text files. Every source can be sharded by
// worker: shard k of n keeps the examples whose global index i has
// i % n == k, so the union of the workers' j-th batches of size b is exactly
// the j-th batch of size n*b of a single process (the sync contract).
#ifndef PSTRAIN_WORKER_DATA_H_
#define PSTRAIN_WORKER_DATA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

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
// infer it from the first example. Errors name the file and line.
absl::StatusOr<Dataset> ReadCsv(const std::string& path, int64_t num_features,
                                int64_t num_classes, ShardSpec shard);

// LIBSVM / SVMlight: "label index:value index:value ..." with 1-based,
// increasing indices; "# comments" ignored. Labels are integers in
// [0, num_classes); with num_classes == 2, -1/+1 are read as 0/1.
// num_features == 0 means infer it (the largest index in the file).
// Errors name the file and line.
absl::StatusOr<Dataset> ReadLibsvm(const std::string& path,
                                   int64_t num_features, int64_t num_classes,
                                   ShardSpec shard);

// Cycles through a dataset in order, batch after batch, wrapping around.
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

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_DATA_H_
