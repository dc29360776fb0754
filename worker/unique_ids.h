// A batch's ids without repeats: the rows a worker pulls for one embedding
// table, and where each occurrence of an id goes among them. Used by the C++
// CTR worker, the sparse benchmark and pstrain.torch (through the C ABI).
#ifndef PSTRAIN_WORKER_UNIQUE_IDS_H_
#define PSTRAIN_WORKER_UNIQUE_IDS_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace pstrain {

// A batch's ids without repeats, and where each occurrence went.
struct UniqueIds {
  std::vector<uint64_t> unique;  // distinct ids, in order of first occurrence
  std::vector<int64_t> index;    // [ids.size()]: unique[index[j]] == ids[j]
};

// Reusable de-duplication: an open-addressing hash table kept between calls,
// so a steady-state step allocates nothing (std or absl maps free or rehash
// their storage). O(ids.size()) expected. The order of `unique` is that of
// first occurrence, so the result is a deterministic function of the ids.
class IdDeduplicator {
 public:
  void Run(absl::Span<const uint64_t> ids, UniqueIds* out);

  // Several arrays of ids, one after another in `ids` (lengths[a] each), each
  // made unique as Run does (a batch's ids of several tables): array a's
  // distinct ids go to the start of its own stretch of `keys` (the positions
  // its ids have in `ids`), unique_counts[a] of them, and index[j] is the
  // position of ids[j] among its array's distinct ids. bounds[a] >= 0: every
  // id of array a must lie in [0, bounds[a]). Returns the first array with an
  // id out of its bounds (it and those after it left unset), else -1. keys
  // and index have ids.size() entries, unique_counts lengths.size().
  int RunEach(absl::Span<const int64_t> ids, absl::Span<const int64_t> lengths,
              absl::Span<const int64_t> bounds, uint64_t* keys, int64_t* index,
              int64_t* unique_counts);

 private:
  std::vector<int64_t> slots_;  // index into out->unique, or -1 when empty
  UniqueIds scratch_;           // RunEach's, kept for its capacity
};

// One-off form of IdDeduplicator::Run.
UniqueIds Deduplicate(absl::Span<const uint64_t> ids);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_UNIQUE_IDS_H_
