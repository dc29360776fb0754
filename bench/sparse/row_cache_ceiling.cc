// row_cache_ceiling: what any worker row cache with a staleness bound of k
// steps could save on the CTR job's id stream, against what pstrain's cache
// policy saves, without servers: the stream is the one worker `worker_id`
// of `num_workers` trains on (worker/ctr_main.cc: MakeSyntheticCtr of its
// slice, batches in order), each step's ids unique per table, as
// Net::Load pulls them.
//
//   policy   pstrain's SparseRowCache: a row pulled for step t serves steps
//            up to t + k, then is pulled again. This is the fewest pulls any
//            cache under the bound can make: each pull serves at most the k
//            steps after it, and pulling at the first use not yet served
//            covers the most of what comes next (a greedy interval cover).
//   ceiling  a looser bound, easier to check: a use is served if this
//            worker used the row in any of the k steps before.
//
// Prints, per k, rows a step from the servers and the share saved, for the
// bench's Criteo shape by default (bench/sparse/row_cache.sh runs the same
// job through real servers; its k = 0 rows a step must match this one's).
#include <cstdio>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "worker/ctr_data.h"

ABSL_FLAG(int, worker_id, 0, "The worker whose stream is measured.");
ABSL_FLAG(int, num_workers, 2, "Workers sharing the training set.");
ABSL_FLAG(int64_t, steps, 1000, "Steps of the stream.");
ABSL_FLAG(int64_t, batch_size, 512, "Examples a step (per worker).");
ABSL_FLAG(int64_t, train_examples, 262144, "--ctr_train_examples.");
ABSL_FLAG(int, dense, 13, "--ctr_dense.");
ABSL_FLAG(uint64_t, seed, 1, "The worker's --seed.");
ABSL_FLAG(std::string, bounds, "1,2,4,16", "Staleness bounds k to measure.");

namespace pstrain {
namespace {

int Main() {
  SyntheticCtrOptions options;
  options.num_fields = 26;
  options.num_dense = absl::GetFlag(FLAGS_dense);
  options.field_vocab.assign(std::begin(kCriteoKaggleCardinalities),
                             std::end(kCriteoKaggleCardinalities));
  options.seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<CtrDataset> train = MakeSyntheticCtr(
      options, 0, absl::GetFlag(FLAGS_train_examples),
      {absl::GetFlag(FLAGS_worker_id), absl::GetFlag(FLAGS_num_workers)});
  if (!train.ok()) {
    std::fprintf(stderr, "row_cache_ceiling: %s\n",
                 std::string(train.status().message()).c_str());
    return 2;
  }
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  // Each step's unique ids per table.
  std::vector<std::vector<std::vector<uint64_t>>> used(steps);
  CtrBatchCursor cursor(&*train);
  CtrDataset batch;
  std::vector<int64_t> offsets;
  std::vector<uint64_t> ids;
  int64_t rows = 0;
  for (int64_t t = 0; t < steps; ++t) {
    cursor.Next(absl::GetFlag(FLAGS_batch_size), &batch);
    used[t].resize(options.num_fields);
    for (int f = 0; f < options.num_fields; ++f) {
      ExtractFieldBags(batch, f, &offsets, &ids);
      absl::flat_hash_set<uint64_t> unique(ids.begin(), ids.end());
      used[t][f].assign(unique.begin(), unique.end());
      rows += static_cast<int64_t>(unique.size());
    }
  }
  std::printf(
      "# row_cache_ceiling: worker %d of %d, %lld steps of %lld, "
      "Criteo-shaped synthetic data (26 fields), seed %llu\n",
      absl::GetFlag(FLAGS_worker_id), absl::GetFlag(FLAGS_num_workers),
      static_cast<long long>(steps),
      static_cast<long long>(absl::GetFlag(FLAGS_batch_size)),
      static_cast<unsigned long long>(options.seed));
  std::printf("%-6s %14s %12s %14s %12s\n", "k", "policy_rows", "policy_saved",
              "ceiling_rows", "ceiling_saved");
  std::printf("%-6d %14.1f %12s %14.1f %12s\n", 0,
              static_cast<double>(rows) / steps, "0.0%",
              static_cast<double>(rows) / steps, "0.0%");
  for (absl::string_view text :
       absl::StrSplit(absl::GetFlag(FLAGS_bounds), ',')) {
    int64_t k = 0;
    if (!absl::SimpleAtoi(text, &k) || k < 1) {
      std::fprintf(stderr,
                   "row_cache_ceiling: --bounds must be integers >= 1\n");
      return 2;
    }
    int64_t policy_misses = 0, ceiling_misses = 0;
    // Per table: the step a row was pulled for (policy), last used
    // (ceiling).
    std::vector<absl::flat_hash_map<uint64_t, int64_t>> pulled_for(
        options.num_fields),
        last_used(options.num_fields);
    for (int64_t t = 0; t < steps; ++t) {
      for (int f = 0; f < options.num_fields; ++f) {
        for (uint64_t id : used[t][f]) {
          auto p = pulled_for[f].find(id);
          if (p == pulled_for[f].end() || t - p->second > k) {
            ++policy_misses;
            pulled_for[f][id] = t;
          }
          auto u = last_used[f].find(id);
          if (u == last_used[f].end() || t - u->second > k) ++ceiling_misses;
          last_used[f][id] = t;
        }
      }
    }
    std::printf("%-6lld %14.1f %11.1f%% %14.1f %11.1f%%\n",
                static_cast<long long>(k),
                static_cast<double>(policy_misses) / steps,
                100.0 * (rows - policy_misses) / rows,
                static_cast<double>(ceiling_misses) / steps,
                100.0 * (rows - ceiling_misses) / rows);
  }
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pstrain::Main();
}
