#include "ps_server/checkpointer.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "glog/logging.h"

namespace pstrain {
namespace {

// How often the thread looks at the shard's progress. A sync checkpoint is
// taken about this late after its step completes: short next to a step, so
// that a crash loses few steps beyond the checkpoint interval (the look is
// one atomic load per block).
constexpr absl::Duration kPoll = absl::Milliseconds(2);
// While a try refused for want of room waits out its backoff, how often
// statvfs is asked whether the room is back (one syscall).
constexpr auto kSpaceCheck = std::chrono::milliseconds(100);
// A failure streak that stays on one error is logged again this often, so
// a log that starts later (rotated) still says checkpoints are failing.
constexpr auto kFailureReminder = std::chrono::minutes(10);

std::string Age(std::chrono::steady_clock::duration d) {
  const absl::Duration duration = absl::FromChrono(d);
  return absl::FormatDuration(absl::Trunc(duration, duration < absl::Seconds(1)
                                                        ? absl::Milliseconds(1)
                                                        : absl::Seconds(1)));
}

// Two errors are the same for the log when they differ only in numbers
// (sequence numbers and pids in paths, free bytes).
std::string ErrorKey(const std::string& reason, const absl::Status& status) {
  std::string key = reason;
  for (char c : status.message()) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) key += c;
  }
  return key;
}

}  // namespace

const std::vector<std::string>& CheckpointFailureReasons() {
  static const auto* reasons = new std::vector<std::string>{
      "no_space", "read_only", "permission", "verify", "io"};
  return *reasons;
}

std::string CheckpointFailureReason(const absl::Status& status) {
  if (absl::StrContains(status.message(), std::strerror(EROFS))) {
    return "read_only";
  }
  if (absl::IsResourceExhausted(status)) return "no_space";
  if (absl::IsPermissionDenied(status)) return "permission";
  if (absl::IsDataLoss(status)) return "verify";
  return "io";
}

Checkpointer::Checkpointer(Shard* shard, int shard_id, int num_shards,
                           const CheckpointerOptions& options)
    : shard_(shard),
      shard_id_(shard_id),
      num_shards_(num_shards),
      options_(options),
      store_(options.dir, options.keep_last) {
  absl::MutexLock lock(&mu_);
  last_time_ = Clock::now();
}

Checkpointer::~Checkpointer() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<std::string> Checkpointer::Restore() {
  absl::StatusOr<bool> loaded = LoadRestore();
  if (!loaded.ok()) return loaded.status();
  if (!*loaded) return std::string();
  return InstallRestore();
}

absl::StatusOr<bool> Checkpointer::LoadRestore() {
  absl::StatusOr<RestoredShard> restored =
      store_.LoadForShard(shard_id_, num_shards_);
  if (absl::IsNotFound(restored.status())) {
    LOG(INFO) << restored.status().message();
    return false;
  }
  if (!restored.ok()) return restored.status();
  absl::MutexLock lock(&mu_);
  next_sequence_ = restored->next_sequence;
  loaded_ = std::move(*restored);
  return true;
}

void Checkpointer::DiscardRestore() {
  absl::MutexLock lock(&mu_);
  if (!loaded_.has_value()) return;
  LOG(INFO) << "the checkpoint read from "
            << absl::StrJoin(loaded_->files_used, ", ")
            << " is not installed: a running replica holds newer state";
  loaded_.reset();
}

absl::StatusOr<std::string> Checkpointer::InstallRestore() {
  std::optional<RestoredShard> restored;
  {
    absl::MutexLock lock(&mu_);
    restored.swap(loaded_);
  }
  if (!restored.has_value()) return std::string();
  if (absl::Status s = shard_->Restore(*restored); !s.ok()) return s;
  int64_t min_version = INT64_MAX, max_version = 0;
  for (const BlockSnapshot& block : restored->blocks) {
    min_version = std::min(min_version, block.version);
    max_version = std::max(max_version, block.version);
  }
  if (restored->blocks.empty()) min_version = 0;
  size_t sparse_rows = 0;
  for (const SparseTableSnapshot& table : restored->sparse) {
    sparse_rows += table.ids.size();
  }
  {
    // The restored files are the newest good checkpoint until this shard
    // writes one.
    double newest_mtime_s = 0;
    for (const std::string& path : restored->files_used) {
      struct stat st;
      if (::stat(path.c_str(), &st) == 0) {
        newest_mtime_s = std::max(
            newest_mtime_s, st.st_mtim.tv_sec + st.st_mtim.tv_nsec * 1e-9);
      }
    }
    absl::MutexLock lock(&stats_mu_);
    stats_.set_last_success_unix_s(newest_mtime_s);
  }
  absl::MutexLock lock(&mu_);
  last_version_ = min_version;
  return absl::StrCat(
      "restored ", restored->blocks.size(), " blocks at step ", min_version,
      min_version == max_version ? "" : absl::StrCat("..", max_version),
      restored->sparse.empty()
          ? ""
          : absl::StrCat(" and ", sparse_rows, " rows of ",
                         restored->sparse.size(), " sparse table(s)"),
      " from ", absl::StrJoin(restored->files_used, ", "),
      restored->old_num_shards == num_shards_
          ? ""
          : absl::StrCat(" (resharded from ", restored->old_num_shards,
                         " shards)"),
      restored->files_skipped.empty()
          ? ""
          : absl::StrCat("; skipped ", restored->files_skipped.size(),
                         " invalid file(s)"));
}

absl::StatusOr<std::string> Checkpointer::CheckpointNow() {
  bool no_model = false;
  return Attempt(&no_model);
}

absl::StatusOr<std::string> Checkpointer::CheckpointFinalState(
    int64_t final_version) {
  bool no_model = false;
  return Attempt(&no_model, FinalAsk{Clock::now(), final_version});
}

absl::StatusOr<std::string> Checkpointer::Attempt(
    bool* no_model, std::optional<FinalAsk> final_ask) {
  absl::MutexLock lock(&mu_);
  const int64_t state_version = shard_->StateVersion();
  if (final_ask.has_value() && !last_path_.empty() &&
      (last_write_began_ >= final_ask->asked ||
       (last_final_version_ >= final_ask->final_version &&
        last_state_version_ == state_version))) {
    return last_path_;
  }
  if (holds_state_ && !holds_state_()) {
    *no_model = true;
    return absl::FailedPreconditionError(
        "this replica holds no state to save now (catching up, or stale)");
  }
  const Clock::time_point start = Clock::now();
  const int64_t version = shard_->MinVersion();
  absl::StatusOr<ShardSnapshot> snapshot = shard_->Snapshot(next_sequence_);
  if (!snapshot.ok()) {
    // FailedPrecondition: no model yet, nothing to save (not a failure).
    *no_model = absl::IsFailedPrecondition(snapshot.status());
    if (!*no_model) {
      Record(snapshot.status(), CheckpointWriteInfo(), "",
             Clock::now() - start);
    }
    return snapshot.status();
  }
  const std::string path =
      absl::StrFormat("%s/shard-%d-of-%d/ckpt-%012d.pstrain", options_.dir,
                      shard_id_, num_shards_, next_sequence_);
  CheckpointWriteInfo info;
  const absl::Status status = store_.Write(*snapshot, &info);
  snapshot = absl::UnknownError("released");  // the copy's memory, now
  if (status.ok()) {
    ++next_sequence_;
    last_version_ = version;
    last_time_ = Clock::now();
    last_path_ = path;
    last_write_began_ = start;
    last_final_version_ = final_ask.has_value() ? final_ask->final_version : 0;
    last_state_version_ = state_version;
  }
  Record(status, info, path, Clock::now() - start);
  if (!status.ok()) return status;
  return path;
}

void Checkpointer::Record(const absl::Status& status,
                          const CheckpointWriteInfo& info,
                          const std::string& path, Clock::duration took) {
  absl::MutexLock lock(&stats_mu_);
  const Clock::time_point now = Clock::now();
  const double took_s = std::chrono::duration<double>(took).count();
  if (status.ok()) {
    stats_.set_written(stats_.written() + 1);
    stats_.set_bytes_written(stats_.bytes_written() + info.bytes);
    stats_.set_last_success_unix_s(
        absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
    stats_.set_last_duration_s(took_s);
    stats_.set_last_bytes(info.bytes);
    stats_.set_duration_total_s(stats_.duration_total_s() + took_s);
    if (any_success_) interval_ = now - last_success_;
    any_success_ = true;
    last_success_ = now;
    if (stats_.failing_tries() > 0) {
      LOG(WARNING) << "checkpoints recovered after failing for "
                   << Age(now - failing_since_) << " ("
                   << stats_.failing_tries() << " failed tries): wrote "
                   << path;
    } else {
      VLOG(1) << "checkpoint " << path << " (" << info.bytes << " bytes in "
              << Age(took) << ")";
    }
    stats_.set_failing_tries(0);
    stats_.clear_last_error();
    needed_bytes_ = 0;
    last_logged_error_.clear();
    return;
  }
  const std::string reason = CheckpointFailureReason(status);
  (*stats_.mutable_failures())[reason] += 1;
  stats_.set_last_error(status.ToString());
  needed_bytes_ = info.no_room ? info.bytes : 0;
  free_at_failure_ = info.free_bytes;
  const std::string key = ErrorKey(reason, status);
  const int64_t tries = stats_.failing_tries() + 1;
  stats_.set_failing_tries(tries);
  if (tries == 1) {
    failing_since_ = now;
    LOG(ERROR) << "checkpoint failed: " << status
               << " (training goes on; retrying with backoff, at most every "
               << absl::FormatDuration(BackoffCap()) << ")";
  } else if (key != last_logged_error_ ||
             now - last_failure_log_ >= kFailureReminder) {
    LOG(ERROR) << "checkpoints failing for " << Age(now - failing_since_)
               << ": " << status << " (" << tries << " tries)";
  } else {
    return;
  }
  last_failure_log_ = now;
  last_logged_error_ = key;
}

absl::Duration Checkpointer::BackoffCap() const {
  absl::Duration interval = options_.every;
  if (interval <= absl::ZeroDuration()) {
    // Steps alone: the measured time between checkpoints stands in.
    interval = absl::FromChrono(interval_);
  }
  return std::max(interval, options_.min_backoff_cap);
}

CheckpointStats Checkpointer::Stats() const {
  absl::MutexLock lock(&stats_mu_);
  CheckpointStats stats = stats_;
  stats.set_enabled(true);
  for (const std::string& reason : CheckpointFailureReasons()) {
    (*stats.mutable_failures())[reason] += 0;  // every reason listed
  }
  if (stats.failing_tries() > 0) {
    stats.set_failing_s(
        std::chrono::duration<double>(Clock::now() - failing_since_).count());
  }
  if (options_.every > absl::ZeroDuration()) {
    stats.set_interval_s(absl::ToDoubleSeconds(options_.every));
  } else if (options_.every_steps > 0) {
    stats.set_interval_s(std::chrono::duration<double>(interval_).count());
  }
  return stats;
}

void Checkpointer::Start() {
  if (options_.every_steps <= 0 && options_.every <= absl::ZeroDuration()) {
    return;
  }
  thread_ = std::thread([this] { Run(); });
}

void Checkpointer::Run() {
  // Backoff state: zero while the last try did not fail.
  absl::Duration backoff = absl::ZeroDuration();
  Clock::time_point next_try, next_space_check;
  while (!stop_.WaitForNotificationWithTimeout(kPoll)) {
    const Clock::time_point now = Clock::now();
    bool due = false;
    {
      absl::MutexLock lock(&mu_);
      const int64_t version = shard_->MinVersion();
      due = (options_.every_steps > 0 &&
             version >= last_version_ + options_.every_steps) ||
            (options_.every > absl::ZeroDuration() &&
             now - last_time_ >= absl::ToChronoNanoseconds(options_.every) &&
             version != last_version_);
    }
    if (!due) continue;
    if (backoff > absl::ZeroDuration() && now < next_try) {
      // A try refused for want of room goes again as soon as there is room,
      // not when the backoff ends: the disk being freed is the operator's
      // fix, and its checkpoint should follow within a poll.
      int64_t needed = 0, free_then = 0;
      bool failing = true;
      {
        absl::MutexLock lock(&stats_mu_);
        needed = needed_bytes_;
        free_then = free_at_failure_;
        failing = stats_.failing_tries() > 0;
      }
      if (!failing) {
        // A checkpoint on request (the Checkpoint RPC) succeeded meanwhile:
        // the streak is over, and so is its backoff.
        backoff = absl::ZeroDuration();
      } else if (needed <= 0 || now < next_space_check) {
        continue;
      }
      if (failing) {
        next_space_check = now + kSpaceCheck;
        absl::StatusOr<int64_t> free_bytes = CheckpointFreeBytes(options_.dir);
        // Only room that grew since the refusal: should the write still
        // find too little (another filesystem under the shard's
        // directory), this does not become a retry loop.
        if (!free_bytes.ok() || *free_bytes < needed ||
            *free_bytes <= free_then) {
          continue;
        }
      }
    }
    bool no_model = false;
    absl::StatusOr<std::string> path = Attempt(&no_model);
    if (path.ok() || no_model) {
      backoff = absl::ZeroDuration();
      continue;
    }
    absl::Duration cap;
    {
      absl::MutexLock lock(&stats_mu_);
      cap = BackoffCap();
    }
    backoff = backoff == absl::ZeroDuration() ? options_.first_backoff
                                              : std::min(2 * backoff, cap);
    next_try = Clock::now() + absl::ToChronoNanoseconds(backoff);
  }
}

absl::Status Checkpointer::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
  bool no_model = false;
  absl::StatusOr<std::string> path = Attempt(&no_model);
  if (no_model) return absl::OkStatus();
  if (!path.ok()) return path.status();
  LOG(INFO) << "final checkpoint " << *path;
  return absl::OkStatus();
}

}  // namespace pstrain
