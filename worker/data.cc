#include "worker/data.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/hash.h"
#include "worker/libsvm.h"
#include "worker/line_reader.h"

namespace pstrain {
namespace {

// Independent streams of the counter-based generator, so that e.g. the noise
// draw of example i can never coincide with one of its feature draws.
enum Stream : uint64_t {
  kTeacherStream = 1,
  kFeatureStream = 2,
  kNoiseStream = 3,
  kNoiseClassStream = 4,
  kShuffleStream = 5,
};

// Every random number is a hash of where it is used rather than of what was
// drawn before it; that is what lets any worker generate any example alone.
uint64_t Hash(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b) {
  uint64_t h = SplitMix64(seed);
  h = SplitMix64(h ^ stream);
  h = SplitMix64(h ^ a);
  return SplitMix64(h ^ b);
}

// Uniform in the open interval (0, 1): never 0, so log() in Box-Muller is
// finite, and never 1, so floor(u * n) < n.
double Uniform(uint64_t h) {
  return (static_cast<double>(h >> 11) + 0.5) * 0x1.0p-53;
}

constexpr double kPi = 3.14159265358979323846;

double Normal(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b) {
  const double u1 = Uniform(Hash(seed, stream, a, 2 * b));
  const double u2 = Uniform(Hash(seed, stream, a, 2 * b + 1));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * kPi * u2);
}

absl::Status ValidateReaderOptions(int64_t num_features, int64_t num_classes,
                                   const ShardSpec& shard) {
  if (num_features < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_features must be >= 0 (0 = infer), got ", num_features));
  }
  if (num_classes != 0 && num_classes < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_classes must be >= 2 (0 = infer), got ", num_classes));
  }
  return ValidateShard(shard);
}

// Parses an integer class label; -1/+1 are the binary convention of LIBSVM.
// num_classes == 0: any label >= 0 (the count is inferred afterwards).
absl::Status ParseLabel(const LineReader& reader, absl::string_view text,
                        int64_t num_classes, bool allow_plus_minus_one,
                        int32_t* label) {
  int64_t value;
  if (!absl::SimpleAtoi(text, &value)) {
    return reader.Error(absl::StrCat("label '", text, "' is not an integer"));
  }
  if (allow_plus_minus_one && num_classes == 2 && value == -1) value = 0;
  if (value < 0) {
    return reader.Error(absl::StrCat(
        "label ", value, " is out of range: class labels are >= 0"));
  }
  if (value >= std::numeric_limits<int32_t>::max()) {
    return reader.Error(absl::StrCat("label ", value, " is too large"));
  }
  if (num_classes > 0 && value >= num_classes) {
    return reader.Error(absl::StrCat("label ", value, " is out of range [0, ",
                                     num_classes, "): set --num_classes to ",
                                     value + 1, " or more (0 infers it)"));
  }
  *label = static_cast<int32_t>(value);
  return absl::OkStatus();
}

absl::Status ParseValue(const LineReader& reader, absl::string_view text,
                        absl::string_view what, float* value) {
  if (!absl::SimpleAtof(text, value)) {
    return reader.Error(absl::StrCat(what, " '", text, "' is not a number"));
  }
  // A NaN or Inf feature would silently poison every parameter it touches.
  if (!std::isfinite(*value)) {
    return reader.Error(
        absl::StrCat(what, " '", text, "' is not a finite float"));
  }
  return absl::OkStatus();
}

// Only text makes a header: an empty field (a trailing comma, say) on the
// first line is a malformed example, which should be reported, not dropped.
bool IsHeader(const std::vector<absl::string_view>& fields) {
  for (absl::string_view field : fields) {
    float unused;
    if (!absl::StripAsciiWhitespace(field).empty() &&
        !absl::SimpleAtof(field, &unused)) {
      return true;
    }
  }
  return false;
}

}  // namespace

absl::Status ValidateShard(const ShardSpec& shard) {
  if (shard.count < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard.count must be >= 1, got ", shard.count));
  }
  if (shard.index < 0 || shard.index >= shard.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard.index must be in [0, shard.count = ", shard.count,
                     "), got ", shard.index));
  }
  return absl::OkStatus();
}

bool InShard(int64_t example_index, const ShardSpec& shard) {
  return example_index % shard.count == shard.index;
}

absl::Status ValidateExampleRange(int64_t first_index, int64_t count) {
  if (first_index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_index must be >= 0, got ", first_index));
  }
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("count must be >= 0, got ", count));
  }
  if (count > std::numeric_limits<int64_t>::max() - first_index) {
    return absl::InvalidArgumentError(absl::StrCat(
        "first_index + count overflows: ", first_index, " + ", count));
  }
  return absl::OkStatus();
}

absl::StatusOr<Dataset> MakeSyntheticClassification(
    const SyntheticOptions& options, int64_t first_index, int64_t count,
    ShardSpec shard) {
  if (options.num_features < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_features must be >= 1, got ", options.num_features));
  }
  if (options.num_classes < 2 ||
      options.num_classes > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_classes must be in [2, 2^31), got ", options.num_classes));
  }
  // Written so that NaN fails too.
  if (!(options.label_noise >= 0.0 && options.label_noise <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "label_noise must be in [0, 1], got ", options.label_noise));
  }
  if (options.num_classes >
      std::numeric_limits<int64_t>::max() / options.num_features) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_classes * num_features overflows: ", options.num_classes, " * ",
        options.num_features));
  }
  if (absl::Status status = ValidateShard(shard); !status.ok()) return status;
  if (absl::Status status = ValidateExampleRange(first_index, count);
      !status.ok()) {
    return status;
  }

  const int64_t num_features = options.num_features;
  const int64_t num_classes = options.num_classes;
  Dataset data;
  data.num_features = num_features;
  data.num_classes = num_classes;

  // The first global index >= first_index that belongs to this shard.
  const int64_t offset =
      (shard.index - first_index % shard.count + shard.count) % shard.count;
  if (offset >= count) return data;
  const int64_t start = first_index + offset;
  const int64_t rows = (count - offset - 1) / shard.count + 1;
  if (rows > std::numeric_limits<int64_t>::max() / num_features) {
    return absl::InvalidArgumentError(absl::StrCat(
        "count * num_features overflows: ", rows, " * ", num_features));
  }

  std::vector<double> teacher(num_classes * num_features);
  for (int64_t c = 0; c < num_classes; ++c) {
    for (int64_t j = 0; j < num_features; ++j) {
      teacher[c * num_features + j] =
          Normal(options.seed, kTeacherStream, c, j);
    }
  }

  data.features.resize(rows * num_features);
  data.labels.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t i = static_cast<uint64_t>(start + r * shard.count);
    float* x = &data.features[r * num_features];
    for (int64_t j = 0; j < num_features; ++j) {
      x[j] = static_cast<float>(Normal(options.seed, kFeatureStream, i, j));
    }
    // The label is computed from the stored floats, so that the teacher is
    // exactly right on the data a model sees, not on a rounded-away version.
    int64_t best = 0;
    double best_score = -std::numeric_limits<double>::infinity();
    for (int64_t c = 0; c < num_classes; ++c) {
      const double* t = &teacher[c * num_features];
      double score = 0;
      for (int64_t j = 0; j < num_features; ++j) score += t[j] * x[j];
      if (score > best_score) {
        best_score = score;
        best = c;
      }
    }
    if (Uniform(Hash(options.seed, kNoiseStream, i, 0)) < options.label_noise) {
      const double u = Uniform(Hash(options.seed, kNoiseClassStream, i, 0));
      best = std::min(static_cast<int64_t>(u * num_classes), num_classes - 1);
    }
    data.labels[r] = static_cast<int32_t>(best);
  }
  return data;
}

double SyntheticBestAccuracy(const SyntheticOptions& options) {
  return (1.0 - options.label_noise) +
         options.label_noise / static_cast<double>(options.num_classes);
}

absl::StatusOr<Dataset> ReadCsv(const std::string& path, int64_t num_features,
                                int64_t num_classes, ShardSpec shard) {
  if (absl::Status status =
          ValidateReaderOptions(num_features, num_classes, shard);
      !status.ok()) {
    return status;
  }
  LineReader reader(path, '\0');
  if (absl::Status status = reader.OpenStatus(); !status.ok()) return status;

  Dataset data;
  data.num_classes = num_classes;
  bool first_line = true;
  bool width_known = num_features > 0;
  int64_t example_index = 0;
  absl::string_view line;
  std::vector<absl::string_view> fields;
  while (reader.Next(&line)) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    const bool header_candidate = first_line;
    first_line = false;
    const bool kept = InShard(example_index, shard);
    // Every shard looks at the first line and the first example, kept or not,
    // so that all of them agree on the header and on the inferred width.
    if (!kept && !header_candidate && width_known) {
      ++example_index;
      continue;
    }
    fields = absl::StrSplit(line, ',');
    if (header_candidate && IsHeader(fields)) continue;
    if (!width_known) {
      num_features = static_cast<int64_t>(fields.size()) - 1;
      if (num_features < 1) {
        return reader.Error(
            "cannot infer num_features: the first example has no feature "
            "columns");
      }
      width_known = true;
    }
    ++example_index;
    if (!kept) continue;
    if (static_cast<int64_t>(fields.size()) != num_features + 1) {
      return reader.Error(absl::StrCat("expected ", num_features + 1,
                                       " columns (label + ", num_features,
                                       " features), got ", fields.size()));
    }
    int32_t label;
    if (absl::Status status =
            ParseLabel(reader, fields[0], num_classes, false, &label);
        !status.ok()) {
      return status;
    }
    data.labels.push_back(label);
    for (int64_t j = 1; j <= num_features; ++j) {
      float value;
      if (absl::Status status =
              ParseValue(reader, absl::StripAsciiWhitespace(fields[j]),
                         absl::StrCat("column ", j + 1), &value);
          !status.ok()) {
        return status;
      }
      data.features.push_back(value);
    }
  }
  if (absl::Status status = reader.ReadStatus(); !status.ok()) return status;
  if (example_index == 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no examples"));
  }
  data.num_features = num_features;
  if (num_classes == 0) data.num_classes = InferNumClasses(data.labels);
  return data;
}

absl::StatusOr<Dataset> ReadLibsvm(const std::string& path,
                                   int64_t num_features, int64_t num_classes,
                                   ShardSpec shard) {
  if (absl::Status status =
          ValidateReaderOptions(num_features, num_classes, shard);
      !status.ok()) {
    return status;
  }
  LineReader reader(path, '#');
  if (absl::Status status = reader.OpenStatus(); !status.ok()) return status;

  // The width may only be known at the end of the file, so kept examples are
  // held sparse until then.
  const bool infer = num_features == 0;
  int64_t max_index = 0;
  std::vector<int32_t> labels;
  std::vector<int64_t> indices;
  std::vector<float> values;
  std::vector<size_t> row_ends;
  int64_t example_index = 0;
  absl::string_view line;
  LibsvmLine parsed;
  while (reader.Next(&line)) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    const bool kept = InShard(example_index, shard);
    ++example_index;
    if (!kept && !infer) continue;
    const absl::Status form = ParseLibsvmLine(line, &parsed);
    if (!kept) {
      // No value or label checks: the shard that keeps this line validates
      // it, but every shard must agree on the width.
      if (form.ok() && !parsed.features.empty()) {
        max_index = std::max(
            max_index, static_cast<int64_t>(parsed.features.back().index));
      }
      continue;
    }
    if (!form.ok()) return reader.Error(form.message());
    int32_t label;
    if (absl::Status status =
            ParseLabel(reader, parsed.label, num_classes, true, &label);
        !status.ok()) {
      return status;
    }
    labels.push_back(label);
    int64_t previous = 0;
    for (const LibsvmFeature& feature : parsed.features) {
      if (feature.index < 1 ||
          (!infer && feature.index > static_cast<uint64_t>(num_features)) ||
          feature.index >
              static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return reader.Error(absl::StrCat(
            "index ", feature.index, " is out of range [1, ",
            infer ? std::string("inf") : absl::StrCat(num_features), "]"));
      }
      const int64_t index = static_cast<int64_t>(feature.index);
      previous = index;
      float value;
      if (absl::Status status =
              ParseValue(reader, feature.value,
                         absl::StrCat("value of index ", index), &value);
          !status.ok()) {
        return status;
      }
      indices.push_back(index);
      values.push_back(value);
    }
    max_index = std::max(max_index, previous);
    row_ends.push_back(indices.size());
  }
  if (absl::Status status = reader.ReadStatus(); !status.ok()) return status;
  if (example_index == 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no examples"));
  }
  if (infer) {
    if (max_index < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": cannot infer num_features: no feature indices in the file"));
    }
    num_features = max_index;
  }
  // A stray huge index would otherwise turn into an impossible allocation.
  if (!labels.empty() &&
      num_features > std::numeric_limits<int64_t>::max() /
                         static_cast<int64_t>(labels.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", labels.size(), " examples of ", num_features,
                     " features overflow"));
  }

  Dataset data;
  data.num_features = num_features;
  data.num_classes = num_classes == 0 ? InferNumClasses(labels) : num_classes;
  data.labels = std::move(labels);
  data.features.assign(data.labels.size() * num_features, 0.0f);
  size_t begin = 0;
  for (size_t r = 0; r < row_ends.size(); ++r) {
    float* row = &data.features[r * num_features];
    for (size_t k = begin; k < row_ends[r]; ++k) {
      row[indices[k] - 1] = values[k];
    }
    begin = row_ends[r];
  }
  return data;
}

void BatchCursor::Next(int64_t rows, float* features, int32_t* labels) {
  // Documented as the caller's error; doing nothing beats dividing by zero.
  if (data_ == nullptr || data_->size() == 0 || rows <= 0) return;
  const int64_t size = data_->size();
  const int64_t width = data_->num_features;
  while (rows > 0) {
    const int64_t n = std::min(rows, size - position_);
    std::copy_n(data_->features.data() + position_ * width, n * width,
                features);
    std::copy_n(data_->labels.data() + position_, n, labels);
    features += n * width;
    labels += n;
    rows -= n;
    position_ += n;
    if (position_ == size) position_ = 0;
  }
}

absl::Status InMemorySource::Gather(absl::Span<const int64_t> indices,
                                    float* features, int32_t* labels) const {
  const int64_t width = data_.num_features;
  for (size_t r = 0; r < indices.size(); ++r) {
    const int64_t i = indices[r];
    if (i < 0 || i >= size()) {
      return absl::OutOfRangeError(
          absl::StrCat("example ", i, " is out of range [0, ", size(), ")"));
    }
    std::copy_n(data_.features.data() + i * width, width, features + r * width);
    labels[r] = data_.labels[i];
  }
  return absl::OkStatus();
}

int64_t InMemorySource::resident_bytes() const {
  return static_cast<int64_t>(data_.features.size() * sizeof(float) +
                              data_.labels.size() * sizeof(int32_t));
}

int64_t InferNumClasses(absl::Span<const int32_t> labels) {
  int64_t largest = 1;
  for (int32_t label : labels) largest = std::max<int64_t>(largest, label);
  return largest + 1;
}

std::vector<int64_t> EpochPermutation(int64_t size, uint64_t seed,
                                      int64_t epoch) {
  std::vector<int64_t> order(std::max<int64_t>(size, 0));
  for (int64_t i = 0; i < size; ++i) order[i] = i;
  for (int64_t i = size - 1; i > 0; --i) {
    // Multiply-shift maps the hash onto [0, i] with a bias below 2^-32.
    const uint64_t h = Hash(seed, kShuffleStream, epoch, i);
    const int64_t j = static_cast<int64_t>(
        (static_cast<unsigned __int128>(h) * static_cast<uint64_t>(i + 1)) >>
        64);
    std::swap(order[i], order[j]);
  }
  return order;
}

absl::StatusOr<EpochPlan> EpochPlan::Create(const Options& options) {
  if (options.worker_batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the per-worker batch must be >= 1, got ", options.worker_batch));
  }
  if (absl::Status status =
          ValidateShard({options.worker_index, options.num_workers});
      !status.ok()) {
    return status;
  }
  const int64_t global_batch = options.worker_batch * options.num_workers;
  if (options.num_examples < global_batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the global batch (", global_batch,
        " examples) is larger than the training set (", options.num_examples,
        " examples): lower --global_batch_size or --batch_size"));
  }
  return EpochPlan(options);
}

EpochPlan::EpochPlan(const Options& options)
    : options_(options),
      steps_per_epoch_(options.num_examples / global_batch()) {}

absl::Span<const int64_t> EpochPlan::WorkerIndices(int64_t step) {
  const int64_t epoch = step / steps_per_epoch_;
  if (epoch != epoch_) {
    if (options_.shuffle) {
      order_ = EpochPermutation(options_.num_examples, options_.seed, epoch);
    } else if (order_.empty()) {
      order_.resize(options_.num_examples);
      std::iota(order_.begin(), order_.end(), int64_t{0});
    }
    epoch_ = epoch;
  }
  const int64_t first = (step % steps_per_epoch_) * global_batch() +
                        options_.worker_index * options_.worker_batch;
  return absl::MakeConstSpan(order_).subspan(first, options_.worker_batch);
}

}  // namespace pstrain
