// Drives a shard's checkpoints: restores the newest valid one at start-up,
// writes one every N completed steps (sync) or every T seconds, on request,
// and at shutdown. Writes happen on the checkpointer's own thread (or the
// caller's, for CheckpointNow), never on a request path.
//
// Failures (a full, read-only or vanished disk) never stop training. They are
// tried again with exponential backoff (1 s, doubling, capped at the larger
// of the checkpoint interval and 30 s), so a disk that stays full costs a
// handful of tries a minute, not one per poll. A try that was refused for
// lack of room (nothing written) is repeated as soon as statvfs shows room
// again, so a freed disk gets its checkpoint without waiting out the
// backoff. The log gets the first failure, one line per distinct error
// (with how long checkpoints have been failing and how many tries), a
// reminder every 10 minutes, and one line when they recover.
#ifndef PSTRAIN_PS_SERVER_CHECKPOINTER_H_
#define PSTRAIN_PS_SERVER_CHECKPOINTER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "proto/ps.pb.h"
#include "ps_server/checkpoint.h"
#include "ps_server/shard.h"

namespace pstrain {

struct CheckpointerOptions {
  std::string dir;  // shared by all shards of the job
  int keep_last = 3;
  // A checkpoint each time every block has completed this many more steps
  // (sync; 0: off).
  int64_t every_steps = 0;
  // A checkpoint at least this often (0: off), timed on a monotonic clock.
  absl::Duration every = absl::ZeroDuration();
  // Backoff after a failed periodic checkpoint: the first wait, doubling up
  // to max(interval, min_backoff_cap).
  absl::Duration first_backoff = absl::Seconds(1);
  absl::Duration min_backoff_cap = absl::Seconds(30);
};

// The failure reasons of CheckpointStats.failures and
// pstrain_checkpoint_failures_total{reason}.
const std::vector<std::string>& CheckpointFailureReasons();
// Which of them `status` (an error of CheckpointStore::Write) is.
std::string CheckpointFailureReason(const absl::Status& status);

class Checkpointer {
 public:
  Checkpointer(Shard* shard, int shard_id, int num_shards,
               const CheckpointerOptions& options);
  ~Checkpointer();  // stops the thread (no final checkpoint: see Stop)

  // Restores the shard from the newest valid checkpoint in the directory,
  // if there is one (reporting files skipped as corrupt). Returns a line
  // saying what was restored, or "" when the directory has none.
  absl::StatusOr<std::string> Restore();
  // Restore in two parts, for a replica that learns only from its peers
  // whether its own checkpoint is the state to hold (ps_server/replication.h,
  // "Catch-up"): LoadRestore reads the newest valid checkpoint (false: the
  // directory has none) and installs nothing; then InstallRestore installs
  // it (Restore's line; "" when none was read), or DiscardRestore drops it. The
  // files' numbering goes on from the one read either way, so that the newest
  // file is always the newest state this process held.
  absl::StatusOr<bool> LoadRestore();
  absl::StatusOr<std::string> InstallRestore();
  void DiscardRestore();

  // Whether the shard's state is one to save now (set before Start; unset:
  // always). A replica's is not while it catches up (half its state is in)
  // or once it is stale: a checkpoint then skips, as before a model.
  void set_holds_state(std::function<bool()> holds_state) {
    holds_state_ = std::move(holds_state);
  }

  // Starts the periodic checkpoints.
  void Start();
  // Stops them and writes a last checkpoint (if a model is registered).
  absl::Status Stop();

  // Writes a checkpoint now; returns its path. FailedPrecondition before a
  // model is registered.
  absl::StatusOr<std::string> CheckpointNow();

  // At the end of a job (CheckpointRequest.final_version): a checkpoint of
  // the shard's state at `final_version`, unless one already holds it: one
  // begun after this call, or one written for this final version with the
  // shard's version unchanged since. Every worker of the job asks once
  // nothing changes any more, so one file serves them all, not one each.
  // Returns its path; FailedPrecondition before a model is registered.
  absl::StatusOr<std::string> CheckpointFinalState(int64_t final_version);

  // For Stats and /metrics; never waits for a checkpoint being written.
  CheckpointStats Stats() const;

 private:
  using Clock = std::chrono::steady_clock;

  void Run();
  // A request for the job's final state (CheckpointFinalState).
  struct FinalAsk {
    Clock::time_point asked;
    int64_t final_version = 0;
  };
  // One try: a snapshot and its write. *no_model is set when there is
  // nothing to write yet (not a failure). With `final_ask`, a file that
  // already holds that final state is the answer (its path).
  absl::StatusOr<std::string> Attempt(
      bool* no_model, std::optional<FinalAsk> final_ask = std::nullopt);
  // Records a try's outcome in the stats and logs what the operator needs
  // to see (see the file comment).
  void Record(const absl::Status& status, const CheckpointWriteInfo& info,
              const std::string& path, Clock::duration took);
  // The backoff's cap: max(interval, min_backoff_cap).
  absl::Duration BackoffCap() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(stats_mu_);

  Shard* shard_;
  std::function<bool()> holds_state_;
  const int shard_id_, num_shards_;
  const CheckpointerOptions options_;
  CheckpointStore store_;

  absl::Mutex mu_;  // one write at a time
  int64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  // Read by LoadRestore, not installed yet.
  std::optional<RestoredShard> loaded_ ABSL_GUARDED_BY(mu_);
  int64_t last_version_ ABSL_GUARDED_BY(mu_) = -1;
  Clock::time_point last_time_ ABSL_GUARDED_BY(mu_);
  // The newest file written by this process, and when its write began.
  std::string last_path_ ABSL_GUARDED_BY(mu_);
  Clock::time_point last_write_began_ ABSL_GUARDED_BY(mu_);
  // The final version the newest file was written for (0: none), and the
  // shard's StateVersion when its snapshot was taken.
  int64_t last_final_version_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_state_version_ ABSL_GUARDED_BY(mu_) = -1;

  // What Stats() reports, and the failure streak; a separate lock so a
  // scrape does not wait behind a write of gigabytes.
  mutable absl::Mutex stats_mu_;
  CheckpointStats stats_ ABSL_GUARDED_BY(stats_mu_);
  Clock::time_point last_success_ ABSL_GUARDED_BY(stats_mu_);
  bool any_success_ ABSL_GUARDED_BY(stats_mu_) = false;
  Clock::duration interval_ ABSL_GUARDED_BY(stats_mu_) = Clock::duration(0);
  // The current failure streak (failing_tries > 0 in stats_).
  Clock::time_point failing_since_ ABSL_GUARDED_BY(stats_mu_);
  Clock::time_point last_failure_log_ ABSL_GUARDED_BY(stats_mu_);
  std::string last_logged_error_ ABSL_GUARDED_BY(stats_mu_);
  // The last try was refused for want of this many bytes (0: it was not).
  int64_t needed_bytes_ ABSL_GUARDED_BY(stats_mu_) = 0;
  // ... when the free space was this.
  int64_t free_at_failure_ ABSL_GUARDED_BY(stats_mu_) = 0;

  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_CHECKPOINTER_H_
