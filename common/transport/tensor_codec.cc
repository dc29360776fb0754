#include "common/transport/tensor_codec.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "absl/base/internal/endian.h"
#include "absl/strings/str_cat.h"

namespace pstrain {

static_assert(sizeof(float) == 4, "float32 wire format needs 4-byte floats");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "The wire format is little-endian; this build assumes a matching host."
#endif

namespace {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The name of a wire type for messages; proto3 enums are open, so a value
// with no name is printed as its number.
std::string TypeName(DataType dtype) {
  if (DataType_IsValid(dtype)) return DataType_Name(dtype);
  return absl::StrCat(static_cast<int>(dtype));
}

// Loads element i of a run of little-endian wire elements as a float. memcpy
// keeps the load legal at any alignment (gRPC slices promise none); it
// compiles to a plain (vector) load.
template <DataType kType>
inline float LoadElement(const char* p);

template <>
inline float LoadElement<FLOAT32>(const char* p) {
  float f;
  std::memcpy(&f, p, sizeof(f));
  return f;
}

template <>
inline float LoadElement<FLOAT16>(const char* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return HalfBitsToFloat(h);
}

template <>
inline float LoadElement<BFLOAT16>(const char* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return Bfloat16BitsToFloat(h);
}

// True when the wire element at p is NaN or +-inf: its exponent is all ones.
template <DataType kType>
inline bool IsNonFinite(const char* p);

template <>
inline bool IsNonFinite<FLOAT32>(const char* p) {
  uint32_t u;
  std::memcpy(&u, p, sizeof(u));
  return (u & 0x7f800000u) == 0x7f800000u;
}

template <>
inline bool IsNonFinite<FLOAT16>(const char* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return (h & 0x7c00u) == 0x7c00u;
}

template <>
inline bool IsNonFinite<BFLOAT16>(const char* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return (h & 0x7f80u) == 0x7f80u;
}

template <DataType kType>
constexpr int64_t kElementBytes = kType == FLOAT32 ? 4 : 2;

// The bulk loops below use GCC/Clang vector extensions: 16-byte vectors map
// to SSE2 on x86-64 (always present) and NEON on ARM. Spelled out because
// at -O2 GCC 12 vectorizes none of these loops by itself (its "very cheap"
// cost model refuses loops that need a scalar epilogue). Other compilers
// get the scalar loops, which are also the tails here.
#if defined(__GNUC__)
#define PSTRAIN_TENSOR_CODEC_SIMD 1
typedef float F32x4 __attribute__((vector_size(16)));
typedef uint32_t U32x4 __attribute__((vector_size(16)));
typedef uint16_t U16x4 __attribute__((vector_size(8)));
typedef uint16_t U16x8 __attribute__((vector_size(16)));

// Unaligned vector load/store: gRPC slices promise no alignment.
template <typename V>
inline V LoadVector(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
inline void StoreVector(void* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

template <typename To, typename From>
inline To VectorBits(From from) {
  static_assert(sizeof(To) == sizeof(From), "same-size vectors only");
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

// Lane-wise mask ? a : b, for masks of all-ones or all-zeros lanes.
inline U32x4 Select(U32x4 mask, U32x4 a, U32x4 b) {
  return (mask & a) | (~mask & b);
}

template <typename V>
inline bool AnyLaneSet(V v) {
  static_assert(sizeof(V) == 16, "16-byte vectors only");
  uint64_t words[2];
  std::memcpy(words, &v, sizeof(words));
  return (words[0] | words[1]) != 0;
}

// Four wire elements at p as floats: the lane-wise HalfBitsToFloat /
// Bfloat16BitsToFloat (same algorithm, so bit-identical results).
template <DataType kType>
inline F32x4 LoadFour(const char* p) {
  if constexpr (kType == FLOAT32) {
    return LoadVector<F32x4>(p);
  } else if constexpr (kType == BFLOAT16) {
    const U32x4 h = __builtin_convertvector(LoadVector<U16x4>(p), U32x4);
    return VectorBits<F32x4>(h << 16);
  } else {
    const U32x4 h = __builtin_convertvector(LoadVector<U16x4>(p), U32x4);
    const U32x4 sign = (h & 0x8000u) << 16;
    U32x4 o = (h & 0x7fffu) << 13;
    const U32x4 exponent = o & 0x0f800000u;
    o += static_cast<uint32_t>(127 - 15) << 23;
    const U32x4 special = (U32x4)(exponent == 0x0f800000u);
    o += special & (static_cast<uint32_t>(128 - 16) << 23);
    const U32x4 small = (U32x4)(exponent == 0u);
    const F32x4 magic = VectorBits<F32x4>(U32x4{} + (113u << 23));
    const U32x4 renormalized =
        VectorBits<U32x4>(VectorBits<F32x4>(o + (1u << 23)) - magic);
    return VectorBits<F32x4>(Select(small, renormalized, o) | sign);
  }
}

// Four floats at p converted as FloatToHalfBits / FloatToBfloat16Bits.
template <DataType kType>
inline U16x4 ConvertFour(const float* p) {
  U32x4 x = VectorBits<U32x4>(LoadVector<F32x4>(p));
  if constexpr (kType == BFLOAT16) {
    const U32x4 nan = (U32x4)((x & 0x7fffffffu) > 0x7f800000u);
    const U32x4 rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    return __builtin_convertvector(Select(nan, (x >> 16) | 0x40u, rounded),
                                   U16x4);
  } else {
    const U32x4 sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    const U32x4 nan = (U32x4)(x > 0x7f800000u);
    const U32x4 overflow = (U32x4)(x >= 0x47800000u);
    const U32x4 small = (U32x4)(x < 0x38800000u);
    const U32x4 normal = (x + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu +
                          ((x >> 13) & 1u)) >>
                         13;
    // Below 2^-14: adding 0.5 leaves the value rounded (to nearest even)
    // to a multiple of 2^-24 in the low mantissa bits. The scalar code
    // rounds with integers instead; both agree under the default rounding
    // mode, and flush-to-zero cannot matter (the sum is >= 0.5, and inputs
    // a denormals-are-zero CPU drops round to zero anyway).
    const U32x4 half = U32x4{} + 0x3f000000u;  // 0.5f
    const U32x4 subnormal =
        VectorBits<U32x4>(VectorBits<F32x4>(x) + VectorBits<F32x4>(half)) -
        half;
    U32x4 r = Select(small, subnormal, normal);
    r = Select(overflow, U32x4{} + 0x7c00u, r);
    r = Select(nan, 0x7e00u | ((x >> 13) & 0x3ffu), r);
    return __builtin_convertvector(r | sign, U16x4);
  }
}
#endif  // __GNUC__

// Decodes n contiguous wire elements at src into dst.
template <DataType kType, bool kAccumulate>
void DecodeRun(const char* src, int64_t n, float* dst) {
  constexpr int64_t kBytes = kElementBytes<kType>;
  if constexpr (kType == FLOAT32 && !kAccumulate) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  int64_t i = 0;
#ifdef PSTRAIN_TENSOR_CODEC_SIMD
  for (; i + 4 <= n; i += 4) {
    const F32x4 v = LoadFour<kType>(src + i * kBytes);
    if constexpr (kAccumulate) {
      StoreVector(dst + i, LoadVector<F32x4>(dst + i) + v);
    } else {
      StoreVector(dst + i, v);
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = LoadElement<kType>(src + i * kBytes);
    if constexpr (kAccumulate) {
      dst[i] += v;
    } else {
      dst[i] = v;
    }
  }
}

// Whether any of n contiguous wire elements is non-finite, without branching
// per element.
template <DataType kType>
bool AnyNonFinite(const char* src, int64_t n) {
  constexpr int64_t kBytes = kElementBytes<kType>;
  int64_t i = 0;
  bool any = false;
#ifdef PSTRAIN_TENSOR_CODEC_SIMD
  constexpr int64_t kLanes = 16 / kBytes;
  if constexpr (kType == FLOAT32) {
    U32x4 found = {};
    for (; i + kLanes <= n; i += kLanes) {
      const U32x4 v = LoadVector<U32x4>(src + i * kBytes);
      found |= (U32x4)((v & 0x7f800000u) == 0x7f800000u);
    }
    any = AnyLaneSet(found);
  } else {
    constexpr uint16_t kExponent = kType == FLOAT16 ? 0x7c00 : 0x7f80;
    U16x8 found = {};
    for (; i + kLanes <= n; i += kLanes) {
      const U16x8 v = LoadVector<U16x8>(src + i * kBytes);
      found |= (U16x8)((v & kExponent) == kExponent);
    }
    any = AnyLaneSet(found);
  }
#endif
  for (; i < n; ++i) any |= IsNonFinite<kType>(src + i * kBytes);
  return any;
}

// The index of the first non-finite element among n contiguous ones, or -1.
// Scans in chunks without branches, so the common all-finite case runs at
// memory speed; only a chunk that has one is rescanned for its position.
template <DataType kType>
int64_t FindNonFiniteRun(const char* src, int64_t n) {
  constexpr int64_t kBytes = kElementBytes<kType>;
  constexpr int64_t kChunk = 256;
  for (int64_t base = 0; base < n; base += kChunk) {
    const int64_t end = std::min(n, base + kChunk);
    if (!AnyNonFinite<kType>(src + base * kBytes, end - base)) continue;
    for (int64_t i = base; i < end; ++i) {
      if (IsNonFinite<kType>(src + i * kBytes)) return i;
    }
  }
  return -1;
}

// Walks the whole elements of a segmented payload in order, calling
// run(const char* bytes, int64_t first_index, int64_t count) for each
// maximal contiguous run of them. An element cut by a segment boundary is
// reassembled in a small buffer and handed over as a run of one. Stops early
// when run returns false. A trailing partial element is never visited.
template <int64_t kBytes, typename Run>
void ForEachElementRun(const ByteSegments& data, Run&& run) {
  char carry[kBytes];
  int64_t carry_len = 0;
  int64_t index = 0;
  for (const absl::string_view segment : data) {
    if (segment.empty()) continue;  // also keeps memcpy away from nullptr
    const char* p = segment.data();
    int64_t left = static_cast<int64_t>(segment.size());
    if (carry_len > 0) {
      const int64_t take = std::min(left, kBytes - carry_len);
      std::memcpy(carry + carry_len, p, take);
      carry_len += take;
      p += take;
      left -= take;
      if (carry_len < kBytes) continue;
      if (!run(static_cast<const char*>(carry), index, int64_t{1})) return;
      ++index;
      carry_len = 0;
    }
    const int64_t n = left / kBytes;
    if (n > 0) {
      if (!run(p, index, n)) return;
      index += n;
      p += n * kBytes;
      left -= n * kBytes;
    }
    if (left > 0) {
      std::memcpy(carry, p, left);
      carry_len = left;
    }
  }
}

template <DataType kType, bool kAccumulate>
void DecodeAll(const ByteSegments& data, float* out) {
  ForEachElementRun<kElementBytes<kType>>(
      data, [out](const char* p, int64_t first, int64_t n) {
        DecodeRun<kType, kAccumulate>(p, n, out + first);
        return true;
      });
}

template <DataType kType>
int64_t FindNonFiniteAll(const ByteSegments& data) {
  int64_t found = -1;
  ForEachElementRun<kElementBytes<kType>>(
      data, [&found](const char* p, int64_t first, int64_t n) {
        const int64_t i = FindNonFiniteRun<kType>(p, n);
        if (i < 0) return true;
        found = first + i;
        return false;
      });
  return found;
}

template <DataType kType, uint16_t (*kConvert)(float)>
void EncodeHalfWidth(absl::Span<const float> values, std::string* out) {
  out->resize(values.size() * sizeof(uint16_t));
  char* dst = out->data();
  const float* src = values.data();
  const size_t n = values.size();
  size_t i = 0;
#ifdef PSTRAIN_TENSOR_CODEC_SIMD
  for (; i + 4 <= n; i += 4) {
    StoreVector(dst + i * sizeof(uint16_t), ConvertFour<kType>(src + i));
  }
#endif
  for (; i < n; ++i) {
    const uint16_t h = kConvert(src[i]);
    std::memcpy(dst + i * sizeof(uint16_t), &h, sizeof(h));
  }
}

}  // namespace

uint16_t FloatToHalfBits(float value) {
  uint32_t x = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) {
    // NaN: a quiet NaN keeping the top payload bits, so a NaN never turns
    // into inf by losing its (low) payload.
    return sign | 0x7e00u | static_cast<uint16_t>((x >> 13) & 0x3ffu);
  }
  if (x >= 0x47800000u) return sign | 0x7c00u;  // >= 65536 (or inf): inf
  if (x < 0x38800000u) {
    // Below 2^-14, the smallest normal half: an fp16 subnormal in units of
    // 2^-24, or zero. Integer rounding keeps this independent of the FP
    // environment (flush-to-zero, rounding mode).
    const int exponent = static_cast<int>(x >> 23);
    if (exponent < 102) return sign;  // < 2^-25: rounds to (signed) zero
    const uint32_t mantissa = (x & 0x7fffffu) | 0x800000u;
    const int shift = 126 - exponent;  // 14..24
    uint32_t result = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (result & 1u))) ++result;
    return sign | static_cast<uint16_t>(result);  // 0x400 is right, too
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits to
  // nearest even; a carry out of the mantissa bumps the exponent, and from
  // 65520 on lands exactly on 0x7c00 (inf).
  const uint32_t odd = (x >> 13) & 1u;
  x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
  return sign | static_cast<uint16_t>(x >> 13);
}

float HalfBitsToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t o = static_cast<uint32_t>(bits & 0x7fffu) << 13;
  const uint32_t exponent = o & 0x0f800000u;
  o += static_cast<uint32_t>(127 - 15) << 23;
  if (exponent == 0x0f800000u) {
    o += static_cast<uint32_t>(128 - 16) << 23;  // inf / NaN keep payload
  } else if (exponent == 0) {
    // Zero or subnormal: build 2^-14 * (1 + m/1024) and subtract 2^-14,
    // which is exact and leaves m * 2^-24.
    o += 1u << 23;
    o = FloatBits(BitsFloat(o) - BitsFloat(113u << 23));
  }
  return BitsFloat(o | sign);
}

uint16_t FloatToBfloat16Bits(float value) {
  const uint32_t x = FloatBits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    // NaN: force the quiet bit, since truncating the payload could
    // otherwise leave an all-zero mantissa, i.e. inf.
    return static_cast<uint16_t>((x >> 16) | 0x40u);
  }
  const uint32_t odd = (x >> 16) & 1u;
  return static_cast<uint16_t>((x + 0x7fffu + odd) >> 16);
}

float Bfloat16BitsToFloat(uint16_t bits) {
  return BitsFloat(static_cast<uint32_t>(bits) << 16);
}

absl::StatusOr<DataType> ParseWireType(absl::string_view name) {
  if (name == "fp32") return FLOAT32;
  if (name == "fp16") return FLOAT16;
  if (name == "bf16") return BFLOAT16;
  if (name == "topk") return TOPK_FLOAT32;
  return absl::InvalidArgumentError(absl::StrCat(
      "--gradient_wire_type must be fp32, fp16, bf16 or topk, got '", name,
      "'"));
}

absl::StatusOr<DataType> ParseParameterWireType(absl::string_view name) {
  if (name == "fp32") return FLOAT32;
  if (name == "fp16") return FLOAT16;
  if (name == "bf16") return BFLOAT16;
  return absl::InvalidArgumentError(absl::StrCat(
      "--parameter_wire_type must be fp32, fp16 or bf16, got '", name, "'"));
}

int64_t WireElementBytes(DataType dtype) {
  switch (dtype) {
    case FLOAT32:
      return 4;
    case FLOAT16:
    case BFLOAT16:
      return 2;
    default:
      return 0;
  }
}

void EncodeFloat32(absl::Span<const float> values, std::string* out) {
  out->resize(values.size() * sizeof(float));
  if (!values.empty()) std::memcpy(out->data(), values.data(), out->size());
}

void EncodeFromFloat32(DataType dtype, absl::Span<const float> values,
                       std::string* out) {
  switch (dtype) {
    case FLOAT32:
      EncodeFloat32(values, out);
      return;
    case FLOAT16:
      EncodeHalfWidth<FLOAT16, FloatToHalfBits>(values, out);
      return;
    case BFLOAT16:
      EncodeHalfWidth<BFLOAT16, FloatToBfloat16Bits>(values, out);
      return;
    default:
      // The sender chose this type itself: a programming error, not input.
      std::fprintf(stderr, "EncodeFromFloat32: unsupported wire type %s\n",
                   TypeName(dtype).c_str());
      std::abort();
  }
}

namespace {

// A TOPK_FLOAT32 payload, gathered contiguous (it is small: 8 bytes per sent
// element) and read element by element with memcpy (no alignment promised).
class TopKPayload {
 public:
  explicit TopKPayload(const ByteSegments& data) {
    for (const absl::string_view segment : data) {
      bytes_.append(segment.data(), segment.size());
    }
  }
  int64_t size() const { return static_cast<int64_t>(bytes_.size() / 8); }
  uint32_t index(int64_t i) const {
    uint32_t v;
    std::memcpy(&v, bytes_.data() + 4 * i, 4);
    return absl::little_endian::ToHost32(v);
  }
  float value(int64_t i) const {
    return LoadElement<FLOAT32>(bytes_.data() + 4 * size() + 4 * i);
  }

 private:
  std::string bytes_;
};

void DecodeTopK(const ByteSegments& data, absl::Span<float> out,
                bool accumulate) {
  const TopKPayload payload(data);
  if (!accumulate) std::fill(out.begin(), out.end(), 0.0f);
  for (int64_t i = 0; i < payload.size(); ++i) {
    out[payload.index(i)] += payload.value(i);
  }
}

}  // namespace

absl::Status ValidatePayload(DataType dtype, const ByteSegments& data,
                             int64_t num_elements) {
  if (num_elements < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a payload of ", num_elements, " elements"));
  }
  uint64_t total = 0;
  for (const absl::string_view segment : data) total += segment.size();
  if (dtype == TOPK_FLOAT32) {
    if (total % 8 != 0 || total / 8 > static_cast<uint64_t>(num_elements)) {
      return absl::InvalidArgumentError(
          absl::StrCat("TOPK_FLOAT32 payload has ", total,
                       " bytes: expected 8 per sent "
                       "element, at most ",
                       num_elements, " elements"));
    }
    const TopKPayload payload(data);
    int64_t previous = -1;
    for (int64_t i = 0; i < payload.size(); ++i) {
      const int64_t index = payload.index(i);
      if (index <= previous || index >= num_elements) {
        return absl::InvalidArgumentError(absl::StrCat(
            "TOPK_FLOAT32 index ", i, " is ", index,
            ": indices must increase strictly and stay below ", num_elements));
      }
      previous = index;
    }
    return absl::OkStatus();
  }
  const int64_t element_bytes = WireElementBytes(dtype);
  if (element_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported wire type ", TypeName(dtype)));
  }
  const uint64_t expected = static_cast<uint64_t>(num_elements) * element_bytes;
  if (total != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload has ", total, " bytes, expected ", expected, " (",
                     num_elements, " ", TypeName(dtype), " elements)"));
  }
  return absl::OkStatus();
}

namespace {

// |x| for ordering, with NaN as +inf: an order needs no NaN, and a NaN is
// then sent at once, for the server to refuse (or skip) as it does a dense
// one, instead of staying in the residual.
float Magnitude(float x) {
  return std::isnan(x) ? std::numeric_limits<float>::infinity() : std::fabs(x);
}

}  // namespace

void EncodeTopK(absl::Span<float> accumulated, int64_t k, std::string* out) {
  const int64_t n = static_cast<int64_t>(accumulated.size());
  k = std::clamp<int64_t>(k, 0, n);
  // Candidates: every element at least as large as a threshold that a
  // strided sample puts at about the top 2k/n. When at least k pass, they
  // hold the exact top k (the k-th largest magnitude is >= the threshold),
  // ties included, so only they need sorting; else every element is one.
  float threshold = 0.0f;
  if (k > 0 && k < n) {
    const int64_t samples = std::min<int64_t>(n, 4096);
    std::vector<float> sample(samples);
    for (int64_t i = 0; i < samples; ++i) {
      sample[i] = Magnitude(accumulated[i * n / samples]);
    }
    const int64_t rank = std::min(samples - 1, 2 * k * samples / n);
    std::nth_element(sample.begin(), sample.begin() + rank, sample.end(),
                     std::greater<float>());
    threshold = sample[rank];
  }
  std::vector<uint32_t> order;
  order.reserve(std::min<int64_t>(n, 4 * k + 16));
  for (int64_t i = 0; i < n && k > 0; ++i) {
    if (Magnitude(accumulated[i]) >= threshold) {
      order.push_back(static_cast<uint32_t>(i));
    }
  }
  if (static_cast<int64_t>(order.size()) < k) {
    order.resize(n);
    for (int64_t i = 0; i < n; ++i) order[i] = static_cast<uint32_t>(i);
  }
  // Largest magnitude first, the lower index on a tie: deterministic.
  std::nth_element(order.begin(), order.begin() + k, order.end(),
                   [&](uint32_t a, uint32_t b) {
                     const float fa = Magnitude(accumulated[a]);
                     const float fb = Magnitude(accumulated[b]);
                     return fa > fb || (fa == fb && a < b);
                   });
  order.resize(k);
  std::sort(order.begin(), order.end());
  out->resize(8 * k);
  char* p = out->data();
  for (int64_t i = 0; i < k; ++i) {
    const uint32_t index = absl::little_endian::FromHost32(order[i]);
    std::memcpy(p + 4 * i, &index, 4);
  }
  for (int64_t i = 0; i < k; ++i) {
    const float value = accumulated[order[i]];
    std::memcpy(p + 4 * k + 4 * i, &value, 4);  // little-endian hosts only
    accumulated[order[i]] = 0.0f;
  }
}

absl::Status DecodeSegments(DataType dtype, const ByteSegments& data,
                            absl::Span<float> out, bool accumulate) {
  if (absl::Status s = ValidatePayload(dtype, data, out.size()); !s.ok()) {
    return s;
  }
  if (dtype == TOPK_FLOAT32) {
    DecodeTopK(data, out, accumulate);
    return absl::OkStatus();
  }
  float* dst = out.data();
  switch (dtype) {
    case FLOAT32:
      accumulate ? DecodeAll<FLOAT32, true>(data, dst)
                 : DecodeAll<FLOAT32, false>(data, dst);
      break;
    case FLOAT16:
      accumulate ? DecodeAll<FLOAT16, true>(data, dst)
                 : DecodeAll<FLOAT16, false>(data, dst);
      break;
    case BFLOAT16:
      accumulate ? DecodeAll<BFLOAT16, true>(data, dst)
                 : DecodeAll<BFLOAT16, false>(data, dst);
      break;
    default:
      break;  // unreachable: ValidatePayload refused it above
  }
  return absl::OkStatus();
}

absl::Status DecodeSegmentsInPieces(
    DataType dtype, const ByteSegments& data, int64_t num_elements,
    absl::FunctionRef<void(int64_t offset, absl::Span<const float> piece)>
        visit) {
  if (absl::Status s = ValidatePayload(dtype, data, num_elements); !s.ok()) {
    return s;
  }
  if (dtype == TOPK_FLOAT32) {
    // Sparse: decoded whole (zeros and all) into a reused buffer.
    thread_local std::vector<float> dense;
    dense.resize(num_elements);
    DecodeTopK(data, absl::MakeSpan(dense), /*accumulate=*/false);
    for (int64_t offset = 0; offset < num_elements;
         offset += kDecodePieceElements) {
      visit(offset,
            absl::MakeConstSpan(dense).subspan(
                offset, std::min(kDecodePieceElements, num_elements - offset)));
    }
    return absl::OkStatus();
  }
  const int64_t element_bytes = WireElementBytes(dtype);
  float piece[kDecodePieceElements];
  size_t segment = 0;  // cursor: the next unread byte is data[segment][at]
  size_t at = 0;
  for (int64_t offset = 0; offset < num_elements;
       offset += kDecodePieceElements) {
    const int64_t n = std::min(kDecodePieceElements, num_elements - offset);
    ByteSegments bytes;
    for (uint64_t need = n * element_bytes; need > 0;) {
      const absl::string_view from = data[segment];
      const size_t take = std::min<uint64_t>(need, from.size() - at);
      bytes.push_back(from.substr(at, take));
      need -= take;
      at += take;
      if (at == from.size()) {
        ++segment;
        at = 0;
      }
    }
    DecodeSegments(dtype, bytes, absl::MakeSpan(piece, n), /*accumulate=*/false)
        .IgnoreError();  // sizes checked above
    visit(offset, absl::MakeConstSpan(piece, n));
  }
  return absl::OkStatus();
}

int64_t FindNonFiniteSegments(DataType dtype, const ByteSegments& data) {
  if (dtype == TOPK_FLOAT32) {  // the element index of the first bad value
    const TopKPayload payload(data);
    for (int64_t i = 0; i < payload.size(); ++i) {
      if (!std::isfinite(payload.value(i))) return payload.index(i);
    }
    return -1;
  }
  switch (dtype) {
    case FLOAT32:
      return FindNonFiniteAll<FLOAT32>(data);
    case FLOAT16:
      return FindNonFiniteAll<FLOAT16>(data);
    case BFLOAT16:
      return FindNonFiniteAll<BFLOAT16>(data);
    default:
      return -1;
  }
}

absl::Status DecodeToFloat32(DataType dtype, absl::string_view bytes,
                             absl::Span<float> out) {
  return DecodeSegments(dtype, ByteSegments{bytes}, out,
                        /*accumulate=*/false);
}

int64_t FindNonFinite(absl::string_view float32_bytes) {
  return FindNonFiniteSegments(FLOAT32, ByteSegments{float32_bytes});
}

}  // namespace pstrain
