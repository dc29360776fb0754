// Drives a shard's checkpoints: restores the newest valid one at start-up,
// writes one every N completed steps (sync) or every T seconds, on request,
// and at shutdown. Writes happen on the checkpointer's own thread (or the
// caller's, for CheckpointNow), never on a request path.
#ifndef PSTRAIN_PS_SERVER_CHECKPOINTER_H_
#define PSTRAIN_PS_SERVER_CHECKPOINTER_H_

#include <cstdint>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "ps_server/checkpoint.h"
#include "ps_server/shard.h"

namespace pstrain {

struct CheckpointerOptions {
  std::string dir;  // shared by all shards of the job
  int keep_last = 3;
  // A checkpoint each time every block has completed this many more steps
  // (sync; 0: off).
  int64_t every_steps = 0;
  // A checkpoint at least this often (0: off).
  absl::Duration every = absl::ZeroDuration();
};

class Checkpointer {
 public:
  Checkpointer(Shard* shard, int shard_id, int num_shards,
               const CheckpointerOptions& options);
  ~Checkpointer();  // stops the thread (no final checkpoint: see Stop)

  // Restores the shard from the newest valid checkpoint in the directory,
  // if there is one (reporting files skipped as corrupt). Returns a line
  // saying what was restored, or "" when the directory has none.
  absl::StatusOr<std::string> Restore();

  // Starts the periodic checkpoints.
  void Start();
  // Stops them and writes a last checkpoint (if a model is registered).
  absl::Status Stop();

  // Writes a checkpoint now; returns its path.
  absl::StatusOr<std::string> CheckpointNow();

 private:
  void Run();

  Shard* shard_;
  const int shard_id_, num_shards_;
  const CheckpointerOptions options_;
  CheckpointStore store_;

  absl::Mutex mu_;  // one write at a time
  int64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_version_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time last_time_ ABSL_GUARDED_BY(mu_);

  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_CHECKPOINTER_H_
