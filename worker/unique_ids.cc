#include "worker/unique_ids.h"

#include <algorithm>

#include "common/hash.h"

namespace pstrain {

void IdDeduplicator::Run(absl::Span<const uint64_t> ids, UniqueIds* out) {
  out->unique.clear();
  out->index.resize(ids.size());
  // Load factor <= 1/2 keeps linear probing short; only the part of the table
  // this call uses is cleared, so a small batch after a big one stays cheap.
  size_t capacity = 16;
  while (capacity < 2 * ids.size()) capacity *= 2;
  if (slots_.size() < capacity) slots_.resize(capacity);
  std::fill_n(slots_.begin(), capacity, int64_t{-1});
  const size_t mask = capacity - 1;
  for (size_t j = 0; j < ids.size(); ++j) {
    const uint64_t id = ids[j];
    // Mixed: LIBSVM ids are small consecutive integers, which a
    // power-of-two table must not see unmixed.
    size_t slot = SplitMix64(id) & mask;
    while (true) {
      const int64_t u = slots_[slot];
      if (u < 0) {
        slots_[slot] = static_cast<int64_t>(out->unique.size());
        out->index[j] = slots_[slot];
        out->unique.push_back(id);
        break;
      }
      if (out->unique[u] == id) {
        out->index[j] = u;
        break;
      }
      slot = (slot + 1) & mask;
    }
  }
}

UniqueIds Deduplicate(absl::Span<const uint64_t> ids) {
  IdDeduplicator dedup;
  UniqueIds out;
  dedup.Run(ids, &out);
  return out;
}

}  // namespace pstrain
