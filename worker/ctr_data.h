// Click-through-rate (CTR) training data: examples with a binary label, a few
// dense count-style features and several categorical fields whose values are
// bags (one or more) of uint64 feature ids. Sources are a deterministic
// synthetic generator with a hidden ground-truth model (so tests know what AUC
// is achievable), a Criteo-style TSV reader and a LIBSVM reader.
//
// Tables: every source produces one embedding table per categorical field,
// named "field{f}" (CtrTableName); the ids of field f are only ever looked up
// in table f. Ids are already hashed (except LIBSVM's, see ReadLibsvmCtr), so
// a table sees realistic, uniformly spread 64-bit keys.
//
// Sharding is that of worker/data.h: shard k of n keeps the examples whose
// global index i (the i-th example of the source, from 0) has i % n == k.
#ifndef PSTRAIN_WORKER_CTR_DATA_H_
#define PSTRAIN_WORKER_CTR_DATA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/data.h"

namespace pstrain {

// A set of CTR examples (also used for one batch, see CtrBatchCursor).
struct CtrDataset {
  int num_dense = 0;
  int num_fields = 0;         // categorical fields, one embedding table each
  std::vector<float> labels;  // [size()], each 0 or 1
  std::vector<float> dense;   // [size(), num_dense], row-major
  // Bags in CSR form, example-major: the ids of example i, field f are
  // ids[offsets[i * num_fields + f] .. offsets[i * num_fields + f + 1]).
  // offsets[0] == 0 and offsets.back() == ids.size(). A bag may be empty (a
  // missing value) and may repeat an id (multi-hot with multiplicity).
  std::vector<int64_t> offsets;  // [size() * num_fields + 1]
  std::vector<uint64_t> ids;

  int64_t size() const { return static_cast<int64_t>(labels.size()); }

  // The bag of example i, field f: [begin, end) into ids.
  int64_t BagBegin(int64_t i, int f) const {
    return offsets[i * num_fields + f];
  }
  int64_t BagEnd(int64_t i, int f) const {
    return offsets[i * num_fields + f + 1];
  }
};

// Checks the shape invariants above (sizes, monotone offsets, 0/1 labels,
// finite dense values); readers and the generator always satisfy them.
absl::Status ValidateCtrDataset(const CtrDataset& data);

// The name of field f's embedding table: "field{f}".
std::string CtrTableName(int field);

// The feature id of a categorical string value of field f: a 64-bit hash of
// (f, value) that is the same on every platform and run (FNV-1a, then
// splitmix64 with the field), so equal strings in different fields differ.
uint64_t CtrCategoricalId(int field, absl::string_view value);

// The feature id of the synthetic generator's raw id r (the Zipf rank minus
// one, r in [0, vocab_per_field)) in field f: a bijective hash of r per field.
uint64_t CtrSyntheticId(int field, uint64_t raw_id);

// The synthetic CTR task.
//
// Features of example i (a pure function of (seed, i)):
//  - dense j: an integer count c = floor(Exp(mean 10^(j % 4))), stored like
//    the Criteo reader stores it: float(log(1 + c)).
//  - field f: a bag of 1 + floor(U * max_bag) raw ids, each drawn
//    independently from a Zipf law over [0, vocab_per_field)
//    (P(r) ~ (r + 1)^-zipf_exponent; exact rejection-inversion sampling, no
//    table), stored as CtrSyntheticId(f, r). Bags can repeat an id.
// Ground truth (hidden; a function of seed and the stored features only, so
// it applies to any CtrDataset with this shape):
//  - every (field f, feature id) has a true embedding e in R^dim_truth,
//    e_d ~ N(0, 1) from (seed, f, id, d); every field a weight w_f ~ N(0, I),
//    every dense feature a weight v_j ~ N(0, 1).
//  - m_f = mean of e over field f's bag (0 for an empty bag);
//    raw = sum_f <w_f, m_f> / sqrt(F dim)
//          + interaction * sum_{f<g} <m_f, m_g> / sqrt(F (F - 1) / 2 dim)
//          + 0.5 * sum_j v_j x_j / sqrt(num_dense)
//  - logit = logit_scale * (raw - mu) / sigma + bias, where mu and sigma are
//    the mean and standard deviation of raw over the first 4096 examples of
//    the stream and bias is solved (bisection) so that their mean click
//    probability is positive_rate: the rate and difficulty stay put whatever
//    the field counts, bag sizes and skew.
//  - label ~ Bernoulli(p), p = (1 - noise) * sigmoid(logit) + noise / 2 (with
//    probability `noise` the label is a fair coin).
// The calibration costs about one 4096-example generation per call.
struct SyntheticCtrOptions {
  int num_dense = 4;
  int num_fields = 6;
  int64_t vocab_per_field = 10000;
  // Each field's own vocabulary (num_fields entries), in place of
  // vocab_per_field; empty: vocab_per_field for every field.
  std::vector<int64_t> field_vocab;
  double zipf_exponent = 1.1;  // >= 0; 0 is uniform
  int max_bag = 3;             // bag sizes are uniform in [1, max_bag]
  int dim_truth = 4;
  uint64_t seed = 1;
  double noise = 0;             // label noise in [0, 1], see above
  double positive_rate = 0.25;  // mean click probability, in (0, 1)
  double logit_scale = 2.0;     // standard deviation of the true logit
  double interaction = 0;       // weight of the pairwise field term
};

// The distinct values of each of the 26 categorical fields of Criteo's
// Kaggle display-advertising set (as counted for DLRM): a few fields of
// tens of values beside fields of millions, the shape recommendation
// benchmarks use with 13 dense features.
inline constexpr int64_t kCriteoKaggleCardinalities[26] = {
    1460,  583,  10131227, 2202608, 305, 24,     12517,   633,   3,
    93145, 5683, 8351593,  3194,    27,  14992,  5461306, 10,    5652,
    2173,  4,    7046547,  18,      15,  286181, 105,     142572};

// Examples [first_index, first_index + count) of the synthetic stream, of
// which this shard keeps its own (by global index). true_probabilities, when
// given, receives what SyntheticCtrTrueProbabilities would return for the
// result, without computing it a second time.
absl::StatusOr<CtrDataset> MakeSyntheticCtr(
    const SyntheticCtrOptions& options, int64_t first_index, int64_t count,
    ShardSpec shard, std::vector<double>* true_probabilities = nullptr);

// The ground-truth click probability p of every example of `data` (which
// must have the options' num_dense and num_fields). For generated data these
// are exactly the probabilities its labels were drawn with, so their AUC and
// logloss on the labels are what a perfect model achieves (up to sampling).
absl::StatusOr<std::vector<double>> SyntheticCtrTrueProbabilities(
    const SyntheticCtrOptions& options, const CtrDataset& data);

// Criteo-style TSV, one example per line, tab-separated:
//   label, num_dense integer features, num_fields categorical values
// - label: 0 or 1.
// - integer feature: empty or negative -> 0, else x -> log(1 + x) (any
//   finite number is accepted; Criteo's are integers).
// - categorical value: empty -> an empty bag; otherwise a bag of the
//   comma-separated non-empty values (Criteo has one hex string per field;
//   commas are this format's extension for multi-hot data), each becoming
//   CtrCategoricalId(field, value).
// Lines must have exactly 1 + num_dense + num_fields columns (so Criteo's
// unlabeled test file is not accepted). Empty lines are skipped and are not
// examples; only the line end (LF or CRLF) is stripped, because a trailing
// tab is an empty last field. Errors name the file and line.
absl::StatusOr<CtrDataset> ReadCriteoTsv(const std::string& path, int num_dense,
                                         int num_fields, ShardSpec shard);

// Writes `data` in the format ReadCriteoTsv reads: dense values are written
// back as the integer counts round(exp(x) - 1) (exact for data from
// ReadCriteoTsv or MakeSyntheticCtr), ids as 16 lower-case hex digits joined
// by commas. Reading the file back gives the same labels, dense values and
// bag structure; ids become CtrCategoricalId(f, hex(id)).
absl::Status WriteCriteoTsv(const std::string& path, const CtrDataset& data);

// LIBSVM / SVMlight for CTR: "label index:value ..." with label 0/1 or -1/+1
// and strictly increasing non-negative integer indices; "# comments" are
// ignored. Features are binary: every value must equal 1 (anything else is an
// error, so a real-valued file is never silently binarized). The result has
// num_dense = 0 and num_fields = 1; each index is used as the feature id
// itself (no hash: indices are already ids, and keeping them lets tests map
// id i to row i of a dense model). Errors name the file and line.
absl::StatusOr<CtrDataset> ReadLibsvmCtr(const std::string& path,
                                         ShardSpec shard);

// Cycles through a dataset in order, batch after batch, wrapping around.
class CtrBatchCursor {
 public:
  explicit CtrBatchCursor(const CtrDataset* data) : data_(data) {}

  // Replaces *batch with the next `rows` examples (wrapping), offsets
  // rebased to start at 0. batch's vectors keep their capacity, so a batch
  // reused across steps stops allocating once it has seen its largest size.
  void Next(int64_t rows, CtrDataset* batch);
  // Moves to example `example` (wrapping): step s's batch of `rows`
  // examples begins at s * rows, so a worker that starts past step 0 (a
  // resumed job, a rejoin) or skips steps reads what one that ran from
  // step 0 would have read at that step.
  void Seek(int64_t example);

 private:
  const CtrDataset* data_;
  int64_t position_ = 0;
};

// Field f's bags of `data` as their own CSR, which is what one table's
// embedding bag consumes: offsets [size() + 1] from 0, ids in example order.
// Reuses the outputs' capacity.
void ExtractFieldBags(const CtrDataset& data, int field,
                      std::vector<int64_t>* offsets,
                      std::vector<uint64_t>* ids);

// The bags of examples `rows` of a data set in CSR form (`offsets` and `ids`
// as CtrDataset's, `num_fields` bags an example), field by field, each
// field's as ExtractFieldBags gives them: field f's ids are
// ids_out[field_ids[f], field_ids[f + 1]) and its bags start at
// bag_offsets[f * rows.size() + k], from 0 within the field. field_ids has
// num_fields + 1 entries, bag_offsets num_fields * rows.size(). OutOfRange
// for a row not in the set or ids_out too small for the rows' ids.
absl::Status GatherFieldBags(absl::Span<const int64_t> offsets,
                             absl::Span<const uint64_t> ids, int num_fields,
                             absl::Span<const int64_t> rows,
                             absl::Span<uint64_t> ids_out,
                             absl::Span<int64_t> bag_offsets,
                             absl::Span<int64_t> field_ids);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CTR_DATA_H_
