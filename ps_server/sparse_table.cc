#include "ps_server/sparse_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/hash.h"
#include "common/init.h"
#include "common/status_text.h"

namespace pstrain {
namespace {

constexpr uint32_t kNil = std::numeric_limits<uint32_t>::max();
// Row storage grows in chunks that double with the stripe (so small tables
// stay small) up to this many rows (so growth never copies rows).
constexpr int64_t kMinChunkRows = 16;
constexpr int64_t kMaxChunkRows = 4096;
constexpr int kMaxStripes = 4096;
constexpr int64_t kMaxDim = int64_t{1} << 20;
// A stripe's eviction log holds one entry per this many rows it may hold
// (its share, or its slots when unbounded; at least kMinEvictionLogEntries):
// deltas since a mark stay exact while fewer rows than that left since it.
constexpr int64_t kEvictionLogRowsPerEntry = 8;
constexpr int64_t kMinEvictionLogEntries = 64;
// Row stamps are 32 bits; marks stop short of wrapping them.
constexpr uint32_t kMaxChangeEpoch = std::numeric_limits<uint32_t>::max() - 1;

absl::Status CheckRange(const char* flag, float value, float lo, float hi,
                        bool lo_inclusive, bool hi_inclusive) {
  const bool ok = std::isfinite(value) &&
                  (lo_inclusive ? value >= lo : value > lo) &&
                  (hi_inclusive ? value <= hi : value < hi);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be in ", lo_inclusive ? "[" : "(", lo,
                   ", ", hi, hi_inclusive ? "]" : ")", ", got ", value));
}

absl::Status CheckPositive(const char* flag, float value) {
  if (std::isfinite(value) && value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be a positive number, got ", value));
}

absl::Status CheckNonNegative(const char* flag, float value) {
  if (std::isfinite(value) && value >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be a non-negative number, got ", value));
}

bool AllFinite(absl::Span<const float> v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

}  // namespace

absl::Status ValidateSparseOptimizer(const SparseOptimizerConfig& c) {
  if (c.name == "sgd") {
    return CheckPositive("sparse_learning_rate", c.learning_rate);
  }
  if (c.name == "adagrad") {
    // torch.optim.Adagrad's rule: w -= lr * g / (sqrt(acc) + eps), the
    // accumulator starting at initial_accumulator (torch: 0, eps 1e-10).
    for (absl::Status s :
         {CheckPositive("sparse_learning_rate", c.learning_rate),
          CheckNonNegative("sparse_adagrad_initial_accumulator",
                           c.initial_accumulator),
          CheckNonNegative("sparse_adagrad_epsilon", c.epsilon)}) {
      if (!s.ok()) return s;
    }
    if (c.initial_accumulator == 0 && c.epsilon == 0) {
      return absl::InvalidArgumentError(
          "adagrad with --sparse_adagrad_initial_accumulator=0 needs an "
          "epsilon > 0 (torch's default is 1e-10): a row's first zero "
          "gradient would divide 0 by 0");
    }
    return absl::OkStatus();
  }
  if (c.name == "adam") {
    for (absl::Status s :
         {CheckPositive("sparse_learning_rate", c.learning_rate),
          CheckRange("sparse_adam_beta1", c.beta1, 0, 1, true, false),
          CheckRange("sparse_adam_beta2", c.beta2, 0, 1, true, false),
          CheckRange("sparse_adam_epsilon", c.epsilon, 0, 1, false, true)}) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (c.name == "ftrl") {
    for (absl::Status s : {CheckPositive("ftrl_alpha", c.ftrl_alpha),
                           CheckNonNegative("ftrl_beta", c.ftrl_beta),
                           CheckNonNegative("ftrl_l1", c.ftrl_l1),
                           CheckNonNegative("ftrl_l2", c.ftrl_l2)}) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--sparse_optimizer must be sgd, adagrad, adam or ftrl, "
                   "got ",
                   QuoteForStatus(c.name)));
}

uint64_t DenseCompatibleIdLimit(int64_t dim) {
  return (uint64_t{1} << 63) / static_cast<uint64_t>(std::max<int64_t>(dim, 1));
}

void FillSparseRowInitialValues(const InitSpec& init, uint64_t seed,
                                absl::string_view table, uint64_t id,
                                absl::Span<float> out) {
  const int64_t dim = static_cast<int64_t>(out.size());
  if (id < DenseCompatibleIdLimit(dim)) {
    // id * dim + dim - 1 <= 2^63 - 1: no overflow.
    FillInitialValues(init, seed, table, static_cast<int64_t>(id) * dim, out);
  } else if (init.kind() == InitSpec::UNIFORM ||
             init.kind() == InitSpec::NORMAL) {
    // The row is tensor "<table>#<id>", hashed without building the name
    // (a string for every created row).
    const absl::AlphaNum id_text(id);
    FillInitialValuesOfHashedName(
        init, seed, Fnv1a64(id_text.Piece(), Fnv1a64("#", Fnv1a64(table))), 0,
        out);
  } else {
    // Constant kinds do not look at the name; skip building it.
    FillInitialValues(init, seed, table, 0, out);
  }
}

// One row's bookkeeping. Its floats (value, then state slot-major) live in
// the stripe's chunks at `data`.
struct RowMeta {
  uint64_t id;
  int64_t update_count;
  float* data;
  uint32_t prev;  // towards more recently used; kNil at the head
  uint32_t next;  // towards less recently used; kNil at the tail
};

struct alignas(64) SparseTable::Stripe {
  mutable absl::Mutex mu;
  int64_t capacity = 0;  // rows; 0: unbounded. Fixed at construction.

  absl::flat_hash_map<uint64_t, uint32_t> index ABSL_GUARDED_BY(mu);
  std::vector<RowMeta> rows ABSL_GUARDED_BY(mu);  // by slot; never shrinks
  std::vector<std::unique_ptr<float[]>> chunks ABSL_GUARDED_BY(mu);
  int64_t allocated_rows ABSL_GUARDED_BY(mu) = 0;  // row capacity of chunks
  float* chunk_cursor ABSL_GUARDED_BY(mu) = nullptr;
  int64_t chunk_rows_left ABSL_GUARDED_BY(mu) = 0;
  // The table's change epoch when each slot's row last changed (created,
  // pushed to or loaded), by slot: what ChangesSince reads.
  std::vector<uint32_t> changed_at ABSL_GUARDED_BY(mu);
  // Ids evicted or expired since the table's first change mark, with the
  // epoch they left in: a ring (LogEviction) whose next entry to overwrite
  // is `eviction_next`. Evictions of epochs up to
  // `evictions_forgotten_through` may be missing.
  std::vector<std::pair<uint64_t, uint32_t>> evictions ABSL_GUARDED_BY(mu);
  size_t eviction_next ABSL_GUARDED_BY(mu) = 0;
  uint32_t evictions_forgotten_through ABSL_GUARDED_BY(mu) = 0;
  // With a TTL: when each slot's row was last touched (TtlNow), the
  // stripe's time (never going back), and the slots freed by expiry, linked
  // through RowMeta::next.
  std::vector<uint32_t> touched_at ABSL_GUARDED_BY(mu);
  uint32_t now ABSL_GUARDED_BY(mu) = 0;
  uint32_t free_head ABSL_GUARDED_BY(mu) = kNil;
  // The LRU list is kept when rows can leave (capacity > 0 or a TTL).
  bool lru = false;  // fixed at construction
  // LRU list over slots, maintained only when `lru`.
  uint32_t lru_head ABSL_GUARDED_BY(mu) = kNil;  // most recently used
  uint32_t lru_tail ABSL_GUARDED_BY(mu) = kNil;  // least recently used

  // Admission (admit_after > 1): sightings of non-resident ids. A count of
  // admit_after marks an admitted id whose row was evicted.
  absl::flat_hash_map<uint64_t, uint32_t> sightings ABSL_GUARDED_BY(mu);
  int64_t remembered ABSL_GUARDED_BY(mu) = 0;  // entries with count >= N

  int64_t rows_created ABSL_GUARDED_BY(mu) = 0;
  int64_t rows_evicted ABSL_GUARDED_BY(mu) = 0;
  int64_t rows_expired ABSL_GUARDED_BY(mu) = 0;
  int64_t rows_loaded ABSL_GUARDED_BY(mu) = 0;
  int64_t pulls_unadmitted ABSL_GUARDED_BY(mu) = 0;
  int64_t pushes_dropped ABSL_GUARDED_BY(mu) = 0;
  int64_t forgotten ABSL_GUARDED_BY(mu) = 0;

  void Unlink(uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    RowMeta& r = rows[slot];
    if (r.prev != kNil) {
      rows[r.prev].next = r.next;
    } else {
      lru_head = r.next;
    }
    if (r.next != kNil) {
      rows[r.next].prev = r.prev;
    } else {
      lru_tail = r.prev;
    }
    r.prev = r.next = kNil;
  }

  void PushFront(uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    RowMeta& r = rows[slot];
    r.prev = kNil;
    r.next = lru_head;
    if (lru_head != kNil) rows[lru_head].prev = slot;
    lru_head = slot;
    if (lru_tail == kNil) lru_tail = slot;
  }
};

namespace {
// The optimizers in Kind's order, and their state floats per value float.
constexpr absl::string_view kOptimizers[] = {"sgd", "adagrad", "adam", "ftrl"};
constexpr int kStatePerElement[] = {0, 1, 2, 2};

// Kind's index of `optimizer`; -1 for one the tables do not run.
int KindIndex(absl::string_view optimizer) {
  for (int k = 0; k < static_cast<int>(std::size(kOptimizers)); ++k) {
    if (kOptimizers[k] == optimizer) return k;
  }
  return -1;
}

int StatePerElement(int kind) { return kStatePerElement[kind]; }
}  // namespace

int64_t SparseTable::BytesPerRow(int64_t dim, absl::string_view optimizer) {
  const int kind = KindIndex(optimizer);
  if (kind < 0) return 0;
  // The index's slots (key, value and a control byte) at its lowest load,
  // 7/16 after growing, and the slot vector at twice its size.
  using IndexEntry = std::pair<const uint64_t, uint32_t>;
  const int64_t index_bytes = (sizeof(IndexEntry) + 1) * 16 / 7 + 1;
  // The change stamp (a slot vector, so also at twice its size) and the
  // eviction log's share: one 16-byte entry per kEvictionLogRowsPerEntry
  // rows.
  return dim * (1 + StatePerElement(kind)) * int64_t{sizeof(float)} +
         2 * (sizeof(RowMeta) + sizeof(uint32_t)) + index_bytes +
         2 * int64_t{sizeof(std::pair<uint64_t, uint32_t>)} /
             kEvictionLogRowsPerEntry;
}

int64_t SparseTable::RowBytes(const SparseTableOptions& options) {
  const int64_t bytes = BytesPerRow(options.dim, options.optimizer.name);
  if (bytes == 0 ||
      (options.ttl == absl::InfiniteDuration() && options.ttl_steps == 0)) {
    return bytes;
  }
  return bytes + 2 * int64_t{sizeof(uint32_t)};  // touched_at, by slot
}

int64_t SparseTable::RowBound(const SparseTableOptions& options) {
  const int64_t row_bytes = RowBytes(options);
  if (options.max_bytes <= 0 || row_bytes <= 0) return options.max_rows;
  const int64_t rows = options.max_bytes / row_bytes;
  return options.max_rows > 0 ? std::min(options.max_rows, rows) : rows;
}

absl::StatusOr<std::unique_ptr<SparseTable>> SparseTable::Create(
    const SparseTableOptions& options) {
  SparseTableOptions o = options;
  if (o.name.empty()) {
    return absl::InvalidArgumentError("sparse table: the name is empty");
  }
  const std::string where =
      absl::StrCat("sparse table ", QuoteForStatus(o.name), ": ");
  if (o.dim < 1 || o.dim > kMaxDim) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "dim must be in [1, ", kMaxDim, "], got ", o.dim));
  }
  if (o.max_rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "max_rows must be >= 0 (0: unbounded), got ", o.max_rows));
  }
  if (o.admit_after < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "admit_after must be >= 0, got ", o.admit_after));
  }
  if (o.admit_after > 1 && o.max_pending_ids < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "max_pending_ids must be >= 1, got ", o.max_pending_ids));
  }
  if (o.num_stripes < 0 || o.num_stripes > kMaxStripes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "num_stripes must be in [1, ", kMaxStripes,
                     "] or 0 (by the machine), got ", o.num_stripes));
  }
  if (!std::isfinite(o.init.value()) || !std::isfinite(o.init.scale())) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "init value and scale must be finite"));
  }
  if (absl::Status s = ValidateSparseOptimizer(o.optimizer); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(where, s.message()));
  }
  // Validated above: one of the four.
  const Kind kind = static_cast<Kind>(KindIndex(o.optimizer.name));
  if (o.max_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "max_bytes must be >= 0 (0: no budget), got ", o.max_bytes));
  }
  if (o.max_bytes > 0 && RowBound(o) < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "max_bytes ", o.max_bytes,
                     " holds no row: one row of dim ", o.dim, " with ",
                     o.optimizer.name, " takes up to ", RowBytes(o), " bytes"));
  }
  if (o.ttl != absl::InfiniteDuration() && o.ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     "a row TTL must be at least 1s (inf: rows never "
                     "expire), got ",
                     absl::FormatDuration(o.ttl)));
  }
  if (o.ttl_steps < 0 ||
      (o.ttl_steps > 0 && o.ttl != absl::InfiniteDuration())) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     "a row TTL in steps must be >= 1 (0: none) and "
                     "not beside one in seconds, got ",
                     o.ttl_steps, " steps and ", absl::FormatDuration(o.ttl)));
  }
  o.max_rows = RowBound(o);
  int stripes = o.num_stripes;
  if (stripes == 0) {
    stripes = DefaultStripes(
        o, static_cast<int>(std::thread::hardware_concurrency()));
  }
  if (o.max_rows > 0 && o.max_rows < stripes) {
    stripes = static_cast<int>(o.max_rows);
  }
  return std::unique_ptr<SparseTable>(new SparseTable(o, kind, stripes));
}

int SparseTable::DefaultStripes(const SparseTableOptions& options,
                                int hardware_threads) {
  constexpr int kBoundedStripes = 64;
  if (RowBound(options) > 0 || options.ttl != absl::InfiniteDuration() ||
      options.ttl_steps > 0 || options.admit_after > 1) {
    return kBoundedStripes;
  }
  int stripes = 8;
  while (stripes < 4 * hardware_threads && stripes < kBoundedStripes) {
    stripes *= 2;
  }
  return stripes;
}

SparseTable::SparseTable(const SparseTableOptions& options, Kind kind,
                         int num_stripes)
    : options_(options),
      kind_(kind),
      state_per_element_(StatePerElement(static_cast<int>(kind))),
      row_floats_(options.dim * (1 + state_per_element_)),
      sightings_capacity_(std::max<int64_t>(
          1, (options.max_pending_ids + num_stripes - 1) / num_stripes)),
      ttl_ticks_(static_cast<uint32_t>(std::min<int64_t>(
          options.ttl_steps > 0 ? options.ttl_steps
          : options.ttl == absl::InfiniteDuration()
              ? 0
              : absl::ToInt64Seconds(absl::Ceil(options.ttl, absl::Seconds(1))),
          std::numeric_limits<uint32_t>::max() / 2))),
      start_(options.clock()) {
  if (kind_ == Kind::kAdam) {
    const SparseOptimizerConfig& c = options_.optimizer;
    static absl::Mutex shared_mu(absl::kConstInit);
    static auto* shared =
        new absl::flat_hash_map<std::tuple<float, float, float>,
                                std::shared_ptr<const AdamCorrections>>();
    absl::MutexLock lock(&shared_mu);
    std::shared_ptr<const AdamCorrections>& corrections =
        (*shared)[{c.learning_rate, c.beta1, c.beta2}];
    if (corrections == nullptr) {
      // 1 - beta^t only grows towards 1, so once both corrections are their
      // limits in float, every later count's are too.
      auto made = std::make_shared<AdamCorrections>();
      constexpr int64_t kMaxCounts = int64_t{1} << 16;
      for (int64_t t = 1; t <= kMaxCounts && !made->final; ++t) {
        const AdamCorrection at = ComputeAdamCorrection(t);
        made->by_count.push_back(at);
        made->final = at.step == c.learning_rate && at.inv_sqrt_c2 == 1.0f;
      }
      made->by_count.shrink_to_fit();
      corrections = std::move(made);
    }
    adam_corrections_ = corrections;
  }
  stripes_.reserve(num_stripes);
  for (int i = 0; i < num_stripes; ++i) {
    auto s = std::make_unique<Stripe>();
    if (options_.max_rows > 0) {
      s->capacity = options_.max_rows / num_stripes +
                    (i < options_.max_rows % num_stripes ? 1 : 0);
    }
    s->lru = s->capacity > 0 || ttl_ticks_ > 0;
    stripes_.push_back(std::move(s));
  }
}

SparseTable::~SparseTable() = default;

std::optional<uint64_t> FindDuplicateId(absl::Span<const uint64_t> ids) {
  const size_t n = ids.size();
  if (n < 2) return std::nullopt;
  // About 16 ids a bucket: a sort that small is a few compares an id.
  int bits = 0;
  while (bits < 16 && (size_t{16} << bits) < n) ++bits;
  const size_t buckets = size_t{1} << bits;
  auto bucket_of = [bits](uint64_t id) {
    return bits == 0 ? size_t{0}
                     : static_cast<size_t>((id * 0x9e3779b97f4a7c15ULL) >>
                                           (64 - bits));
  };
  thread_local std::vector<uint32_t> begin;
  thread_local std::vector<uint64_t> grouped;
  begin.assign(buckets + 1, 0);
  grouped.resize(n);
  for (uint64_t id : ids) ++begin[bucket_of(id) + 1];
  for (size_t b = 0; b < buckets; ++b) begin[b + 1] += begin[b];
  for (uint64_t id : ids) grouped[begin[bucket_of(id)]++] = id;
  // begin[b] is now bucket b's end, bucket b - 1's is its start.
  for (size_t b = 0; b < buckets; ++b) {
    auto first = grouped.begin() + (b == 0 ? 0 : begin[b - 1]);
    auto last = grouped.begin() + begin[b];
    std::sort(first, last);
    auto dup = std::adjacent_find(first, last);
    if (dup != last) return *dup;
  }
  return std::nullopt;
}

int SparseTable::StripeOf(uint64_t id) const {
  // Top bits of a salted mix: independent of the bits absl's hash tables use
  // inside a stripe and of a shard placement hash on (table, id).
  const uint64_t h = SplitMix64(id ^ 0x6a09e667f3bcc909ULL) >> 32;
  return static_cast<int>((h * stripes_.size()) >> 32);
}

int64_t SparseTable::StripeCapacity(int stripe) const {
  return stripes_[stripe]->capacity;
}

void SparseTable::InitialValue(uint64_t id, absl::Span<float> out) const {
  if (kind_ == Kind::kFtrl) {
    std::fill(out.begin(), out.end(), 0.0f);
    return;
  }
  FillSparseRowInitialValues(options_.init, options_.seed, options_.name, id,
                             out);
}

void SparseTable::InitRowState(absl::Span<float> state) const {
  const float v =
      kind_ == Kind::kAdagrad ? options_.optimizer.initial_accumulator : 0.0f;
  std::fill(state.begin(), state.end(), v);
}

void SparseTable::GroupByStripe(absl::Span<const uint64_t> ids,
                                std::vector<uint32_t>* order,
                                std::vector<uint32_t>* begin) const {
  const size_t n = ids.size();
  const size_t num = stripes_.size();
  order->resize(n);
  begin->assign(num + 1, 0);
  if (num == 1) {
    for (size_t i = 0; i < n; ++i) (*order)[i] = static_cast<uint32_t>(i);
    (*begin)[1] = static_cast<uint32_t>(n);
    return;
  }
  thread_local std::vector<uint32_t> stripe, next;
  stripe.resize(n);
  for (size_t i = 0; i < n; ++i) {
    stripe[i] = static_cast<uint32_t>(StripeOf(ids[i]));
    ++(*begin)[stripe[i] + 1];
  }
  for (size_t s = 0; s < num; ++s) (*begin)[s + 1] += (*begin)[s];
  next.assign(begin->begin(), begin->end() - 1);
  for (size_t i = 0; i < n; ++i) {
    (*order)[next[stripe[i]]++] = static_cast<uint32_t>(i);
  }
}

// The index entry of the id `ahead` positions on (if any) starts its way
// into the cache while this one is looked up: a table larger than the cache
// misses on nearly every lookup, and the misses then overlap.
void SparseTable::PrefetchIndex(const Stripe& s, absl::Span<const uint64_t> ids,
                                const std::vector<uint32_t>& order,
                                uint32_t ahead, uint32_t end) const
    ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
  if (ahead < end) s.index.prefetch(ids[order[ahead]]);
}

// A stripe's group is often shorter than the look-ahead (a table's ids of
// one request spread over 64 stripes): its first entries are started here,
// or no lookup of a short group would be prefetched at all.
void SparseTable::PrefetchFirstIndexEntries(const Stripe& s,
                                            absl::Span<const uint64_t> ids,
                                            const std::vector<uint32_t>& order,
                                            uint32_t first, uint32_t end) const
    ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
  const uint32_t last = std::min(end, first + kLookAhead);
  for (uint32_t k = first; k < last; ++k) s.index.prefetch(ids[order[k]]);
}

template <typename SlotOf, typename Use>
void SparseTable::VisitRows(Stripe& s, uint32_t first, uint32_t end,
                            SlotOf slot_of, Use use) const
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  if (s.capacity > 0 &&
      static_cast<int64_t>(s.index.size()) + (end - first) > s.capacity) {
    // A row made here may evict one found just before: each is used before
    // the next is looked up.
    for (uint32_t k = first; k < end; ++k) {
      const uint32_t slot = slot_of(k);
      if (slot != kNil) use(k, slot);
    }
    return;
  }
  // The first cache lines of a row: its values and optimizer state.
  const size_t prefetch_bytes =
      std::min<size_t>(static_cast<size_t>(row_floats_) * sizeof(float), 256);
  thread_local std::vector<uint32_t> slots;
  slots.resize(end - first);
  // Three passes, so that the misses of each (index, row meta, row data)
  // overlap instead of following each other id by id.
  for (uint32_t k = first; k < end; ++k) {
    const uint32_t slot = slot_of(k);
    slots[k - first] = slot;
    if (slot != kNil) __builtin_prefetch(&s.rows[slot]);
  }
  for (uint32_t k = first; k < end; ++k) {
    if (slots[k - first] == kNil) continue;
    const char* row =
        reinterpret_cast<const char*>(s.rows[slots[k - first]].data);
    for (size_t offset = 0; offset < prefetch_bytes; offset += 64) {
      __builtin_prefetch(row + offset, /*rw=*/1);
    }
  }
  for (uint32_t k = first; k < end; ++k) {
    if (slots[k - first] != kNil) use(k, slots[k - first]);
  }
}

uint32_t SparseTable::FindAndTouch(Stripe& s, uint64_t id) const
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  auto it = s.index.find(id);
  if (it == s.index.end()) return kNil;
  const uint32_t slot = it->second;
  if (s.lru && s.lru_head != slot) {
    s.Unlink(slot);
    s.PushFront(slot);
  }
  if (ttl_ticks_ > 0) s.touched_at[slot] = s.now;
  return slot;
}

// Takes a slot for `id` (evicting the LRU row of a full stripe), fills it
// with the initial value and state and makes it most recently used. The
// caller updates the admission table and the counters.
uint32_t SparseTable::CreateRow(Stripe& s, uint64_t id) const
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  uint32_t slot;
  if (s.capacity > 0 && static_cast<int64_t>(s.index.size()) >= s.capacity) {
    slot = RemoveLeastRecentlyUsed(s);
    ++s.rows_evicted;
  } else if (s.free_head != kNil) {
    slot = s.free_head;
    s.free_head = s.rows[slot].next;
  } else {
    if (s.chunk_rows_left == 0) {
      int64_t rows = std::clamp<int64_t>(static_cast<int64_t>(s.rows.size()),
                                         kMinChunkRows, kMaxChunkRows);
      if (s.capacity > 0) rows = std::min(rows, s.capacity - s.allocated_rows);
      s.chunks.emplace_back(new float[rows * row_floats_]);
      s.chunk_cursor = s.chunks.back().get();
      s.chunk_rows_left = rows;
      s.allocated_rows += rows;
    }
    slot = static_cast<uint32_t>(s.rows.size());
    s.rows.push_back(RowMeta{id, 0, s.chunk_cursor, kNil, kNil});
    s.changed_at.push_back(0);
    if (ttl_ticks_ > 0) s.touched_at.push_back(0);
    s.chunk_cursor += row_floats_;
    --s.chunk_rows_left;
  }
  RowMeta& r = s.rows[slot];
  r.id = id;
  r.update_count = 0;
  s.changed_at[slot] = epoch_.load();
  InitialValue(id, absl::MakeSpan(r.data, options_.dim));
  InitRowState(
      absl::MakeSpan(r.data + options_.dim, row_floats_ - options_.dim));
  if (ttl_ticks_ > 0) s.touched_at[slot] = s.now;
  s.index.emplace(id, slot);
  if (s.lru) s.PushFront(slot);
  return slot;
}

// Halves every count, forgetting zeros, until the table is at most half
// full. Counts never exceed admit_after, so this ends after at most
// log2(admit_after) + 1 passes, and the next one is at least capacity/2
// insertions away: amortised O(log N) per new id.
void SparseTable::AgeSightings(Stripe& s) const
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  const size_t target = static_cast<size_t>(sightings_capacity_ / 2);
  while (s.sightings.size() > target) {
    for (auto it = s.sightings.begin(); it != s.sightings.end();) {
      it->second >>= 1;
      if (it->second == 0) {
        s.sightings.erase(it++);
        ++s.forgotten;
      } else {
        ++it;
      }
    }
  }
  s.remembered = 0;
  for (const auto& [id, count] : s.sightings) {
    if (count >= static_cast<uint32_t>(options_.admit_after)) ++s.remembered;
  }
}

// Counts one sighting of a non-resident id; returns its count.
uint32_t SparseTable::CountSighting(Stripe& s, uint64_t id) const
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  auto it = s.sightings.find(id);
  if (it == s.sightings.end()) {
    if (static_cast<int64_t>(s.sightings.size()) >= sightings_capacity_) {
      AgeSightings(s);
    }
    it = s.sightings.emplace(id, 0).first;
  }
  return ++it->second;
}

void SparseTable::RememberEvicted(Stripe& s, uint64_t id) const
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  const uint32_t n = static_cast<uint32_t>(options_.admit_after);
  auto it = s.sightings.find(id);
  if (it == s.sightings.end()) {
    if (static_cast<int64_t>(s.sightings.size()) >= sightings_capacity_) {
      AgeSightings(s);
    }
    s.sightings.emplace(id, n);
    ++s.remembered;
  } else {
    if (it->second < n) ++s.remembered;
    it->second = n;
  }
}

uint32_t SparseTable::RemoveLeastRecentlyUsed(Stripe& s) const
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  const uint32_t slot = s.lru_tail;
  s.Unlink(slot);
  const uint64_t id = s.rows[slot].id;
  s.index.erase(id);
  if (options_.admit_after > 1) RememberEvicted(s, id);
  LogEviction(s, id);
  return slot;
}

void SparseTable::LogEviction(Stripe& s, uint64_t id) const
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  const uint32_t epoch = epoch_.load();
  if (epoch <= 1) return;  // no mark yet: no delta can ask for it
  // An entry per kEvictionLogRowsPerEntry rows the stripe may hold (its
  // share, or what it holds now when unbounded).
  const size_t capacity = static_cast<size_t>(
      std::max(kMinEvictionLogEntries,
               std::max(s.capacity, static_cast<int64_t>(s.rows.size())) /
                   kEvictionLogRowsPerEntry));
  if (s.evictions.size() < capacity) {
    s.evictions.emplace_back(id, epoch);
    return;
  }
  // Full: a ring, overwriting its oldest entry. Entries are filtered by
  // epoch, never read in order, and the newest epoch overwritten is what
  // the log can no longer answer for.
  std::pair<uint64_t, uint32_t>& oldest = s.evictions[s.eviction_next];
  s.evictions_forgotten_through =
      std::max(s.evictions_forgotten_through, oldest.second);
  oldest = {id, epoch};
  s.eviction_next = (s.eviction_next + 1) % s.evictions.size();
}

void SparseTable::AdvanceStep(int64_t step) {
  if (options_.ttl_steps == 0) return;
  int64_t first = -1;
  first_step_.compare_exchange_strong(first, step);
  int64_t latest = step_.load();
  while (step > latest && !step_.compare_exchange_weak(latest, step)) {
  }
}

uint32_t SparseTable::TtlNow() const {
  if (ttl_ticks_ == 0) return 0;
  if (options_.ttl_steps > 0) {
    const int64_t first = first_step_.load();
    if (first < 0) return 0;
    return static_cast<uint32_t>(std::clamp<int64_t>(
        step_.load() - first, 0, std::numeric_limits<uint32_t>::max()));
  }
  return static_cast<uint32_t>(
      std::max<int64_t>(0, absl::ToInt64Seconds(options_.clock() - start_)));
}

void SparseTable::ExpireRows(Stripe& s, uint32_t now) const
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  if (ttl_ticks_ == 0) return;
  // A call that waited for the lock may bring an older time.
  s.now = std::max(s.now, now);
  now = s.now;
  // The tail is the least recently touched: expire from it until a row is
  // young enough (a touch stamped by a slower call may be a second older
  // than one before it in the list; it then waits for that one).
  while (s.lru_tail != kNil &&
         int64_t{s.touched_at[s.lru_tail]} + ttl_ticks_ < int64_t{now}) {
    const uint32_t slot = RemoveLeastRecentlyUsed(s);
    ++s.rows_expired;
    s.changed_at[slot] = 0;  // free: no change since any mark
    s.rows[slot].next = s.free_head;
    s.free_head = slot;
  }
}

absl::StatusOr<uint32_t> SparseTable::MarkChanges() {
  uint32_t epoch = epoch_.load();
  do {
    if (epoch >= kMaxChangeEpoch) {
      return absl::ResourceExhaustedError(
          absl::StrCat("sparse table ", QuoteForStatus(options_.name), ": all ",
                       kMaxChangeEpoch - 1,
                       " change marks of this server process are "
                       "taken; restart it to mark again"));
    }
  } while (!epoch_.compare_exchange_weak(epoch, epoch + 1));
  return epoch;
}

absl::StatusOr<SparseTable::ChangesPage> SparseTable::ChangesSince(
    uint32_t mark, ChangesCursor cursor, int64_t max_bytes) const {
  const std::string where =
      absl::StrCat("sparse table ", QuoteForStatus(options_.name), ": ");
  const uint32_t epoch = epoch_.load();
  if (mark == 0 || mark >= epoch) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "change mark ", mark,
                     " was not given by this server process (its marks so "
                     "far are 1 to ",
                     epoch - 1, ")"));
  }
  if (cursor.stripe < 0 || cursor.stripe > num_stripes() || max_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "changes cursor at stripe ", cursor.stripe, " of ",
                     num_stripes(), ", page of ", max_bytes, " bytes"));
  }
  const int64_t d = options_.dim;
  const int64_t row_bytes = d * int64_t{sizeof(float)} + sizeof(uint64_t);
  // A page's work (page.bytes): its rows' bytes, and a byte for each
  // unchanged slot it looks at, so that one call never scans a huge table
  // whole.
  ChangesPage page;
  int64_t& bytes = page.bytes;
  bool progressed = false;  // a page takes at least one slot or stripe
  page.next = cursor;
  while (page.next.stripe < num_stripes()) {
    const Stripe& s = *stripes_[page.next.stripe];
    absl::ReaderMutexLock lock(&s.mu);
    if (s.evictions_forgotten_through > mark) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, "rows evicted since change mark ", mark,
          " are no longer all known (a stripe's eviction log keeps one per ",
          kEvictionLogRowsPerEntry, " rows it may hold, at least ",
          kMinEvictionLogEntries, "): take a whole export"));
    }
    const uint32_t slots = static_cast<uint32_t>(s.rows.size());
    if (page.next.slot > slots) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "changes cursor at slot ", page.next.slot,
                       " of stripe ", page.next.stripe, ", which has ", slots));
    }
    uint32_t slot = page.next.slot;
    for (; slot < slots; ++slot) {
      const bool changed = s.changed_at[slot] > mark;
      const int64_t cost = changed ? row_bytes : 1;
      if (bytes + cost > max_bytes && progressed) break;
      bytes += cost;
      progressed = true;
      if (!changed) continue;
      const RowMeta& r = s.rows[slot];
      page.ids.push_back(r.id);
      page.values.insert(page.values.end(), r.data, r.data + d);
    }
    if (slot < slots) {
      page.next.slot = slot;
      return page;
    }
    // A finished stripe's evictions come whole (its log is bounded).
    for (const auto& [id, evicted_in] : s.evictions) {
      if (evicted_in > mark) {
        page.evicted_ids.push_back(id);
        bytes += sizeof(uint64_t);
      }
    }
    ++page.next.stripe;
    page.next.slot = 0;
    progressed = true;
    if (bytes >= max_bytes && page.next.stripe < num_stripes()) return page;
  }
  page.done = true;
  return page;
}

void SparseTable::ForEachSighting(
    const std::function<void(uint64_t id, uint32_t count)>& visit) const {
  for (const auto& stripe : stripes_) {
    absl::MutexLock lock(&stripe->mu);
    for (const auto& [id, count] : stripe->sightings) visit(id, count);
  }
}

absl::Status SparseTable::LoadSighting(uint64_t id, uint32_t count) {
  const uint32_t n = static_cast<uint32_t>(std::max(options_.admit_after, 0));
  if (n <= 1) {
    return absl::InvalidArgumentError(
        "this table admits every id (admit_after <= 1): it counts no "
        "sightings");
  }
  if (count == 0 || count > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("id ", id, ": ", count, " sightings, expected 1 to ", n));
  }
  Stripe& s = *stripes_[StripeOf(id)];
  absl::MutexLock lock(&s.mu);
  if (s.index.contains(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("id ", id, " has a row: it is admitted"));
  }
  auto it = s.sightings.find(id);
  if (it == s.sightings.end()) {
    if (static_cast<int64_t>(s.sightings.size()) >= sightings_capacity_) {
      AgeSightings(s);
    }
    it = s.sightings.emplace(id, 0).first;
  }
  if (it->second >= n) --s.remembered;
  it->second = count;
  if (count >= n) ++s.remembered;
  return absl::OkStatus();
}

float SparseTable::FtrlWeight(float z, float n) const {
  const SparseOptimizerConfig& c = options_.optimizer;
  if (std::fabs(z) <= c.ftrl_l1) return 0.0f;
  return -(z - std::copysign(c.ftrl_l1, z)) /
         ((c.ftrl_beta + std::sqrt(n)) / c.ftrl_alpha + c.ftrl_l2);
}

SparseTable::AdamCorrection SparseTable::ComputeAdamCorrection(
    int64_t t) const {
  const SparseOptimizerConfig& c = options_.optimizer;
  const double td = static_cast<double>(t);
  AdamCorrection correction;
  correction.step =
      c.learning_rate / static_cast<float>(1 - std::pow(c.beta1, td));
  correction.inv_sqrt_c2 =
      1.0f / std::sqrt(static_cast<float>(1 - std::pow(c.beta2, td)));
  return correction;
}

SparseTable::AdamCorrection SparseTable::AdamCorrectionAt(int64_t t) const {
  const std::vector<AdamCorrection>& by_count = adam_corrections_->by_count;
  if (t >= 1 && t <= static_cast<int64_t>(by_count.size())) {
    return by_count[t - 1];
  }
  if (adam_corrections_->final && t >= 1) return by_count.back();
  return ComputeAdamCorrection(t);
}

void SparseTable::ApplyGradient(int64_t t, float* w, const float* g) const {
  const int64_t d = options_.dim;
  const SparseOptimizerConfig& c = options_.optimizer;
  switch (kind_) {
    case Kind::kSgd: {
      const float lr = c.learning_rate;
      for (int64_t i = 0; i < d; ++i) w[i] -= lr * g[i];
      break;
    }
    case Kind::kAdagrad: {
      const float lr = c.learning_rate;
      float* acc = w + d;
      for (int64_t i = 0; i < d; ++i) {
        acc[i] += g[i] * g[i];
        w[i] -= lr * g[i] / (std::sqrt(acc[i]) + c.epsilon);
      }
      break;
    }
    case Kind::kAdam: {
      float* m = w + d;
      float* v = w + 2 * d;
      const auto [step, inv_sqrt_c2] = AdamCorrectionAt(t);
      for (int64_t i = 0; i < d; ++i) {
        m[i] = c.beta1 * m[i] + (1 - c.beta1) * g[i];
        v[i] = c.beta2 * v[i] + (1 - c.beta2) * g[i] * g[i];
        w[i] -= step * m[i] / (std::sqrt(v[i]) * inv_sqrt_c2 + c.epsilon);
      }
      break;
    }
    case Kind::kFtrl: {
      float* z = w + d;
      float* n = w + 2 * d;
      for (int64_t i = 0; i < d; ++i) {
        const float n_new = n[i] + g[i] * g[i];
        const float sigma = (std::sqrt(n_new) - std::sqrt(n[i])) / c.ftrl_alpha;
        z[i] += g[i] - sigma * w[i];
        n[i] = n_new;
        w[i] = FtrlWeight(z[i], n[i]);
      }
      break;
    }
  }
}

absl::Status SparseTable::Pull(absl::Span<const uint64_t> ids,
                               absl::Span<float> out) {
  const int64_t d = options_.dim;
  if (out.size() != ids.size() * static_cast<size_t>(d)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sparse table ", QuoteForStatus(options_.name), ": pull of ",
        ids.size(), " ids of dim ", d, " into ", out.size(), " floats"));
  }
  // Kept per thread: a request allocates nothing here once warm.
  thread_local std::vector<uint32_t> order, begin;
  GroupByStripe(ids, &order, &begin);
  const uint32_t admit_after = static_cast<uint32_t>(options_.admit_after);
  const uint32_t now = TtlNow();
  for (size_t si = 0; si < stripes_.size(); ++si) {
    if (begin[si] == begin[si + 1]) continue;
    Stripe& s = *stripes_[si];
    absl::MutexLock lock(&s.mu);
    ExpireRows(s, now);
    const uint32_t first = begin[si], end = begin[si + 1];
    PrefetchFirstIndexEntries(s, ids, order, first, end);
    // The row of position k (kNil: not admitted, its initial values given).
    const auto slot_of = [&](uint32_t k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
      PrefetchIndex(s, ids, order, k + kLookAhead, end);
      const uint64_t id = ids[order[k]];
      uint32_t slot = FindAndTouch(s, id);
      if (slot != kNil) return slot;
      if (admit_after > 1) {
        const uint32_t count = CountSighting(s, id);
        if (count < admit_after) {
          ++s.pulls_unadmitted;
          InitialValue(id, out.subspan(static_cast<size_t>(order[k]) * d, d));
          return kNil;
        }
        s.sightings.erase(id);
        if (count > admit_after) --s.remembered;  // it was remembered
      }
      slot = CreateRow(s, id);
      ++s.rows_created;
      return slot;
    };
    VisitRows(s, first, end, slot_of,
              [&](uint32_t k, uint32_t slot)
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
                    std::memcpy(out.data() + static_cast<size_t>(order[k]) * d,
                                s.rows[slot].data, d * sizeof(float));
                  });
  }
  return absl::OkStatus();
}

absl::Status SparseTable::Push(absl::Span<const uint64_t> ids,
                               absl::Span<const float> grads,
                               SparsePushResult* result) {
  if (result != nullptr) *result = SparsePushResult();
  const int64_t d = options_.dim;
  if (grads.size() != ids.size() * static_cast<size_t>(d)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse table ", QuoteForStatus(options_.name),
                     ": push of ", ids.size(), " ids of dim ", d, " with ",
                     grads.size(), " gradient floats"));
  }
  if (!AllFinite(grads)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse table ", QuoteForStatus(options_.name),
                     ": push with a non-finite gradient; nothing applied"));
  }
  if (std::optional<uint64_t> dup = FindDuplicateId(ids)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sparse table ", QuoteForStatus(options_.name), ": id ", *dup,
        " appears more than once in one push; sum its gradients first. "
        "Nothing applied"));
  }
  const SparsePushResult pushed = PushChecked(ids, grads);
  if (result != nullptr) *result = pushed;
  return absl::OkStatus();
}

SparsePushResult SparseTable::PushChecked(absl::Span<const uint64_t> ids,
                                          absl::Span<const float> grads) {
  SparsePushResult pushed;
  const int64_t d = options_.dim;
  // Kept per thread: a request allocates nothing here once warm.
  thread_local std::vector<uint32_t> order, begin;
  GroupByStripe(ids, &order, &begin);
  const uint32_t admit_after = static_cast<uint32_t>(options_.admit_after);
  const uint32_t now = TtlNow();
  for (size_t si = 0; si < stripes_.size(); ++si) {
    if (begin[si] == begin[si + 1]) continue;
    Stripe& s = *stripes_[si];
    absl::MutexLock lock(&s.mu);
    ExpireRows(s, now);
    // Read under the stripe's lock: a mark taken before a reader locked
    // this stripe is seen by every change applied after that reader.
    const uint32_t epoch = epoch_.load();
    const uint32_t first = begin[si], end = begin[si + 1];
    PrefetchFirstIndexEntries(s, ids, order, first, end);
    const auto slot_of = [&](uint32_t k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
      PrefetchIndex(s, ids, order, k + kLookAhead, end);
      const uint64_t id = ids[order[k]];
      uint32_t slot = FindAndTouch(s, id);
      if (slot != kNil) return slot;
      if (admit_after > 1) {
        auto it = s.sightings.find(id);
        if (it == s.sightings.end() || it->second < admit_after) {
          ++s.pushes_dropped;
          ++pushed.dropped_unadmitted;
          return kNil;
        }
        s.sightings.erase(it);
        --s.remembered;
      }
      slot = CreateRow(s, id);
      ++s.rows_created;
      ++pushed.rows_created;
      return slot;
    };
    VisitRows(
        s, first, end, slot_of,
        [&](uint32_t k, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
          ++pushed.rows_applied;
          s.changed_at[slot] = epoch;
          RowMeta& r = s.rows[slot];
          ApplyGradient(++r.update_count, r.data,
                        grads.data() + static_cast<size_t>(order[k]) * d);
        });
  }
  return pushed;
}

SparseTableStats SparseTable::Stats() const {
  SparseTableStats st;
  st.memory_bytes = sizeof(*this) + stripes_.capacity() * sizeof(stripes_[0]);
  for (const auto& sp : stripes_) {
    const Stripe& s = *sp;
    absl::ReaderMutexLock lock(&s.mu);
    st.rows += static_cast<int64_t>(s.index.size());
    st.rows_created += s.rows_created;
    st.rows_evicted += s.rows_evicted;
    st.rows_expired += s.rows_expired;
    st.rows_loaded += s.rows_loaded;
    st.pulls_unadmitted += s.pulls_unadmitted;
    st.pushes_dropped_unadmitted += s.pushes_dropped;
    st.ids_pending_admission +=
        static_cast<int64_t>(s.sightings.size()) - s.remembered;
    st.evicted_ids_remembered += s.remembered;
    st.pending_ids_forgotten += s.forgotten;
    // A flat_hash_map holds capacity() slots plus one control byte each.
    using IndexEntry = std::pair<const uint64_t, uint32_t>;
    st.memory_bytes +=
        sizeof(Stripe) +
        s.allocated_rows * row_floats_ * static_cast<int64_t>(sizeof(float)) +
        static_cast<int64_t>(s.chunks.capacity() * sizeof(s.chunks[0])) +
        static_cast<int64_t>(s.rows.capacity() * sizeof(RowMeta)) +
        static_cast<int64_t>(s.changed_at.capacity() * sizeof(uint32_t)) +
        static_cast<int64_t>(s.touched_at.capacity() * sizeof(uint32_t)) +
        static_cast<int64_t>(s.evictions.capacity() * sizeof(s.evictions[0])) +
        static_cast<int64_t>(s.index.capacity() * (sizeof(IndexEntry) + 1)) +
        static_cast<int64_t>(s.sightings.capacity() * (sizeof(IndexEntry) + 1));
  }
  return st;
}

void SparseTable::ForEachRow(const RowVisitor& visit) const {
  const int64_t d = options_.dim;
  for (const auto& sp : stripes_) {
    const Stripe& s = *sp;
    absl::ReaderMutexLock lock(&s.mu);
    auto emit = [&](const RowMeta& r) {
      visit(r.id, absl::MakeConstSpan(r.data, d),
            absl::MakeConstSpan(r.data + d, row_floats_ - d), r.update_count);
    };
    if (s.lru) {
      for (uint32_t slot = s.lru_tail; slot != kNil; slot = s.rows[slot].prev) {
        emit(s.rows[slot]);
      }
    } else {
      // No row ever leaves, so every slot is resident, in creation order
      // (the order of first touch; there is no LRU to keep).
      for (const RowMeta& r : s.rows) emit(r);
    }
  }
}

absl::Status SparseTable::LoadRow(uint64_t id, absl::Span<const float> value,
                                  absl::Span<const float> state,
                                  int64_t update_count) {
  const int64_t d = options_.dim;
  const std::string where = absl::StrCat(
      "sparse table ", QuoteForStatus(options_.name), ": row ", id, ": ");
  if (value.size() != static_cast<size_t>(d) ||
      state.size() != static_cast<size_t>(row_floats_ - d)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "expected ", d, " values and ", row_floats_ - d,
        " state floats, got ", value.size(), " and ", state.size()));
  }
  if (update_count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "negative update count ", update_count));
  }
  if (!AllFinite(value) || !AllFinite(state)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "non-finite value or state"));
  }
  std::vector<float> ftrl_w;
  switch (kind_) {
    case Kind::kSgd:
      break;
    case Kind::kAdagrad:
      for (float acc : state) {
        if (!(acc >= 0)) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, "adagrad accumulator must be >= 0"));
        }
      }
      break;
    case Kind::kAdam:
      for (int64_t i = 0; i < d; ++i) {
        if (state[d + i] < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, "adam second moment must be >= 0"));
        }
      }
      break;
    case Kind::kFtrl:
      ftrl_w.resize(d);
      for (int64_t i = 0; i < d; ++i) {
        if (state[d + i] < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, "ftrl n must be >= 0"));
        }
        ftrl_w[i] = FtrlWeight(state[i], state[d + i]);
        if (!std::isfinite(ftrl_w[i])) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, "ftrl (z, n) give a non-finite weight"));
        }
      }
      value = ftrl_w;
      break;
  }
  const uint32_t now = TtlNow();
  Stripe& s = *stripes_[StripeOf(id)];
  absl::MutexLock lock(&s.mu);
  ExpireRows(s, now);
  uint32_t slot = FindAndTouch(s, id);
  if (slot == kNil) {
    if (options_.admit_after > 1) {
      auto it = s.sightings.find(id);
      if (it != s.sightings.end()) {
        if (it->second >= static_cast<uint32_t>(options_.admit_after)) {
          --s.remembered;
        }
        s.sightings.erase(it);
      }
    }
    slot = CreateRow(s, id);
  }
  ++s.rows_loaded;
  s.changed_at[slot] = epoch_.load();
  RowMeta& r = s.rows[slot];
  r.update_count = update_count;
  std::copy(value.begin(), value.end(), r.data);
  std::copy(state.begin(), state.end(), r.data + d);
  return absl::OkStatus();
}

}  // namespace pstrain
