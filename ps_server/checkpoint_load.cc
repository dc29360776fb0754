// Loading a shard's state: every checkpoint file is checked before use,
// the newest complete layout is found, and its blocks, rows and optimizer
// state are read back for this shard, resharding from another shard count
// by the placement rule of common/partition.h (CheckpointStore::LoadForShard).
#include <fcntl.h>
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
#include <optional>
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
// Reading.

// Reads a file front to back through a buffer, keeping the CRC-32 of every
// byte consumed. Large reads go straight into the caller's memory.
class CrcFileReader {
 public:
  explicit CrcFileReader(int fd)
      : fd_(fd),
        buffer_(new char[kBufferBytes]),
        crc_(crc32_z(0L, Z_NULL, 0)) {}

  absl::Status Read(void* dst, size_t n) {
    char* out = static_cast<char*>(dst);
    crc_ = CrcAfter(out, n, /*copy=*/true);
    return status_;
  }

  absl::Status Skip(size_t n) {
    crc_ = CrcAfter(nullptr, n, /*copy=*/false);
    return status_;
  }

  uint32_t crc() const { return static_cast<uint32_t>(crc_); }
  int64_t offset() const { return offset_; }

 private:
  // Consumes n bytes (into `out` when copy), returning the updated CRC.
  uLong CrcAfter(char* out, size_t n, bool copy) {
    uLong crc = crc_;
    while (n > 0 && status_.ok()) {
      if (begin_ == end_) {
        if (copy && n >= kBufferBytes) {
          // Straight into the destination: no second copy of big payloads.
          const size_t got = ReadSome(out, n);
          if (got == 0) break;
          crc = crc32_z(crc, reinterpret_cast<const Bytef*>(out), got);
          out += got;
          n -= got;
          offset_ += got;
          continue;
        }
        begin_ = 0;
        end_ = ReadSome(buffer_.get(), kBufferBytes);
        if (end_ == 0) break;
      }
      const size_t take = std::min(n, end_ - begin_);
      const char* src = buffer_.get() + begin_;
      crc = crc32_z(crc, reinterpret_cast<const Bytef*>(src), take);
      if (copy) {
        std::memcpy(out, src, take);
        out += take;
      }
      begin_ += take;
      n -= take;
      offset_ += take;
    }
    return crc;
  }

  // 0 on end of file or error (recorded in status_).
  size_t ReadSome(char* out, size_t n) {
    while (true) {
      const ssize_t r = ::read(fd_, out, n);
      if (r > 0) return static_cast<size_t>(r);
      if (r == 0) {
        // The size was checked up front: the file shrank while being read.
        status_ = absl::DataLossError(
            absl::StrCat("unexpected end of file at byte ", offset_));
        return 0;
      }
      if (errno == EINTR) continue;
      status_ = absl::ErrnoToStatus(
          errno, absl::StrCat("read error at byte ", offset_));
      return 0;
    }
  }

  const int fd_;
  std::unique_ptr<char[]> buffer_;
  size_t begin_ = 0, end_ = 0;
  int64_t offset_ = 0;
  uLong crc_;
  absl::Status status_;
};

struct CheckpointFile {
  std::string path;
  int64_t sequence = 0;
  int64_t mtime_ns = 0;
};

struct LoadedFile {
  CheckpointFile file;
  CheckpointHeader header;  // without the per-block entries
  // The lowest version of its dense blocks (of its tables when it has no
  // block): in sync, the step the file holds (-1: neither).
  int64_t step = -1;
  // Only the blocks the new shard owns.
  std::vector<BlockSnapshot> blocks;
  // Per table in header order, only the rows the new shard owns.
  std::vector<SparseTableSnapshot> sparse;
};

// Checks everything that can be checked before the CRC: that the header's
// claimed lengths add up to exactly the file size, which bounds every
// allocation by the file's size.
absl::Status CheckHeaderLengths(const CheckpointHeader& header,
                                int64_t header_bytes, int64_t file_bytes) {
  int64_t payload_floats = 0;
  const int64_t max_floats = file_bytes / 4;
  for (const CheckpointBlock& b : header.blocks()) {
    if (b.value_count() < 0 || b.state_count() < 0 ||
        b.value_count() > max_floats || b.state_count() > max_floats) {
      return absl::DataLossError(absl::StrCat(
          "block entry for global block ", b.global_block(), " claims ",
          b.value_count(), " values and ", b.state_count(),
          " state floats in a ", file_bytes, "-byte file"));
    }
    payload_floats += b.value_count() + b.state_count();
    if (payload_floats > max_floats) break;  // reported below, no overflow
  }
  // A sparse row is 16 bytes of id and count plus its floats: 4 floats'
  // worth of bytes.
  for (const CheckpointSparseTable& t : header.sparse()) {
    const int64_t rows = t.row_count();
    if (rows < 0 || t.value_floats() < 0 || t.state_floats() < 0 ||
        rows > max_floats || t.value_floats() > max_floats ||
        t.state_floats() > max_floats ||
        (rows > 0 &&
         4 + t.value_floats() + t.state_floats() > max_floats / rows)) {
      return absl::DataLossError(absl::StrCat(
          "sparse table entry ", QuoteForStatus(t.name()), " claims ", rows,
          " rows of ", t.value_floats(), "+", t.state_floats(), " floats in a ",
          file_bytes, "-byte file"));
    }
    payload_floats += rows * (4 + t.value_floats() + t.state_floats());
    if (payload_floats > max_floats) break;
  }
  const int64_t expected =
      kPreambleBytes + header_bytes + 4 * payload_floats + kTrailerBytes;
  if (payload_floats > max_floats || expected != file_bytes) {
    return absl::DataLossError(absl::StrCat(
        "file is ", file_bytes, " bytes but its header describes ",
        payload_floats > max_floats ? "more than that" : absl::StrCat(expected),
        " (truncated or corrupt)"));
  }
  return absl::OkStatus();
}

// Checks, after the CRC, that the header is a consistent checkpoint of shard
// `shard_id` of `num_shards` with sequence `sequence` (what its path says).
absl::Status CheckHeaderContents(const CheckpointHeader& header, int shard_id,
                                 int num_shards, int64_t sequence) {
  if (header.shard_id() != shard_id || header.num_shards() != num_shards) {
    return absl::DataLossError(absl::StrCat(
        "header says shard ", header.shard_id(), " of ", header.num_shards(),
        " but the file is in ", ShardDirName(shard_id, num_shards)));
  }
  if (header.sequence() != sequence) {
    return absl::DataLossError(
        absl::StrCat("header says sequence ", header.sequence(),
                     " but the file name says ", sequence));
  }
  if (absl::Status s = ValidateSchema(header.schema()); !s.ok()) {
    return absl::DataLossError(
        absl::StrCat("header holds a bad schema: ", s.message()));
  }
  const BlockGeometry geometry(header.schema());
  absl::flat_hash_set<int64_t> seen;
  // Per tensor: each may have its own optimizer (STATE tensors none).
  std::vector<int64_t> state_per_element(header.schema().dense_size(), -1);
  for (const CheckpointBlock& b : header.blocks()) {
    const int64_t g = b.global_block();
    if (g < 0 || g >= geometry.num_blocks()) {
      return absl::DataLossError(absl::StrCat("global block ", g,
                                              " is outside the schema's [0, ",
                                              geometry.num_blocks(), ")"));
    }
    if (ShardOfBlock(g, num_shards) != shard_id) {
      return absl::DataLossError(
          absl::StrCat(geometry.Describe(g), " belongs to shard ",
                       ShardOfBlock(g, num_shards), ", not ", shard_id));
    }
    if (!seen.insert(g).second) {
      return absl::DataLossError(
          absl::StrCat(geometry.Describe(g), " is listed twice"));
    }
    const int64_t length = geometry.Length(g);
    int64_t& tensor_state = state_per_element[geometry.TensorOf(g)];
    if (b.value_count() != length || b.state_count() % length != 0 ||
        (tensor_state >= 0 && b.state_count() / length != tensor_state)) {
      return absl::DataLossError(
          absl::StrCat(geometry.Describe(g), " has ", b.value_count(),
                       " values and ", b.state_count(),
                       " state floats for a block of ", length, " elements"));
    }
    tensor_state = b.state_count() / length;
  }
  if (header.sparse_size() != 0 &&
      header.sparse_size() != header.schema().sparse_size()) {
    return absl::DataLossError(absl::StrCat(
        "header lists ", header.sparse_size(),
        " sparse tables, the schema has ", header.schema().sparse_size()));
  }
  for (int t = 0; t < header.sparse_size(); ++t) {
    const CheckpointSparseTable& table = header.sparse(t);
    const SparseTableSpec& spec = header.schema().sparse(t);
    if (table.name() != spec.name() || table.value_floats() != spec.dim() ||
        table.version() < 0) {
      return absl::DataLossError(absl::StrCat(
          "sparse table entry ", t, " (", QuoteForStatus(table.name()),
          ", dim ", table.value_floats(), ", version ", table.version(),
          ") does not match the schema's ", QuoteForStatus(spec.name()),
          " (dim ", spec.dim(), ")"));
    }
  }
  return absl::OkStatus();
}

// Reads and verifies one file, keeping the blocks that shard `new_shard_id`
// of `new_num_shards` owns. Errors are the reason the file is invalid.
// The dense blocks of `header` that shard `new_shard_id` of
// `new_num_shards` holds, into `kept`; every payload passes through
// `reader`'s checksum, kept or not.
absl::Status ReadKeptBlocks(CrcFileReader& reader,
                            const CheckpointHeader& header, int new_shard_id,
                            int new_num_shards,
                            std::vector<BlockSnapshot>* kept) {
  for (const CheckpointBlock& b : header.blocks()) {
    const bool keep =
        b.global_block() >= 0 &&
        ShardOfBlock(b.global_block(), new_num_shards) == new_shard_id;
    if (!keep) {
      if (absl::Status s = reader.Skip(4 * (b.value_count() + b.state_count()));
          !s.ok()) {
        return s;
      }
      continue;
    }
    BlockSnapshot block;
    block.global_block = b.global_block();
    block.version = b.version();
    block.last_step.assign(b.last_step().begin(), b.last_step().end());
    block.value.resize(b.value_count());
    block.optimizer_state.resize(b.state_count());
    if (absl::Status s = reader.Read(block.value.data(), 4 * b.value_count());
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            reader.Read(block.optimizer_state.data(), 4 * b.state_count());
        !s.ok()) {
      return s;
    }
#if defined(ABSL_IS_BIG_ENDIAN)
    ByteSwapFloats(block.value.data(), block.value.size());
    ByteSwapFloats(block.optimizer_state.data(), block.optimizer_state.size());
#endif
    kept->push_back(std::move(block));
  }
  return absl::OkStatus();
}

// Every sparse row of `header` is read (its id says where it goes); those of
// shard `new_shard_id` of `new_num_shards` are kept, one table each.
absl::Status ReadKeptRows(CrcFileReader& reader, const CheckpointHeader& header,
                          int new_shard_id, int new_num_shards,
                          std::vector<SparseTableSnapshot>* kept_tables) {
  for (const CheckpointSparseTable& t : header.sparse()) {
    const int64_t rows = t.row_count();
    SparseTableSnapshot all;
    all.ids.resize(rows);
    all.update_counts.resize(rows);
    all.values.resize(rows * t.value_floats());
    all.states.resize(rows * t.state_floats());
    for (absl::Status s :
         {reader.Read(all.ids.data(), 8 * rows),
          reader.Read(all.update_counts.data(), 8 * rows),
          reader.Read(all.values.data(), 4 * all.values.size()),
          reader.Read(all.states.data(), 4 * all.states.size())}) {
      if (!s.ok()) return s;
    }
#if defined(ABSL_IS_BIG_ENDIAN)
    for (uint64_t& id : all.ids) id = GetLE64(reinterpret_cast<char*>(&id));
    for (int64_t& n : all.update_counts) {
      n = static_cast<int64_t>(GetLE64(reinterpret_cast<char*>(&n)));
    }
    ByteSwapFloats(all.values.data(), all.values.size());
    ByteSwapFloats(all.states.data(), all.states.size());
#endif
    SparseTableSnapshot& kept = kept_tables->emplace_back();
    kept.name = t.name();
    kept.version = t.version();
    kept.dim = t.value_floats();
    kept.state_floats = t.state_floats();
    const SparseShards shards(t.name(), new_num_shards);
    for (int64_t r = 0; r < rows; ++r) {
      if (shards.Of(all.ids[r]) != new_shard_id) {
        continue;
      }
      kept.ids.push_back(all.ids[r]);
      kept.update_counts.push_back(all.update_counts[r]);
      kept.values.insert(kept.values.end(), all.values.begin() + r * kept.dim,
                         all.values.begin() + (r + 1) * kept.dim);
      kept.states.insert(kept.states.end(),
                         all.states.begin() + r * kept.state_floats,
                         all.states.begin() + (r + 1) * kept.state_floats);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<LoadedFile> ReadCheckpointFile(const CheckpointFile& file,
                                              int shard_id, int num_shards,
                                              int new_shard_id,
                                              int new_num_shards) {
  const int fd = ::open(file.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, "cannot open");
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) return absl::ErrnoToStatus(errno, "cannot stat");
  const int64_t file_bytes = st.st_size;
  if (file_bytes < kMinFileBytes) {
    return absl::DataLossError(
        absl::StrCat("file is ", file_bytes, " bytes, shorter than the ",
                     kMinFileBytes, "-byte minimum (truncated)"));
  }

  // The end marker first: the cheapest test for a truncated file.
  char trailer[kTrailerBytes];
  const ssize_t got =
      ::pread(fd, trailer, sizeof(trailer), file_bytes - kTrailerBytes);
  if (got != static_cast<ssize_t>(sizeof(trailer))) {
    return got < 0 ? absl::ErrnoToStatus(errno, "cannot read the trailer")
                   : absl::DataLossError("cannot read the trailer");
  }
  if (absl::string_view(trailer + 4, 4) != kEndMagic) {
    return absl::DataLossError(absl::StrCat(
        "no '", kEndMagic, "' end marker (truncated or corrupt): found '",
        absl::CHexEscape(absl::string_view(trailer + 4, 4)), "'"));
  }

  CrcFileReader reader(fd);
  char preamble[kPreambleBytes];
  if (absl::Status s = reader.Read(preamble, sizeof(preamble)); !s.ok()) {
    return s;
  }
  if (absl::string_view(preamble, kMagic.size()) != kMagic) {
    return absl::DataLossError(absl::StrCat(
        "bad magic '", absl::CHexEscape(absl::string_view(preamble, 8)),
        "', expected '", kMagic, "'"));
  }
  const uint64_t header_bytes = GetLE64(preamble + 8);
  if (header_bytes > static_cast<uint64_t>(file_bytes - kMinFileBytes) ||
      header_bytes > static_cast<uint64_t>(INT_MAX)) {
    return absl::DataLossError(
        absl::StrCat("header length ", header_bytes, " does not fit in a ",
                     file_bytes, "-byte file (truncated or corrupt)"));
  }
  std::string serialized(header_bytes, '\0');
  if (absl::Status s = reader.Read(serialized.data(), header_bytes); !s.ok()) {
    return s;
  }
  LoadedFile loaded;
  loaded.file = file;
  if (!loaded.header.ParseFromString(serialized)) {
    return absl::DataLossError("header does not parse");
  }
  serialized = std::string();
  if (absl::Status s =
          CheckHeaderLengths(loaded.header, header_bytes, file_bytes);
      !s.ok()) {
    return s;
  }

  // One pass over the payloads: keep the new shard's, checksum all.
  if (absl::Status s = ReadKeptBlocks(reader, loaded.header, new_shard_id,
                                      new_num_shards, &loaded.blocks);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ReadKeptRows(reader, loaded.header, new_shard_id,
                                    new_num_shards, &loaded.sparse);
      !s.ok()) {
    return s;
  }
  const uint32_t stored_crc = GetLE32(trailer);
  if (reader.crc() != stored_crc) {
    return absl::DataLossError(
        absl::StrFormat("CRC-32 mismatch: computed %08x, stored %08x (corrupt)",
                        reader.crc(), stored_crc));
  }

  if (absl::Status s = CheckHeaderContents(loaded.header, shard_id, num_shards,
                                           file.sequence);
      !s.ok()) {
    return s;
  }
  for (const CheckpointBlock& block : loaded.header.blocks()) {
    loaded.step = loaded.step < 0 ? block.version()
                                  : std::min(loaded.step, block.version());
  }
  // Tables only where there is no block: an embedding table may run its
  // own (async) steps beside a sync job's dense blocks.
  for (const CheckpointSparseTable& table : loaded.header.sparse()) {
    if (loaded.header.blocks_size() > 0) break;
    loaded.step = loaded.step < 0 ? table.version()
                                  : std::min(loaded.step, table.version());
  }
  loaded.header.clear_blocks();
  return loaded;
}

// Every checkpoint file of one layout, newest sequence first per shard.
struct Layout {
  int num_shards = 0;
  std::map<int, std::vector<CheckpointFile>> shards;
  int64_t newest_mtime_ns = 0;
  int64_t max_sequence = -1;

  std::string Name() const { return absl::StrCat("shard-*-of-", num_shards); }
};

// The newest valid file of every old shard of a layout, or the first old
// shard that has none.
struct LayoutScan {
  bool complete = false;
  // Complete, but the new shard's own file predates another layout's files
  // (ScanLayout's `newer_elsewhere`): restored only when no layout is
  // complete without that.
  bool stale = false;
  int missing_shard = -1;
  int missing_skipped = 0;  // files of missing_shard found invalid
  std::vector<LoadedFile> files;
};

// Resharding (a new shard count, or the exporter's one shard): every new
// shard takes blocks of every old one, so a sync model is one step's only
// if every old shard's file is of that step. A newest file that was invalid
// (a disk error, a truncated copy) leaves one shard's newest valid file
// older than the others': their older files of that step, when they are
// still there, make the model one step's instead of a mix. Every new shard
// scans the same files, so all choose alike. When some shard has no file of
// that step the newest valid files stay, and the caller says they mix
// steps (pstrain_export does).
void MatchSyncSteps(const Layout& layout, int new_shard_id, int new_num_shards,
                    LayoutScan& scan) {
  if (scan.files.empty() || scan.files.front().header.mode() != "sync") {
    return;
  }
  int64_t target = -1;  // files without blocks or tables have no step
  for (const LoadedFile& file : scan.files) {
    if (file.step >= 0) {
      target = target < 0 ? file.step : std::min(target, file.step);
    }
  }
  // Nothing is changed until every shard has a file of `target`.
  std::vector<std::optional<LoadedFile>> older_files(scan.files.size());
  for (size_t f = 0; f < scan.files.size(); ++f) {
    const LoadedFile& file = scan.files[f];
    if (file.step == target || file.step < 0) continue;
    const int old_shard = file.header.shard_id();
    for (const CheckpointFile& older : layout.shards.at(old_shard)) {
      if (older.sequence >= file.file.sequence) continue;
      absl::StatusOr<LoadedFile> loaded = ReadCheckpointFile(
          older, old_shard, layout.num_shards, new_shard_id, new_num_shards);
      if (!loaded.ok() || loaded->step > target) continue;
      if (loaded->step == target) older_files[f] = *std::move(loaded);
      break;  // older files hold older steps
    }
    if (!older_files[f].has_value()) return;
  }
  std::vector<std::string> replaced;
  for (size_t f = 0; f < scan.files.size(); ++f) {
    if (!older_files[f].has_value()) continue;
    replaced.push_back(absl::StrCat(scan.files[f].file.path, " (step ",
                                    scan.files[f].step, ") by ",
                                    older_files[f]->file.path));
    scan.files[f] = *std::move(older_files[f]);
  }
  if (!replaced.empty()) {
    LOG(WARNING) << "the shards' newest valid checkpoint files are of "
                    "different steps: every shard's file of step "
                 << target << " is restored instead, replacing "
                 << absl::StrJoin(replaced, "; ");
  }
}

// `newer_elsewhere`: the newest sequence of any other layout. A file of
// this shard in its own layout older than that predates the job's moving
// to that layout and back (2 -> 3 -> 2 shards, this shard restarted before
// its first file since): restoring it would go back past the other
// layout's state, so the scan says it is stale.
LayoutScan ScanLayout(const Layout& layout, int new_shard_id,
                      int new_num_shards, int64_t newer_elsewhere,
                      std::vector<std::string>* files_skipped) {
  LayoutScan scan;
  // In its own layout a shard's blocks and rows are all in its own files;
  // the others' are read to check that they describe the same job. A peer
  // that never completed a checkpoint (no file at all: it died before its
  // first) has nothing to check and does not hold this shard back.
  const bool own_layout = layout.num_shards == new_num_shards;
  for (int i = 0; i < layout.num_shards; ++i) {
    const auto it = layout.shards.find(i);
    if (own_layout && i != new_shard_id && it == layout.shards.end()) {
      continue;
    }
    int skipped = 0;
    bool found = false;
    if (it != layout.shards.end()) {
      for (const CheckpointFile& file : it->second) {
        absl::StatusOr<LoadedFile> loaded = ReadCheckpointFile(
            file, i, layout.num_shards, new_shard_id, new_num_shards);
        if (loaded.ok()) {
          scan.stale |= own_layout && i == new_shard_id &&
                        file.sequence < newer_elsewhere;
          scan.files.push_back(*std::move(loaded));
          found = true;
          break;
        }
        const std::string reason =
            absl::StrCat(file.path, ": ", loaded.status().message());
        LOG(WARNING) << "skipping invalid checkpoint " << reason;
        files_skipped->push_back(reason);
        ++skipped;
      }
    }
    if (!found) {
      scan.missing_shard = i;
      scan.missing_skipped = skipped;
      scan.files.clear();
      return scan;
    }
  }
  scan.complete = true;
  if (!own_layout) MatchSyncSteps(layout, new_shard_id, new_num_shards, scan);
  return scan;
}

// Every checkpoint file under `dir`'s shard directories, grouped by
// layout (the shard count they were written for), each shard's newest
// first; `max_sequence` the highest sequence number seen (-1: none).
std::map<int, Layout> ListLayouts(const std::string& dir,
                                  const std::vector<std::string>& entries,
                                  int64_t* max_sequence) {
  *max_sequence = -1;
  std::map<int, Layout> layouts;
  for (const std::string& entry : entries) {
    int old_shard = 0, old_num_shards = 0;
    if (!ParseShardDirName(entry, &old_shard, &old_num_shards)) continue;
    const std::string shard_dir = JoinPath(dir, entry);
    absl::StatusOr<std::vector<std::string>> names = ListDir(shard_dir);
    if (!names.ok()) {
      // Not a directory, or unreadable: its files cannot be tried.
      if (!absl::IsNotFound(names.status())) {
        LOG(WARNING) << "ignoring " << shard_dir << ": " << names.status();
      }
      continue;
    }
    for (const std::string& name : *names) {
      CheckpointFile file;
      if (!ParseCheckpointFileName(name, &file.sequence)) continue;
      file.path = JoinPath(shard_dir, name);
      struct stat st;
      if (::stat(file.path.c_str(), &st) == 0) {
        file.mtime_ns =
            int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec;
      }
      Layout& layout = layouts[old_num_shards];
      layout.num_shards = old_num_shards;
      layout.newest_mtime_ns = std::max(layout.newest_mtime_ns, file.mtime_ns);
      layout.max_sequence = std::max(layout.max_sequence, file.sequence);
      *max_sequence = std::max(*max_sequence, file.sequence);
      layout.shards[old_shard].push_back(std::move(file));
    }
  }
  for (auto& [n, layout] : layouts) {
    for (auto& [i, files] : layout.shards) {
      std::sort(files.begin(), files.end(),
                [](const CheckpointFile& a, const CheckpointFile& b) {
                  return a.sequence > b.sequence;
                });
    }
  }

  return layouts;
}

// The order to try layouts in: newest first, by the highest sequence number
// of their files (one counter for the whole directory, so a layout's files
// are newer than another's exactly when the job wrote them later), then by
// the files' times, the one matching `num_shards` first among equals. Going
// back to an earlier shard count (2 -> 3 -> 2) so restores the 3-shard
// files, which hold the job's latest state, not the older 2-shard ones.
std::vector<const Layout*> LayoutsToTry(const std::map<int, Layout>& layouts,
                                        int num_shards) {
  std::vector<const Layout*> order;
  for (const auto& [n, layout] : layouts) order.push_back(&layout);
  std::sort(
      order.begin(), order.end(),
      [num_shards](const Layout* a, const Layout* b) {
        return std::make_tuple(a->max_sequence, a->newest_mtime_ns,
                               a->num_shards == num_shards, a->num_shards) >
               std::make_tuple(b->max_sequence, b->newest_mtime_ns,
                               b->num_shards == num_shards, b->num_shards);
      });
  return order;
}

// The old shards must describe the same model and training setup.
absl::Status CheckFilesAgree(const std::vector<LoadedFile>& files) {
  const LoadedFile& first = files.front();
  for (const LoadedFile& other : files) {
    std::string difference =
        FirstSchemaDifference(first.header.schema(), other.header.schema());
    if (difference.empty() && first.header.mode() != other.header.mode()) {
      difference = absl::StrCat("mode ", QuoteForStatus(first.header.mode()),
                                " vs ", QuoteForStatus(other.header.mode()));
    }
    if (difference.empty() &&
        first.header.optimizer() != other.header.optimizer()) {
      difference =
          absl::StrCat("optimizer ", QuoteForStatus(first.header.optimizer()),
                       " vs ", QuoteForStatus(other.header.optimizer()));
    }
    if (!difference.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoints disagree: ", first.file.path, " vs ",
                       other.file.path, ": ", difference));
    }
  }

  return absl::OkStatus();
}

// Every block shard `shard_id` of `num_shards` owns, exactly once, in
// global order, moved out of `files` (written for `old_num_shards`).
absl::Status GatherBlocks(std::vector<LoadedFile>& files, int old_num_shards,
                          int shard_id, int num_shards,
                          std::vector<BlockSnapshot>* blocks) {
  const LoadedFile& first = files.front();
  const BlockGeometry geometry(first.header.schema());
  absl::flat_hash_map<int64_t, BlockSnapshot*> found;
  for (LoadedFile& file : files) {
    for (BlockSnapshot& block : file.blocks) {
      found[block.global_block] = &block;
    }
  }
  const int64_t owned =
      BlocksOnShard(geometry.num_blocks(), shard_id, num_shards);
  (*blocks).reserve(std::min<int64_t>(owned, found.size()));
  // Per tensor: each may have its own optimizer (STATE tensors none).
  std::vector<int64_t> state_per_element(first.header.schema().dense_size(),
                                         -1);
  for (int64_t g = shard_id; g < geometry.num_blocks(); g += num_shards) {
    const auto it = found.find(g);
    const int old_shard = static_cast<int>(g % old_num_shards);
    if (it == found.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot restore shard ", shard_id, " of ", num_shards,
                       ": ", geometry.Describe(g), " is missing from ",
                       files[old_shard].file.path));
    }
    BlockSnapshot& block = *it->second;
    const int64_t per_element =
        static_cast<int64_t>(block.optimizer_state.size()) /
        static_cast<int64_t>(block.value.size());
    int64_t& tensor_state = state_per_element[geometry.TensorOf(g)];
    if (tensor_state >= 0 && per_element != tensor_state) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoints disagree on optimizer state per element: ",
          geometry.Describe(g), " in ", files[old_shard].file.path, " has ",
          per_element, ", earlier blocks of its tensor ", tensor_state));
    }
    tensor_state = per_element;
    (*blocks).push_back(std::move(block));
  }

  return absl::OkStatus();
}

// Sparse rows: each old shard's share of the new shard's rows, merged per
// table. None when some file predates sparse checkpoints.
absl::Status MergeSparseTables(std::vector<LoadedFile>& files,
                               std::vector<SparseTableSnapshot>* tables) {
  const LoadedFile& first = files.front();
  const bool all_have_sparse =
      std::all_of(files.begin(), files.end(), [&](const LoadedFile& f) {
        return static_cast<int>(f.sparse.size()) ==
               first.header.schema().sparse_size();
      });
  if (first.header.schema().sparse_size() > 0 && !all_have_sparse) {
    LOG(WARNING) << "some checkpoint files hold no sparse rows (written by an "
                    "older ps_server): every table starts afresh";
  }
  for (int t = 0; all_have_sparse && t < first.header.schema().sparse_size();
       ++t) {
    SparseTableSnapshot& merged = (*tables).emplace_back();
    merged.name = first.sparse[t].name;
    merged.dim = first.sparse[t].dim;
    merged.state_floats = first.sparse[t].state_floats;
    merged.version = first.sparse[t].version;
    for (LoadedFile& file : files) {
      SparseTableSnapshot& part = file.sparse[t];
      if (part.state_floats != merged.state_floats) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoints disagree on the state floats per row of sparse "
            "table ",
            QuoteForStatus(merged.name), ": ", file.file.path, " has ",
            part.state_floats, ", ", first.file.path, " ",
            merged.state_floats));
      }
      merged.version = std::min(merged.version, part.version);
      merged.ids.insert(merged.ids.end(), part.ids.begin(), part.ids.end());
      merged.update_counts.insert(merged.update_counts.end(),
                                  part.update_counts.begin(),
                                  part.update_counts.end());
      merged.values.insert(merged.values.end(), part.values.begin(),
                           part.values.end());
      merged.states.insert(merged.states.end(), part.states.begin(),
                           part.states.end());
      part = SparseTableSnapshot();
    }
  }

  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RestoredShard> CheckpointStore::LoadForShard(
    int shard_id, int num_shards) const {
  if (num_shards < 1 || shard_id < 0 || shard_id >= num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot restore shard ", shard_id, " of ", num_shards,
                     ": need 0 <= shard_id < num_shards"));
  }
  absl::StatusOr<std::vector<std::string>> entries = ListDir(dir_);
  if (!entries.ok()) {
    if (absl::IsNotFound(entries.status())) {
      return absl::NotFoundError(
          absl::StrCat("no checkpoint in ", dir_, ": no such directory"));
    }
    return entries.status();
  }

  int64_t max_sequence;
  const std::map<int, Layout> layouts =
      ListLayouts(dir_, *entries, &max_sequence);
  if (layouts.empty()) {
    return absl::NotFoundError(absl::StrCat("no checkpoint in ", dir_));
  }
  const std::vector<const Layout*> order = LayoutsToTry(layouts, num_shards);

  RestoredShard restored;
  restored.next_sequence = max_sequence + 1;
  const Layout* chosen = nullptr;
  LayoutScan scan;
  std::vector<std::string> incomplete;
  // The matching layout lacks this shard's own files, valid or not.
  bool own_never_written = false;
  // A layout whose file of this shard predates another layout's files is
  // the fallback: a later complete layout holds the job's newer state.
  const Layout* stale = nullptr;
  LayoutScan stale_scan;
  for (const Layout* layout : order) {
    int64_t newer_elsewhere = -1;
    for (const auto& [n, other] : layouts) {
      if (n != layout->num_shards) {
        newer_elsewhere = std::max(newer_elsewhere, other.max_sequence);
      }
    }
    scan = ScanLayout(*layout, shard_id, num_shards, newer_elsewhere,
                      &restored.files_skipped);
    if (scan.complete && !scan.stale) {
      chosen = layout;
      break;
    }
    if (scan.complete) {
      if (stale == nullptr) {
        stale = layout;
        stale_scan = std::move(scan);
      }
      incomplete.push_back(absl::StrCat(
          ShardDirName(shard_id, layout->num_shards),
          "'s newest valid file is older than another layout's files"));
      continue;
    }
    if (layout->num_shards == num_shards &&
        layout->shards.find(shard_id) == layout->shards.end()) {
      own_never_written = true;
    }
    incomplete.push_back(
        absl::StrCat(ShardDirName(scan.missing_shard, layout->num_shards),
                     " has no valid checkpoint file (", scan.missing_skipped,
                     " invalid ones skipped)"));
  }
  if (chosen == nullptr && stale != nullptr) {
    chosen = stale;
    scan = std::move(stale_scan);
  }
  if (chosen == nullptr && own_never_written) {
    // This shard died before its first checkpoint completed (a temporary
    // file at most), while the others have theirs: its state is the
    // initial one, as a shard without --checkpoint_dir restarts; the
    // workers' steps it lacks are then skipped and counted (steps_lost).
    // Files that are there but invalid are still a DataLoss below.
    return absl::NotFoundError(absl::StrCat(
        "no checkpoint of shard ", shard_id, " of ", num_shards, " in ", dir_,
        " yet (the other shards have theirs: this one stopped before its "
        "first was complete, or every one it tried failed, a full disk "
        "say: its log says which)"));
  }
  if (chosen == nullptr) {
    return absl::DataLossError(absl::StrCat(
        "cannot restore shard ", shard_id, " of ", num_shards, " from ", dir_,
        ": no layout has a valid checkpoint for every shard: ",
        absl::StrJoin(incomplete, "; ")));
  }
  if (!incomplete.empty()) {
    LOG(WARNING) << "restoring from " << chosen->Name() << " in " << dir_
                 << " because " << absl::StrJoin(incomplete, "; ");
  }
  if (chosen->num_shards != num_shards) {
    LOG(INFO) << "restoring from " << chosen->Name() << " in " << dir_
              << ", the newest complete layout, into " << num_shards
              << " shards";
  }

  if (absl::Status s = CheckFilesAgree(scan.files); !s.ok()) return s;
  if (absl::Status s = GatherBlocks(scan.files, chosen->num_shards, shard_id,
                                    num_shards, &restored.blocks);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = MergeSparseTables(scan.files, &restored.sparse);
      !s.ok()) {
    return s;
  }
  const LoadedFile& first = scan.files.front();
  restored.schema = first.header.schema();
  restored.mode = first.header.mode();
  restored.optimizer = first.header.optimizer();
  restored.old_num_shards = chosen->num_shards;
  for (const LoadedFile& file : scan.files) {
    restored.files_used.push_back(file.file.path);
  }
  return restored;
}

}  // namespace pstrain
