// The checkpoint format's names, byte order and POSIX helpers
// (checkpoint_format.h).
#include "ps_server/checkpoint_format.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace pstrain {
namespace checkpoint_internal {
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

}  // namespace checkpoint_internal
}  // namespace pstrain
