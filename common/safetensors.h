// safetensors files: the tensor container numpy, PyTorch and most ML tools
// read (https://github.com/huggingface/safetensors), written and read here
// without a library.
//
// Layout:
//   8 bytes   N, unsigned little-endian: the length of the header
//   N bytes   a JSON object, UTF-8, padded with trailing spaces:
//               {"<name>": {"dtype": "F32", "shape": [2, 3],
//                           "data_offsets": [begin, end]}, ...,
//                "__metadata__": {"<key>": "<string value>", ...}}
//   the rest  the data buffer: every tensor's raw little-endian elements,
//             row-major; data_offsets are byte offsets into this buffer.
//
// The reader is strict, because a model file is user input: N must fit in
// the file (and 100 MB, the format's own cap), the header must be a JSON
// object with no duplicate keys, each tensor exactly {dtype, shape,
// data_offsets} with a known dtype and non-negative dimensions, its byte
// range exactly shape-product * element size, and the ranges must tile the
// data buffer exactly: contiguous from 0, in range, not overlapping, no
// bytes left over. Only the dtypes pstrain produces are accepted: F32
// (parameters and embedding rows), I64 and U64 (sparse ids).
#ifndef PSTRAIN_COMMON_SAFETENSORS_H_
#define PSTRAIN_COMMON_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace pstrain {

enum class SafetensorsDtype { kF32, kI64, kU64 };

// "F32", "I64", "U64".
const char* SafetensorsDtypeName(SafetensorsDtype dtype);

struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;  // empty: a scalar (one element)
  std::string data;            // raw little-endian elements

  static SafetensorsTensor F32(std::string name, std::vector<int64_t> shape,
                               absl::Span<const float> values);
  static SafetensorsTensor I64(std::string name, std::vector<int64_t> shape,
                               absl::Span<const int64_t> values);
  static SafetensorsTensor U64(std::string name, std::vector<int64_t> shape,
                               absl::Span<const uint64_t> values);

  int64_t NumElements() const;
  // The elements, when the dtype matches (checked by the caller).
  std::vector<float> AsF32() const;
  std::vector<int64_t> AsI64() const;
  std::vector<uint64_t> AsU64() const;
};

struct SafetensorsFile {
  // Tensors in file order (the writer lays them out in this order).
  std::vector<SafetensorsTensor> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"

  // The tensor named `name`, or null.
  const SafetensorsTensor* Find(absl::string_view name) const;
};

// The file's bytes. InvalidArgument for a tensor whose data length does not
// match its shape and dtype, or for empty or duplicate names (or the
// reserved "__metadata__").
absl::StatusOr<std::string> SerializeSafetensors(const SafetensorsFile& file);

// Parses a whole file's bytes. Every error is InvalidArgument (DataLoss for
// a truncated file) whose message says what is wrong and, where there is
// one, names the tensor; `source` (a path) prefixes it.
absl::StatusOr<SafetensorsFile> ParseSafetensors(absl::string_view bytes,
                                                 absl::string_view source);

// Serializes and writes atomically (temporary file + rename).
absl::Status WriteSafetensorsFile(const std::string& path,
                                  const SafetensorsFile& file);
// Reads and parses `path`; NotFound / PermissionDenied name the path.
absl::StatusOr<SafetensorsFile> ReadSafetensorsFile(const std::string& path);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_SAFETENSORS_H_
