// Shard checkpoints: atomic, checksummed files of a shard's blocks, and a
// restore that works for any number of shards.
//
// Directory layout (`dir` is shared by every shard of a job; on a cluster a
// shared filesystem):
//   <dir>/shard-<i>-of-<n>/ckpt-<sequence, 12 digits>.pstrain
// Names are canonical (no leading zeros in i and n); anything else in `dir`,
// including temporary files of a write in progress or of one that crashed,
// is ignored by restore.
//
// File format (all integers little-endian):
//   offset 0   8 bytes   magic "PSCKPT01"
//   offset 8   uint64    H, the length of the header
//   offset 16  H bytes   serialized CheckpointHeader (proto/checkpoint.proto):
//                        schema, mode, optimizer, shard_id, num_shards,
//                        sequence, and per block {global_block, version,
//                        value_count, state_count, last_step}
//   then, for each block in header order: value_count float32 values, then
//                        state_count float32 optimizer state (IEEE-754
//                        binary32, little-endian)
//   then, for each sparse table in header order (CheckpointSparseTable):
//                        row_count uint64 ids, row_count int64 update counts,
//                        row_count * value_floats values, row_count *
//                        state_floats state
//   last 8 bytes         uint32 CRC-32 (zlib crc32) of every byte before the
//                        trailer, then the 4-byte magic "END1"
// The file size is therefore exactly 24 + H + 4 * sum(value_count +
// state_count) + sum(row_count * (16 + 4 * (value_floats + state_floats)));
// a reader checks that before it allocates anything, so a
// truncated or corrupt file can neither crash it nor make it allocate more
// than the file's size. The payloads stay outside the proto so a large shard
// is streamed to disk through a small buffer instead of being copied into a
// message (and is not bound by protobuf's 2 GiB limit).
//
// A file is valid when its magic, trailer, lengths and CRC check out, its
// header parses, and the header is consistent with itself and with the file
// name: shard and layout match its directory, sequence matches its name, the
// schema passes ValidateSchema, and every block is a block of that schema
// owned by that shard (g % n == i), listed once, with value_count equal to
// the block's length and state_count a multiple of it. Whether a file holds
// *every* block its shard owns is checked by LoadForShard, not here: a file
// that is intact but incomplete is a writer's bug, reported as
// FailedPrecondition instead of being silently replaced by an older file.
#ifndef PSTRAIN_PS_SERVER_CHECKPOINT_H_
#define PSTRAIN_PS_SERVER_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/ps.pb.h"

namespace pstrain {

// One block of a shard as saved. Blocks are identified by their global index
// in Partition::Create(schema, num_shards).blocks(), which is the same for
// every shard count: that is what makes restoring into a different shard
// count work.
struct BlockSnapshot {
  int64_t global_block = 0;
  int64_t version = 0;                 // updates applied
  std::vector<float> value;            // the block's parameters
  std::vector<float> optimizer_state;  // state_per_element * length floats
  // Async de-duplication: the last step applied, per worker; may be empty.
  std::vector<int64_t> last_step;
};

// The rows of one sparse table that a shard holds (columns, row i at index
// i of each).
struct SparseTableSnapshot {
  std::string name;
  int64_t version = 0;       // sync steps completed
  int64_t dim = 0;           // value floats per row
  int64_t state_floats = 0;  // optimizer state floats per row
  std::vector<uint64_t> ids;
  std::vector<int64_t> update_counts;
  std::vector<float> values;  // ids.size() * dim
  std::vector<float> states;  // ids.size() * state_floats
};

struct ShardSnapshot {
  ModelSchema schema;     // from proto/ps.proto
  std::string mode;       // "sync" | "async" | "ssp"
  std::string optimizer;  // "sgd" | "momentum" | "adam"
  int shard_id = 0;
  int num_shards = 1;
  // Increases with every checkpoint of this shard: in [0, 10^12), and
  // greater than the sequence of every file the shard already has (Write
  // refuses anything else, since a smaller one would sort as older and be
  // pruned or passed over by restore).
  int64_t sequence = 0;
  // Exactly the blocks shard_id owns (global block g with g % num_shards ==
  // shard_id), in increasing global order.
  std::vector<BlockSnapshot> blocks;
  // One per sparse table of the schema, in schema order: the rows this
  // shard holds.
  std::vector<SparseTableSnapshot> sparse;
};

struct RestoredShard {
  ModelSchema schema;
  std::string mode, optimizer;
  int old_num_shards = 0;  // the layout it was restored from
  // One more than the largest sequence of any checkpoint file in `dir`, of
  // any layout (and so of the new one): the first sequence the new shard
  // should write. Every shard of the new layout computes the same value when
  // they restore from the same directory state.
  int64_t next_sequence = 0;
  // Exactly the blocks the new shard owns, in increasing global order.
  std::vector<BlockSnapshot> blocks;
  // Per sparse table in schema order, the saved rows the new shard owns
  // (SparseShardOf); version: the smallest of the old shards'. Empty when
  // the files predate sparse checkpoints (the tables then start afresh).
  std::vector<SparseTableSnapshot> sparse;
  // Paths of the files restored from, one per old shard, in old shard order.
  std::vector<std::string> files_used;
  // "<path>: <reason>" for every file found corrupt, truncated or unreadable
  // while looking (of any layout that was examined).
  std::vector<std::string> files_skipped;
};

// What one CheckpointStore::Write did, for the checkpointer's metrics and
// its decisions about when to try again.
struct CheckpointWriteInfo {
  int64_t bytes = 0;        // the file's size (written, or that it would be)
  int64_t free_bytes = -1;  // free space seen before writing (-1: unknown)
  bool no_room = false;     // not started: it would not fit (statvfs)
  bool written = false;     // the file is complete, verified and durable
};

class CheckpointStore {
 public:
  // `dir` is shared by all shards of a job. `keep_last` >= 1 is how many of
  // its newest files each shard keeps; keep_last <= 0 keeps every file.
  CheckpointStore(std::string dir, int keep_last);

  // Atomically writes <dir>/shard-<i>-of-<n>/ckpt-<sequence>.pstrain: a
  // temporary file in the same directory is written through a buffer,
  // fsync'ed, renamed over the final name, and the directory fsync'ed, so a
  // crash leaves either the whole new file or none of it. Directories are
  // created as needed. Before writing, leftover temporary files of this
  // shard (a crashed earlier write) are removed; after it, this shard's files
  // beyond the newest keep_last are deleted (a failure to delete is only
  // logged: the new checkpoint is already durable). Other shards' files are
  // never touched.
  //
  // Full disks: before anything is written, the file's exact size is
  // compared with the free space (statvfs); if it does not fit, this shard's
  // files that the write would prune anyway go first (never the newest),
  // and if it still does not fit, the write is not started
  // (ResourceExhausted naming both sizes, info->no_room). A write that fails
  // part way removes its temporary file. After the rename the file's size
  // and trailer are checked against what was written; only then are older
  // files pruned, so the last good checkpoint is never deleted before a
  // newer one is complete and verified.
  //
  // InvalidArgument for a snapshot that could not be restored (bad schema,
  // shard, sequence or blocks); FailedPrecondition when the sequence is not
  // greater than that of the shard's newest file; an I/O error names the path
  // and the errno text; DataLoss when the written file does not verify (it
  // is removed). Calls for the same shard must not overlap (one writer per
  // shard, as in the server); calls for different shards may.
  absl::Status Write(const ShardSnapshot& snapshot,
                     CheckpointWriteInfo* info = nullptr);

  // Restores the blocks that shard `shard_id` of `num_shards` owns (global
  // block g is owned by shard g % num_shards) from the newest valid
  // checkpoint of EACH old shard of one layout (shard-*-of-N).
  //
  // Layout choice: N == num_shards when every one of its shards has a valid
  // file, even if another layout has newer files (logged as a warning);
  // otherwise the complete layout whose newest checkpoint file has the
  // newest mtime (ties: larger sequence, then larger N). A shard's files are
  // tried newest sequence first; an invalid one is LOG(WARNING)ed, listed in
  // files_skipped with the reason, and the shard's previous file is tried.
  //
  // InvalidArgument for a bad shard_id/num_shards; NotFound when `dir` has no
  // checkpoint file at all; DataLoss when no layout is complete, naming each
  // layout's first shard without a valid file; FailedPrecondition when the
  // chosen files disagree on schema/mode/optimizer (naming both files and the
  // difference), or when they do not hold every block the new shard owns
  // (naming the first missing block and the file that should have held it).
  absl::StatusOr<RestoredShard> LoadForShard(int shard_id,
                                             int num_shards) const;

  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  int keep_last_;
};

// Checks at start-up that checkpoints can be written to `dir`: creates it
// (and its parents) if missing, then creates and removes an empty probe
// file there (a full disk passes: see Checkpointer's backoff). The error names
// the directory and the reason ("Read-only file system", "Not a directory",
// ...), so a server can refuse to start instead of failing every checkpoint of
// the job.
absl::Status ProbeCheckpointDir(const std::string& dir);

// This process's hold on shard `shard_id`'s checkpoints in a directory: an
// exclusive flock on <dir>/shard-<shard_id>.lock, which says who holds it
// (pid, host, since when). The kernel drops it when the process ends, however
// it ends (kill -9 included), so only a live process holds it. Two jobs
// pointed at one directory, or two servers given the same shard, would
// interleave their files and the next restore would pick the other's
// newest: the second is refused at start instead.
class CheckpointDirLock {
 public:
  // Takes the lock, waiting up to `wait` for a holder to let go (a server
  // of the shard that is still writing its last checkpoint on SIGTERM while
  // its replacement starts). FailedPrecondition naming the holder when it
  // still holds it then.
  static absl::StatusOr<std::unique_ptr<CheckpointDirLock>> Acquire(
      const std::string& dir, int shard_id, absl::Duration wait);
  ~CheckpointDirLock();
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;

 private:
  explicit CheckpointDirLock(int fd) : fd_(fd) {}
  const int fd_;
};

// Free bytes for an unprivileged writer on the filesystem holding `dir`.
absl::StatusOr<int64_t> CheckpointFreeBytes(const std::string& dir);

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_CHECKPOINT_H_
