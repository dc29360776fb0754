// Writing a shard's checkpoint: the snapshot checked, the file written
// through a temporary one, verified, renamed into place and the old ones
// pruned (CheckpointStore::Write); the directory probe at start.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/partition.h"
#include "common/status_text.h"
#include "glog/logging.h"
#include "proto/checkpoint.pb.h"
#include "ps_server/checkpoint.h"
#include "ps_server/checkpoint_format.h"

namespace pstrain {

using namespace checkpoint_internal;  // NOLINT: this file's own format

namespace {

// ---------------------------------------------------------------------------
// Writing.

// Buffers small writes, passes large payloads straight to the file, and
// keeps the running CRC-32, so a shard is written without an in-memory copy
// of its payloads.
class CrcFileWriter {
 public:
  CrcFileWriter(int fd, std::string path)
      : fd_(fd),
        path_(std::move(path)),
        buffer_(new char[kBufferBytes]),
        crc_(crc32_z(0L, Z_NULL, 0)) {}

  absl::Status Append(const void* data, size_t n) {
    // zlib's crc32_z(crc, NULL, 0) returns 0, not crc: an empty vector's
    // data() may be null (SGD has no optimizer state), so skip empty runs.
    if (n == 0) return absl::OkStatus();
    const char* p = static_cast<const char*>(data);
    crc_ = crc32_z(crc_, reinterpret_cast<const Bytef*>(p), n);
    return AppendUnchecksummed(p, n);
  }

  absl::Status AppendFloats(const std::vector<float>& values) {
#if defined(ABSL_IS_BIG_ENDIAN)
    // Converts through a bounded scratch buffer, never the whole payload.
    std::vector<float> chunk;
    for (size_t i = 0; i < values.size(); i += kBufferBytes / 4) {
      const size_t n = std::min(values.size() - i, kBufferBytes / 4);
      chunk.assign(values.begin() + i, values.begin() + i + n);
      ByteSwapFloats(chunk.data(), n);
      if (absl::Status s = Append(chunk.data(), n * 4); !s.ok()) return s;
    }
    return absl::OkStatus();
#else
    return Append(values.data(), values.size() * sizeof(float));
#endif
  }

  // 64-bit integers, little-endian.
  template <typename Int64>
  absl::Status AppendWords(const std::vector<Int64>& values) {
    static_assert(sizeof(Int64) == 8);
#if defined(ABSL_IS_BIG_ENDIAN)
    std::vector<char> chunk(kBufferBytes);
    for (size_t i = 0; i < values.size(); i += kBufferBytes / 8) {
      const size_t n = std::min(values.size() - i, kBufferBytes / 8);
      for (size_t k = 0; k < n; ++k) {
        PutLE64(static_cast<uint64_t>(values[i + k]), chunk.data() + 8 * k);
      }
      if (absl::Status s = Append(chunk.data(), n * 8); !s.ok()) return s;
    }
    return absl::OkStatus();
#else
    return Append(values.data(), values.size() * 8);
#endif
  }

  // The trailer itself is outside the checksum.
  absl::Status AppendTrailer() {
    char trailer[kTrailerBytes];
    PutLE32(static_cast<uint32_t>(crc_), trailer);
    std::memcpy(trailer + 4, kEndMagic.data(), kEndMagic.size());
    return AppendUnchecksummed(trailer, sizeof(trailer));
  }

  uint32_t crc() const { return static_cast<uint32_t>(crc_); }

  absl::Status Flush() {
    absl::Status s = WriteAll(fd_, buffer_.get(), used_, path_);
    used_ = 0;
    return s;
  }

 private:
  absl::Status AppendUnchecksummed(const char* p, size_t n) {
    if (used_ + n <= kBufferBytes) {
      std::memcpy(buffer_.get() + used_, p, n);
      used_ += n;
      return absl::OkStatus();
    }
    if (absl::Status s = Flush(); !s.ok()) return s;
    if (n >= kBufferBytes) return WriteAll(fd_, p, n, path_);
    std::memcpy(buffer_.get(), p, n);
    used_ = n;
    return absl::OkStatus();
  }

  const int fd_;
  const std::string path_;
  std::unique_ptr<char[]> buffer_;
  size_t used_ = 0;
  uLong crc_;
};

// Refuses a snapshot that LoadForShard could not restore, so a bad one fails
// loudly at the writer instead of at the next restart.
absl::Status ValidateSnapshot(const ShardSnapshot& s) {
  if (s.num_shards < 1 || s.shard_id < 0 || s.shard_id >= s.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint of shard ", s.shard_id, " of ", s.num_shards,
                     ": need 0 <= shard_id < num_shards"));
  }
  const std::string who =
      absl::StrCat("checkpoint of shard ", s.shard_id, " of ", s.num_shards);
  if (s.sequence < 0 || s.sequence > kMaxSequence) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": sequence ", s.sequence, " is outside [0, ", kMaxSequence, "]"));
  }
  if (s.mode.empty() || s.optimizer.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": mode and optimizer must be set"));
  }
  if (absl::Status st = ValidateSchema(s.schema); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": bad schema: ", st.message()));
  }
  const BlockGeometry geometry(s.schema);
  const int64_t owned =
      BlocksOnShard(geometry.num_blocks(), s.shard_id, s.num_shards);
  if (static_cast<int64_t>(s.blocks.size()) != owned) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": has ", s.blocks.size(), " blocks, the shard owns ", owned));
  }
  std::vector<int64_t> state_per_element(s.schema.dense_size(), -1);
  for (size_t k = 0; k < s.blocks.size(); ++k) {
    const BlockSnapshot& b = s.blocks[k];
    const int64_t expected =
        s.shard_id + static_cast<int64_t>(k) * s.num_shards;
    if (b.global_block != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": block ", k, " is global block ", b.global_block,
                       ", expected ", expected,
                       " (blocks must be the shard's own, in global order)"));
    }
    const int64_t length = geometry.Length(expected);
    const std::string where =
        absl::StrCat(who, ": ", geometry.Describe(expected));
    if (b.version < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": negative version ", b.version));
    }
    if (static_cast<int64_t>(b.value.size()) != length) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", b.value.size(), " values, the block has ", length));
    }
    // One optimizer per tensor, not per shard: tensors may have their own,
    // and BatchNorm's statistics (role STATE) have none.
    const int64_t state = static_cast<int64_t>(b.optimizer_state.size());
    int64_t& tensor_state = state_per_element[geometry.TensorOf(expected)];
    if (state % length != 0 ||
        (tensor_state >= 0 && state / length != tensor_state)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", state, " optimizer state floats for ", length,
          " elements (must be the same multiple for every block of a "
          "tensor)"));
    }
    tensor_state = state / length;
  }
  if (!s.sparse.empty() &&
      static_cast<int>(s.sparse.size()) != s.schema.sparse_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", s.sparse.size(), " sparse tables, the schema has ",
        s.schema.sparse_size()));
  }
  for (size_t t = 0; t < s.sparse.size(); ++t) {
    const SparseTableSnapshot& table = s.sparse[t];
    const SparseTableSpec& spec = s.schema.sparse(static_cast<int>(t));
    const std::string where = absl::StrCat(who, ": sparse table ", t, " ",
                                           QuoteForStatus(table.name));
    const size_t rows = table.ids.size();
    if (table.name != spec.name() || table.dim != spec.dim() ||
        table.version < 0 || table.state_floats < 0 ||
        table.update_counts.size() != rows ||
        table.values.size() != rows * table.dim ||
        table.states.size() != rows * table.state_floats) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": inconsistent with the schema's ",
          QuoteForStatus(spec.name()), " (dim ", spec.dim(),
          ") or with itself (", rows, " ids, ", table.update_counts.size(),
          " update counts, ", table.values.size(), " values, ",
          table.states.size(), " state floats)"));
    }
  }
  return absl::OkStatus();
}

CheckpointHeader MakeHeader(const ShardSnapshot& s) {
  CheckpointHeader header;
  *header.mutable_schema() = s.schema;
  header.set_mode(s.mode);
  header.set_optimizer(s.optimizer);
  header.set_shard_id(s.shard_id);
  header.set_num_shards(s.num_shards);
  header.set_sequence(s.sequence);
  for (const BlockSnapshot& b : s.blocks) {
    CheckpointBlock* hb = header.add_blocks();
    hb->set_global_block(b.global_block);
    hb->set_version(b.version);
    hb->set_value_count(static_cast<int64_t>(b.value.size()));
    hb->set_state_count(static_cast<int64_t>(b.optimizer_state.size()));
    hb->mutable_last_step()->Add(b.last_step.begin(), b.last_step.end());
  }
  for (const SparseTableSnapshot& t : s.sparse) {
    CheckpointSparseTable* ht = header.add_sparse();
    ht->set_name(t.name);
    ht->set_version(t.version);
    ht->set_row_count(static_cast<int64_t>(t.ids.size()));
    ht->set_value_floats(t.dim);
    ht->set_state_floats(t.state_floats);
  }
  return header;
}

// The size of the file WriteCheckpointFile writes for `s`, whose header
// serializes to `header_bytes` (see the format in checkpoint.h).
int64_t FileBytes(const ShardSnapshot& s, int64_t header_bytes) {
  int64_t bytes = kPreambleBytes + header_bytes + kTrailerBytes;
  for (const BlockSnapshot& b : s.blocks) {
    bytes +=
        4 * static_cast<int64_t>(b.value.size() + b.optimizer_state.size());
  }
  for (const SparseTableSnapshot& t : s.sparse) {
    bytes += 8 * static_cast<int64_t>(t.ids.size() + t.update_counts.size()) +
             4 * static_cast<int64_t>(t.values.size() + t.states.size());
  }
  return bytes;
}

// Writes the file for `s` to `fd`; *crc is the CRC-32 its trailer holds.
absl::Status WriteCheckpointFile(const ShardSnapshot& s,
                                 const CheckpointHeader& header, int fd,
                                 const std::string& path, uint32_t* crc) {
  std::string serialized;
  if (!header.SerializeToString(&serialized)) {
    return absl::InternalError(
        absl::StrCat("cannot serialize the checkpoint header for ", path));
  }

  CrcFileWriter writer(fd, path);
  char preamble[kPreambleBytes];
  std::memcpy(preamble, kMagic.data(), kMagic.size());
  PutLE64(serialized.size(), preamble + 8);
  if (absl::Status st = writer.Append(preamble, sizeof(preamble)); !st.ok()) {
    return st;
  }
  if (absl::Status st = writer.Append(serialized.data(), serialized.size());
      !st.ok()) {
    return st;
  }
  for (const BlockSnapshot& b : s.blocks) {
    if (absl::Status st = writer.AppendFloats(b.value); !st.ok()) return st;
    if (absl::Status st = writer.AppendFloats(b.optimizer_state); !st.ok()) {
      return st;
    }
  }
  for (const SparseTableSnapshot& t : s.sparse) {
    for (absl::Status st :
         {writer.AppendWords(t.ids), writer.AppendWords(t.update_counts),
          writer.AppendFloats(t.values), writer.AppendFloats(t.states)}) {
      if (!st.ok()) return st;
    }
  }
  *crc = writer.crc();
  if (absl::Status st = writer.AppendTrailer(); !st.ok()) return st;
  return writer.Flush();
}

// Checks that the file at `path` is exactly what was written: `bytes` long,
// ending in the trailer of `crc`. The payload's CRC was computed as it was
// written, so this re-reads only the trailer: cheap next to the write, and
// enough to catch a file the filesystem truncated or lost after the rename.
absl::Status VerifyWritten(const std::string& path, int64_t bytes,
                           uint32_t crc) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "cannot reopen to verify", path);
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, "cannot stat", path);
  if (st.st_size != bytes) {
    return absl::DataLossError(absl::StrCat("verifying ", path, ": it is ",
                                            st.st_size, " bytes, ", bytes,
                                            " were written"));
  }
  char trailer[kTrailerBytes];
  if (::pread(fd, trailer, sizeof(trailer), bytes - kTrailerBytes) !=
          static_cast<ssize_t>(sizeof(trailer)) ||
      GetLE32(trailer) != crc ||
      absl::string_view(trailer + 4, 4) != kEndMagic) {
    return absl::DataLossError(absl::StrCat(
        "verifying ", path, ": its trailer is not the one written"));
  }
  return absl::OkStatus();
}

// Free bytes on the filesystem holding `path` for an unprivileged writer.
absl::StatusOr<int64_t> FreeBytesAt(const std::string& path) {
  struct statvfs vfs;
  if (::statvfs(path.c_str(), &vfs) != 0) {
    return ErrnoError(errno, "cannot statvfs", path);
  }
  return static_cast<int64_t>(vfs.f_bavail) *
         static_cast<int64_t>(vfs.f_frsize);
}

// "512 B", "3.2 KiB", "61.0 MiB": sizes in an error a person reads.
std::string HumanBytes(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = bytes / 1024.0;
  int unit = 0;
  while (value >= 1024 && unit < 3) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, units[unit]);
}

// The sequences of the checkpoint files in `shard_dir`, newest first.
// Temporary files left by a write that crashed before its rename are
// removed on the way: they are never checkpoints.
absl::StatusOr<std::vector<int64_t>> SequencesRemovingLeftovers(
    const std::string& shard_dir) {
  absl::StatusOr<std::vector<std::string>> names = ListDir(shard_dir);
  if (!names.ok()) return names.status();
  std::vector<int64_t> sequences;
  for (const std::string& name : *names) {
    int64_t sequence = 0;
    if (ParseCheckpointFileName(name, &sequence)) {
      sequences.push_back(sequence);
    } else if (IsTempFileName(name)) {
      const std::string path = JoinPath(shard_dir, name);
      if (::unlink(path.c_str()) == 0) {
        LOG(WARNING) << "removed leftover temporary checkpoint file " << path;
      } else if (errno != ENOENT) {
        LOG(WARNING) << ErrnoError(errno, "cannot remove leftover", path);
      }
    }
  }
  std::sort(sequences.begin(), sequences.end(), std::greater<int64_t>());
  return sequences;
}

// RESOURCE_EXHAUSTED (and info->no_room) when `bytes` cannot fit in
// `shard_dir`. A checkpoint that cannot fit is not started: on a full disk
// every try would otherwise write (and delete) up to the model's size, and
// fill any room that other writers (logs) free up. The files that the write
// would prune anyway (`sequences`, newest first) may go first, but never the
// newest: until a newer one is complete and verified it is the last good
// checkpoint.
absl::Status MakeRoom(const std::string& shard_dir,
                      const std::string& final_path, int64_t bytes,
                      int keep_last, std::vector<int64_t> sequences,
                      CheckpointWriteInfo* info) {
  absl::StatusOr<int64_t> free_bytes = FreeBytesAt(shard_dir);
  if (free_bytes.ok()) {
    const size_t keep_now = std::max(keep_last - 1, 1);
    while (*free_bytes < bytes && keep_last > 0 &&
           sequences.size() > keep_now) {
      const std::string path =
          JoinPath(shard_dir, CheckpointFileName(sequences.back()));
      sequences.pop_back();
      if (::unlink(path.c_str()) != 0) break;
      // Once per process at WARNING: on a disk that holds fewer than
      // keep_last checkpoints this happens at every checkpoint.
      LOG_FIRST_N(WARNING, 1)
          << "removed old checkpoint " << path << " before its time to make "
          << "room for " << final_path << ": the disk holds fewer than "
          << keep_last << " checkpoints (logged once; --v=1 logs each)";
      VLOG(1) << "removed old checkpoint " << path << " to make room";
      free_bytes = FreeBytesAt(shard_dir);
      if (!free_bytes.ok()) break;
    }
  }
  if (free_bytes.ok()) {
    info->free_bytes = *free_bytes;
    if (*free_bytes < bytes) {
      info->no_room = true;
      return absl::ResourceExhaustedError(
          absl::StrCat("no room for checkpoint ", final_path, ": it needs ",
                       HumanBytes(bytes), ", ", HumanBytes(*free_bytes),
                       " free in ", shard_dir));
    }
  }
  return absl::OkStatus();
}

// Writes `snapshot` to a temporary file in `shard_dir`, fsyncs it and renames
// it to `final_name`: a reader sees the whole file or none. No failed try
// leaves its partial file behind to fill the disk.
absl::Status WriteAndRename(const ShardSnapshot& snapshot,
                            const CheckpointHeader& header,
                            const std::string& shard_dir,
                            const std::string& final_name, uint32_t* crc) {
  const std::string final_path = JoinPath(shard_dir, final_name);
  const std::string temp_path =
      JoinPath(shard_dir, absl::StrCat(".", final_name, ".tmp-", ::getpid()));
  const int fd =
      ::open(temp_path.c_str(),
             O_WRONLY | O_CREAT | O_EXCL | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, "cannot create", temp_path);
  absl::Status status;
  {
    FdCloser closer(fd);
    status = WriteCheckpointFile(snapshot, header, fd, temp_path, crc);
    if (status.ok() && ::fsync(fd) != 0) {
      status = ErrnoError(errno, "cannot fsync", temp_path);
    }
    if (status.ok()) status = closer.Close(temp_path);
  }
  if (status.ok() && ::rename(temp_path.c_str(), final_path.c_str()) != 0) {
    status = ErrnoError(errno, absl::StrCat("cannot rename ", temp_path, " to"),
                        final_path);
  }
  if (!status.ok() && ::unlink(temp_path.c_str()) != 0 && errno != ENOENT) {
    LOG(WARNING) << ErrnoError(errno, "cannot remove", temp_path);
  }
  return status;
}

// Keeps the newest `keep_last` checkpoint files of `shard_dir`; what cannot
// be listed or removed is logged.
void PruneOldCheckpoints(const std::string& shard_dir, int keep_last) {
  absl::StatusOr<std::vector<std::string>> names = ListDir(shard_dir);
  if (!names.ok()) {
    LOG(WARNING) << "not pruning old checkpoints: " << names.status();
    return;
  }
  std::vector<int64_t> sequences;
  for (const std::string& name : *names) {
    int64_t sequence = 0;
    if (ParseCheckpointFileName(name, &sequence)) sequences.push_back(sequence);
  }
  std::sort(sequences.begin(), sequences.end(), std::greater<int64_t>());
  for (size_t k = keep_last; k < sequences.size(); ++k) {
    const std::string path =
        JoinPath(shard_dir, CheckpointFileName(sequences[k]));
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      LOG(WARNING) << ErrnoError(errno, "cannot remove old checkpoint", path);
    }
  }
}

}  // namespace

CheckpointStore::CheckpointStore(std::string dir, int keep_last)
    : dir_(std::move(dir)), keep_last_(keep_last) {}

absl::Status CheckpointStore::Write(const ShardSnapshot& snapshot,
                                    CheckpointWriteInfo* info) {
  CheckpointWriteInfo ignored;
  if (info == nullptr) info = &ignored;
  *info = CheckpointWriteInfo();
  if (absl::Status s = ValidateSnapshot(snapshot); !s.ok()) return s;
  const std::string shard_dir =
      JoinPath(dir_, ShardDirName(snapshot.shard_id, snapshot.num_shards));
  if (absl::Status s = MakeDirs(shard_dir); !s.ok()) return s;

  absl::StatusOr<std::vector<int64_t>> sequences =
      SequencesRemovingLeftovers(shard_dir);
  if (!sequences.ok()) return sequences.status();
  const int64_t newest = sequences->empty() ? -1 : sequences->front();
  const std::string final_name = CheckpointFileName(snapshot.sequence);
  const std::string final_path = JoinPath(shard_dir, final_name);
  if (snapshot.sequence <= newest) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint sequence ", snapshot.sequence, " for ",
                     final_path, " is not greater than the shard's newest, ",
                     JoinPath(shard_dir, CheckpointFileName(newest))));
  }

  const CheckpointHeader header = MakeHeader(snapshot);
  const int64_t bytes =
      FileBytes(snapshot, static_cast<int64_t>(header.ByteSizeLong()));
  info->bytes = bytes;
  if (absl::Status s =
          MakeRoom(shard_dir, final_path, bytes, keep_last_, *sequences, info);
      !s.ok()) {
    return s;
  }
  uint32_t crc = 0;
  if (absl::Status s =
          WriteAndRename(snapshot, header, shard_dir, final_name, &crc);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = VerifyWritten(final_path, bytes, crc); !s.ok()) {
    ::unlink(final_path.c_str());
    return s;
  }
  if (absl::Status s = FsyncDir(shard_dir); !s.ok()) return s;
  info->written = true;
  // The new file is durable and verified: a failure to prune is only
  // reported.
  if (keep_last_ > 0) PruneOldCheckpoints(shard_dir, keep_last_);
  return absl::OkStatus();
}

absl::Status ProbeCheckpointDir(const std::string& dir) {
  auto unusable = [&dir](const absl::Status& s) {
    return absl::Status(s.code(),
                        absl::StrCat("--checkpoint_dir=", dir,
                                     " cannot be written: ", s.message()));
  };
  if (absl::Status s = MakeDirs(dir); !s.ok()) return unusable(s);
  const std::string probe =
      JoinPath(dir, absl::StrCat(".pstrain-probe-", ::getpid()));
  // Created and closed empty: a disk that is full now may have room by the
  // first checkpoint (and a full one gets backoff, not an exit), but a
  // read-only, foreign or missing one will not.
  const int fd =
      ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return unusable(ErrnoError(errno, "cannot create", probe));
  absl::Status status = FdCloser(fd).Close(probe);
  if (::unlink(probe.c_str()) != 0 && status.ok()) {
    status = ErrnoError(errno, "cannot remove", probe);
  }
  return status.ok() ? status : unusable(status);
}

absl::StatusOr<std::unique_ptr<CheckpointDirLock>> CheckpointDirLock::Acquire(
    const std::string& dir, int shard_id, absl::Duration wait) {
  const std::string path =
      JoinPath(dir, absl::StrCat("shard-", shard_id, ".lock"));
  // Read-only: a file held open for writing would keep the filesystem from
  // being remounted read-only (EBUSY) for the whole job.
  int fd = ::open(path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, "cannot open", path);
  bool opened_for_writing = false;
  auto holder = [&fd] {
    char text[256] = {};
    const ssize_t n = ::pread(fd, text, sizeof(text) - 1, 0);
    std::string said(text, n > 0 ? n : 0);
    while (!said.empty() && said.back() == '\n') said.pop_back();
    return said.empty() ? std::string("a process that has not said who") : said;
  };
  const absl::Time deadline = absl::Now() + wait;
  bool said_waiting = false;
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    if (error == EINTR) continue;
    if (error == EBADF && !opened_for_writing) {
      // NFS makes flock a byte-range lock, whose exclusive kind needs the
      // file open for writing.
      const int writable = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (writable >= 0) {
        ::close(fd);
        fd = writable;
        opened_for_writing = true;
        continue;
      }
    }
    if (error == ENOLCK || error == ENOSYS || error == EOPNOTSUPP ||
        error == EBADF) {
      // A filesystem that keeps no locks (Lustre without -o flock, an NFS
      // mount with nolock ...) must not stop the job: it runs unguarded.
      LOG(WARNING) << "cannot lock " << path << " (" << std::strerror(error)
                   << "): this filesystem keeps no locks, so nothing stops a "
                      "second job from sharing "
                   << dir;
      return std::unique_ptr<CheckpointDirLock>(new CheckpointDirLock(fd));
    }
    if (error != EWOULDBLOCK) {
      ::close(fd);
      return ErrnoError(error, "cannot lock", path);
    }
    if (absl::Now() >= deadline) {
      const std::string held_by = holder();
      ::close(fd);
      return absl::FailedPreconditionError(absl::StrCat(
          "--checkpoint_dir=", dir, ": shard ", shard_id,
          "'s checkpoints there are held by another ps_server (", held_by, "; ",
          path, ", waited ", absl::FormatDuration(wait),
          "): two jobs, or two servers of one shard, cannot share a "
          "checkpoint directory"));
    }
    if (!said_waiting) {
      said_waiting = true;
      LOG(WARNING) << "waiting up to " << absl::FormatDuration(wait)
                   << " for shard " << shard_id << "'s checkpoints in " << dir
                   << ", held by " << holder();
    }
    // A poll, with a deadline: flock has no timed wait.
    absl::SleepFor(absl::Milliseconds(50));
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string me =
      absl::StrCat("pid ", ::getpid(), " on ", host, " since ",
                   absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::Now(),
                                    absl::UTCTimeZone()),
                   "\n");
  // Who holds it, for the message of whoever is refused; the lock itself
  // does not depend on it (closing another descriptor of the file keeps a
  // flock).
  const int writer = ::open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (writer < 0 || ::write(writer, me.data(), me.size()) !=
                        static_cast<ssize_t>(me.size())) {
    LOG(WARNING) << "cannot say who holds " << path << ": "
                 << std::strerror(errno);
  }
  if (writer >= 0) ::close(writer);
  return std::unique_ptr<CheckpointDirLock>(new CheckpointDirLock(fd));
}

CheckpointDirLock::~CheckpointDirLock() { ::close(fd_); }

absl::StatusOr<int64_t> CheckpointFreeBytes(const std::string& dir) {
  return FreeBytesAt(dir);
}

}  // namespace pstrain
