// Tensor payloads on the wire: raw little-endian elements in a `bytes`
// field (a `repeated float` was measured ~3x slower to serialize here).
#ifndef PSTRAIN_COMMON_TENSOR_CODEC_H_
#define PSTRAIN_COMMON_TENSOR_CODEC_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/ps.pb.h"

namespace pstrain {

// Bytes per element of a wire type, or 0 for a type this build cannot decode.
int64_t WireElementBytes(DataType dtype);

// Replaces *out with the float32 encoding of values (reusing its capacity).
void EncodeFloat32(absl::Span<const float> values, std::string* out);

// Decodes `bytes` of type `dtype` into out. The byte count must be exactly
// out.size() elements; a mismatch or an unsupported type is InvalidArgument
// and leaves out untouched.
absl::Status DecodeToFloat32(DataType dtype, absl::string_view bytes,
                             absl::Span<float> out);

// The index of the first NaN or infinity in the float32 payload, or -1.
int64_t FindNonFinite(absl::string_view float32_bytes);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TENSOR_CODEC_H_
