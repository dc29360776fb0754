#include "worker/client/sparse_row_cache.h"

#include <algorithm>
#include <cstring>

namespace pstrain {

SparseRowCache::SparseRowCache(int64_t max_staleness_steps, int64_t max_bytes)
    : max_staleness_steps_(max_staleness_steps), max_bytes_(max_bytes) {}

int64_t SparseRowCache::RowBytes(int64_t dim) {
  // The values, the step and id beside them, and about two map entries'
  // worth of hash table (flat_hash_map at its usual load).
  return dim * static_cast<int64_t>(sizeof(float)) + 2 * sizeof(int64_t) +
         2 * (sizeof(uint64_t) + sizeof(int32_t));
}

SparseRowCache::Table& SparseRowCache::TableOf(int table, int64_t dim) {
  if (table >= static_cast<int>(tables_.size())) tables_.resize(table + 1);
  Table& t = tables_[table];
  t.dim = dim;
  return t;
}

std::vector<size_t> SparseRowCache::Lookup(int table, int64_t dim, int64_t step,
                                           absl::Span<const uint64_t> ids,
                                           float* out) {
  Table& t = TableOf(table, dim);
  std::vector<size_t> missing;
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = t.slot_of.find(ids[i]);
    if (it == t.slot_of.end() || !Fresh(t.pulled_for[it->second], step)) {
      missing.push_back(i);
      continue;
    }
    std::memcpy(out + i * dim, t.values.data() + it->second * dim,
                dim * sizeof(float));
  }
  const int64_t hits = static_cast<int64_t>(ids.size() - missing.size());
  stats_.hits += hits;
  stats_.misses += static_cast<int64_t>(missing.size());
  stats_.bytes_saved += hits * dim * static_cast<int64_t>(sizeof(float));
  return missing;
}

void SparseRowCache::Insert(int table, int64_t dim, int64_t step,
                            absl::Span<const uint64_t> ids,
                            absl::Span<const size_t> which, const float* rows) {
  Table& t = TableOf(table, dim);
  const int64_t row_bytes = RowBytes(dim);
  bool dropped_stale = false;
  for (size_t i : which) {
    auto it = t.slot_of.find(ids[i]);
    int32_t slot;
    if (it != t.slot_of.end()) {
      slot = it->second;
    } else {
      if (stats_.bytes_held + row_bytes > max_bytes_ && !dropped_stale) {
        DropStale(step);
        dropped_stale = true;
      }
      if (stats_.bytes_held + row_bytes > max_bytes_) {
        ++stats_.rows_not_kept;
        continue;
      }
      if (!t.free_slots.empty()) {
        slot = t.free_slots.back();
        t.free_slots.pop_back();
      } else {
        slot = static_cast<int32_t>(t.pulled_for.size());
        t.values.resize(t.values.size() + dim);
        t.pulled_for.push_back(0);
        t.id_of.push_back(0);
      }
      t.slot_of.emplace(ids[i], slot);
      t.id_of[slot] = ids[i];
      stats_.bytes_held += row_bytes;
    }
    t.pulled_for[slot] = step;
    std::memcpy(t.values.data() + slot * dim, rows + i * dim,
                dim * sizeof(float));
  }
}

void SparseRowCache::Clear() {
  tables_.clear();
  stats_.bytes_held = 0;
}

void SparseRowCache::DropStale(int64_t step) {
  for (Table& t : tables_) {
    const int64_t row_bytes = RowBytes(t.dim);
    for (auto it = t.slot_of.begin(); it != t.slot_of.end();) {
      if (Fresh(t.pulled_for[it->second], step)) {
        ++it;
        continue;
      }
      t.free_slots.push_back(it->second);
      stats_.bytes_held -= row_bytes;
      ++stats_.rows_dropped;
      t.slot_of.erase(it++);
    }
  }
}

}  // namespace pstrain
