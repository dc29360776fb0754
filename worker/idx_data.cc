#include "worker/idx_data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace pstrain {
namespace {

constexpr uint8_t kUnsignedByte = 0x08;
constexpr int kGzipMagic0 = 0x1f, kGzipMagic1 = 0x8b;
// Header bytes before the dimensions: 0x00 0x00 type ndims.
constexpr int64_t kMagicBytes = 4;

absl::Status FileError(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// Closes the descriptor it owns.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd = -1) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  ~FileDescriptor() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads exactly `size` bytes at `offset`; false at a short read.
bool ReadAt(int fd, int64_t offset, int64_t size, uint8_t* out) {
  while (size > 0) {
    const ssize_t n = pread(fd, out, size, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    out += n;
    offset += n;
    size -= n;
  }
  return true;
}

// The whole decompressed content of a gzip file. `size_hint`: the size the
// gzip trailer states (mod 2^32), reserved up front so that the buffer is
// not grown by doubling, which would briefly need twice the memory.
absl::StatusOr<std::vector<uint8_t>> Inflate(const std::string& path,
                                             uint32_t size_hint) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  gzbuffer(file, 1 << 17);
  std::vector<uint8_t> out;
  out.reserve(size_hint);
  constexpr int kChunk = 1 << 20;
  std::vector<uint8_t> chunk(kChunk);
  int n;
  while ((n = gzread(file, chunk.data(), kChunk)) > 0) {
    out.insert(out.end(), chunk.begin(), chunk.begin() + n);
  }
  int error_number = Z_OK;
  // zlib puts the path in front of its message; ours names the file already.
  absl::string_view error = gzerror(file, &error_number);
  absl::ConsumePrefix(&error, path + ": ");
  const std::string zlib_error(error);
  // gzclose_r also reports a stream that ended before its trailer.
  const int closed = gzclose_r(file);
  if (n < 0 || error_number != Z_OK || closed != Z_OK) {
    return FileError(
        path,
        absl::StrCat("corrupt or truncated gzip data (zlib: ",
                     zlib_error.empty() ? "stream ended early" : zlib_error,
                     "); the file is damaged, fetch it again"));
  }
  return out;
}

// What the header of an IDX file says.
struct IdxHeader {
  std::vector<int64_t> dims;
  int64_t header_bytes = 0;
  int64_t data_bytes = 0;  // product of dims: one byte per element
};

// Parses the header at the start of `bytes` (`size` of them available),
// expecting `want_dims` dimensions ("images" files: 3, "labels": 1).
absl::StatusOr<IdxHeader> ParseHeader(const std::string& path,
                                      const uint8_t* bytes, int64_t size,
                                      int want_dims, const char* what) {
  const uint32_t want_magic = (kUnsignedByte << 8) | want_dims;
  if (size < kMagicBytes) {
    return FileError(path, absl::StrFormat("too short to be an IDX %s file "
                                           "(%d bytes)",
                                           what, size));
  }
  const uint32_t magic = (uint32_t{bytes[0]} << 24) |
                         (uint32_t{bytes[1]} << 16) |
                         (uint32_t{bytes[2]} << 8) | bytes[3];
  if (magic != want_magic) {
    return FileError(path,
                     absl::StrFormat("not an IDX %s file: magic number 0x%08x, "
                                     "expected 0x%08x (unsigned bytes, %d "
                                     "dimension%s)",
                                     what, magic, want_magic, want_dims,
                                     want_dims == 1 ? "" : "s"));
  }
  IdxHeader header;
  header.header_bytes = kMagicBytes + 4 * want_dims;
  if (size < header.header_bytes) {
    return FileError(path, absl::StrFormat("truncated in its header (%d of %d "
                                           "bytes)",
                                           size, header.header_bytes));
  }
  header.data_bytes = 1;
  for (int d = 0; d < want_dims; ++d) {
    const uint8_t* p = bytes + kMagicBytes + 4 * d;
    const uint32_t dim = (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) |
                         (uint32_t{p[2]} << 8) | p[3];
    if (dim == 0 ||
        dim > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
      return FileError(path, absl::StrFormat("dimension %d is %u: must be in "
                                             "[1, 2^31)",
                                             d, dim));
    }
    header.dims.push_back(dim);
    if (header.data_bytes > (int64_t{1} << 40) / dim) {
      return FileError(path, "dimensions multiply to more than 2^40 bytes");
    }
    header.data_bytes *= dim;
  }
  return header;
}

// The data must be exactly as long as the header says.
absl::Status CheckLength(const std::string& path, const IdxHeader& header,
                         int64_t file_bytes, const char* what) {
  const int64_t have = file_bytes - header.header_bytes;
  if (have < header.data_bytes) {
    return FileError(
        path, absl::StrFormat("truncated: the header announces %d %s (%d "
                              "bytes of data) but only %d bytes follow",
                              header.dims[0], what, header.data_bytes, have));
  }
  if (have > header.data_bytes) {
    return FileError(
        path, absl::StrFormat("%d bytes after the %d %s the header announces "
                              "(not an IDX file, or two files joined?)",
                              have - header.data_bytes, header.dims[0], what));
  }
  return absl::OkStatus();
}

bool IsGzip(const uint8_t* bytes, int64_t size) {
  return size >= 2 && bytes[0] == kGzipMagic0 && bytes[1] == kGzipMagic1;
}

// The uncompressed size a gzip file's trailer states (little-endian, mod
// 2^32); 0 when unreadable. Only a hint: the data is checked as it inflates.
uint32_t GzipSizeHint(int fd, int64_t file_bytes) {
  uint8_t trailer[4];
  if (file_bytes < 18 || !ReadAt(fd, file_bytes - 4, 4, trailer)) return 0;
  const uint32_t size = uint32_t{trailer[0]} | (uint32_t{trailer[1]} << 8) |
                        (uint32_t{trailer[2]} << 16) |
                        (uint32_t{trailer[3]} << 24);
  // A damaged trailer must not turn into a huge allocation.
  return size <= (uint32_t{1} << 31) ? size : 0;
}

// The file's first bytes, to tell gzip from IDX and read the header.
absl::StatusOr<std::pair<FileDescriptor, std::vector<uint8_t>>> OpenAndPeek(
    const std::string& path, int64_t* file_bytes) {
  FileDescriptor fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat info;
  if (fstat(fd.get(), &info) != 0 || !S_ISREG(info.st_mode)) {
    return FileError(path, "not a regular file");
  }
  *file_bytes = info.st_size;
  std::vector<uint8_t> head(std::min<int64_t>(info.st_size, 64));
  if (!ReadAt(fd.get(), 0, head.size(), head.data())) {
    return absl::DataLossError(
        absl::StrCat(path, ": read failed: ", std::strerror(errno)));
  }
  return std::make_pair(std::move(fd), std::move(head));
}

// A labels file, read whole (one byte per example).
absl::StatusOr<std::vector<int32_t>> ReadLabels(const std::string& path) {
  int64_t file_bytes = 0;
  auto opened = OpenAndPeek(path, &file_bytes);
  if (!opened.ok()) return opened.status();
  std::vector<uint8_t> content;
  if (IsGzip(opened->second.data(), opened->second.size())) {
    absl::StatusOr<std::vector<uint8_t>> inflated =
        Inflate(path, GzipSizeHint(opened->first.get(), file_bytes));
    if (!inflated.ok()) return inflated.status();
    content = std::move(*inflated);
  } else {
    content.resize(file_bytes);
    if (!ReadAt(opened->first.get(), 0, file_bytes, content.data())) {
      return absl::DataLossError(
          absl::StrCat(path, ": read failed: ", std::strerror(errno)));
    }
  }
  absl::StatusOr<IdxHeader> header =
      ParseHeader(path, content.data(), content.size(), 1, "labels");
  if (!header.ok()) return header.status();
  if (absl::Status s = CheckLength(path, *header, content.size(), "labels");
      !s.ok()) {
    return s;
  }
  return std::vector<int32_t>(content.begin() + header->header_bytes,
                              content.end());
}

class IdxSource : public ExampleSource {
 public:
  IdxSource(int64_t num_features, int64_t num_classes,
            std::vector<int32_t> labels, FileDescriptor fd, int64_t data_offset,
            std::vector<uint8_t> inflated)
      : num_features_(num_features),
        num_classes_(num_classes),
        labels_(std::move(labels)),
        fd_(std::move(fd)),
        data_offset_(data_offset),
        inflated_(std::move(inflated)) {}

  int64_t size() const override { return labels_.size(); }
  int64_t num_features() const override { return num_features_; }
  int64_t num_classes() const override { return num_classes_; }

  absl::Status Gather(absl::Span<const int64_t> indices, float* features,
                      int32_t* labels) const override {
    std::vector<uint8_t> record(inflated_.empty() ? num_features_ : 0);
    for (size_t r = 0; r < indices.size(); ++r) {
      const int64_t i = indices[r];
      if (i < 0 || i >= size()) {
        return absl::OutOfRangeError(
            absl::StrCat("example ", i, " is out of range [0, ", size(), ")"));
      }
      const int64_t offset = data_offset_ + i * num_features_;
      const uint8_t* pixels;
      if (inflated_.empty()) {
        if (!ReadAt(fd_.get(), offset, num_features_, record.data())) {
          return absl::DataLossError(
              absl::StrCat("reading example ", i,
                           " of an IDX file failed (changed "
                           "while training?): ",
                           std::strerror(errno)));
        }
        pixels = record.data();
      } else {
        pixels = inflated_.data() + offset;
      }
      float* row = features + r * num_features_;
      for (int64_t j = 0; j < num_features_; ++j) {
        row[j] = pixels[j] * (1.0f / 255.0f);
      }
      labels[r] = labels_[i];
    }
    return absl::OkStatus();
  }

  int64_t resident_bytes() const override {
    return static_cast<int64_t>(labels_.size() * sizeof(int32_t) +
                                inflated_.size());
  }

 private:
  const int64_t num_features_;
  const int64_t num_classes_;
  const std::vector<int32_t> labels_;
  const FileDescriptor fd_;    // uncompressed: records are read from here
  const int64_t data_offset_;  // where example 0 starts (in the file or
                               // in inflated_)
  const std::vector<uint8_t> inflated_;  // gzipped: the whole file
};

}  // namespace

absl::StatusOr<std::unique_ptr<ExampleSource>> OpenIdx(
    const std::string& images_path, const std::string& labels_path,
    int64_t num_classes) {
  absl::StatusOr<std::vector<int32_t>> labels = ReadLabels(labels_path);
  if (!labels.ok()) return labels.status();

  int64_t file_bytes = 0;
  auto opened = OpenAndPeek(images_path, &file_bytes);
  if (!opened.ok()) return opened.status();
  FileDescriptor fd = std::move(opened->first);
  std::vector<uint8_t> inflated;
  const uint8_t* head = opened->second.data();
  int64_t head_bytes = opened->second.size();
  if (IsGzip(head, head_bytes)) {
    absl::StatusOr<std::vector<uint8_t>> content =
        Inflate(images_path, GzipSizeHint(fd.get(), file_bytes));
    if (!content.ok()) return content.status();
    inflated = std::move(*content);
    // Exact unless the trailer lied (then the file fails its CRC anyway).
    inflated.shrink_to_fit();
    fd = FileDescriptor();
    head = inflated.data();
    head_bytes = file_bytes = inflated.size();
  }
  absl::StatusOr<IdxHeader> header =
      ParseHeader(images_path, head, head_bytes, 3, "images");
  if (!header.ok()) return header.status();
  if (absl::Status s = CheckLength(images_path, *header, file_bytes, "images");
      !s.ok()) {
    return s;
  }
  const int64_t count = header->dims[0];
  if (count != static_cast<int64_t>(labels->size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        images_path, ": ", count, " images, but ", labels_path, " holds ",
        labels->size(), " labels: not a matching pair of files"));
  }
  const int64_t inferred = InferNumClasses(*labels);
  if (num_classes > 0) {
    for (size_t i = 0; i < labels->size(); ++i) {
      if ((*labels)[i] >= num_classes) {
        return FileError(labels_path,
                         absl::StrCat("label ", (*labels)[i], " (example ", i,
                                      ") is out of range [0, ", num_classes,
                                      "): set --num_classes to ", inferred,
                                      " or more (0 infers it)"));
      }
    }
  } else {
    num_classes = inferred;
  }
  return std::make_unique<IdxSource>(
      header->dims[1] * header->dims[2], num_classes, std::move(*labels),
      std::move(fd), header->header_bytes, std::move(inflated));
}

absl::StatusOr<IdxDataset> FindIdxDataset(const std::string& dir) {
  auto find = [&](const std::string& stem) -> absl::StatusOr<std::string> {
    for (const std::string& name : {stem + ".gz", stem}) {
      const std::string path = absl::StrCat(dir, "/", name);
      if (access(path.c_str(), R_OK) == 0) return path;
    }
    return absl::NotFoundError(absl::StrCat(
        dir, ": no readable ", stem,
        "[.gz] (an MNIST-layout directory; for "
        "Fashion-MNIST install the Debian package dataset-fashion-mnist)"));
  };
  IdxDataset found;
  const std::pair<std::string*, const char*> files[] = {
      {&found.train_images, "train-images-idx3-ubyte"},
      {&found.train_labels, "train-labels-idx1-ubyte"},
      {&found.test_images, "t10k-images-idx3-ubyte"},
      {&found.test_labels, "t10k-labels-idx1-ubyte"}};
  for (const auto& [out, stem] : files) {
    absl::StatusOr<std::string> path = find(stem);
    if (!path.ok()) return path.status();
    *out = std::move(*path);
  }
  return found;
}

}  // namespace pstrain
