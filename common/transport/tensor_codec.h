// Tensor payloads on the wire: raw little-endian elements in a `bytes`
// field (a `repeated float` was measured ~3x slower to serialize here).
//
// A received payload need not be contiguous: a zero-copy receiver sees it as
// the gRPC slices it arrived in, cut at arbitrary byte boundaries, so the
// decoders here take a list of segments and handle an element that straddles
// two of them.
#ifndef PSTRAIN_COMMON_TRANSPORT_TENSOR_CODEC_H_
#define PSTRAIN_COMMON_TRANSPORT_TENSOR_CODEC_H_

#include <cstdint>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/ps.pb.h"

namespace pstrain {

// A byte string given as consecutive pieces (in order; any piece may be
// empty). Four inline pieces cover the usual case of a payload split across
// a couple of gRPC slices without a heap allocation.
using ByteSegments = absl::InlinedVector<absl::string_view, 4>;

// The wire type a flag names: fp32, fp16, bf16 or topk; InvalidArgument
// naming the choices otherwise.
absl::StatusOr<DataType> ParseWireType(absl::string_view name);

// The parameters' wire type a flag names (--parameter_wire_type): fp32,
// fp16 or bf16; InvalidArgument naming the choices otherwise.
absl::StatusOr<DataType> ParseParameterWireType(absl::string_view name);

// Bytes per element of a wire type: FLOAT32 4, FLOAT16 2, BFLOAT16 2, or 0
// for a value this build cannot decode (proto3 enums are open, so a newer
// peer may send one).
int64_t WireElementBytes(DataType dtype);

// Replaces *out with the float32 encoding of values (reusing its capacity).
// Same as EncodeFromFloat32(FLOAT32, ...).
void EncodeFloat32(absl::Span<const float> values, std::string* out);

// Replaces *out with `values` converted to `dtype` (reusing its capacity):
//   FLOAT32   bit-exact copy.
//   FLOAT16   IEEE binary16, round to nearest even; magnitudes that round
//             past 65504 become +-inf, float32 subnormal range becomes fp16
//             subnormals or +-0, NaN stays a (quiet) NaN.
//   BFLOAT16  the top 16 bits rounded to nearest even (overflow rounds to
//             +-inf as IEEE does); NaN stays a (quiet) NaN.
// Conversions assume the default rounding mode (round to nearest); flush-
// to-zero settings do not change results. `dtype` must be one
// WireElementBytes() knows: anything else is a bug in the caller (the sender
// picks its own type), and aborts.
void EncodeFromFloat32(DataType dtype, absl::Span<const float> values,
                       std::string* out);

// Checks that `data` is a well-formed payload of `num_elements` elements of
// `dtype`, naming the problem: the exact size for dense types; for
// TOPK_FLOAT32 a size of 8k bytes with k <= num_elements, and indices
// strictly increasing and below num_elements. Decoders assume it passed.
absl::Status ValidatePayload(DataType dtype, const ByteSegments& data,
                             int64_t num_elements);

// Top-k compression with error feedback: writes the k entries of
// `accumulated` with the largest magnitudes (ties: the lower index) to *out
// as a TOPK_FLOAT32 payload, and zeroes them in `accumulated`, which keeps
// what was not sent for the caller's next push (add the next gradient to
// it). k >= accumulated.size() sends every element.
void EncodeTopK(absl::Span<float> accumulated, int64_t k, std::string* out);

// Decodes the payload `data` of type `dtype` into out: out[i] = x[i], or
// out[i] += x[i] when `accumulate`. The payload must hold exactly out.size()
// elements (TOPK_FLOAT32: pass ValidatePayload for out.size()); a size
// mismatch or an unsupported type is InvalidArgument and leaves out
// untouched. Elements may straddle segment boundaries. For
// FLOAT32 the bulk of each segment is a memcpy (overwrite) or a vectorizable
// add loop (accumulate), whatever the segment's alignment.
absl::Status DecodeSegments(DataType dtype, const ByteSegments& data,
                            absl::Span<float> out, bool accumulate);

// Decodes the payload, which must hold exactly `num_elements` elements, in
// consecutive pieces of at most kDecodePieceElements, calling
// visit(offset, piece) for each in order. For a consumer that can take the
// values a piece at a time (an elementwise update): each piece stays in L1,
// instead of a whole decoded copy making a round trip through memory.
// Errors as DecodeSegments, before any visit.
inline constexpr int64_t kDecodePieceElements = 4096;
absl::Status DecodeSegmentsInPieces(
    DataType dtype, const ByteSegments& data, int64_t num_elements,
    absl::FunctionRef<void(int64_t offset, absl::Span<const float> piece)>
        visit);

// The index of the first NaN or infinity in the payload, or -1 if there is
// none. FLOAT16/BFLOAT16 are checked by bit pattern, without converting.
// A trailing partial element is ignored, and an unsupported type returns -1:
// size and type are DecodeSegments' to check.
int64_t FindNonFiniteSegments(DataType dtype, const ByteSegments& data);

// Single-buffer forms of the above, kept for callers that hold a parsed
// TensorBlock.
//
// DecodeSegments(dtype, {bytes}, out, /*accumulate=*/false).
absl::Status DecodeToFloat32(DataType dtype, absl::string_view bytes,
                             absl::Span<float> out);

// FindNonFiniteSegments(FLOAT32, {float32_bytes}).
int64_t FindNonFinite(absl::string_view float32_bytes);

// Scalar conversions, exposed for tests and for code that converts one value
// at a time. Semantics as in EncodeFromFloat32.
uint16_t FloatToHalfBits(float value);
float HalfBitsToFloat(uint16_t bits);
uint16_t FloatToBfloat16Bits(float value);
float Bfloat16BitsToFloat(uint16_t bits);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_TENSOR_CODEC_H_
