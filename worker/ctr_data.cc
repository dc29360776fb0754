#include "worker/ctr_data.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>  // NOLINT: absl::Mutex would do as well
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/hash.h"
#include "worker/libsvm.h"
#include "worker/line_reader.h"

namespace pstrain {
namespace {

// Independent streams of the counter-based generator, so that no two uses of
// randomness can ever draw the same number.
enum Stream : uint64_t {
  kDenseStream = 11,
  kBagSizeStream = 12,
  kZipfStream = 13,
  kLabelStream = 14,
  kEmbeddingStream = 15,
  kFieldWeightStream = 16,
  kDenseWeightStream = 17,
};

// Salts of the id hashes: fixed forever, since ids written into checkpoints
// and tables must mean the same thing in every later build.
constexpr uint64_t kSyntheticIdSalt = 0x5ca1ab1e0ddba11ULL;
constexpr uint64_t kCategoricalIdSalt = 0xc7a17e0f1e1d5eedULL;

// Examples of the stream used to standardize the true logit and solve for
// the bias (see ctr_data.h).
constexpr int64_t kCalibrationExamples = 4096;

// The dense part's weight in the raw score: the task is about the sparse
// features, so they carry most of the signal.
constexpr double kDenseWeight = 0.5;

// Every random number is a hash of where it is used (seed, stream, example,
// field, ...) rather than of what was drawn before it; that is what lets any
// worker generate any example alone.
uint64_t Hash(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0;
  for (uint64_t part : parts) h = SplitMix64(h ^ part);
  return h;
}

// Uniform in the open interval (0, 1): never 0 (log is finite) nor 1.
double Uniform(uint64_t h) {
  return (static_cast<double>(h >> 11) + 0.5) * 0x1.0p-53;
}

constexpr double kPi = 3.14159265358979323846;

double NormalFrom(uint64_t h1, uint64_t h2) {
  return std::sqrt(-2.0 * std::log(Uniform(h1))) *
         std::cos(2.0 * kPi * Uniform(h2));
}

double Sigmoid(double x) {
  // Both branches avoid exp overflow for large |x|.
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

// Exact sampling from the Zipf law P(k) ~ k^-s on {1..n} by rejection-
// inversion (Hormann and Derflinger 1996, as in Apache Commons RNG): O(1)
// time and memory per draw whatever n is, and the acceptance rate is above
// 90%, so a draw needs on average little more than one uniform.
class ZipfSampler {
 public:
  ZipfSampler(int64_t n, double exponent) : n_(n), exponent_(exponent) {
    h_integral_x1_ = HIntegral(1.5) - 1.0;
    h_integral_n_ = HIntegral(static_cast<double>(n) + 0.5);
    s_ = 2.0 - HIntegralInverse(HIntegral(2.5) - H(2.0));
  }

  // A rank in [1, n]; uniform(t) gives the t-th uniform of this draw.
  template <typename UniformFn>
  int64_t Sample(UniformFn uniform) const {
    for (uint64_t t = 0;; ++t) {
      const double u =
          h_integral_n_ + uniform(t) * (h_integral_x1_ - h_integral_n_);
      const double x = HIntegralInverse(u);
      int64_t k = static_cast<int64_t>(x + 0.5);
      k = std::clamp<int64_t>(k, 1, n_);
      if (static_cast<double>(k) - x <= s_ ||
          u >= HIntegral(static_cast<double>(k) + 0.5) -
                   H(static_cast<double>(k))) {
        return k;
      }
    }
  }

 private:
  // h(x) = x^-s and its antiderivative, written with log1p/expm1 helpers
  // that stay accurate as s -> 1.
  double H(double x) const { return std::exp(-exponent_ * std::log(x)); }
  double HIntegral(double x) const {
    const double log_x = std::log(x);
    return Helper2((1.0 - exponent_) * log_x) * log_x;
  }
  double HIntegralInverse(double x) const {
    double t = x * (1.0 - exponent_);
    if (t < -1.0) t = -1.0;  // rounding only; keeps log1p finite
    return std::exp(Helper1(t) * x);
  }
  static double Helper1(double x) {  // log(1 + x) / x
    if (std::abs(x) > 1e-8) return std::log1p(x) / x;
    return 1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x));
  }
  static double Helper2(double x) {  // (exp(x) - 1) / x
    if (std::abs(x) > 1e-8) return std::expm1(x) / x;
    return 1.0 + x * 0.5 * (1.0 + x * (1.0 / 3.0) * (1.0 + 0.25 * x));
  }

  int64_t n_;
  double exponent_;
  double h_integral_x1_;
  double h_integral_n_;
  double s_;
};

absl::Status ValidateOptions(const SyntheticCtrOptions& o) {
  const auto bad = [](absl::string_view what) {
    return absl::InvalidArgumentError(what);
  };
  if (o.num_dense < 0) {
    return bad(absl::StrCat("num_dense must be >= 0, got ", o.num_dense));
  }
  if (o.num_fields < 0) {
    return bad(absl::StrCat("num_fields must be >= 0, got ", o.num_fields));
  }
  if (!o.field_vocab.empty() &&
      static_cast<int>(o.field_vocab.size()) != o.num_fields) {
    return bad(absl::StrCat("field_vocab has ", o.field_vocab.size(),
                            " entries for ", o.num_fields, " fields"));
  }
  for (int64_t vocab : o.field_vocab.empty()
                           ? std::vector<int64_t>{o.vocab_per_field}
                           : o.field_vocab) {
    if (vocab < 1) {
      return bad(absl::StrCat("vocab_per_field must be >= 1, got ", vocab));
    }
    // The sampler's arithmetic is in double; ranks beyond 2^53 would round.
    if (vocab > (int64_t{1} << 53)) {
      return bad(absl::StrCat("vocab_per_field must be <= 2^53, got ", vocab));
    }
  }
  // Written so that NaN fails too.
  if (!(o.zipf_exponent >= 0.0 && o.zipf_exponent <= 100.0)) {
    return bad(absl::StrCat("zipf_exponent must be in [0, 100], got ",
                            o.zipf_exponent));
  }
  if (o.max_bag < 1) {
    return bad(absl::StrCat("max_bag must be >= 1, got ", o.max_bag));
  }
  if (o.dim_truth < 1) {
    return bad(absl::StrCat("dim_truth must be >= 1, got ", o.dim_truth));
  }
  if (!(o.noise >= 0.0 && o.noise <= 1.0)) {
    return bad(absl::StrCat("noise must be in [0, 1], got ", o.noise));
  }
  if (!(o.positive_rate > 0.0 && o.positive_rate < 1.0)) {
    return bad(
        absl::StrCat("positive_rate must be in (0, 1), got ", o.positive_rate));
  }
  if (!(o.logit_scale >= 0.0 && std::isfinite(o.logit_scale))) {
    return bad(absl::StrCat("logit_scale must be finite and >= 0, got ",
                            o.logit_scale));
  }
  if (!std::isfinite(o.interaction)) {
    return bad(absl::StrCat("interaction must be finite, got ", o.interaction));
  }
  return absl::OkStatus();
}

// Appends the features (dense values and bags, no label) of global example i
// to `data`.
// One sampler per field, over that field's vocabulary.
std::vector<ZipfSampler> FieldSamplers(const SyntheticCtrOptions& o) {
  std::vector<ZipfSampler> samplers;
  for (int f = 0; f < o.num_fields; ++f) {
    samplers.emplace_back(
        o.field_vocab.empty() ? o.vocab_per_field : o.field_vocab[f],
        o.zipf_exponent);
  }
  return samplers;
}

void AppendSyntheticFeatures(const SyntheticCtrOptions& o,
                             const std::vector<ZipfSampler>& zipf, uint64_t i,
                             CtrDataset* data) {
  for (int j = 0; j < o.num_dense; ++j) {
    static constexpr double kMeans[] = {1.0, 10.0, 100.0, 1000.0};
    const double u = Uniform(Hash({o.seed, kDenseStream, i, uint64_t(j)}));
    const double count = std::floor(-kMeans[j % 4] * std::log(u));
    data->dense.push_back(static_cast<float>(std::log1p(count)));
  }
  for (int f = 0; f < o.num_fields; ++f) {
    const double u = Uniform(Hash({o.seed, kBagSizeStream, i, uint64_t(f)}));
    const int bag =
        1 + std::min(static_cast<int>(u * o.max_bag), o.max_bag - 1);
    for (int k = 0; k < bag; ++k) {
      const int64_t rank = zipf[f].Sample([&](uint64_t t) {
        return Uniform(
            Hash({o.seed, kZipfStream, i, uint64_t(f), uint64_t(k), t}));
      });
      data->ids.push_back(CtrSyntheticId(f, static_cast<uint64_t>(rank - 1)));
    }
    data->offsets.push_back(static_cast<int64_t>(data->ids.size()));
  }
}

// The hidden model of ctr_data.h: weights from the seed, plus the
// standardization and bias found on the calibration examples.
class Truth {
 public:
  explicit Truth(const SyntheticCtrOptions& o) : o_(o) {
    const int dim = o.dim_truth;
    field_weights_.resize(static_cast<size_t>(o.num_fields) * dim);
    for (int f = 0; f < o.num_fields; ++f) {
      for (int d = 0; d < dim; ++d) {
        field_weights_[f * dim + d] = NormalFrom(
            Hash({o.seed, kFieldWeightStream, uint64_t(f), uint64_t(2 * d)}),
            Hash({o.seed, kFieldWeightStream, uint64_t(f),
                  uint64_t(2 * d + 1)}));
      }
    }
    dense_weights_.resize(o.num_dense);
    for (int j = 0; j < o.num_dense; ++j) {
      dense_weights_[j] =
          NormalFrom(Hash({o.seed, kDenseWeightStream, uint64_t(j), 0}),
                     Hash({o.seed, kDenseWeightStream, uint64_t(j), 1}));
    }
    means_.resize(static_cast<size_t>(o.num_fields) * dim);
    cached_embeddings_.reset(new double[kEmbeddingSlots * dim]);
    // A trainer may generate data in many small calls; the calibration is
    // the expensive part and depends only on the options, so it is cached.
    static std::mutex mu;
    static std::vector<std::pair<SyntheticCtrOptions, Calibration>>* cache =
        new std::vector<std::pair<SyntheticCtrOptions, Calibration>>();
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& [options, calibration] : *cache) {
        if (SameTruth(options, o)) {
          calibration_ = calibration;
          return;
        }
      }
    }
    Calibrate();
    std::lock_guard<std::mutex> lock(mu);
    // Bounded: a process sweeping many option sets keeps only the latest.
    if (cache->size() >= 64) cache->erase(cache->begin());
    cache->emplace_back(o, calibration_);
  }

  // The click probability of example i of `data`, labels' noise included.
  double Probability(const CtrDataset& data, int64_t i) {
    const double logit =
        o_.logit_scale * (Raw(data, i) - calibration_.mu) / calibration_.sigma +
        calibration_.bias;
    return (1.0 - o_.noise) * Sigmoid(logit) + 0.5 * o_.noise;
  }

 private:
  // The unstandardized score of example i of `data`.
  double Raw(const CtrDataset& data, int64_t i) {
    const int dim = o_.dim_truth;
    const int num_fields = o_.num_fields;
    double linear = 0;
    for (int f = 0; f < num_fields; ++f) {
      double* m = &means_[f * dim];
      std::fill(m, m + dim, 0.0);
      const int64_t begin = data.BagBegin(i, f);
      const int64_t end = data.BagEnd(i, f);
      for (int64_t k = begin; k < end; ++k) {
        const double* e = Embedding(f, data.ids[k]);
        for (int d = 0; d < dim; ++d) m[d] += e[d];
      }
      if (end > begin) {
        for (int d = 0; d < dim; ++d) m[d] /= static_cast<double>(end - begin);
      }
      for (int d = 0; d < dim; ++d)
        linear += field_weights_[f * dim + d] * m[d];
    }
    double raw = 0;
    if (num_fields > 0) raw += linear / std::sqrt(double(num_fields) * dim);
    if (o_.interaction != 0 && num_fields > 1) {
      double pairs = 0;
      for (int f = 0; f < num_fields; ++f) {
        for (int g = f + 1; g < num_fields; ++g) {
          for (int d = 0; d < dim; ++d) {
            pairs += means_[f * dim + d] * means_[g * dim + d];
          }
        }
      }
      const double num_pairs = 0.5 * num_fields * (num_fields - 1);
      raw += o_.interaction * pairs / std::sqrt(num_pairs * dim);
    }
    if (o_.num_dense > 0) {
      double dense = 0;
      const float* x = &data.dense[i * o_.num_dense];
      for (int j = 0; j < o_.num_dense; ++j) dense += dense_weights_[j] * x[j];
      raw += kDenseWeight * dense / std::sqrt(double(o_.num_dense));
    }
    return raw;
  }

  // The true embedding of (field f, id): dim_truth normals, each a log, a
  // square root and a cosine. Zipf ids repeat, so recent ones are kept in a
  // direct-mapped cache (the same values, computed once while they stay).
  const double* Embedding(int f, uint64_t id) {
    const int dim = o_.dim_truth;
    // Ids are hashes already; the field is mixed in so that two fields'
    // equal ids take different slots.
    const size_t slot = static_cast<size_t>(
        (id ^ (uint64_t(f) * 0x9e3779b97f4a7c15ULL)) & (kEmbeddingSlots - 1));
    double* e = &cached_embeddings_[slot * dim];
    CachedKey& key = cached_keys_[slot];
    if (key.field == f && key.id == id) return e;
    for (int d = 0; d < dim; ++d) {
      e[d] = NormalFrom(
          Hash({o_.seed, kEmbeddingStream, uint64_t(f), id, uint64_t(2 * d)}),
          Hash({o_.seed, kEmbeddingStream, uint64_t(f), id,
                uint64_t(2 * d + 1)}));
    }
    key = {id, f};
    return e;
  }

  void Calibrate() {
    CtrDataset sample;
    sample.num_dense = o_.num_dense;
    sample.num_fields = o_.num_fields;
    sample.offsets.push_back(0);
    const std::vector<ZipfSampler> zipf = FieldSamplers(o_);
    std::vector<double> raw(kCalibrationExamples);
    for (int64_t i = 0; i < kCalibrationExamples; ++i) {
      AppendSyntheticFeatures(o_, zipf, static_cast<uint64_t>(i), &sample);
      sample.labels.push_back(0);
    }
    double sum = 0;
    for (int64_t i = 0; i < kCalibrationExamples; ++i) {
      raw[i] = Raw(sample, i);
      sum += raw[i];
    }
    const double mu = sum / kCalibrationExamples;
    double squares = 0;
    for (double r : raw) squares += (r - mu) * (r - mu);
    double sigma = std::sqrt(squares / kCalibrationExamples);
    // No features (or constant ones): the logit is just the bias.
    if (!(sigma > 1e-12)) sigma = 1.0;
    for (double& r : raw) r = o_.logit_scale * (r - mu) / sigma;
    // The mean probability is increasing in the bias; a rate in (0, 1) is
    // reached within +-60 for any standardized logit of scale <= 1e6-ish,
    // and the ends of the bracket are a fine answer otherwise.
    double lo = -60.0;
    double hi = 60.0;
    for (int iteration = 0; iteration < 100; ++iteration) {
      const double mid = 0.5 * (lo + hi);
      double mean = 0;
      for (double r : raw) mean += Sigmoid(r + mid);
      mean /= kCalibrationExamples;
      if (mean < o_.positive_rate) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    calibration_ = {mu, sigma, 0.5 * (lo + hi)};
  }

  // Whether two option sets have the same standardization and bias (all
  // but the label noise, which acts after the logit).
  static bool SameTruth(const SyntheticCtrOptions& a,
                        const SyntheticCtrOptions& b) {
    return a.num_dense == b.num_dense && a.num_fields == b.num_fields &&
           a.vocab_per_field == b.vocab_per_field &&
           a.field_vocab == b.field_vocab &&
           a.zipf_exponent == b.zipf_exponent && a.max_bag == b.max_bag &&
           a.dim_truth == b.dim_truth && a.seed == b.seed &&
           a.positive_rate == b.positive_rate &&
           a.logit_scale == b.logit_scale && a.interaction == b.interaction;
  }

  struct Calibration {
    double mu = 0;
    double sigma = 1;
    double bias = 0;
  };

  SyntheticCtrOptions o_;
  Calibration calibration_;
  std::vector<double> field_weights_;  // [num_fields, dim_truth]
  std::vector<double> dense_weights_;  // [num_dense]
  std::vector<double> means_;          // scratch: m_f, [num_fields, dim_truth]
  // Embedding's cache: slot s holds the values of cached_keys_[s] (field
  // -1: empty) at s * dim_truth.
  static constexpr size_t kEmbeddingSlots = size_t{1} << 18;
  struct CachedKey {
    uint64_t id = 0;
    int field = -1;
  };
  std::vector<CachedKey> cached_keys_ = std::vector<CachedKey>(kEmbeddingSlots);
  // Not value-initialized: only the slots in use are ever touched.
  std::unique_ptr<double[]> cached_embeddings_;
};

CtrDataset EmptyDataset(int num_dense, int num_fields) {
  CtrDataset data;
  data.num_dense = num_dense;
  data.num_fields = num_fields;
  data.offsets.push_back(0);
  return data;
}

}  // namespace

absl::Status ValidateCtrDataset(const CtrDataset& data) {
  if (data.num_dense < 0 || data.num_fields < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_dense (", data.num_dense, ") and num_fields (",
                     data.num_fields, ") must be >= 0"));
  }
  const int64_t n = data.size();
  if (static_cast<int64_t>(data.dense.size()) != n * data.num_dense) {
    return absl::InvalidArgumentError(
        absl::StrCat("dense has ", data.dense.size(), " values, expected ", n,
                     " * ", data.num_dense));
  }
  if (static_cast<int64_t>(data.offsets.size()) != n * data.num_fields + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("offsets has ", data.offsets.size(), " entries, expected ",
                     n, " * ", data.num_fields, " + 1"));
  }
  if (data.offsets[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("offsets[0] must be 0, got ", data.offsets[0]));
  }
  for (size_t k = 1; k < data.offsets.size(); ++k) {
    if (data.offsets[k] < data.offsets[k - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("offsets decrease at ", k,
                                                     ": ", data.offsets[k - 1],
                                                     " > ", data.offsets[k]));
    }
  }
  if (data.offsets.back() != static_cast<int64_t>(data.ids.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("offsets end at ", data.offsets.back(), " but there are ",
                     data.ids.size(), " ids"));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (data.labels[i] != 0.0f && data.labels[i] != 1.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("labels[", i, "] = ", data.labels[i], " is not 0 or 1"));
    }
  }
  for (size_t k = 0; k < data.dense.size(); ++k) {
    if (!std::isfinite(data.dense[k])) {
      return absl::InvalidArgumentError(
          absl::StrCat("dense[", k, "] = ", data.dense[k], " is not finite"));
    }
  }
  return absl::OkStatus();
}

std::string CtrTableName(int field) { return absl::StrCat("field", field); }

uint64_t CtrCategoricalId(int field, absl::string_view value) {
  return SplitMix64(Fnv1a64(value) ^
                    SplitMix64(kCategoricalIdSalt + uint64_t(field)));
}

uint64_t CtrSyntheticId(int field, uint64_t raw_id) {
  // Mix is a bijection, so distinct raw ids of a field never collide.
  return SplitMix64(raw_id ^ SplitMix64(kSyntheticIdSalt + uint64_t(field)));
}

absl::StatusOr<CtrDataset> MakeSyntheticCtr(
    const SyntheticCtrOptions& options, int64_t first_index, int64_t count,
    ShardSpec shard, std::vector<double>* true_probabilities) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  if (absl::Status s = ValidateShard(shard); !s.ok()) return s;
  if (absl::Status s = ValidateExampleRange(first_index, count); !s.ok()) {
    return s;
  }
  CtrDataset data = EmptyDataset(options.num_dense, options.num_fields);
  if (true_probabilities != nullptr) true_probabilities->clear();
  // The first global index >= first_index that belongs to this shard.
  const int64_t offset =
      (shard.index - first_index % shard.count + shard.count) % shard.count;
  if (offset >= count) return data;
  const int64_t start = first_index + offset;
  const int64_t rows = (count - offset - 1) / shard.count + 1;

  const std::vector<ZipfSampler> zipf = FieldSamplers(options);
  Truth truth(options);
  data.labels.reserve(rows);
  data.dense.reserve(rows * options.num_dense);
  data.offsets.reserve(rows * options.num_fields + 1);
  if (true_probabilities != nullptr) true_probabilities->reserve(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t i = static_cast<uint64_t>(start + r * shard.count);
    AppendSyntheticFeatures(options, zipf, i, &data);
    data.labels.push_back(0);
    // The probability is computed from the stored floats, so the truth is
    // exactly right on the data a model sees.
    const double p = truth.Probability(data, r);
    data.labels[r] = Uniform(Hash({options.seed, kLabelStream, i})) < p;
    if (true_probabilities != nullptr) true_probabilities->push_back(p);
  }
  return data;
}

absl::StatusOr<std::vector<double>> SyntheticCtrTrueProbabilities(
    const SyntheticCtrOptions& options, const CtrDataset& data) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  if (absl::Status s = ValidateCtrDataset(data); !s.ok()) return s;
  if (data.num_dense != options.num_dense ||
      data.num_fields != options.num_fields) {
    return absl::InvalidArgumentError(
        absl::StrCat("the data has ", data.num_dense, " dense features and ",
                     data.num_fields, " fields, the options ",
                     options.num_dense, " and ", options.num_fields));
  }
  Truth truth(options);
  std::vector<double> p(data.size());
  for (int64_t i = 0; i < data.size(); ++i) p[i] = truth.Probability(data, i);
  return p;
}

absl::StatusOr<CtrDataset> ReadCriteoTsv(const std::string& path, int num_dense,
                                         int num_fields, ShardSpec shard) {
  if (num_dense < 0 || num_fields < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_dense (", num_dense, ") and num_fields (", num_fields,
                     ") must be >= 0"));
  }
  if (absl::Status s = ValidateShard(shard); !s.ok()) return s;
  LineReader reader(path, '\0');
  if (absl::Status s = reader.OpenStatus(); !s.ok()) return s;

  CtrDataset data = EmptyDataset(num_dense, num_fields);
  const size_t columns = 1 + static_cast<size_t>(num_dense) + num_fields;
  int64_t example_index = 0;
  absl::string_view line;
  std::vector<absl::string_view> fields;
  while (reader.Next(&line)) {
    if (line.empty()) continue;
    const bool kept = InShard(example_index, shard);
    ++example_index;
    if (!kept) continue;
    fields = absl::StrSplit(line, '\t');
    if (fields.size() != columns) {
      return reader.Error(absl::StrCat(
          "expected ", columns, " tab-separated columns (label + ", num_dense,
          " integer + ", num_fields, " categorical), got ", fields.size()));
    }
    if (fields[0] == "0") {
      data.labels.push_back(0.0f);
    } else if (fields[0] == "1") {
      data.labels.push_back(1.0f);
    } else {
      return reader.Error(
          absl::StrCat("label '", fields[0], "' is not 0 or 1"));
    }
    for (int j = 0; j < num_dense; ++j) {
      const absl::string_view text = fields[1 + j];
      double x = 0;
      if (!text.empty()) {
        if (!absl::SimpleAtod(text, &x) || !std::isfinite(x)) {
          return reader.Error(absl::StrCat("integer feature ", j + 1, " '",
                                           text, "' is not a finite number"));
        }
        // Criteo's -1/-2 are "missing"-like codes, not magnitudes.
        if (x < 0) x = 0;
      }
      data.dense.push_back(static_cast<float>(std::log1p(x)));
    }
    for (int f = 0; f < num_fields; ++f) {
      const absl::string_view text = fields[1 + num_dense + f];
      if (!text.empty()) {
        for (absl::string_view value :
             absl::StrSplit(text, ',', absl::SkipEmpty())) {
          data.ids.push_back(CtrCategoricalId(f, value));
        }
      }
      data.offsets.push_back(static_cast<int64_t>(data.ids.size()));
    }
  }
  if (absl::Status s = reader.ReadStatus(); !s.ok()) return s;
  if (example_index == 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no examples"));
  }
  return data;
}

absl::Status WriteCriteoTsv(const std::string& path, const CtrDataset& data) {
  if (absl::Status s = ValidateCtrDataset(data); !s.ok()) return s;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out.is_open()) {
    return absl::NotFoundError(absl::StrCat(
        path, ": cannot open for writing: ", std::strerror(errno)));
  }
  std::string line;
  for (int64_t i = 0; i < data.size(); ++i) {
    line.clear();
    absl::StrAppend(&line, data.labels[i] != 0 ? "1" : "0");
    for (int j = 0; j < data.num_dense; ++j) {
      const double x = data.dense[i * data.num_dense + j];
      if (x < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("dense[", i, ", ", j, "] = ", x,
                         " is negative: not log(1 + count) of a count"));
      }
      absl::StrAppend(&line, "\t", std::llround(std::expm1(x)));
    }
    for (int f = 0; f < data.num_fields; ++f) {
      line.push_back('\t');
      for (int64_t k = data.BagBegin(i, f); k < data.BagEnd(i, f); ++k) {
        if (k > data.BagBegin(i, f)) line.push_back(',');
        absl::StrAppend(&line, absl::StrFormat("%016x", data.ids[k]));
      }
    }
    line.push_back('\n');
    out << line;
  }
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write error"));
  return absl::OkStatus();
}

absl::StatusOr<CtrDataset> ReadLibsvmCtr(const std::string& path,
                                         ShardSpec shard) {
  if (absl::Status s = ValidateShard(shard); !s.ok()) return s;
  LineReader reader(path, '#');
  if (absl::Status s = reader.OpenStatus(); !s.ok()) return s;

  CtrDataset data = EmptyDataset(/*num_dense=*/0, /*num_fields=*/1);
  int64_t example_index = 0;
  absl::string_view line;
  LibsvmLine parsed;
  while (reader.Next(&line)) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    const bool kept = InShard(example_index, shard);
    ++example_index;
    if (!kept) continue;
    if (absl::Status form = ParseLibsvmLine(line, &parsed); !form.ok()) {
      return reader.Error(form.message());
    }
    double label;
    if (!absl::SimpleAtod(parsed.label, &label) ||
        (label != 0.0 && label != 1.0 && label != -1.0)) {
      return reader.Error(
          absl::StrCat("label '", parsed.label, "' is not 0, 1, -1 or +1"));
    }
    data.labels.push_back(label == 1.0 ? 1.0f : 0.0f);
    for (const LibsvmFeature& feature : parsed.features) {
      double value;
      if (!absl::SimpleAtod(feature.value, &value) || value != 1.0) {
        return reader.Error(
            absl::StrCat("value '", feature.value, "' of index ", feature.index,
                         " is not 1: CTR LIBSVM features must be binary"));
      }
      data.ids.push_back(feature.index);
    }
    data.offsets.push_back(static_cast<int64_t>(data.ids.size()));
  }
  if (absl::Status s = reader.ReadStatus(); !s.ok()) return s;
  if (example_index == 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no examples"));
  }
  return data;
}

void CtrBatchCursor::Seek(int64_t example) {
  const int64_t size = data_->size();
  position_ = size > 0 ? example % size : 0;
}

void CtrBatchCursor::Next(int64_t rows, CtrDataset* batch) {
  batch->num_dense = data_->num_dense;
  batch->num_fields = data_->num_fields;
  batch->labels.clear();
  batch->dense.clear();
  batch->ids.clear();
  batch->offsets.assign(1, 0);
  // Documented as the caller's error; an empty batch beats dividing by zero.
  if (data_->size() == 0 || rows <= 0) return;
  const int64_t size = data_->size();
  const int nd = data_->num_dense;
  const int nf = data_->num_fields;
  while (rows > 0) {
    const int64_t n = std::min(rows, size - position_);
    batch->labels.insert(batch->labels.end(), data_->labels.begin() + position_,
                         data_->labels.begin() + position_ + n);
    batch->dense.insert(batch->dense.end(),
                        data_->dense.begin() + position_ * nd,
                        data_->dense.begin() + (position_ + n) * nd);
    const int64_t id_begin = data_->offsets[position_ * nf];
    const int64_t id_end = data_->offsets[(position_ + n) * nf];
    // Rebase: this chunk's offsets continue from the ids already copied.
    const int64_t shift = static_cast<int64_t>(batch->ids.size()) - id_begin;
    for (int64_t k = position_ * nf + 1; k <= (position_ + n) * nf; ++k) {
      batch->offsets.push_back(data_->offsets[k] + shift);
    }
    batch->ids.insert(batch->ids.end(), data_->ids.begin() + id_begin,
                      data_->ids.begin() + id_end);
    rows -= n;
    position_ += n;
    if (position_ == size) position_ = 0;
  }
}

void ExtractFieldBags(const CtrDataset& data, int field,
                      std::vector<int64_t>* offsets,
                      std::vector<uint64_t>* ids) {
  offsets->clear();
  ids->clear();
  offsets->push_back(0);
  for (int64_t i = 0; i < data.size(); ++i) {
    ids->insert(ids->end(), data.ids.begin() + data.BagBegin(i, field),
                data.ids.begin() + data.BagEnd(i, field));
    offsets->push_back(static_cast<int64_t>(ids->size()));
  }
}

absl::Status GatherFieldBags(absl::Span<const int64_t> offsets,
                             absl::Span<const uint64_t> ids, int num_fields,
                             absl::Span<const int64_t> rows,
                             absl::Span<uint64_t> ids_out,
                             absl::Span<int64_t> bag_offsets,
                             absl::Span<int64_t> field_ids) {
  const int64_t num_examples =
      (static_cast<int64_t>(offsets.size()) - 1) / num_fields;
  if (field_ids.size() != static_cast<size_t>(num_fields) + 1 ||
      bag_offsets.size() != rows.size() * num_fields) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GatherFieldBags: ", field_ids.size(), " field starts and ",
        bag_offsets.size(), " bag offsets for ", num_fields, " fields of ",
        rows.size(), " rows"));
  }
  for (int64_t row : rows) {
    if (row < 0 || row >= num_examples) {
      return absl::OutOfRangeError(
          absl::StrCat("example ", row, " of a data set of ", num_examples));
    }
  }
  size_t out = 0;
  for (int f = 0; f < num_fields; ++f) {
    field_ids[f] = static_cast<int64_t>(out);
    for (size_t k = 0; k < rows.size(); ++k) {
      const int64_t bag = rows[k] * num_fields + f;
      const size_t begin = static_cast<size_t>(offsets[bag]);
      const size_t length = static_cast<size_t>(offsets[bag + 1]) - begin;
      bag_offsets[f * rows.size() + k] =
          static_cast<int64_t>(out) - field_ids[f];
      if (out + length > ids_out.size()) {
        return absl::OutOfRangeError(absl::StrCat("GatherFieldBags: room for ",
                                                  ids_out.size(),
                                                  " ids, the rows have more"));
      }
      std::copy_n(ids.begin() + begin, length, ids_out.begin() + out);
      out += length;
    }
  }
  field_ids[num_fields] = static_cast<int64_t>(out);
  return absl::OkStatus();
}

}  // namespace pstrain
