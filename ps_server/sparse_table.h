// Server-side sparse embedding table: rows of `dim` floats keyed by uint64
// feature id, created on demand, each with its own optimizer state, so a
// table far larger than any worker never travels whole.
//
// Initial values. Row `id` starts at a pure function of (seed, table name,
// id, element), independent of the shard count, the stripe count and the
// order in which ids arrive (see FillSparseRowInitialValues). For ids below
// DenseCompatibleIdLimit(dim) (2^63 / dim: every vocabulary that could also be
// a dense tensor) row `id` equals rows [id*dim, id*dim + dim) of a dense
// [vocab, dim] tensor with the same name, seed and InitSpec, so a sparse table
// and the dense tensor it replaces start identical.
//
// Optimizers (per row, state stored beside the row, slot-major within a
// row: all `dim` floats of slot 0, then all of slot 1):
//   sgd      w -= lr * g                                       (no state)
//   adagrad  acc += g^2; w -= lr * g / sqrt(acc)               (acc, starts at
//            initial_accumulator)
//   adam     lazy: only rows in a push move; t is the row's own update count
//            m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//            w -= lr / (1-b1^t) * m / (sqrt(v / (1-b2^t)) + eps)   (m, v)
//   ftrl     FTRL-proximal (McMahan et al. 2013), per coordinate      (z, n)
//            sigma = (sqrt(n + g^2) - sqrt(n)) / alpha
//            z += g - sigma * w; n += g^2
//            w = 0 if |z| <= l1 else
//                -(z - sign(z) l1) / ((beta + sqrt(n)) / alpha + l2)
//            The stored value IS w(z, n), recomputed after every update.
//            FTRL's weights start at 0 by definition (z = n = 0), so an ftrl
//            table ignores InitSpec: its initial values are all zeros.
//
// Concurrency. Rows live in `num_stripes` stripes chosen by a hash of the id,
// each with its own mutex, row index, LRU list and admission counters. Pull,
// Push, LoadRow, ForEachRow, MarkChanges, ChangesSince and Stats may be
// called from any thread. A row's
// update is atomic with respect to every other access to that row; concurrent
// pushes to one row serialize, pushes to rows in different stripes run in
// parallel. A Push (or Pull) spanning several stripes is applied stripe by
// stripe, not atomically as a whole.
//
// Memory control (all optional, all counted in Stats):
//   max_rows     Each stripe holds at most its share of max_rows (the shares
//                sum to exactly max_rows; num_stripes is lowered to max_rows
//                if larger, so every share is >= 1). Creating a row in a full
//                stripe evicts that stripe's least recently used row (a pull
//                or push touches a row). So rows <= max_rows always, and the
//                guarantee is per stripe: a row survives as long as fewer than
//                its stripe's share of *other* ids of its stripe were touched
//                since it was last touched. In particular the
//                min-share most recently used rows always survive. With
//                num_stripes = 1 the LRU is exact and global. An evicted row
//                loses its value and optimizer state.
//   admit_after  N > 1: an id's row is created by the pull that sees it the
//                N-th time (every occurrence in a Pull counts; pushes do not).
//                Before that, pulls return the initial values without storing
//                anything and pushes are dropped (counted). Sightings are
//                counted exactly per id in a per-stripe table of at most
//                ceil(max_pending_ids / num_stripes) ids; when it fills, all
//                its counts are halved and zeros forgotten (TinyLFU-style
//                aging) until it is at most half full, so memory is bounded
//                and ids seen once long ago fade out. An admitted row that was
//                evicted is remembered there with count N, so a push that
//                arrives after its eviction re-creates it from its initial
//                value and applies; aging may eventually forget it.
//   N <= 1: every id is admitted; a push to an absent (never pulled or
//           evicted) row creates it from its initial value, then applies.
//   ttl          Rows not touched (pulled, pushed, loaded) for longer than
//                this, to the second on a monotonic clock, are expired:
//                removed when their stripe is next pulled from, pushed to
//                or loaded into, counted apart from evictions
//                (rows_expired), their slots reused and, like evicted rows,
//                reported by ChangesSince and remembered by admission. A
//                stripe nobody touches keeps its expired rows until somebody
//                does.
//   ttl_steps    The same, counted in the table's completed sync steps
//                (AdvanceStep) instead of seconds, from the first the table
//                completed, so that rows a restore loaded start their count
//                at the job's step, not at step 0.
// Change tracking (MarkChanges, ChangesSince) costs every row a 4-byte
// stamp, and each stripe a log of recent evictions (one 16-byte entry per 8
// rows it may hold); RowBytes counts both.
#ifndef PSTRAIN_PS_SERVER_SPARSE_TABLE_H_
#define PSTRAIN_PS_SERVER_SPARSE_TABLE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/ps.pb.h"

namespace pstrain {

struct SparseOptimizerConfig {
  std::string name = "sgd";     // --sparse_optimizer: sgd|adagrad|adam|ftrl
  float learning_rate = 0.05f;  // --sparse_learning_rate (not ftrl)
  float initial_accumulator = 0.1f;  // --sparse_adagrad_initial_accumulator
  float beta1 = 0.9f;                // --sparse_adam_beta1
  float beta2 = 0.999f;              // --sparse_adam_beta2
  float epsilon = 1e-8f;     // adam's and adagrad's (torch's adagrad: 1e-10)
  float ftrl_alpha = 0.05f;  // --ftrl_alpha (ftrl's learning rate)
  float ftrl_beta = 1.0f;    // --ftrl_beta
  float ftrl_l1 = 0.0f;      // --ftrl_l1
  float ftrl_l2 = 0.0f;      // --ftrl_l2
};

// Refuses unknown names and out-of-range hyper-parameters of the chosen
// optimizer with InvalidArgument naming the flag (the comments above).
absl::Status ValidateSparseOptimizer(const SparseOptimizerConfig& config);

struct SparseTableOptions {
  std::string name;  // the table's name; with `seed`, keys the initial values
  int64_t dim = 8;
  InitSpec init;  // ignored by ftrl (its weights start at 0)
  uint64_t seed = 0;
  SparseOptimizerConfig optimizer;
  // 0: unbounded. Otherwise at most this many rows, evicting least recently
  // used rows per stripe (see the file comment).
  int64_t max_rows = 0;
  // 0: no budget. Otherwise the rows the table holds are bounded to
  // max_bytes / RowBytes (max_rows, when smaller, bounds them instead);
  // a budget below one row is refused.
  int64_t max_bytes = 0;
  // 0 or 1: rows are created on first sight. N > 1: on the N-th pull.
  int admit_after = 0;
  // Bound on the ids whose sightings are being counted (admit_after > 1).
  int64_t max_pending_ids = int64_t{1} << 20;
  // Lock stripes; lowered to max_rows when that is smaller. 0: by the
  // table and the machine (DefaultStripes).
  int num_stripes = 0;
  // Infinite: rows never expire. Otherwise at least a second.
  absl::Duration ttl = absl::InfiniteDuration();
  // 0: none. Otherwise rows not touched in this many of the table's steps
  // (AdvanceStep) expire, as `ttl` does in seconds; not with `ttl`.
  int64_t ttl_steps = 0;
  // The time TTLs are counted in: monotonic, so that a step of the wall
  // clock cannot expire every row at once (tests move it by hand).
  std::function<absl::Time()> clock = [] {
    return absl::UnixEpoch() +
           absl::FromChrono(
               std::chrono::steady_clock::now().time_since_epoch());
  };
};

struct SparseTableStats {
  int64_t rows = 0;                       // resident now
  int64_t rows_created = 0;               // by Pull/Push, re-creations too
  int64_t rows_evicted = 0;               // LRU evictions
  int64_t rows_expired = 0;               // removed by the TTL
  int64_t rows_loaded = 0;                // LoadRow calls that stored a row
  int64_t pulls_unadmitted = 0;           // pulled ids answered, not stored
  int64_t pushes_dropped_unadmitted = 0;  // gradients dropped, id unadmitted
  int64_t ids_pending_admission = 0;      // ids with 0 < sightings < N
  int64_t evicted_ids_remembered = 0;     // admitted, evicted, still known
  int64_t pending_ids_forgotten = 0;      // dropped by admission aging
  // Heap bytes held by the table: row values and state, per-row bookkeeping
  // and the capacity of its hash tables (measured, not modelled). Row storage
  // grows per stripe in chunks that double up to 4096 rows (never beyond the
  // stripe's share under max_rows), so it may hold up to ~2x the resident
  // rows' floats while growing, and never moves a row once stored.
  int64_t memory_bytes = 0;
};

// What one Push did, row by row (exact even under concurrent pushes, unlike
// differences of Stats()).
struct SparsePushResult {
  int64_t rows_applied = 0;        // gradients applied (includes re-created)
  int64_t rows_created = 0;        // absent admitted rows re-created first
  int64_t dropped_unadmitted = 0;  // gradients dropped: id not admitted
};

// Ids below this bound initialise like rows of a dense [vocab, dim] tensor.
uint64_t DenseCompatibleIdLimit(int64_t dim);

// An id that appears more than once in `ids`, if any (which one, when
// several do, is unspecified). Every push is checked with it, so it is made
// cheap: ids spread over buckets by a hash, each bucket sorted alone, in
// scratch memory kept per thread (a sort of the whole push, or a hash set
// built per call, cost a third of a row's update).
std::optional<uint64_t> FindDuplicateId(absl::Span<const uint64_t> ids);

// The initial value of row `id` (out.size() == dim) of table `table`:
//   id < DenseCompatibleIdLimit(dim):
//     FillInitialValues(init, seed, table, id * dim, out)
//     i.e. row id of a dense [vocab, dim] tensor named `table`;
//   otherwise (where id * dim would overflow int64):
//     FillInitialValues(init, seed, StrCat(table, "#", id), 0, out)
//     i.e. its own tensor named "<table>#<decimal id>".
// Either way a pure function of (init, seed, table, id, element index).
void FillSparseRowInitialValues(const InitSpec& init, uint64_t seed,
                                absl::string_view table, uint64_t id,
                                absl::Span<float> out);

class SparseTable {
 public:
  // Validates the options (InvalidArgument naming the offending one).
  static absl::StatusOr<std::unique_ptr<SparseTable>> Create(
      const SparseTableOptions& options);
  ~SparseTable();
  SparseTable(const SparseTable&) = delete;
  SparseTable& operator=(const SparseTable&) = delete;

  // What one resident row may cost, at most: its values and optimizer
  // state, and its bookkeeping with the hash index and slot vector at their
  // largest for that row count. The unit of a table's byte budget; 0 for an
  // optimizer name the tables do not run.
  static int64_t BytesPerRow(int64_t dim, absl::string_view optimizer);
  // BytesPerRow of a table of these options: with a TTL, each row also
  // keeps the time it was last touched. The unit of its byte budget.
  static int64_t RowBytes(const SparseTableOptions& options);
  // The most rows a table of these options holds: max_rows, or as many as
  // max_bytes holds at RowBytes each when that is fewer; 0: unbounded.
  static int64_t RowBound(const SparseTableOptions& options);
  // The stripes a table of these options gets when num_stripes is 0. Where
  // rows can leave or wait for admission (a row bound, a TTL, admit_after
  // > 1), 64: which rows go depends on the stripes (each keeps its own LRU
  // list and sighting counts), so it must not depend on the host. Otherwise
  // the stripes change nothing but speed: 4 a hardware thread (threads
  // contending for a stripe stay rare), at least 8 and at most 64. Fewer
  // stripes make each stripe's share of a request longer, which the
  // prefetches of its lookups need (a request's ids of one table spread
  // over 64 stripes left a few ids each: a 512-id pull ran 1.4x faster on
  // 8, bench/results/table_apply.txt).
  static int DefaultStripes(const SparseTableOptions& options,
                            int hardware_threads);

  int64_t dim() const { return options_.dim; }
  // Optimizer state floats per value float (sgd 0, adagrad 1, adam 2,
  // ftrl 2); a row's state holds state_per_element() * dim() floats.
  int state_per_element() const { return state_per_element_; }
  const SparseTableOptions& options() const { return options_; }
  int num_stripes() const { return static_cast<int>(stripes_.size()); }
  // The stripe holding `id` and its row share (0: unbounded). For tests and
  // diagnostics: the LRU guarantee is stated per stripe.
  int StripeOf(uint64_t id) const;
  int64_t StripeCapacity(int stripe) const;

  // The value row `id` starts at (zeros for ftrl); touches nothing.
  void InitialValue(uint64_t id, absl::Span<float> out) const;

  // Copies row ids[i] to out[i*dim, (i+1)*dim). Ids may repeat and come in any
  // order. An absent id counts a sighting; an admitted one is created from its
  // initial value (evicting if the stripe is full), an unadmitted one gets its
  // initial value without being stored. InvalidArgument (and nothing done) if
  // out.size() != ids.size() * dim.
  absl::Status Pull(absl::Span<const uint64_t> ids, absl::Span<float> out);

  // Applies grads[i*dim, (i+1)*dim) to row ids[i] with the table's optimizer.
  // Ids must be unique within a call (the caller aggregates per id);
  // InvalidArgument, before anything changes, on a duplicate, a size mismatch
  // or a non-finite gradient. An absent admitted id (admit_after <= 1, or
  // evicted after admission) is re-created from its initial value, then
  // updated; an unadmitted id's gradient is dropped and counted. `result`,
  // when given, receives this call's counts (zeros on error).
  absl::Status Push(absl::Span<const uint64_t> ids,
                    absl::Span<const float> grads,
                    SparsePushResult* result = nullptr);
  // Push without its checks, for a caller that made them already (the
  // shard checks a whole request, every table of it, before applying any):
  // ids unique, grads.size() == ids.size() * dim, every gradient finite.
  SparsePushResult PushChecked(absl::Span<const uint64_t> ids,
                               absl::Span<const float> grads);
  // The table completed sync step `step`: the clock of ttl_steps (a step
  // at or below one seen before changes nothing).
  void AdvanceStep(int64_t step);

  SparseTableStats Stats() const;

  // Change marks, so an export can carry only what changed since an earlier
  // one. Every change to a row (its creation, a push, LoadRow) is stamped
  // with the table's current epoch, and every eviction or expiry after the
  // first mark is logged with it. MarkChanges ends the current epoch and
  // returns it: the mark (ResourceExhausted once 2^32 - 2 marks are taken).
  // A row whose value a reader that started after MarkChanges returned m has
  // not seen carries a stamp > m (stamps are read under the row's stripe
  // lock), so ChangesSince(m) covers every change after that read, and
  // perhaps a few rows that did not change.
  absl::StatusOr<uint32_t> MarkChanges();

  struct ChangesCursor {
    int stripe = 0;     // stripes before this one are done
    uint32_t slot = 0;  // and this one's slots before this
  };
  struct ChangesPage {
    std::vector<uint64_t> ids;          // rows stamped after the mark
    std::vector<float> values;          // [ids, dim]
    std::vector<uint64_t> evicted_ids;  // in the stripes this page finished
    bool done = false;                  // no page follows
    ChangesCursor next;                 // where the next page starts
    int64_t bytes = 0;                  // the work it took, as max_bytes
  };
  // A page of the changes since `mark`: from `cursor` on, the resident rows
  // stamped after it (their current values) and the ids evicted or expired
  // after it from every stripe the page finishes, up to about `max_bytes`
  // of work (8 bytes an id, 4 a value, 1 for each unchanged row looked at;
  // at least one row, and a finished stripe's evictions whole). Ask again with
  // `next` until `done`. Pages are read at different moments: a row evicted and
  // created again between two pages may come in both (the later is newer), and
  // an id may be both evicted and resident again (its row is then in a page).
  // The eviction log is bounded: FailedPrecondition when a stripe forgot
  // evictions after `mark`, InvalidArgument for a mark this table never gave
  // (0, or not below its epoch) or a cursor out of range.
  absl::StatusOr<ChangesPage> ChangesSince(uint32_t mark, ChangesCursor cursor,
                                           int64_t max_bytes) const;

  using RowVisitor =
      std::function<void(uint64_t id, absl::Span<const float> value,
                         absl::Span<const float> state, int64_t update_count)>;
  // Visits every resident row, stripe by stripe (each stripe's rows from least
  // to most recently used, so loading them back in visit order rebuilds each
  // stripe's LRU order). A stripe is locked while its rows are visited: the
  // visitor must not call back into this table. Not a global snapshot.
  void ForEachRow(const RowVisitor& visit) const;

  // Visits every id whose sightings are counted for admission (admit_after
  // > 1) with its count (admit_after: an admitted id whose row was evicted),
  // stripe by stripe, each stripe locked while visited. With LoadSighting,
  // how a replica catching up admits ids when the primary would.
  void ForEachSighting(
      const std::function<void(uint64_t id, uint32_t count)>& visit) const;

  // Sets an id's count as ForEachSighting gave it (ageing the stripe's
  // counts first when its table is full, as a sighting would).
  // InvalidArgument when this table counts no sightings, the count is 0 or
  // above admit_after, or the id has a resident row.
  absl::Status LoadSighting(uint64_t id, uint32_t count);

  // Stores a row as ForEachRow gave it (overwriting a resident one), marking
  // the id admitted and most recently used; may evict. For ftrl the value is
  // recomputed from (z, n) and `value` only size-checked. InvalidArgument on
  // wrong sizes, non-finite numbers, a negative update count or state no
  // optimizer could have produced (adagrad acc <= 0, adam v < 0, ftrl n < 0).
  absl::Status LoadRow(uint64_t id, absl::Span<const float> value,
                       absl::Span<const float> state, int64_t update_count);

 private:
  enum class Kind { kSgd, kAdagrad, kAdam, kFtrl };
  struct Stripe;

  SparseTable(const SparseTableOptions& options, Kind kind, int num_stripes);

  // Orders the positions of `ids` by stripe: positions of stripe s are
  // order[begin[s], begin[s+1]).
  void GroupByStripe(absl::Span<const uint64_t> ids,
                     std::vector<uint32_t>* order,
                     std::vector<uint32_t>* begin) const;

  // All below: the stripe's mutex is held. Stripe is incomplete here, so
  // the definitions in sparse_table.cc carry the annotations
  // (ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu)), which clang checks at every
  // caller after them.
  uint32_t FindAndTouch(Stripe& s, uint64_t id) const;
  // Lookups run this many ids behind the index prefetches.
  static constexpr uint32_t kLookAhead = 8;
  void PrefetchIndex(const Stripe& s, absl::Span<const uint64_t> ids,
                     const std::vector<uint32_t>& order, uint32_t ahead,
                     uint32_t end) const;
  void PrefetchFirstIndexEntries(const Stripe& s,
                                 absl::Span<const uint64_t> ids,
                                 const std::vector<uint32_t>& order,
                                 uint32_t first, uint32_t end) const;
  // For positions [first, end) of one stripe's group: slot_of(k) finds (or
  // makes) the row of ids[order[k]] (kNil: none), use(k, slot) reads or
  // updates it. Every slot first, each row's lines prefetched as it is
  // found, then the uses: on a table larger than the cache the rows' misses
  // overlap instead of coming one a row. Where a row slot_of makes may evict
  // one found before it (a full stripe), each row is used before the next
  // is looked up.
  template <typename SlotOf, typename Use>
  void VisitRows(Stripe& s, uint32_t first, uint32_t end, SlotOf slot_of,
                 Use use) const;
  // Logs `id`'s eviction or expiry for ChangesSince, once a mark was taken.
  void LogEviction(Stripe& s, uint64_t id) const;
  // Takes the stripe's least recently used row out (index, LRU list,
  // admission memory, eviction log) and returns its slot; the caller counts
  // it and reuses or frees the slot.
  uint32_t RemoveLeastRecentlyUsed(Stripe& s) const;
  // With a TTL: records `now` (TtlNow) as the stripe's time for the
  // touches under this lock, and expires its rows past the TTL.
  void ExpireRows(Stripe& s, uint32_t now) const;
  // The TTL's clock: seconds since the table was made (on options_.clock),
  // or with ttl_steps the steps since the first AdvanceStep.
  uint32_t TtlNow() const;
  uint32_t CreateRow(Stripe& s, uint64_t id) const;
  void InitRowState(absl::Span<float> state) const;
  uint32_t CountSighting(Stripe& s, uint64_t id) const;
  void RememberEvicted(Stripe& s, uint64_t id) const;
  void AgeSightings(Stripe& s) const;
  void ApplyGradient(int64_t t, float* row, const float* g) const;
  // Adam's bias corrections at a row's update count t: its step size
  // lr / (1 - beta1^t) and 1 / sqrt(1 - beta2^t).
  struct AdamCorrection {
    float step = 0;
    float inv_sqrt_c2 = 0;
  };
  AdamCorrection ComputeAdamCorrection(int64_t t) const;
  AdamCorrection AdamCorrectionAt(int64_t t) const;
  float FtrlWeight(float z, float n) const;

  const SparseTableOptions options_;
  const Kind kind_;
  const int state_per_element_;
  const int64_t row_floats_;          // dim * (1 + state_per_element)
  const int64_t sightings_capacity_;  // per stripe
  // The TTL in whole seconds (rounded up) or in steps; 0: none.
  const uint32_t ttl_ticks_;
  const absl::Time start_;
  // ttl_steps' clock (AdvanceStep): the first step seen (-1: none yet) and
  // the latest.
  std::atomic<int64_t> first_step_{-1};
  std::atomic<int64_t> step_{0};
  // The change epoch (MarkChanges): 1 until the first mark.
  std::atomic<uint32_t> epoch_{1};
  std::vector<std::unique_ptr<Stripe>> stripes_;
  // Adam: ComputeAdamCorrection(t) for t = 1, 2, ... (its two pow calls were
  // most of a row's update), until both reach their limits in float, which
  // later counts keep (`final`), or 2^16 counts. Shared by the process's
  // adam tables of one (lr, beta1, beta2), not counted in a table's
  // memory_bytes: ~140 KB for torch's default betas, once.
  struct AdamCorrections {
    std::vector<AdamCorrection> by_count;  // [t - 1]
    bool final = false;
  };
  std::shared_ptr<const AdamCorrections> adam_corrections_;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SPARSE_TABLE_H_
