// How fast one SparseTable applies a step's rows, in the server's own code
// and without the network: Pull and Push of batches of unique Zipf ids, per
// optimizer, beside the plainest table a user could write instead (an
// absl::flat_hash_map from id to the row's floats, the same update rule,
// rows made on first sight) measured in the same run.
//
//   bazel build //bench/sparse:table_apply_bench
//   bazel-bin/bench/sparse/table_apply_bench [--dim=16] [--rows=4096]
//       [--vocab=1000000] [--zipf=1.1] [--batches=2000]
//       [--optimizers=sgd,adagrad,adam,ftrl]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/random/random.h"
#include "absl/random/zipf_distribution.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "ps_server/sparse_table.h"

ABSL_FLAG(int64_t, dim, 16, "Row size.");
ABSL_FLAG(int64_t, rows, 4096, "Ids drawn per batch (then made unique).");
ABSL_FLAG(int64_t, vocab, 1'000'000, "Distinct ids (Zipf ranks).");
ABSL_FLAG(double, zipf, 1.1, "Zipf exponent (> 1).");
ABSL_FLAG(int, batches, 2000, "Batches timed (after as many to warm up).");
ABSL_FLAG(std::string, optimizers, "sgd,adagrad", "Sparse optimizers to time.");
ABSL_FLAG(int, stripes, 0,
          "The table's lock stripes (SparseTableOptions; 0: by the machine).");

namespace pstrain {
namespace {

std::vector<std::vector<uint64_t>> Batches(int count) {
  absl::BitGen random(std::seed_seq{1});
  absl::zipf_distribution<uint64_t> zipf(absl::GetFlag(FLAGS_vocab) - 1,
                                         absl::GetFlag(FLAGS_zipf));
  std::vector<std::vector<uint64_t>> batches(count);
  for (auto& batch : batches) {
    absl::flat_hash_set<uint64_t> seen;
    for (int64_t i = 0; i < absl::GetFlag(FLAGS_rows); ++i) {
      // Hashed, as feature ids are: hot ids spread over the table.
      const uint64_t id = zipf(random) * 0x9e3779b97f4a7c15ULL;
      if (seen.insert(id).second) batch.push_back(id);
    }
  }
  return batches;
}

// The user's own table: a hash map to the row and its adagrad accumulator.
struct PlainTable {
  int64_t dim;
  float lr;
  bool adagrad;
  absl::flat_hash_map<uint64_t, std::vector<float>> rows;

  void Pull(const std::vector<uint64_t>& ids, std::vector<float>& out) {
    for (size_t i = 0; i < ids.size(); ++i) {
      std::vector<float>& row = rows[ids[i]];
      if (row.empty()) row.assign(adagrad ? 2 * dim : dim, 0.01f);
      std::copy(row.begin(), row.begin() + dim, out.begin() + i * dim);
    }
  }
  void Push(const std::vector<uint64_t>& ids, const std::vector<float>& g) {
    for (size_t i = 0; i < ids.size(); ++i) {
      std::vector<float>& row = rows[ids[i]];
      if (row.empty()) row.assign(adagrad ? 2 * dim : dim, 0.01f);
      const float* gi = g.data() + i * dim;
      for (int64_t j = 0; j < dim; ++j) {
        if (adagrad) {
          row[dim + j] += gi[j] * gi[j];
          row[j] -= lr * gi[j] / (std::sqrt(row[dim + j]) + 1e-10f);
        } else {
          row[j] -= lr * gi[j];
        }
      }
    }
  }
};

int Main() {
  const int64_t dim = absl::GetFlag(FLAGS_dim);
  const int batches_timed = absl::GetFlag(FLAGS_batches);
  const std::vector<std::vector<uint64_t>> batches = Batches(2 * batches_timed);
  int64_t timed_rows = 0;
  for (int b = batches_timed; b < 2 * batches_timed; ++b) {
    timed_rows += batches[b].size();
  }
  std::printf(
      "# table_apply_bench: dim %lld, %lld ids a batch (%.0f unique), vocab "
      "%lld, zipf %.2f, %d batches timed after %d\n",
      static_cast<long long>(dim),
      static_cast<long long>(absl::GetFlag(FLAGS_rows)),
      static_cast<double>(timed_rows) / batches_timed,
      static_cast<long long>(absl::GetFlag(FLAGS_vocab)),
      absl::GetFlag(FLAGS_zipf), batches_timed, batches_timed);
  std::printf("%-9s %14s %14s %14s %14s %9s\n", "optimizer", "pull Mrows/s",
              "push Mrows/s", "plain pull", "plain push", "push/plain");
  for (absl::string_view name :
       absl::StrSplit(absl::GetFlag(FLAGS_optimizers), ',')) {
    SparseTableOptions options;
    options.name = "t";
    options.dim = dim;
    options.num_stripes = absl::GetFlag(FLAGS_stripes);
    options.optimizer.name = std::string(name);
    options.init.set_kind(InitSpec::UNIFORM);
    options.init.set_scale(0.01f);
    absl::StatusOr<std::unique_ptr<SparseTable>> table =
        SparseTable::Create(options);
    if (!table.ok()) {
      std::fprintf(stderr, "%s\n", table.status().ToString().c_str());
      return 2;
    }
    PlainTable plain{
        dim, options.optimizer.learning_rate, name == "adagrad", {}};
    std::vector<float> rows, grads;
    double pull_s = 0, push_s = 0, plain_pull_s = 0, plain_push_s = 0;
    for (int b = 0; b < 2 * batches_timed; ++b) {
      const std::vector<uint64_t>& ids = batches[b];
      rows.resize(ids.size() * dim);
      grads.assign(ids.size() * dim, 0.001f);
      const absl::Time t0 = absl::Now();
      if (!(*table)->Pull(ids, absl::MakeSpan(rows)).ok()) return 1;
      const absl::Time t1 = absl::Now();
      if (!(*table)->Push(ids, grads).ok()) return 1;
      const absl::Time t2 = absl::Now();
      plain.Pull(ids, rows);
      const absl::Time t3 = absl::Now();
      plain.Push(ids, grads);
      const absl::Time t4 = absl::Now();
      if (b < batches_timed) continue;
      pull_s += absl::ToDoubleSeconds(t1 - t0);
      push_s += absl::ToDoubleSeconds(t2 - t1);
      plain_pull_s += absl::ToDoubleSeconds(t3 - t2);
      plain_push_s += absl::ToDoubleSeconds(t4 - t3);
    }
    const double n = static_cast<double>(timed_rows) / 1e6;
    std::printf("%-9s %14.2f %14.2f %14.2f %14.2f %9.2f\n",
                std::string(name).c_str(), n / pull_s, n / push_s,
                n / plain_pull_s, n / plain_push_s,
                (n / push_s) / (n / plain_push_s));
  }
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pstrain::Main();
}
