// A worker's copy of the embedding rows it pulled lately, so that a hot row
// (ids follow a power law: a few rows are in almost every batch) is not
// pulled again every step. A row pulled for step t serves the pulls of steps
// up to t + max_staleness_steps; then it is pulled again. The rows this
// worker pushes are not invalidated: a hot row is pushed every step, so that
// would empty the cache; the staleness bound is the contract instead (a row
// lags the servers' by at most that many steps of every worker's updates,
// this worker's own included). Bounded in bytes: when full, rows past their
// bound are dropped, and rows that still do not fit are not kept.
//
// Not thread-safe (PsClient's is one caller at a time).
#ifndef PSTRAIN_WORKER_CLIENT_SPARSE_ROW_CACHE_H_
#define PSTRAIN_WORKER_CLIENT_SPARSE_ROW_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace pstrain {

struct SparseRowCacheStats {
  int64_t hits = 0;    // rows served from the cache
  int64_t misses = 0;  // rows pulled from the servers
  int64_t bytes_saved = 0;
  int64_t bytes_held = 0;
  int64_t rows_dropped = 0;   // past their bound, to make room
  int64_t rows_not_kept = 0;  // pulled, but no room even then
};

class SparseRowCache {
 public:
  // max_staleness_steps >= 1; max_bytes: the rows' values and bookkeeping.
  SparseRowCache(int64_t max_staleness_steps, int64_t max_bytes);

  // Copies into out[i * dim ..] the rows of ids[i] cached fresh enough for
  // `step`; returns the indices i it did not serve (to pull).
  std::vector<size_t> Lookup(int table, int64_t dim, int64_t step,
                             absl::Span<const uint64_t> ids, float* out);
  // Keeps rows[i * dim ..] for ids[i], i in `which`, pulled for `step`.
  void Insert(int table, int64_t dim, int64_t step,
              absl::Span<const uint64_t> ids, absl::Span<const size_t> which,
              const float* rows);

  // Forgets every row (the counts stay).
  void Clear();

  const SparseRowCacheStats& stats() const { return stats_; }
  // What one row of `dim` floats costs the budget.
  static int64_t RowBytes(int64_t dim);

 private:
  struct Table {
    int64_t dim = 0;
    absl::flat_hash_map<uint64_t, int32_t> slot_of;
    std::vector<float> values;  // slot * dim
    std::vector<int64_t> pulled_for;
    std::vector<uint64_t> id_of;
    std::vector<int32_t> free_slots;
  };
  Table& TableOf(int table, int64_t dim);
  bool Fresh(int64_t pulled_for, int64_t step) const {
    return step - pulled_for <= max_staleness_steps_;
  }
  // Drops every row past its bound at `step`, in every table.
  void DropStale(int64_t step);

  const int64_t max_staleness_steps_;
  const int64_t max_bytes_;
  std::vector<Table> tables_;
  SparseRowCacheStats stats_;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CLIENT_SPARSE_ROW_CACHE_H_
