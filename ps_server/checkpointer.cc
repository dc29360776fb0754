#include "ps_server/checkpointer.h"

#include <cstdio>

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

}  // namespace

Checkpointer::Checkpointer(Shard* shard, int shard_id, int num_shards,
                           const CheckpointerOptions& options)
    : shard_(shard),
      shard_id_(shard_id),
      num_shards_(num_shards),
      options_(options),
      store_(options.dir, options.keep_last) {
  absl::MutexLock lock(&mu_);
  last_time_ = absl::Now();
}

Checkpointer::~Checkpointer() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<std::string> Checkpointer::Restore() {
  absl::StatusOr<RestoredShard> restored =
      store_.LoadForShard(shard_id_, num_shards_);
  if (absl::IsNotFound(restored.status())) return std::string();
  if (!restored.ok()) return restored.status();
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
  absl::MutexLock lock(&mu_);
  next_sequence_ = restored->next_sequence;
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
  absl::MutexLock lock(&mu_);
  const int64_t version = shard_->MinVersion();
  absl::StatusOr<ShardSnapshot> snapshot = shard_->Snapshot(next_sequence_);
  if (!snapshot.ok()) return snapshot.status();
  if (absl::Status s = store_.Write(*snapshot); !s.ok()) return s;
  const std::string path =
      absl::StrFormat("%s/shard-%d-of-%d/ckpt-%012d.pstrain", options_.dir,
                      shard_id_, num_shards_, next_sequence_);
  ++next_sequence_;
  last_version_ = version;
  last_time_ = absl::Now();
  return path;
}

void Checkpointer::Start() {
  if (options_.every_steps <= 0 && options_.every <= absl::ZeroDuration()) {
    return;
  }
  thread_ = std::thread([this] { Run(); });
}

void Checkpointer::Run() {
  while (!stop_.WaitForNotificationWithTimeout(kPoll)) {
    bool due = false;
    {
      absl::MutexLock lock(&mu_);
      const int64_t version = shard_->MinVersion();
      due = (options_.every_steps > 0 &&
             version >= last_version_ + options_.every_steps) ||
            (options_.every > absl::ZeroDuration() &&
             absl::Now() - last_time_ >= options_.every &&
             version != last_version_);
    }
    if (!due) continue;
    absl::StatusOr<std::string> path = CheckpointNow();
    if (path.ok()) {
      VLOG(1) << "checkpoint " << *path;
    } else if (!absl::IsFailedPrecondition(path.status())) {
      LOG(ERROR) << "checkpoint failed: " << path.status();
    }
  }
}

absl::Status Checkpointer::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
  absl::StatusOr<std::string> path = CheckpointNow();
  if (absl::IsFailedPrecondition(path.status())) return absl::OkStatus();
  if (!path.ok()) return path.status();
  LOG(INFO) << "final checkpoint " << *path;
  return absl::OkStatus();
}

}  // namespace pstrain
