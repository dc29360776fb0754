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

 private:
  std::vector<int64_t> slots_;  // index into out->unique, or -1 when empty
};

// One-off form of IdDeduplicator::Run.
UniqueIds Deduplicate(absl::Span<const uint64_t> ids);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_UNIQUE_IDS_H_
