// One parameter-server shard: its blocks of every dense tensor, their
// optimizer state, job membership, and the consistency protocol. This is
// the one place where a push is applied. It knows nothing of gRPC: the
// service adapts it.
//
// Blocks are the unit of transfer, locking and consistency. Each block has a
// version: the number of updates applied to it.
// sync:  a block at version v sums the step-v gradients of the workers; once
//        the step's quorum is in (a gradient from every member counted in
//        step v, or --replicas_to_aggregate gradients), the mean is applied
//        once and the block moves to v + 1. A step whose members have all
//        lapsed completes with the gradients it holds, or with the next one
//        to arrive: it never waits for nobody.
//        Gradients for a step that completed without them are dropped and
//        counted as late. Pull(step t) answers once every requested block is
//        at version >= t (exactly t unless the worker fell behind).
// async: every push is applied on arrival under the block's lock; staleness
//        (block version at apply - version the worker pulled) is recorded.
// ssp:   applied as async, but Pull(step c) waits while some member's clock
//        (steps it has pushed) is more than the staleness bound behind c.
// Always: a block push is identified by (worker_id, step); a repeat is
//        acknowledged as a duplicate and never applied twice. Every request
//        is validated completely before it touches state, and every wait has
//        a deadline.
//
// Membership: workers [0, num_workers) are expected from the start. In sync
// and ssp the job starts once every one of them has been heard from: a
// worker never seen is missing, not lapsed, and the first step waits for it
// (AwaitJobStart lets a worker wait for the start and see who is missing).
// At startup_timeout the job starts with those present if they are at least
// min_workers, and otherwise fails: every request is then refused with a
// status naming the missing ids. A lease starts at a worker's first
// contact; a worker that misses it (no request or heartbeat for
// --worker_lease_s) is dropped and the steps stop waiting for it; a worker
// that comes back, a new incarnation of a worker id, or a new id below
// max_workers (elastic scale-up) joins at the step of its next pull. Leave
// drops one at once. A sync step completed with fewer than num_workers
// gradients is counted (Stats.steps_short).
//
// Shard is one class over several files, each holding one part:
//   shard.cc             creation, registration and the model, the
//                        validation every request shares, reaper, stats
//   shard_membership.cc  leases, heartbeats, joining and leaving, job start
//   shard_dense.cc       where a dense push is applied (sync sum in worker
//                        order, async apply), what a restored shard lost
//   shard_pull.cc        dense pulls, and the waiting every pull shares
//   shard_sparse.cc      sparse tables: their pulls and pushes
//   shard_clip.cc        sync steps with clip_grad_norm_ (ClipNorm, ApplyClip)
//   shard_restore.cc     checkpoint snapshot and restore
//   shard_replica_state.cc  the whole state, for a replica that catches up
//   shard_step_records.cc   each sync step as applied, for the backups
//   shard_internal.h     the nested types and helpers those files share
#ifndef PSTRAIN_PS_SERVER_SHARD_H_
#define PSTRAIN_PS_SERVER_SHARD_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/consistency_mode.h"
#include "common/partition.h"
#include "common/transport/wire.h"
#include "proto/ps.pb.h"
#include "ps_server/block_values.h"
#include "ps_server/optimizer.h"
#include "ps_server/ordered_sum.h"
#include "ps_server/sparse_table.h"

namespace pstrain {

struct ShardOptions {
  int shard_id = 0;
  int num_shards = 1;
  // Workers expected from the start; ids may go up to max_workers - 1
  // (0: max_workers = num_workers, a fixed-size job).
  int num_workers = 1;
  int max_workers = 0;
  ConsistencyMode mode = ConsistencyMode::kSync;
  // ssp: how many steps a worker may be ahead of the slowest member.
  int ssp_staleness = 3;
  // sync: apply a step once this many gradients are in (0: every member).
  int replicas_to_aggregate = 0;
  // A member not heard from for this long is dropped from the quorum.
  absl::Duration worker_lease = absl::Seconds(10);
  // sync/ssp: how long the first step waits for every expected worker, and
  // how many must have come by then for the job to start without the rest
  // (0: num_workers, all of them).
  absl::Duration startup_timeout = absl::Minutes(10);
  int min_workers = 0;
  OptimizerConfig optimizer;
  // A gradient with NaN/Inf is refused (false) or acknowledged and left out
  // of the update, counted in stats (true). In sync mode a skipped worker
  // still counts toward the block's quorum; the mean is over finite ones.
  bool skip_nonfinite_gradients = false;
  // sync: sum each step's gradients as they arrive instead of in worker-id
  // order (ordered_sum.h): results then vary from run to run. For measuring
  // what the order costs.
  bool sum_in_arrival_order = false;
  // Upper bound on how long a pull waits, whatever the caller's deadline.
  absl::Duration max_pull_wait = absl::Minutes(2);
  // Sparse tables: rows kept per table on this shard (0: unbounded; least
  // recently used rows are evicted beyond it), and how many sightings of an
  // id it takes before a row is created for it (0 or 1: the first).
  int64_t sparse_max_rows = 0;
  int sparse_admit_after = 0;
  absl::Duration sparse_row_ttl = absl::InfiniteDuration();
  int64_t sparse_row_ttl_steps = 0;  // the same in steps (0: none)
  // The most memory one shard's dense parameters, optimizer state and block
  // bookkeeping may take; a larger model is refused at registration
  // (RESOURCE_EXHAUSTED) before anything is allocated.
  int64_t max_shard_bytes = int64_t{16} << 30;
  // --sparse_memory_gb in bytes: what the tables without their own budget
  // share (0: no limit).
  int64_t sparse_memory_bytes = 0;
  // sync, --replicas > 1: dense blocks complete their steps only on the
  // replica that leads (set_leads_steps), which records each step it
  // applies (TakeStepRecords) for the others to apply as it did
  // (ApplyStepRecords). A backup then needs no push that the primary's
  // step record covers.
  bool record_steps = false;
  // --replicas > 1: a table with its own budget (max_bytes) is refused at
  // registration. A backup sees the pushes, not the pulls that also keep a
  // row recent, so it would evict other rows than its primary (the servers'
  // --sparse_max_rows and --sparse_memory_gb are refused at start for the
  // same reason).
  bool replicated = false;
};

// One block's values as of `version`, ready to send: a reference, not a
// copy; updates leave this memory alone while it is held.
struct PulledBlock {
  const std::string* tensor = nullptr;  // owned by the registered schema
  int64_t block = 0;
  int64_t version = 0;
  BlockValues::Ref values;
  // A STATE tensor's block: sent exactly, whatever the pull's dtype.
  bool state_values = false;
};

// The saved state of one block (see ps_server/checkpoint.h).
// A shard's whole state for a replica that catches up
// (Shard::ExportReplicaState): chunk headers and, per chunk, the pieces of
// block memory its floats are (each block's value, then its state).
struct ReplicaStateExport {
  std::vector<ReplicaStateChunk> chunks;
  std::vector<std::vector<absl::string_view>> floats;
  // Holds the values the pieces point into, whatever an update does.
  std::vector<BlockValues::Ref> values;
};

struct BlockSnapshot;
struct ShardSnapshot;
struct RestoredShard;

class Shard {
 public:
  // Called exactly once per Pull: inline when the blocks are ready, else
  // later from the push that releases it, the reaper (deadline, lease
  // expiry), or BeginShutdown.
  using PullDone =
      std::function<void(absl::Status, std::vector<PulledBlock> blocks)>;

  static absl::StatusOr<std::unique_ptr<Shard>> Create(
      const ShardOptions& options);
  ~Shard();  // fails waiting pulls (as BeginShutdown) and stops the reaper

  absl::StatusOr<RegisterModelResponse> Register(
      const RegisterModelRequest& request);
  // `deadline` is the caller's; a wait is also capped by max_pull_wait.
  // Sync: a worker's pull of step s says it pushed s - 1 to every block
  // here, so a restored shard counts a gradient it lacks as lost with its
  // previous life. `follows_own_push` (the pull half of a PushPull) says
  // only that this pull's own blocks were pushed: the worker's pushes to
  // other blocks may still be on their way, so nothing counts as lost.
  void Pull(const PullRequest& request, absl::Time deadline, PullDone done,
            bool follows_own_push = false);
  // A sync backup's answer to a worker that reads from it (PsClient's
  // pulls_from_backups): the blocks once this replica holds step s - 1
  // (its record applied), changing nothing else here. Waiting reads end
  // with `status` at FailReplicaReads (a takeover: the worker's step goes
  // again to the new primary, which it could not while it waited here).
  void PullOnBackup(const PullRequest& request, absl::Time deadline,
                    PullDone done);
  void FailReplicaReads(const absl::Status& status);
  // Sync: a push one step past a restored block that still waits for
  // another member's gradient (that worker pulled the step from this
  // shard's previous life), or a push to a shard restarted with nothing
  // restored before every worker has come ahead of it, is refused as
  // retryable; with `hold_until` in the future it waits instead, until
  // then. A refused push is retried only after the worker's other calls
  // end, and those can wait on a worker held behind it.
  absl::StatusOr<PushResponse> Push(
      const WirePushRequest& request,
      absl::Time hold_until = absl::InfinitePast());
  // A backup replica (ps_server/replication.h), before it applies a sync
  // push the primary forwarded: returns once every block the push names has
  // reached its step, at shutdown, or at `until`. Forwards travel on
  // concurrent calls, so a worker's push of step s can arrive before the
  // last gradient of step s - 1 that the primary applied first.
  void WaitForPushStep(const WirePushRequest& request, absl::Time until);
  // The same for a forwarded sync push to sparse tables (each it names).
  void WaitForSparsePushStep(const SparsePushRequest& request,
                             absl::Time until);
  // Sets the values of blocks whose init is PROVIDED and that have none
  // yet (others are acknowledged as duplicates): float32 only, from any
  // worker id; releases the pulls that waited for them.
  absl::StatusOr<PushResponse> Assign(const WirePushRequest& request);

  // Rows of a sparse table (all of them on this shard), with the same step
  // semantics as Pull/Push: sync pulls wait for the table's step, sync
  // pushes are summed per row until every member has pushed the step (an
  // empty push counts), then the mean is applied once.
  using SparsePullDone =
      std::function<void(absl::Status, SparsePullResponse response)>;
  void SparsePull(const SparsePullRequest& request, absl::Time deadline,
                  SparsePullDone done);
  // With SparsePushRequest.more: every part is validated before any is
  // applied (a bad one refuses the whole push), then each is applied as if
  // it came alone.
  absl::StatusOr<SparsePushResponse> SparsePush(
      const SparsePushRequest& request);
  // SparseChangesRequest: ends every table's change epoch (mark) and/or
  // answers a page of the asked tables' rows changed since their marks
  // (SparseTable::ChangesSince); server_life is the caller's to fill.
  absl::StatusOr<SparseChangesResponse> SparseChanges(
      const SparseChangesRequest& request);
  // sync, a clipped step (PushRequest.clip_max_norm): answers once every
  // parameter block of this shard has the step's gradients in, with this
  // shard's share of the squared norm of the step's mean gradient (or
  // `applied` when a worker already brought the coefficient). Called once,
  // like a pull's done, with a deadline like a pull's.
  using ClipNormDone = std::function<void(absl::StatusOr<ClipNormResponse>)>;
  void ClipNorm(const ClipNormRequest& request, absl::Time deadline,
                ClipNormDone done);
  // Applies the held step with its mean gradient times the coefficient;
  // the first call for a step applies it, later ones change nothing.
  absl::StatusOr<ApplyClipResponse> ApplyClip(const ApplyClipRequest& request);
  // The clipped step that waits for its coefficient, if one does.
  std::optional<int64_t> PendingClipStep() const;
  absl::Status Heartbeat(const HeartbeatRequest& request);
  // Answers (once) when the job has started, or failed to, or at
  // `deadline` (capped at a few seconds) with who is still missing.
  using JobStartDone = std::function<void(absl::StatusOr<JobStart>)>;
  void AwaitJobStart(const AwaitJobStartRequest& request, absl::Time deadline,
                     JobStartDone done);
  absl::Status Leave(const LeaveRequest& request);
  StatsResponse Stats() const;

  // Installs a model restored from a checkpoint, before any Register. Until
  // the first worker request, a sync shard then accepts a step ahead of its
  // blocks by moving them forward to it (the lost steps are counted).
  absl::Status Restore(const RestoredShard& restored);
  // Copies the model's state (each block consistent under its lock), or
  // FailedPrecondition before a model is registered.
  absl::StatusOr<ShardSnapshot> Snapshot(int64_t sequence) const;

  // Replica catch-up (ps_server/replication.h). Whether no sync step is
  // part done here: no block or table holds some of a step's gradients or
  // waits for its clip. The state is then whole at each block's step, and
  // ExportReplicaState need not carry sums in progress.
  bool QuietForTransfer() const;

  // While held, the lease clock stands still, as for a server that did not
  // run: the requests waiting meanwhile (a catch-up holds every change,
  // heartbeats too, while the state is sent) cost no worker its lease,
  // however long that takes. Holds nest; each true needs its false.
  void HoldLeaseClock(bool hold) {
    lease_clock_holds_.fetch_add(hold ? 1 : -1, std::memory_order_acq_rel);
  }
  // Sync: the lowest step of any block or table (the step under way); the
  // pushes a quiet moment waits for are of this step.
  int64_t StepUnderWay() const;
  // The whole state a backup needs (model, rows, optimizer state, versions,
  // de-duplication steps, workers), in chunks of about `chunk_bytes`, with
  // the dense blocks' floats apart, in place (ReplicaStateExport). The
  // first chunk only installs the model; then come the dense blocks, the
  // sparse rows, and a last chunk that only ends the transfer. Call
  // while QuietForTransfer and no change can reach the shard, and send it
  // before any can: the floats are the blocks' own memory.
  absl::StatusOr<ReplicaStateExport> ExportReplicaState(
      int64_t chunk_bytes) const;
  // A joining replica installs the chunks, each with its floats (`floats`:
  // what followed it): the first before any other (it installs the model,
  // so this shard must have none), the dense blocks' chunks in any order,
  // possibly at once, the sparse ones in order, the last after every
  // other. InvalidArgument (naming what) for a chunk that does not fit the
  // model it installed, or a last chunk with a block still missing.
  absl::Status ImportReplicaChunk(const ReplicaStateChunk& chunk,
                                  absl::string_view floats = {});
  // Whether a model is registered (or restored) here.
  bool HasModel() const { return model_.load() != nullptr; }
  ConsistencyMode mode() const { return options_.mode; }
  // The smallest block version: the step every block has completed.
  int64_t MinVersion() const;
  // The version a job's final model is compared with (CheckpointResponse):
  // MinVersion; with sparse tables only, their smallest step in sync and -1
  // in async/ssp (tables count no versions there); -1 for a shard that holds
  // no part of the model.
  int64_t StateVersion() const;
  // Worker `worker_id` (-1: an observer) holds the job's final model at
  // `version` and says so at the end of the job. The largest is kept
  // (Stats.job_final_version), so a shard restored behind it says so at its
  // exit. In sync it is also the worker's step, as a heartbeat carries it:
  // a shard restarted empty after the last step then takes that step once
  // every worker has shown it, though some will never pull again.
  // NOT_FOUND before a model is registered (the client registers again:
  // the heartbeat needs the model's blocks).
  absl::Status NoteJobFinalVersion(int worker_id, int64_t version);
  // The furthest step this shard skipped to without the updates before it
  // (restarted behind the workers; the steps are counted in steps_lost); 0
  // when it never did.
  int64_t SkippedToStep() const { return skipped_to_step_.load(); }
  // sync: worker `worker` holds the job's final model at `version`, pulled
  // from a process before this one (this one never served it that step),
  // and this process rebuilt the state up to `version` from a checkpoint
  // below it with updates or gradients lost: the servers' copy is not the
  // model the worker holds, though both are at `version`.
  // Remembered for the shard's exit line (FinalModelRebuilt).
  bool RebuiltWithLossesBefore(int worker, int64_t version);
  bool FinalModelRebuilt() const { return final_model_rebuilt_.load(); }

  // Counts a request refused before it reached the shard (unparseable).
  void CountRejected() { requests_rejected_.fetch_add(1); }

  bool records_steps() const { return options_.record_steps; }
  // Step records (ShardOptions::record_steps). `leads` says whether this
  // replica completes dense steps now (the primary); set it once, before
  // any request. Unset, it does.
  void set_leads_steps(std::function<bool()> leads) {
    leads_steps_ = std::move(leads);
  }
  // The steps completed and not yet taken, in the order they completed,
  // each record's sum beside it (empty when it has none). At least one
  // record when HasStepRecords(), and no more than fit in `max_sum_bytes`
  // of sums past the first (a message to a backup has a size bound).
  // Several takes may be on their way to the backups at once (the
  // service's senders): a take passes over a record of a block that has
  // one on its way (it leaves in a later take), so that each block's
  // records reach a backup in step order whatever order the messages
  // finish in, and the other blocks' records do not wait for it.
  struct TakenStepRecords {
    StepRecords records;
    std::vector<std::vector<float>> sums;
    // Each record's place in the order records were made (0, 1, ...), and
    // when it was made.
    std::vector<int64_t> places;
    std::vector<absl::Time> made;
  };
  // Records of `before_step` on stay queued (a test's fault injection).
  TakenStepRecords TakeStepRecords(
      int64_t max_sum_bytes,
      int64_t before_step = std::numeric_limits<int64_t>::max());
  // Records that could not be sent: back in the queue, in the order they
  // were made, before any later record of their blocks.
  void ReturnStepRecords(TakenStepRecords taken);
  // Records every backup holds: their sums' memory serves later steps.
  void ConfirmStepRecords(TakenStepRecords taken);
  // The lowest step of a record not yet on every backup (queued or on its
  // way; a skip's is the step it skips from), or INT64_MAX when there is
  // none: every step before it is on the backups.
  int64_t OldestUnconfirmedStep() const;
  // Whether the pushes of `step` that its workers keep (PsClient) make the
  // same step again on a new primary: in worker order, and every worker's
  // gradient in it. Not when it ran short (a lease ran out, a worker left,
  // --replicas_to_aggregate) or the sum is in arrival order: the pulls that
  // show such a step wait for its record (the service's record window).
  bool StepRebuildsFromPushes(int64_t step) const {
    return !options_.sum_in_arrival_order && last_short_step_.load() < step;
  }
  // Records made so far (a pull answered now may show all of them).
  int64_t StepRecordsMade() const {
    return step_records_made_.load(std::memory_order_acquire);
  }
  // How many records, counted from the first made, every backup holds (no
  // record made before that count is queued or on its way).
  int64_t StepRecordsConfirmed() const;
  // Whether a take now would return a record: one is queued whose block
  // has none on its way.
  bool HasStepRecords() const;
  // A replica that does not lead: applies the leader's records, each
  // exactly as the leader applied it (`sums`: the records' sums, float32,
  // one after the other). A record of a step this shard is past is a
  // repeat and changes nothing; one of a step ahead of it (a record
  // missed), or one that does not fit the model, is refused before
  // anything is applied.
  absl::Status ApplyStepRecords(const StepRecords& records,
                                absl::string_view sums);
  // This replica has begun to lead: the workers' leases start again when
  // the first of them reaches it (a backup judges no lease, see
  // ExpireLeases), and the steps whose gradients are all in complete now
  // (and are recorded).
  void CompleteStepsNowLeading();

  // Answers every waiting pull UNAVAILABLE, so the server can stop without
  // waiting for workers that will never push.
  void BeginShutdown();

 private:
  // sync: a block gradient that came before a lower worker id's, as it
  // came over the wire (a pool buffer); none for a skipped non-finite one.
  struct EarlyGradient {
    DataType dtype = FLOAT32;
    bool has_values = false;
    std::string bytes;
  };
  // sync: a sparse push that came before a lower worker id's.
  struct EarlySparsePush {
    std::vector<uint64_t> ids;
    std::vector<float> grads;
  };
  // Complete here (not only in shard_internal.h) so that the lock annotations
  // of the functions below can name their mutexes.
  struct Block {
    const BlockLocation* location = nullptr;
    int local = 0;  // its index in Model::blocks
    const std::string* tensor_name = nullptr;
    // A STATE tensor's block: pushes carry values, no optimizer.
    bool state_values = false;
    // Its update rule (its tensor's torch rule, or the server's), and the
    // param group whose rate a push carries (-1: none, the rule's own; the
    // server's rule follows group 0's).
    const Optimizer* optimizer = nullptr;
    int lr_group = -1;
    // Init PROVIDED and no Assign yet: pulls wait, pushes are refused.
    std::atomic<bool> awaiting_values{false};
    // Updates applied. Written under mu; read without it by pulls deciding
    // whether to wait.
    std::atomic<int64_t> version{0};

    mutable absl::Mutex mu;
    BlockValues value ABSL_GUARDED_BY(mu);
    std::vector<float> state ABSL_GUARDED_BY(mu);  // optimizer slots
    // sync: this step's gradient sum (meaningful only once
    // finite_contributors > 0; allocated by the first gradient added), taken in
    // worker order (ordered_sum.h) with the gradients that came before their
    // turn held in `early`, and the last step each worker contributed to (==
    // version: counted in this step).
    std::vector<float> gradient_sum ABSL_GUARDED_BY(mu);
    InWorkerOrder<EarlyGradient> early ABSL_GUARDED_BY(mu);
    std::vector<int64_t> last_contributed ABSL_GUARDED_BY(mu);
    int contributors ABSL_GUARDED_BY(mu) = 0;
    int finite_contributors ABSL_GUARDED_BY(mu) = 0;
    // Of `contributors`, the gradients credited as lost with a previous life
    // (CreditLostGradientsLocked): a step made of those alone applies no
    // update, and that update counts as lost.
    int lost_contributors ABSL_GUARDED_BY(mu) = 0;
    // Whether gradient_sum holds this step's first added gradient yet (the
    // first overwrites what the last step left).
    bool sum_started ABSL_GUARDED_BY(mu) = false;
    // sync: the rate (and momentum) of this step's update, from the push of
    // the lowest worker id that carried one (every worker's scheduler
    // agrees; the lowest makes it one answer whatever the order).
    StepHyper step_hyper ABSL_GUARDED_BY(mu);
    int step_hyper_worker ABSL_GUARDED_BY(mu) = std::numeric_limits<int>::max();
    // sync, a clipped step (PushRequest.clip_max_norm, from the lowest
    // worker id's push): its mean is held once the quorum is in
    // (awaiting_clip; read without mu by waiters) until ApplyClip, with its
    // share of the norm.
    std::atomic<bool> awaiting_clip{false};
    double clip_max_norm ABSL_GUARDED_BY(mu) = 0;
    int clip_worker ABSL_GUARDED_BY(mu) = std::numeric_limits<int>::max();
    double clip_sum_of_squares ABSL_GUARDED_BY(mu) = 0;
    // The last clipped step applied, and its norm (ApplyClipRequest.norm).
    int64_t clip_applied_step ABSL_GUARDED_BY(mu) = -1;
    double clip_applied_norm ABSL_GUARDED_BY(mu) = 0;
    // async/ssp: the last step applied per worker (-1: none).
    std::vector<int64_t> last_step ABSL_GUARDED_BY(mu);
    // async/ssp after a restore: the workers not heard from since. A
    // worker's first push tells how many of its pushes (those after
    // last_step) the previous life applied and lost.
    std::vector<bool> unseen_since_restore ABSL_GUARDED_BY(mu);
    // Updates this block lost to restores.
    int64_t updates_lost ABSL_GUARDED_BY(mu) = 0;
  };

  // A sparse table's rows on this shard and its step protocol (the rows
  // themselves are thread-safe in SparseTable).
  struct SparseState {
    const SparseTableSpec* spec = nullptr;
    // The table's own mode (TableConsistencyMode), fixed at install: an
    // async table under sync servers takes no part in the step (its pushes
    // are applied on arrival, its pulls never wait, no fast-forward or lost
    // gradient touches it) and its version stays what async gives it.
    ConsistencyMode mode = ConsistencyMode::kSync;
    std::unique_ptr<SparseTable> table;
    std::atomic<int64_t> version{0};
    std::atomic<int64_t> rows_pulled{0}, rows_pushed{0};

    mutable absl::Mutex mu;
    // sync: this step's per-row gradient sums, taken in worker order with
    // the pushes that came before their turn in `early`, and who has
    // contributed.
    absl::flat_hash_map<uint64_t, std::vector<float>> gradient_sum
        ABSL_GUARDED_BY(mu);
    InWorkerOrder<EarlySparsePush> early ABSL_GUARDED_BY(mu);
    std::vector<int64_t> last_contributed ABSL_GUARDED_BY(mu);
    int contributors ABSL_GUARDED_BY(mu) = 0;
    // async/ssp: the last step applied per worker (-1: none).
    std::vector<int64_t> last_step ABSL_GUARDED_BY(mu);
  };
  struct Model;
  struct Waiter;
  struct WorkerState;
  struct StartWaiter {
    absl::Time deadline;
    JobStartDone done;
  };
  // For each worker id, the first step whose quorum counts it (kNever when
  // it is not a member). Replaced, never modified, so block completion can
  // read it without the shard's lock.
  using Membership = std::vector<int64_t>;
  // A validated block of a push: its local index and the wire block.
  struct BlockPush {
    int local = 0;
    const WireBlock* wire = nullptr;
    bool nonfinite = false;
  };
  enum class BlockResult { kApplied, kDuplicate, kLate };

  Shard(const ShardOptions& options, std::unique_ptr<Optimizer> optimizer);

  absl::Status Reject(absl::Status status);
  // An apply that validation promised could not fail did: a gradient, or
  // part of one, was not applied. Counted (Stats.internal_errors), logged,
  // and fatal under `bazel test`, so such a disagreement is found, never
  // silently dropped.
  void ReportInternalError(absl::string_view what, const absl::Status& status);
  // async/ssp: counts the updates of `worker` this block lost to a restore,
  // at its first push (of `step`) since.
  void CountUpdatesLostLocked(Block& block, int worker, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu);
  absl::StatusOr<const Model*> ValidateCommon(uint32_t protocol_version,
                                              int worker_id, int64_t step,
                                              bool allow_observer) const;
  // `assign`: values for Assign (float32 only, blocks that wait for them
  // allowed); else a push (blocks still waiting for values refused).
  absl::StatusOr<std::vector<BlockPush>> ValidatePushBlocks(
      const Model& model, const WirePushRequest& request,
      bool assign = false) const;
  absl::StatusOr<std::vector<int>> ResolvePullBlocks(
      const Model& model, const PullRequest& request) const;
  // Refuses, before anything is allocated, a schema with too many blocks
  // or one whose values, optimizer state and per-block bookkeeping on this
  // shard exceed max_shard_bytes.
  // A sparse table's options: the spec's, with this server's bounds (its
  // own max_bytes, or its share of --sparse_memory_gb, SharedTableBudget).
  SparseTableOptions TableOptions(const ModelSchema& schema,
                                  const SparseTableSpec& spec) const;
  // What each table of `schema` without its own max_bytes may take of
  // sparse_memory_bytes once the others' budgets are taken out; 0 when there
  // is no limit, negative when the others' budgets leave nothing.
  int64_t SharedTableBudget(const ModelSchema& schema) const;
  // Also describes, in `estimate` when given, what the shard may hold: the
  // dense blocks and each sparse table's bound (or that it has none).
  absl::Status CheckModelFits(
      const ModelSchema& schema,
      const std::vector<std::unique_ptr<Optimizer>>& tensor_optimizers,
      std::string* estimate = nullptr) const;
  // Each dense tensor's torch.optim rule (its spec's optimizer), null where
  // it has none (the server's --optimizer); InvalidArgument naming the
  // tensor for a rule the servers cannot run.
  absl::StatusOr<std::vector<std::unique_ptr<Optimizer>>> MakeTensorOptimizers(
      const ModelSchema& schema) const;
  // What InstallModel puts in the blocks: the schema's initial values, or
  // nothing yet, for a catch-up's import, which brings each block's values
  // and optimizer state with its chunk. Computing 16M random initial values
  // it then overwrote took 75 ms; zeros it then overwrote, 40 ms of page
  // faults that the chunks' copies now take in parallel, while the rest of
  // the state is still on the wire.
  enum class InitialValues { kFromSchema, kArriveWithState };
  absl::Status InstallModel(const ModelSchema& schema,
                            InitialValues values = InitialValues::kFromSchema);

  // Whether Push may still hold a push until `until`: not once the
  // server is shutting down, so a held push ends with it.
  bool MayHold(absl::Time until) const {
    return absl::Now() < until && !holds_released_.load();
  }
  // Returns once this shard is no longer fresh_ (it took the job's step),
  // at shutdown, or at `until`.
  void WaitWhileFresh(absl::Time until) ABSL_LOCKS_EXCLUDED(mu_);
  bool FreshWaitOverLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !fresh_ || shutting_down_;
  }
  // Returns once `block` is at `step` or later, at shutdown, or at `until`.
  void WaitForBlockStep(const Block& block, int64_t step, absl::Time until);

  // The hyper-parameters `request` carries for `block`'s group, or the
  // block's rule's own.
  static StepHyper HyperOfPush(const Block& block,
                               const WirePushRequest& request);
  BlockResult PushSyncBlock(Block& block, const Membership& membership,
                            const WirePushRequest& request,
                            const BlockPush& push, bool* completed);
  // sync: adds `worker`'s gradient (none when non-finite) to the block's
  // step sum in worker order: now if its turn has come, else held.
  void AddInWorkerOrderLocked(Block& block, int worker, const BlockPush& push)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu);
  // Adds one gradient's payload to the block's step sum.
  void AddToStepSumLocked(Block& block, DataType dtype,
                          const ByteSegments& data)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu);
  // Adds the held gradients to the block's step sum (the step completes),
  // or drops them (`add` false: a restored shard skips the step).
  void SettleEarlyGradientsLocked(Block& block, bool add)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu);
  // The sparse counterparts.
  void AddSparseInWorkerOrderLocked(SparseState& table, int worker,
                                    EarlySparsePush push)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table.mu);
  void SettleEarlySparsePushesLocked(SparseState& table, bool add)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table.mu);
  BlockResult PushAsyncBlock(Block& block, const WirePushRequest& request,
                             const BlockPush& push);
  // Applies the block's step if its quorum is in (a clipped step: holds it
  // for ApplyClip); true when it did.
  bool CompleteIfReadyLocked(Block& block, const Membership& membership)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu);
  // Applies the step whose gradients are in, their mean times
  // `coefficient`, and moves the block to the next step.
  void ApplyStepLocked(Block& block, float coefficient)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu);
  // record_steps: whether this replica completes dense steps now.
  bool LeadsSteps() const {
    return !options_.record_steps || leads_steps_ == nullptr || leads_steps_();
  }
  // Records the step ApplyStepLocked is applying (its sum moves into the
  // record).
  void RecordStepLocked(Block& block, float coefficient)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu);
  // Queues a record for TakeStepRecords (its sum: none, or the block's).
  void AddStepRecord(StepRecord record, std::vector<float> sum);
  // Moves the block from its step to `step`, values untouched: the steps
  // between are lost (counted in updates_lost) and what was summed of its
  // step is dropped. On a restored primary (FastForwardLocked) and, from
  // its record, on the backups (ApplyStepRecords).
  void SkipBlockLocked(Block& block, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu);
  // Counts a skip to `step` that lost `lost` steps (the most any block or
  // table skipped) in steps_lost. One skip may come in parts on a backup
  // (its tables by its own fast-forward, its blocks by the primary's
  // records, in one message or several): each part counts only what the
  // parts before it of the same skip did not.
  void CountSkipLocked(int64_t step, int64_t lost)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A step sum's memory: one a sent record gave back, or new.
  std::vector<float> SpareStepSum();
  void CompleteReadyBlocks();
  // Sparse counterparts of the block step protocol.
  bool CompleteSparseIfReadyLocked(SparseState& state,
                                   const Membership& membership)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  absl::StatusOr<SparseState*> ValidateSparse(const Model& model,
                                              absl::string_view table,
                                              absl::Span<const uint64_t> ids,
                                              bool unique) const;
  // A restored sync shard meeting its first worker at `step`: moves every
  // block and table forward to it. True when it moved any: pulls may be
  // waiting for the steps it skipped (a sparse pull of one step past a
  // table's does not end the recovery), and the caller must answer them
  // (ReleaseReadyWaiters, once mu_ is released) or they wait out their
  // deadline while every other worker waits for theirs.
  ABSL_MUST_USE_RESULT bool FastForwardLocked(const Model& model, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A fresh shard (fresh_) met by `worker` at `step`, past what it holds:
  // true once every expected worker has been, and the shard may take the
  // job's step (FastForwardLocked moves to the furthest step any of them
  // came with, at most one past the nearest); until then the caller
  // refuses with FreshShardBehind.
  bool ConfirmLostStateLocked(int worker, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FreshShardBehindLocked(absl::string_view what, int64_t step,
                                      int64_t version) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Membership, under mu_. A worker's first contact starts its lease and
  // may start the job: true when it did (the caller then answers the
  // start's waiters once mu_ is released).
  bool TouchLocked(int worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker that left stopping registers again (LeaveRequest.stopping):
  // a member like any other, and the others that stopped get a lease.
  void ResumeStoppedLocked(int worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The lease start that makes a stopping member lapse `hold` from now.
  absl::Time StoppingLeaseStartLocked(absl::Duration hold) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void JoinIfPendingLocked(int worker, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // sync: the step a member's predecessor (a worker process that died) was
  // to push next on every block and table of this shard, or -1 when it had
  // pushed a step to some and not others, or not every step before.
  int64_t PredecessorsNextStepLocked(const Model& model, int worker)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishMembershipLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<const Membership> membership() const;
  int64_t MinMemberClockLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops members whose lease expired; true when any was dropped.
  bool ExpireLeases() ABSL_LOCKS_EXCLUDED(mu_);

  // The job's start (sync/ssp).
  JobStart JobStartLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<int> MissingWorkersLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reaper: logs the wait now and then, and at startup_timeout starts the
  // job without the missing workers or fails it. True when it started.
  bool CheckJobStart() ABSL_LOCKS_EXCLUDED(mu_);
  // Answers the start's waiters: all of them once the job started or
  // failed, else those whose deadline passed.
  void AnswerStartWaiters() ABSL_LOCKS_EXCLUDED(mu_);
  // Reaper: says once how long after the start the first step completed.
  void LogFirstStepOnce();
  // Refuses every waiting pull and every later request with `failure`.
  void FailJob(absl::Status failure) ABSL_LOCKS_EXCLUDED(mu_);
  // sync: a block or table completed step `version` from `contributors`
  // gradients. Counts it once per step when that was fewer than
  // num_workers, and records when the first step completed.
  void OnStepCompleted(int64_t version, int contributors);

  // The block's values for an update, counting a copy a pull forced.
  absl::Span<float> MutableValues(Block& block)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu);
  std::vector<PulledBlock> ShareBlocks(const Model& model,
                                       const std::vector<int>& locals) const;
  bool WaiterReadyLocked(const Waiter& waiter) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues a pull of `model`'s blocks that is not ready: answered with
  // them once it is (ReleaseReadyWaiters), or with an error by its
  // deadline (`deadline`, capped by max_pull_wait).
  void QueueBlocksWaiterLocked(std::unique_ptr<Waiter> waiter,
                               const Model* model, absl::Time deadline,
                               PullDone done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers the waiting pulls that may now proceed.
  void ReleaseReadyWaiters() ABSL_LOCKS_EXCLUDED(mu_);
  // Expires waiters and leases; runs on reaper_ until shutdown.
  void RunReaper();
  std::string DescribeWait(const Waiter& waiter) const;
  // A ClipNorm's answer for `step` over the blocks `locals`.
  ClipNormResponse ClipAnswer(const Model& model, int64_t step,
                              const std::vector<int>& locals) const;
  // Which members' gradients `block`'s current step still waits for.
  std::string DescribeBlockWaitLocked(const Block& block,
                                      const Membership& members) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu);
  // Brings `table` to a sync push's step where a restored shard may: moves a
  // recovering shard forward, or credits the pusher's lost gradient.
  // Unavailable (retryable) while that step still waits for other members.
  absl::Status CatchUpSparseForPush(const Model& model, SparseState& table,
                                    const SparsePushRequest& request);
  // One table's part of a SparsePush: validated and decoded
  // (PrepareSparsePush, which changes nothing), then applied.
  struct PreparedSparsePush {
    SparseState* table = nullptr;
    std::vector<uint64_t> ids;
    std::vector<float> grads;
  };
  // `part`: the request itself or one of its `more` (table, ids, dtype
  // and gradients read); `request`: the worker and step it is applied with.
  absl::StatusOr<PreparedSparsePush> PrepareSparsePush(
      const Model& model, const SparsePushRequest& part);
  absl::StatusOr<SparsePushResponse> ApplySparsePush(
      const Model& model, const SparsePushRequest& request,
      PreparedSparsePush prepared);
  // WaitForSparsePushStep for one of the push's tables.
  void WaitForSparseTableStep(absl::string_view name, int64_t step,
                              absl::Time until);
  // A sync worker finishes every push of step s - 1 (dense and sparse)
  // before it asks for anything of step s. So `worker` asking for `step`
  // (a pull, or a push after a pull from this shard's previous life) has
  // given its step - 1 gradient to every block and table; on a restored
  // shard, within the steps it may have lost, one it does not hold counts
  // as given. `skipped`: the worker said it skips step - 1 here
  // (HeartbeatRequest.skip_to_step), on any shard: the step completes
  // without it (short, as for a lapsed lease; nothing counted lost). Returns
  // whether some block or table completed its step.
  bool CreditLostGradientsLocked(const Model& model, int worker, int64_t step,
                                 bool skipped = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ShardOptions options_;
  const std::unique_ptr<Optimizer> optimizer_;

  // Set once (Register or Restore), then immutable (the blocks' values
  // change under their own locks).
  absl::Mutex register_mu_;
  std::unique_ptr<Model> model_owner_ ABSL_GUARDED_BY(register_mu_);
  std::atomic<const Model*> model_{nullptr};

  // Coordination: membership, ssp clocks and waiting pulls. Lock order:
  // mu_ before any block's mu, never the reverse. A pull checks and
  // enqueues under mu_; whatever may release it changes state first and
  // then scans under mu_, so no wake-up is lost.
  mutable absl::Mutex mu_;
  std::vector<WorkerState> workers_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const Membership> membership_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Waiter>> waiters_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  // FailReplicaReads ran: this replica took over, and reads no more.
  bool replica_reads_ended_ ABSL_GUARDED_BY(mu_) = false;
  // Restored and not yet met by a worker (sync fast-forward allowed).
  bool recovering_ ABSL_GUARDED_BY(mu_) = false;
  // Sync, started with nothing restored, and no worker has met it at the
  // step it holds yet: it may be a restart that lost its state (killed
  // before its first checkpoint, or run without one). Workers ahead of it
  // are refused as retryable until every expected worker is (then it takes
  // their step: ConfirmLostStateLocked); one client alone cannot move it.
  bool fresh_ ABSL_GUARDED_BY(mu_) = false;
  // The step this process's state started from: the restored checkpoint's
  // (its smallest block version), 0 when it restored nothing.
  int64_t life_start_version_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<int> ahead_of_fresh_ ABSL_GUARDED_BY(mu_);
  // The steps they came with, furthest and nearest (ConfirmLostStateLocked).
  int64_t furthest_ahead_of_fresh_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t nearest_ahead_of_fresh_ ABSL_GUARDED_BY(mu_) =
      std::numeric_limits<int64_t>::max();
  // A restored shard may have lost gradients of steps up to this one (the
  // steps in flight when it crashed); -1 when it never restored.
  int64_t recovery_horizon_ ABSL_GUARDED_BY(mu_) = -1;
  std::thread reaper_;
  // The lease clock: time the server was running to observe leases. Only
  // the reaper advances it, by the monotonic time since its last tick but
  // never more than a tick's worth, so a server that did not run (stopped,
  // a paused VM) expires no lease on waking: the heartbeats sent meanwhile
  // still wait unread in its sockets. Leases are timed on it alone.
  absl::Time LeaseNow() const {
    return absl::FromUnixNanos(lease_clock_ns_.load(std::memory_order_acquire));
  }
  std::atomic<int64_t> lease_clock_ns_{0};
  // HoldLeaseClock's holds in force: while any, the clock stands still.
  std::atomic<int> lease_clock_holds_{0};

  // The job's start (sync and ssp; async starts at once).
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  int expected_seen_ ABSL_GUARDED_BY(mu_) = 0;  // of [0, num_workers)
  // Set when this replica takes over (CompleteStepsNowLeading): no lease
  // runs until a worker reaches it, and then every lease starts again.
  bool leases_wait_for_a_worker_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time waiting_since_ ABSL_GUARDED_BY(mu_);
  absl::Time started_at_ ABSL_GUARDED_BY(mu_);
  // When some block or table first completed step 0 (0: not yet).
  std::atomic<int64_t> first_step_at_ns_{0};
  bool first_step_logged_ = false;  // the reaper's
  absl::Time last_wait_log_ ABSL_GUARDED_BY(mu_);
  std::vector<StartWaiter> start_waiters_ ABSL_GUARDED_BY(mu_);
  // Set once, before job_failed_; read by any request after it.
  absl::Status job_failure_;
  std::atomic<bool> job_failed_{false};

  std::atomic<int64_t> blocks_applied_{0};
  std::atomic<int64_t> blocks_duplicate_{0};
  std::atomic<int64_t> blocks_late_{0};
  std::atomic<int64_t> requests_rejected_{0};
  mutable std::atomic<int64_t> pulls_served_{0};
  std::atomic<int64_t> nonfinite_skipped_{0};
  // sync: buffers of the gradients that came before their turn.
  GradientBufferPool early_gradients_;
  std::atomic<int64_t> staleness_sum_{0};
  std::atomic<int64_t> staleness_max_{0};
  std::atomic<int64_t> async_applies_{0};
  std::atomic<int64_t> steps_lost_{0};
  std::atomic<int64_t> job_final_version_{0};
  // The furthest step FastForwardLocked moved this shard to: its state
  // lacks the updates up to it.
  std::atomic<int64_t> skipped_to_step_{0};
  // CountSkipLocked: the skip counted last, and what it counted.
  int64_t skip_counted_to_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t skip_counted_lost_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> final_model_rebuilt_{false};
  // Set by BeginShutdown: Push holds nothing any more (MayHold).
  std::atomic<bool> holds_released_{false};
  std::atomic<int64_t> gradients_lost_{0};
  std::atomic<int64_t> updates_lost_{0};
  std::atomic<int64_t> internal_errors_{0};
  std::atomic<int64_t> values_copied_for_pulls_{0};
  std::atomic<int64_t> ssp_gap_max_{0};
  // Blocks whose PROVIDED values have not come yet.
  std::atomic<int64_t> blocks_awaiting_values_{0};
  std::atomic<int64_t> steps_short_{0};
  std::atomic<int64_t> last_short_step_{-1};

  // Step records (record_steps). step_records_mu_ is a leaf: taken under
  // a block's mu, never the reverse.
  std::function<bool()> leads_steps_;
  mutable absl::Mutex step_records_mu_;
  struct QueuedStepRecord {
    StepRecord record;
    std::vector<float> sum;
    int64_t place = 0;
    absl::Time made = absl::InfinitePast();
  };
  // Sorted by place.
  std::deque<QueuedStepRecord> step_records_ ABSL_GUARDED_BY(step_records_mu_);
  // Taken and not yet confirmed or returned: their places, and their blocks.
  std::set<int64_t> step_records_on_way_ ABSL_GUARDED_BY(step_records_mu_);
  absl::flat_hash_set<int> blocks_on_way_ ABSL_GUARDED_BY(step_records_mu_);
  // How many records of each step are made and not confirmed.
  std::map<int64_t, int64_t> unconfirmed_steps_
      ABSL_GUARDED_BY(step_records_mu_);
  std::vector<std::vector<float>> spare_step_sums_
      ABSL_GUARDED_BY(step_records_mu_);
  std::atomic<int64_t> step_records_made_{0};
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SHARD_H_
