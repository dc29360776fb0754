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

int IdDeduplicator::RunEach(absl::Span<const int64_t> ids,
                            absl::Span<const int64_t> lengths,
                            absl::Span<const int64_t> bounds, uint64_t* keys,
                            int64_t* index, int64_t* unique_counts) {
  size_t start = 0;
  for (size_t a = 0; a < lengths.size(); start += lengths[a], ++a) {
    const absl::Span<const int64_t> of = ids.subspan(start, lengths[a]);
    if (bounds[a] >= 0 &&
        std::any_of(of.begin(), of.end(), [bound = bounds[a]](int64_t id) {
          return id < 0 || id >= bound;
        })) {
      return static_cast<int>(a);
    }
    // Hashed ids are the same 64 bits as the tables' uint64 keys.
    Run(absl::MakeConstSpan(reinterpret_cast<const uint64_t*>(of.data()),
                            of.size()),
        &scratch_);
    std::copy(scratch_.unique.begin(), scratch_.unique.end(), keys + start);
    std::copy(scratch_.index.begin(), scratch_.index.end(), index + start);
    unique_counts[a] = static_cast<int64_t>(scratch_.unique.size());
  }
  return -1;
}

UniqueIds Deduplicate(absl::Span<const uint64_t> ids) {
  IdDeduplicator dedup;
  UniqueIds out;
  dedup.Run(ids, &out);
  return out;
}

}  // namespace pstrain
