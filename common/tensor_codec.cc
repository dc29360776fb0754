#include "common/tensor_codec.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pstrain {

static_assert(sizeof(float) == 4, "float32 wire format needs 4-byte floats");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "The wire format is little-endian; this build assumes a matching host."
#endif

int64_t WireElementBytes(DataType dtype) {
  switch (dtype) {
    case FLOAT32:
      return 4;
    default:
      return 0;
  }
}

void EncodeFloat32(absl::Span<const float> values, std::string* out) {
  out->resize(values.size() * sizeof(float));
  if (!values.empty()) std::memcpy(out->data(), values.data(), out->size());
}

absl::Status DecodeToFloat32(DataType dtype, absl::string_view bytes,
                             absl::Span<float> out) {
  const int64_t element_bytes = WireElementBytes(dtype);
  if (element_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported wire type ", DataType_Name(dtype)));
  }
  const uint64_t expected = static_cast<uint64_t>(out.size()) * element_bytes;
  if (bytes.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload has ", bytes.size(), " bytes, expected ", expected, " (",
        out.size(), " ", DataType_Name(dtype), " elements)"));
  }
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return absl::OkStatus();
}

int64_t FindNonFinite(absl::string_view float32_bytes) {
  const int64_t n = float32_bytes.size() / sizeof(float);
  const char* p = float32_bytes.data();
  for (int64_t i = 0; i < n; ++i) {
    float v;
    std::memcpy(&v, p + i * sizeof(float), sizeof(float));
    if (!std::isfinite(v)) return i;
  }
  return -1;
}

}  // namespace pstrain
