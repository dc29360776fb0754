// What the checkpoint sources share (ps_server/checkpoint_*.cc and
// checkpoint.cc): the file format's constants, names and byte order, the
// POSIX helpers, and the block geometry a header is checked against. The
// public API is checkpoint.h; only those files include this.
//
// The format (checkpoint.h says what a checkpoint holds):
//   kMagic (8) | u64 header length | CheckpointHeader | payload | trailer
// where the trailer is the CRC-32 of everything before it and kEndMagic.
#ifndef PSTRAIN_PS_SERVER_CHECKPOINT_FORMAT_H_
#define PSTRAIN_PS_SERVER_CHECKPOINT_FORMAT_H_

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/partition.h"
#include "common/status_text.h"
#include "proto/ps.pb.h"

namespace pstrain {
namespace checkpoint_internal {

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

// Names and paths: shard-<i>-of-<n>/ckpt-<12 digits>.pstrain.
std::string JoinPath(absl::string_view dir, absl::string_view name);
std::string ShardDirName(int shard_id, int num_shards);
std::string CheckpointFileName(int64_t sequence);
// Only the canonical spellings (no leading zeros), so two names never
// mean the same shard or sequence.
bool ParseShardDirName(absl::string_view name, int* shard_id, int* num_shards);
bool ParseCheckpointFileName(absl::string_view name, int64_t* sequence);
bool IsTempFileName(absl::string_view name);

// Little-endian integers and floats.
void PutLE64(uint64_t v, char* out);
void PutLE32(uint32_t v, char* out);
uint64_t GetLE64(const char* in);
uint32_t GetLE32(const char* in);
#if defined(ABSL_IS_BIG_ENDIAN)
void ByteSwapFloats(float* data, size_t n);
#endif

// POSIX helpers: every error names the path and the errno text.
absl::Status ErrnoError(int error, absl::string_view what,
                        absl::string_view path);
absl::Status WriteAll(int fd, const char* data, size_t n,
                      const std::string& path);
absl::Status FsyncDir(const std::string& path);
absl::Status MakeDirs(const std::string& path);
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path);

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

}  // namespace checkpoint_internal
}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_CHECKPOINT_FORMAT_H_
