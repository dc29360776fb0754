#include "ps_server/checkpoint.h"

#include <dirent.h>
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
#include <tuple>
#include <utility>

#include "absl/base/config.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/partition.h"
#include "common/status_text.h"
#include "glog/logging.h"
#include "proto/checkpoint.pb.h"

namespace pstrain {
namespace {

constexpr absl::string_view kMagic("PSCKPT01", 8);
constexpr absl::string_view kEndMagic("END1", 4);
constexpr int64_t kPreambleBytes = 16;  // magic + header length
constexpr int64_t kTrailerBytes = 8;    // crc32 + end magic
constexpr int64_t kMinFileBytes = kPreambleBytes + kTrailerBytes;
constexpr int64_t kMaxSequence = 999'999'999'999;  // 12 digits in the name
constexpr int kSequenceDigits = 12;
constexpr absl::string_view kFilePrefix = "ckpt-";
constexpr absl::string_view kFileSuffix = ".pstrain";
// Temporary files are hidden and never end in kFileSuffix, so no listing of
// checkpoints can mistake one for a checkpoint.
constexpr absl::string_view kTempPrefix = ".ckpt-";
constexpr absl::string_view kTempMarker = ".pstrain.tmp";
constexpr size_t kBufferBytes = size_t{1} << 20;

// ---------------------------------------------------------------------------
// Names and paths.

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (!dir.empty() && dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

std::string ShardDirName(int shard_id, int num_shards) {
  return absl::StrCat("shard-", shard_id, "-of-", num_shards);
}

std::string CheckpointFileName(int64_t sequence) {
  return absl::StrFormat("ckpt-%0*d.pstrain", kSequenceDigits, sequence);
}

bool AllDigits(absl::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return absl::ascii_isdigit(static_cast<unsigned char>(c));
  });
}

// Accepts only the canonical "shard-<i>-of-<n>" (no leading zeros), so two
// spellings can never name the same shard.
bool ParseShardDirName(absl::string_view name, int* shard_id, int* num_shards) {
  if (!absl::ConsumePrefix(&name, "shard-")) return false;
  const size_t of = name.find("-of-");
  if (of == absl::string_view::npos) return false;
  const absl::string_view i = name.substr(0, of);
  const absl::string_view n = name.substr(of + 4);
  if (!AllDigits(i) || !AllDigits(n)) return false;
  if (!absl::SimpleAtoi(i, shard_id) || !absl::SimpleAtoi(n, num_shards)) {
    return false;
  }
  return *num_shards >= 1 && *shard_id < *num_shards &&
         absl::StrCat(*shard_id) == i && absl::StrCat(*num_shards) == n;
}

bool ParseCheckpointFileName(absl::string_view name, int64_t* sequence) {
  if (!absl::ConsumePrefix(&name, kFilePrefix) ||
      !absl::ConsumeSuffix(&name, kFileSuffix) ||
      name.size() != kSequenceDigits || !AllDigits(name)) {
    return false;
  }
  return absl::SimpleAtoi(name, sequence);
}

bool IsTempFileName(absl::string_view name) {
  return absl::StartsWith(name, kTempPrefix) &&
         absl::StrContains(name, kTempMarker);
}

// ---------------------------------------------------------------------------
// Little-endian integers and floats.

void PutLE64(uint64_t v, char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(v >> (8 * i));
}
void PutLE32(uint32_t v, char* out) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>(v >> (8 * i));
}
uint64_t GetLE64(const char* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) {
    v |= uint64_t{static_cast<unsigned char>(in[i])} << (8 * i);
  }
  return v;
}
uint32_t GetLE32(const char* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= uint32_t{static_cast<unsigned char>(in[i])} << (8 * i);
  }
  return v;
}

#if defined(ABSL_IS_BIG_ENDIAN)
void ByteSwapFloats(float* data, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &data[i], 4);
    bits = __builtin_bswap32(bits);
    std::memcpy(&data[i], &bits, 4);
  }
}
#endif

// ---------------------------------------------------------------------------
// POSIX helpers: every error names the path and the errno text.

absl::Status ErrnoError(int error, absl::string_view what,
                        absl::string_view path) {
  return absl::ErrnoToStatus(error, absl::StrCat(what, " ", path));
}

absl::Status WriteAll(int fd, const char* data, size_t n,
                      const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "cannot write", path);
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "cannot open directory", path);
  // Some filesystems cannot sync a directory (EINVAL); the rename is then as
  // durable as that filesystem makes it, and failing the write would not
  // make it more so.
  if (::fsync(fd) != 0 && errno != EINVAL) {
    const int error = errno;
    ::close(fd);
    return ErrnoError(error, "cannot fsync directory", path);
  }
  ::close(fd);
  return absl::OkStatus();
}

std::string ParentDir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// mkdir -p, fsync'ing the parent of every directory it creates so the new
// entries survive a crash along with the files in them.
absl::Status MakeDirs(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("not a directory: ", path));
  }
  if (errno != ENOENT) return ErrnoError(errno, "cannot stat", path);
  const std::string parent = ParentDir(path);
  if (parent != path) {
    if (absl::Status s = MakeDirs(parent); !s.ok()) return s;
  }
  if (::mkdir(path.c_str(), 0755) != 0) {
    if (errno == EEXIST) return absl::OkStatus();  // a concurrent shard won
    return ErrnoError(errno, "cannot create directory", path);
  }
  return FsyncDir(parent);
}

// NotFound when `path` does not exist.
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) return ErrnoError(errno, "cannot list directory", path);
  std::vector<std::string> names;
  errno = 0;
  while (const dirent* e = ::readdir(d)) {
    const absl::string_view name = e->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
  }
  const int error = errno;
  ::closedir(d);
  if (error != 0) return ErrnoError(error, "cannot list directory", path);
  return names;
}

// Closes the descriptor on every path out of a function.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  // Closes now, reporting the error (a write-back failure can surface here).
  absl::Status Close(const std::string& path) {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return ErrnoError(errno, "cannot close", path);
    return absl::OkStatus();
  }

 private:
  int fd_;
};

// ---------------------------------------------------------------------------
// Block geometry computed from the schema alone. It mirrors common/partition.h
// (blocks numbered in schema order, block_elements each, the last block of a
// tensor shorter) without materializing every block: a header read from disk
// is checked before anything proportional to the model's block count is
// allocated, and a shard only ever needs its own blocks.

class BlockGeometry {
 public:
  // The schema must pass ValidateSchema.
  explicit BlockGeometry(const ModelSchema& schema)
      : schema_(&schema), block_elements_(schema.block_elements()) {
    first_block_.reserve(schema.dense_size() + 1);
    int64_t total = 0;
    for (const DenseTensorSpec& tensor : schema.dense()) {
      first_block_.push_back(total);
      elements_.push_back(NumElements(tensor));
      // At most 2^40 elements per tensor (ValidateSchema) and far fewer
      // tensors than 2^23: no overflow.
      total += (elements_.back() + block_elements_ - 1) / block_elements_;
    }
    first_block_.push_back(total);
  }

  int64_t num_blocks() const { return first_block_.back(); }

  // g must be in [0, num_blocks()).
  int TensorOf(int64_t g) const {
    const auto it =
        std::upper_bound(first_block_.begin(), first_block_.end(), g);
    return static_cast<int>(it - first_block_.begin()) - 1;
  }
  int64_t Length(int64_t g) const {
    const int t = TensorOf(g);
    const int64_t offset = (g - first_block_[t]) * block_elements_;
    return std::min(block_elements_, elements_[t] - offset);
  }
  std::string Describe(int64_t g) const {
    const int t = TensorOf(g);
    return absl::StrCat("global block ", g, " (tensor ",
                        QuoteForStatus(schema_->dense(t).name()), " block ",
                        g - first_block_[t], ")");
  }

 private:
  const ModelSchema* schema_;
  int64_t block_elements_;
  std::vector<int64_t> first_block_;  // per tensor, then the total
  std::vector<int64_t> elements_;
};

// Blocks a shard owns: shard_id, shard_id + num_shards, ... < num_blocks.
int64_t OwnedBlockCount(int64_t num_blocks, int shard_id, int num_shards) {
  return num_blocks > shard_id ? (num_blocks - shard_id - 1) / num_shards + 1
                               : 0;
}

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
      OwnedBlockCount(geometry.num_blocks(), s.shard_id, s.num_shards);
  if (static_cast<int64_t>(s.blocks.size()) != owned) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": has ", s.blocks.size(), " blocks, the shard owns ", owned));
  }
  int64_t state_per_element = -1;
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
    const int64_t state = static_cast<int64_t>(b.optimizer_state.size());
    if (state % length != 0 ||
        (state_per_element >= 0 && state / length != state_per_element)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", state, " optimizer state floats for ", length,
          " elements (must be the same multiple for every block)"));
    }
    state_per_element = state / length;
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
  int64_t state_per_element = -1;
  for (const CheckpointBlock& b : header.blocks()) {
    const int64_t g = b.global_block();
    if (g < 0 || g >= geometry.num_blocks()) {
      return absl::DataLossError(absl::StrCat("global block ", g,
                                              " is outside the schema's [0, ",
                                              geometry.num_blocks(), ")"));
    }
    if (g % num_shards != shard_id) {
      return absl::DataLossError(
          absl::StrCat(geometry.Describe(g), " belongs to shard ",
                       g % num_shards, ", not ", shard_id));
    }
    if (!seen.insert(g).second) {
      return absl::DataLossError(
          absl::StrCat(geometry.Describe(g), " is listed twice"));
    }
    const int64_t length = geometry.Length(g);
    if (b.value_count() != length || b.state_count() % length != 0 ||
        (state_per_element >= 0 &&
         b.state_count() / length != state_per_element)) {
      return absl::DataLossError(
          absl::StrCat(geometry.Describe(g), " has ", b.value_count(),
                       " values and ", b.state_count(),
                       " state floats for a block of ", length, " elements"));
    }
    state_per_element = b.state_count() / length;
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

  // One pass over the payloads: keep the new shard's blocks, checksum all.
  for (const CheckpointBlock& b : loaded.header.blocks()) {
    const bool keep = b.global_block() >= 0 &&
                      b.global_block() % new_num_shards == new_shard_id;
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
    loaded.blocks.push_back(std::move(block));
  }
  // Every row is read (its id says where it goes); the new shard's are kept.
  for (const CheckpointSparseTable& t : loaded.header.sparse()) {
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
    SparseTableSnapshot& kept = loaded.sparse.emplace_back();
    kept.name = t.name();
    kept.version = t.version();
    kept.dim = t.value_floats();
    kept.state_floats = t.state_floats();
    for (int64_t r = 0; r < rows; ++r) {
      if (SparseShardOf(t.name(), all.ids[r], new_num_shards) != new_shard_id) {
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
  int missing_shard = -1;
  int missing_skipped = 0;  // files of missing_shard found invalid
  std::vector<LoadedFile> files;
};

LayoutScan ScanLayout(const Layout& layout, int new_shard_id,
                      int new_num_shards,
                      std::vector<std::string>* files_skipped) {
  LayoutScan scan;
  for (int i = 0; i < layout.num_shards; ++i) {
    const auto it = layout.shards.find(i);
    int skipped = 0;
    bool found = false;
    if (it != layout.shards.end()) {
      for (const CheckpointFile& file : it->second) {
        absl::StatusOr<LoadedFile> loaded = ReadCheckpointFile(
            file, i, layout.num_shards, new_shard_id, new_num_shards);
        if (loaded.ok()) {
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
  return scan;
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

  absl::StatusOr<std::vector<std::string>> names = ListDir(shard_dir);
  if (!names.ok()) return names.status();
  std::vector<int64_t> sequences;  // of this shard's checkpoint files
  for (const std::string& name : *names) {
    int64_t sequence = 0;
    if (ParseCheckpointFileName(name, &sequence)) {
      sequences.push_back(sequence);
    } else if (IsTempFileName(name)) {
      // Left by a write that crashed before its rename: never a checkpoint.
      const std::string path = JoinPath(shard_dir, name);
      if (::unlink(path.c_str()) == 0) {
        LOG(WARNING) << "removed leftover temporary checkpoint file " << path;
      } else if (errno != ENOENT) {
        LOG(WARNING) << ErrnoError(errno, "cannot remove leftover", path);
      }
    }
  }
  std::sort(sequences.begin(), sequences.end(), std::greater<int64_t>());
  const int64_t newest = sequences.empty() ? -1 : sequences.front();
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
  // A checkpoint that cannot fit is not started: on a full disk every try
  // would otherwise write (and delete) up to the model's size, and fill any
  // room that other writers (logs) free up. The files that the write would
  // prune anyway may go first, but never the newest: until a newer one is
  // complete and verified it is the last good checkpoint.
  absl::StatusOr<int64_t> free_bytes = FreeBytesAt(shard_dir);
  if (free_bytes.ok()) {
    const size_t keep_now = std::max(keep_last_ - 1, 1);
    while (*free_bytes < bytes && keep_last_ > 0 &&
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
          << keep_last_ << " checkpoints (logged once; --v=1 logs each)";
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

  const std::string temp_path =
      JoinPath(shard_dir, absl::StrCat(".", final_name, ".tmp-", ::getpid()));
  const int fd =
      ::open(temp_path.c_str(),
             O_WRONLY | O_CREAT | O_EXCL | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, "cannot create", temp_path);
  absl::Status status;
  uint32_t crc = 0;
  {
    FdCloser closer(fd);
    status = WriteCheckpointFile(snapshot, header, fd, temp_path, &crc);
    if (status.ok() && ::fsync(fd) != 0) {
      status = ErrnoError(errno, "cannot fsync", temp_path);
    }
    if (status.ok()) status = closer.Close(temp_path);
  }
  if (status.ok() && ::rename(temp_path.c_str(), final_path.c_str()) != 0) {
    status = ErrnoError(errno, absl::StrCat("cannot rename ", temp_path, " to"),
                        final_path);
  }
  if (!status.ok()) {
    // No failed try leaves its partial file behind to fill the disk.
    if (::unlink(temp_path.c_str()) != 0 && errno != ENOENT) {
      LOG(WARNING) << ErrnoError(errno, "cannot remove", temp_path);
    }
    return status;
  }
  if (absl::Status s = VerifyWritten(final_path, bytes, crc); !s.ok()) {
    ::unlink(final_path.c_str());
    return s;
  }
  if (absl::Status s = FsyncDir(shard_dir); !s.ok()) return s;
  info->written = true;

  // Pruning: the new file is durable and verified, so a failure here is only
  // reported.
  if (keep_last_ <= 0) return absl::OkStatus();
  names = ListDir(shard_dir);
  if (!names.ok()) {
    LOG(WARNING) << "not pruning old checkpoints: " << names.status();
    return absl::OkStatus();
  }
  sequences.clear();
  for (const std::string& name : *names) {
    int64_t sequence = 0;
    if (ParseCheckpointFileName(name, &sequence)) sequences.push_back(sequence);
  }
  std::sort(sequences.begin(), sequences.end(), std::greater<int64_t>());
  for (size_t k = keep_last_; k < sequences.size(); ++k) {
    const std::string path =
        JoinPath(shard_dir, CheckpointFileName(sequences[k]));
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      LOG(WARNING) << ErrnoError(errno, "cannot remove old checkpoint", path);
    }
  }
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

absl::StatusOr<int64_t> CheckpointFreeBytes(const std::string& dir) {
  return FreeBytesAt(dir);
}

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

  // Every checkpoint file, grouped by layout.
  std::map<int, Layout> layouts;
  int64_t max_sequence = -1;
  for (const std::string& entry : *entries) {
    int old_shard = 0, old_num_shards = 0;
    if (!ParseShardDirName(entry, &old_shard, &old_num_shards)) continue;
    const std::string shard_dir = JoinPath(dir_, entry);
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
      max_sequence = std::max(max_sequence, file.sequence);
      layout.shards[old_shard].push_back(std::move(file));
    }
  }
  if (layouts.empty()) {
    return absl::NotFoundError(absl::StrCat("no checkpoint in ", dir_));
  }
  for (auto& [n, layout] : layouts) {
    for (auto& [i, files] : layout.shards) {
      std::sort(files.begin(), files.end(),
                [](const CheckpointFile& a, const CheckpointFile& b) {
                  return a.sequence > b.sequence;
                });
    }
  }

  // The matching layout first, then the others, newest first.
  std::vector<const Layout*> order;
  for (const auto& [n, layout] : layouts) {
    if (n != num_shards) order.push_back(&layout);
  }
  std::sort(order.begin(), order.end(), [](const Layout* a, const Layout* b) {
    return std::make_tuple(a->newest_mtime_ns, a->max_sequence, a->num_shards) >
           std::make_tuple(b->newest_mtime_ns, b->max_sequence, b->num_shards);
  });
  if (const auto it = layouts.find(num_shards); it != layouts.end()) {
    order.insert(order.begin(), &it->second);
  }

  RestoredShard restored;
  restored.next_sequence = max_sequence + 1;
  const Layout* chosen = nullptr;
  LayoutScan scan;
  std::vector<std::string> incomplete;
  for (const Layout* layout : order) {
    scan = ScanLayout(*layout, shard_id, num_shards, &restored.files_skipped);
    if (scan.complete) {
      chosen = layout;
      break;
    }
    incomplete.push_back(
        absl::StrCat(ShardDirName(scan.missing_shard, layout->num_shards),
                     " has no valid checkpoint file (", scan.missing_skipped,
                     " invalid ones skipped)"));
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
  if (chosen->num_shards == num_shards) {
    for (const auto& [n, layout] : layouts) {
      if (n != num_shards && layout.newest_mtime_ns > chosen->newest_mtime_ns) {
        LOG(WARNING) << "restoring from the matching layout " << chosen->Name()
                     << " although " << layout.Name() << " in " << dir_
                     << " has newer files";
      }
    }
  }

  // The old shards must describe the same model and training setup.
  const LoadedFile& first = scan.files.front();
  for (const LoadedFile& other : scan.files) {
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

  // Every block the new shard owns, exactly once, in global order.
  const BlockGeometry geometry(first.header.schema());
  absl::flat_hash_map<int64_t, BlockSnapshot*> found;
  for (LoadedFile& file : scan.files) {
    for (BlockSnapshot& block : file.blocks) {
      found[block.global_block] = &block;
    }
  }
  const int64_t owned =
      OwnedBlockCount(geometry.num_blocks(), shard_id, num_shards);
  restored.blocks.reserve(std::min<int64_t>(owned, found.size()));
  int64_t state_per_element = -1;
  for (int64_t g = shard_id; g < geometry.num_blocks(); g += num_shards) {
    const auto it = found.find(g);
    const int old_shard = static_cast<int>(g % chosen->num_shards);
    if (it == found.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot restore shard ", shard_id, " of ", num_shards,
                       ": ", geometry.Describe(g), " is missing from ",
                       scan.files[old_shard].file.path));
    }
    BlockSnapshot& block = *it->second;
    const int64_t per_element =
        static_cast<int64_t>(block.optimizer_state.size()) /
        static_cast<int64_t>(block.value.size());
    if (state_per_element >= 0 && per_element != state_per_element) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoints disagree on optimizer state per element: ",
          geometry.Describe(g), " in ", scan.files[old_shard].file.path,
          " has ", per_element, ", earlier blocks ", state_per_element));
    }
    state_per_element = per_element;
    restored.blocks.push_back(std::move(block));
  }

  // Sparse rows: each old shard's share of the new shard's rows.
  const bool all_have_sparse = std::all_of(
      scan.files.begin(), scan.files.end(), [&](const LoadedFile& f) {
        return static_cast<int>(f.sparse.size()) ==
               first.header.schema().sparse_size();
      });
  if (first.header.schema().sparse_size() > 0 && !all_have_sparse) {
    LOG(WARNING) << "some checkpoint files hold no sparse rows (written by an "
                    "older ps_server): every table starts afresh";
  }
  for (int t = 0; all_have_sparse && t < first.header.schema().sparse_size();
       ++t) {
    SparseTableSnapshot& merged = restored.sparse.emplace_back();
    merged.name = first.sparse[t].name;
    merged.dim = first.sparse[t].dim;
    merged.state_floats = first.sparse[t].state_floats;
    merged.version = first.sparse[t].version;
    for (LoadedFile& file : scan.files) {
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
