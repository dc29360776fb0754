#include "common/transport/tensor_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Cuts `bytes` at the given (sorted) offsets.
ByteSegments Split(absl::string_view bytes, const std::vector<size_t>& cuts) {
  ByteSegments out;
  size_t start = 0;
  for (size_t cut : cuts) {
    out.push_back(bytes.substr(start, cut - start));
    start = cut;
  }
  out.push_back(bytes.substr(start));
  return out;
}

TEST(TensorCodecTest, Float32RoundTripIsBitExact) {
  const std::vector<float> values = {
      0.0f,       -0.0f, 1.5f,
      -3.25e-38f, 1e38f, std::numeric_limits<float>::denorm_min()};
  std::string wire;
  EncodeFloat32(values, &wire);
  ASSERT_EQ(wire.size(), values.size() * 4);
  std::vector<float> decoded(values.size(), 7.0f);
  ASSERT_TRUE(DecodeToFloat32(FLOAT32, wire, absl::MakeSpan(decoded)).ok());
  EXPECT_EQ(0, std::memcmp(values.data(), decoded.data(), wire.size()));
}

TEST(TensorCodecTest, EncodingIsLittleEndian) {
  std::string wire;
  EncodeFloat32({1.0f}, &wire);  // 0x3f800000
  EXPECT_EQ(wire, std::string("\x00\x00\x80\x3f", 4));
  EncodeFromFloat32(FLOAT16, {1.0f}, &wire);  // 0x3c00
  EXPECT_EQ(wire, std::string("\x00\x3c", 2));
  EncodeFromFloat32(BFLOAT16, {1.0f}, &wire);  // 0x3f80
  EXPECT_EQ(wire, std::string("\x80\x3f", 2));
}

TEST(TensorCodecTest, ElementBytes) {
  EXPECT_EQ(WireElementBytes(FLOAT32), 4);
  EXPECT_EQ(WireElementBytes(FLOAT16), 2);
  EXPECT_EQ(WireElementBytes(BFLOAT16), 2);
  EXPECT_EQ(WireElementBytes(static_cast<DataType>(7)), 0);
  EXPECT_EQ(WireElementBytes(static_cast<DataType>(-1)), 0);
}

TEST(TensorCodecTest, WrongLengthIsRefusedAndOutputUntouched) {
  std::vector<float> out(3, 9.0f);
  const absl::Status status =
      DecodeToFloat32(FLOAT32, std::string(11, '\0'), absl::MakeSpan(out));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("11 bytes, expected 12"), std::string::npos)
      << status;
  EXPECT_EQ(out, std::vector<float>(3, 9.0f));
}

TEST(TensorCodecTest, SegmentedWrongLengthNamesTypeAndCount) {
  std::vector<float> out(3, 9.0f);
  const std::string bytes(7, '\0');
  for (const bool accumulate : {false, true}) {
    const absl::Status status = DecodeSegments(FLOAT16, Split(bytes, {1, 4}),
                                               absl::MakeSpan(out), accumulate);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(),
              "payload has 7 bytes, expected 6 (3 FLOAT16 elements)");
    EXPECT_EQ(out, std::vector<float>(3, 9.0f));
  }
}

TEST(TensorCodecTest, UnknownTypesAreRefused) {
  std::vector<float> out(2, 1.0f);
  const absl::Status status =
      DecodeSegments(static_cast<DataType>(7), {std::string(8, '\0')},
                     absl::MakeSpan(out), /*accumulate=*/false);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "unsupported wire type 7");
  EXPECT_EQ(out, std::vector<float>(2, 1.0f));
  EXPECT_EQ(FindNonFiniteSegments(static_cast<DataType>(7), {"\xff\xff"}), -1);
}

TEST(TensorCodecTest, HalfWidthTypesDecodeThroughTheOldEntryPoint) {
  std::vector<float> out(2);
  ASSERT_TRUE(DecodeToFloat32(BFLOAT16, std::string("\x80\x3f\x00\xc0", 4),
                              absl::MakeSpan(out))
                  .ok());
  EXPECT_EQ(out, std::vector<float>({1.0f, -2.0f}));
  ASSERT_TRUE(DecodeToFloat32(FLOAT16, std::string("\x00\x3c\x00\xc0", 4),
                              absl::MakeSpan(out))
                  .ok());
  EXPECT_EQ(out, std::vector<float>({1.0f, -2.0f}));
}

TEST(TensorCodecTest, FindsFirstNonFinite) {
  std::string wire;
  EncodeFloat32({1.0f, 2.0f}, &wire);
  EXPECT_EQ(FindNonFinite(wire), -1);
  EncodeFloat32({1.0f, std::nanf(""), INFINITY}, &wire);
  EXPECT_EQ(FindNonFinite(wire), 1);
  EncodeFloat32({-INFINITY}, &wire);
  EXPECT_EQ(FindNonFinite(wire), 0);
}

// --- fp16 ------------------------------------------------------------------

// Every half value converts to float and back to itself; NaNs stay NaNs.
TEST(Float16Test, AllHalfValuesRoundTrip) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = HalfBitsToFloat(static_cast<uint16_t>(h));
    const bool is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      const uint16_t back = FloatToHalfBits(f);
      ASSERT_EQ(back & 0x7e00, 0x7e00) << std::hex << h;  // quiet NaN
      ASSERT_EQ(back & 0x8000, h & 0x8000) << std::hex << h;
    } else {
      ASSERT_EQ(FloatToHalfBits(f), h) << std::hex << h << " " << f;
    }
  }
}

TEST(Float16Test, DecodesKnownValues) {
  EXPECT_EQ(HalfBitsToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfBitsToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfBitsToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfBitsToFloat(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(HalfBitsToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfBitsToFloat(0x03ff), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(Bits(HalfBitsToFloat(0x8000)), 0x80000000u);
  EXPECT_EQ(HalfBitsToFloat(0x7c00), INFINITY);
  EXPECT_EQ(HalfBitsToFloat(0xfc00), -INFINITY);
  EXPECT_TRUE(std::isnan(HalfBitsToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(HalfBitsToFloat(0x7c01)));
}

TEST(Float16Test, SpecialValues) {
  EXPECT_EQ(FloatToHalfBits(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalfBits(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalfBits(INFINITY), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(-INFINITY), 0xfc00);
  EXPECT_EQ(FloatToHalfBits(std::nanf("")) & 0x7e00, 0x7e00);
  // A NaN whose payload lives only in the low bits must not become inf.
  EXPECT_EQ(FloatToHalfBits(FromBits(0x7f800001)) & 0x7e00, 0x7e00);
  EXPECT_EQ(FloatToHalfBits(FromBits(0xff800001)), 0xfe00);
  // Overflow: 65504 is the largest half; from 65520 (halfway to 65536) up,
  // round to nearest even gives inf.
  EXPECT_EQ(FloatToHalfBits(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65519.996f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(1e10f), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToHalfBits(std::numeric_limits<float>::max()), 0x7c00);
  // Subnormals and underflow.
  const float unit = std::ldexp(1.0f, -24);  // smallest half subnormal
  EXPECT_EQ(FloatToHalfBits(unit), 0x0001);
  EXPECT_EQ(FloatToHalfBits(-unit), 0x8001);
  EXPECT_EQ(FloatToHalfBits(0.5f * unit), 0x0000);  // tie: to even (0)
  EXPECT_EQ(FloatToHalfBits(1.5f * unit), 0x0002);  // tie: to even (2)
  EXPECT_EQ(FloatToHalfBits(2.5f * unit), 0x0002);  // tie: to even (2)
  EXPECT_EQ(FloatToHalfBits(0.50001f * unit), 0x0001);
  EXPECT_EQ(FloatToHalfBits(1023.5f * unit), 0x0400);  // rounds up to normal
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(FloatToHalfBits(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(FloatToHalfBits(-std::numeric_limits<float>::min()), 0x8000);
  // Normal rounding ties: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  EXPECT_EQ(FloatToHalfBits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(FloatToHalfBits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
}

#ifdef __FLT16_MAX__
// The compiler's own conversion (IEEE round to nearest even) as the oracle.
uint16_t ReferenceHalf(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, sizeof(u));
  return u;
}

TEST(Float16Test, MatchesCompilerConversion) {
  auto check = [](uint32_t u) {
    const float f = FromBits(u);
    if (std::isnan(f)) return;
    ASSERT_EQ(FloatToHalfBits(f), ReferenceHalf(f)) << std::hex << u;
  };
  // A sparse sweep of all floats...
  for (uint64_t u = 0; u <= 0xffffffffu; u += 997) check(u);
  // ...and every rounding boundary: each half value's float, and the
  // midpoint to the next one with its float neighbours.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const float lo = HalfBitsToFloat(h);
    const float hi = h + 1 == 0x7c00 ? 65536.0f : HalfBitsToFloat(h + 1);
    const uint32_t mid = Bits((lo + hi) / 2);  // exact: 12 bits needed
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (uint32_t u : {Bits(lo), mid - 1, mid, mid + 1}) check(u | sign);
    }
  }
}
#endif

TEST(Float16Test, RelativeErrorInNormalRange) {
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-14, 15);
  for (int i = 0; i < 100000; ++i) {
    const float x = std::ldexp(mantissa(rng), exponent(rng)) *
                    ((i & 1) != 0 ? -1.0f : 1.0f);
    if (std::fabs(x) > 65504.0f) continue;
    const float y = HalfBitsToFloat(FloatToHalfBits(x));
    ASSERT_LE(std::fabs(y - x), std::ldexp(std::fabs(x), -11)) << x;
  }
}

// --- bf16 ------------------------------------------------------------------

// Round to nearest even of the top 16 bits, computed the slow way.
uint16_t ReferenceBfloat16(float f) {
  const uint32_t u = Bits(f);
  if (std::isinf(f)) return u >> 16;
  const uint32_t down = u & 0xffff0000u;
  const uint32_t up = down + 0x10000u;
  const double d = f;
  const double below = std::fabs(d - static_cast<double>(FromBits(down)));
  // `up` may be the infinity bit pattern: treat it as 2^128, IEEE's
  // rounding point for overflow.
  const double above =
      (up & 0x7fffffffu) == 0x7f800000u
          ? std::fabs(std::ldexp(std::signbit(f) ? -1.0 : 1.0, 128) - d)
          : std::fabs(static_cast<double>(FromBits(up)) - d);
  if (below < above) return down >> 16;
  if (above < below) return up >> 16;
  return ((down >> 16) & 1) == 0 ? down >> 16 : up >> 16;
}

TEST(Bfloat16Test, MatchesReferenceRounding) {
  for (uint64_t u = 0; u <= 0xffffffffu; u += 997) {
    const float f = FromBits(u);
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBfloat16Bits(f), ReferenceBfloat16(f)) << std::hex << u;
  }
  // Exact ties on either parity, and their neighbours.
  for (uint32_t u : {0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u,
                     0xbf808000u, 0xbf818000u, 0x7f7f8000u, 0x7f7fffffu}) {
    ASSERT_EQ(FloatToBfloat16Bits(FromBits(u)), ReferenceBfloat16(FromBits(u)))
        << std::hex << u;
  }
}

TEST(Bfloat16Test, SpecialValues) {
  EXPECT_EQ(FloatToBfloat16Bits(0.0f), 0x0000);
  EXPECT_EQ(FloatToBfloat16Bits(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBfloat16Bits(INFINITY), 0x7f80);
  EXPECT_EQ(FloatToBfloat16Bits(-INFINITY), 0xff80);
  EXPECT_EQ(FloatToBfloat16Bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie
  EXPECT_EQ(FloatToBfloat16Bits(std::numeric_limits<float>::max()), 0x7f80);
  // NaN stays NaN even when only low payload bits are set.
  EXPECT_TRUE(std::isnan(Bfloat16BitsToFloat(FloatToBfloat16Bits(NAN))));
  EXPECT_EQ(FloatToBfloat16Bits(FromBits(0x7f800001)), 0x7fc0);
  EXPECT_EQ(FloatToBfloat16Bits(FromBits(0xff800001)), 0xffc0);
  // bf16 keeps float32's exponent range: subnormals with a 7-bit mantissa
  // survive; below half of the smallest one, values round to zero.
  EXPECT_EQ(Bits(Bfloat16BitsToFloat(FloatToBfloat16Bits(FromBits(0x10000)))),
            0x10000u);
  EXPECT_EQ(FloatToBfloat16Bits(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(FloatToBfloat16Bits(FromBits(0x8000)), 0);  // tie: to even
  EXPECT_EQ(FloatToBfloat16Bits(FromBits(0x8001)), 0x0001);
  EXPECT_EQ(Bfloat16BitsToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bits(Bfloat16BitsToFloat(0x8000)), 0x80000000u);
}

TEST(Bfloat16Test, RelativeErrorInNormalRange) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-126, 126);
  for (int i = 0; i < 100000; ++i) {
    const float x = std::ldexp(mantissa(rng), exponent(rng)) *
                    ((i & 1) != 0 ? -1.0f : 1.0f);
    const float y = Bfloat16BitsToFloat(FloatToBfloat16Bits(x));
    ASSERT_LE(std::fabs(y - x), std::ldexp(std::fabs(x), -8)) << x;
  }
}

// --- bulk paths against the scalar conversions ------------------------------

// The bulk encoders and decoders (vectorized where the compiler allows) must
// agree bit for bit with the scalar functions tested above, on every half
// pattern and a sweep of float patterns, NaN payloads included.
TEST(BulkConversionTest, DecodersMatchScalarOnEveryPattern) {
  std::string wire(2 * 65536, '\0');
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    std::memcpy(&wire[2 * h], &bits, 2);
  }
  std::vector<float> out(65536);
  for (const DataType dtype : {FLOAT16, BFLOAT16}) {
    for (const bool accumulate : {false, true}) {
      std::fill(out.begin(), out.end(), 0.0f);
      ASSERT_TRUE(DecodeSegments(dtype, Split(wire, {6, 7, 1001}),
                                 absl::MakeSpan(out), accumulate)
                      .ok());
      for (uint32_t h = 0; h <= 0xffff; ++h) {
        const uint16_t bits = static_cast<uint16_t>(h);
        const float want = dtype == FLOAT16 ? HalfBitsToFloat(bits)
                                            : Bfloat16BitsToFloat(bits);
        if (accumulate) {
          // 0 + x: same value, except -0 becomes +0 and NaN stays NaN.
          ASSERT_TRUE(out[h] == want ||
                      (std::isnan(want) && std::isnan(out[h])))
              << std::hex << h;
        } else {
          ASSERT_EQ(Bits(out[h]), Bits(want)) << std::hex << h;
        }
      }
    }
  }
}

TEST(BulkConversionTest, EncodersMatchScalarOnASweep) {
  std::vector<float> values;
  for (uint64_t u = 0; u <= 0xffffffffu; u += 4093) {
    values.push_back(FromBits(static_cast<uint32_t>(u)));
  }
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // fp16 rounding boundaries
    const float lo = HalfBitsToFloat(h);
    const float hi = h + 1 == 0x7c00 ? 65536.0f : HalfBitsToFloat(h + 1);
    const uint32_t mid = Bits((lo + hi) / 2);
    for (uint32_t u : {mid - 1, mid, mid + 1}) {
      values.push_back(FromBits(u));
      values.push_back(-FromBits(u));
    }
  }
  for (uint32_t u : {0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7fbfffffu,
                     0x00008000u, 0x00018000u, 0x7f7fffffu, 0x7f800000u}) {
    values.push_back(FromBits(u));
  }
  std::string wire;
  EncodeFromFloat32(FLOAT16, values, &wire);
  ASSERT_EQ(wire.size(), 2 * values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t got;
    std::memcpy(&got, &wire[2 * i], 2);
    ASSERT_EQ(got, FloatToHalfBits(values[i])) << std::hex << Bits(values[i]);
  }
  EncodeFromFloat32(BFLOAT16, values, &wire);
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t got;
    std::memcpy(&got, &wire[2 * i], 2);
    ASSERT_EQ(got, FloatToBfloat16Bits(values[i]))
        << std::hex << Bits(values[i]);
  }
}

// --- segmented decoding ----------------------------------------------------

std::vector<float> Values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

// What DecodeSegments must produce: the scalar conversion of each element.
std::vector<float> Expected(DataType dtype, const std::vector<float>& values) {
  std::vector<float> out(values);
  for (float& v : out) {
    if (dtype == FLOAT16) v = HalfBitsToFloat(FloatToHalfBits(v));
    if (dtype == BFLOAT16) v = Bfloat16BitsToFloat(FloatToBfloat16Bits(v));
  }
  return out;
}

class SegmentedDecodeTest : public ::testing::TestWithParam<DataType> {};

TEST_P(SegmentedDecodeTest, EverySingleSplitDecodesTheSame) {
  const DataType dtype = GetParam();
  const std::vector<float> values = Values(9, 1);
  const std::vector<float> expected = Expected(dtype, values);
  std::string wire;
  EncodeFromFloat32(dtype, values, &wire);
  ASSERT_EQ(wire.size(), values.size() * WireElementBytes(dtype));
  for (size_t cut = 0; cut <= wire.size(); ++cut) {
    std::vector<float> out(values.size(), -1.0f);
    ASSERT_TRUE(
        DecodeSegments(dtype, Split(wire, {cut}), absl::MakeSpan(out), false)
            .ok());
    ASSERT_EQ(out, expected) << "cut at " << cut;
  }
}

TEST_P(SegmentedDecodeTest, RandomSplitsAndAccumulate) {
  const DataType dtype = GetParam();
  std::mt19937 rng(99);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = std::uniform_int_distribution<size_t>(0, 700)(rng);
    const std::vector<float> values = Values(n, trial);
    const std::vector<float> expected = Expected(dtype, values);
    std::string wire;
    EncodeFromFloat32(dtype, values, &wire);
    // Random cuts, repeats allowed (empty segments), many one-byte ones.
    std::vector<size_t> cuts;
    const int num_cuts = std::uniform_int_distribution<int>(0, 20)(rng);
    for (int i = 0; i < num_cuts; ++i) {
      cuts.push_back(
          std::uniform_int_distribution<size_t>(0, wire.size())(rng));
    }
    std::sort(cuts.begin(), cuts.end());
    const ByteSegments segments = Split(wire, cuts);

    std::vector<float> out(n, 123.0f);
    ASSERT_TRUE(
        DecodeSegments(dtype, segments, absl::MakeSpan(out), false).ok());
    ASSERT_EQ(out, expected);

    std::vector<float> sum(n);
    for (size_t i = 0; i < n; ++i) sum[i] = 0.25f * i;
    std::vector<float> want = sum;
    for (size_t i = 0; i < n; ++i) want[i] += expected[i];
    ASSERT_TRUE(
        DecodeSegments(dtype, segments, absl::MakeSpan(sum), true).ok());
    ASSERT_EQ(sum, want);
  }
}

// Pieces cover the payload in order, each at most kDecodePieceElements
// long, and together decode what DecodeSegments does, however it is cut.
TEST_P(SegmentedDecodeTest, PiecesCoverThePayloadInOrder) {
  const DataType dtype = GetParam();
  std::mt19937 rng(7);
  for (const size_t n :
       {size_t{0}, size_t{1}, size_t{kDecodePieceElements - 1},
        size_t{kDecodePieceElements}, size_t{3 * kDecodePieceElements + 5}}) {
    const std::vector<float> values = Values(n, n);
    std::string wire;
    EncodeFromFloat32(dtype, values, &wire);
    std::vector<size_t> cuts;
    for (int i = 0; i < 9; ++i) {
      cuts.push_back(
          std::uniform_int_distribution<size_t>(0, wire.size())(rng));
    }
    std::sort(cuts.begin(), cuts.end());
    std::vector<float> out(n, NAN);
    int64_t next = 0;
    ASSERT_TRUE(DecodeSegmentsInPieces(
                    dtype, Split(wire, cuts), n,
                    [&](int64_t offset, absl::Span<const float> piece) {
                      EXPECT_EQ(offset, next);
                      EXPECT_GT(piece.size(), 0u);
                      EXPECT_LE(piece.size(), kDecodePieceElements);
                      std::copy(piece.begin(), piece.end(), &out[offset]);
                      next = offset + piece.size();
                    })
                    .ok());
    EXPECT_EQ(next, static_cast<int64_t>(n));
    EXPECT_EQ(out, Expected(dtype, values)) << n << " elements";
  }
}

TEST_P(SegmentedDecodeTest, PiecesOfAWrongLengthAreRefusedBeforeAnyVisit) {
  const DataType dtype = GetParam();
  std::string wire;
  EncodeFromFloat32(dtype, Values(10, 1), &wire);
  int visits = 0;
  const absl::Status status = DecodeSegmentsInPieces(
      dtype, ByteSegments{wire}, 11,
      [&](int64_t, absl::Span<const float>) { ++visits; });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(visits, 0);
}

TEST_P(SegmentedDecodeTest, FindsNonFiniteAcrossSegments) {
  const DataType dtype = GetParam();
  const size_t n = 1000;
  for (size_t bad :
       {size_t{0}, size_t{255}, size_t{256}, size_t{700}, size_t{999}}) {
    for (const float special : {NAN, INFINITY, -INFINITY}) {
      std::vector<float> values = Values(n, 5);
      values[bad] = special;
      if (bad + 3 < n) values[bad + 3] = NAN;  // only the first counts
      std::string wire;
      EncodeFromFloat32(dtype, values, &wire);
      const int64_t e = WireElementBytes(dtype);
      // Cut through the middle of the bad element, and elsewhere.
      const size_t mid = bad * e + 1;
      EXPECT_EQ(FindNonFiniteSegments(dtype, Split(wire, {mid})), bad);
      EXPECT_EQ(FindNonFiniteSegments(dtype, Split(wire, {3, mid, mid})), bad);
      EXPECT_EQ(FindNonFiniteSegments(dtype, {wire}), bad);
    }
  }
  std::string wire;
  EncodeFromFloat32(dtype, Values(n, 6), &wire);
  EXPECT_EQ(FindNonFiniteSegments(dtype, Split(wire, {1, 17, 1001})), -1);
  EXPECT_EQ(FindNonFiniteSegments(dtype, {}), -1);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, SegmentedDecodeTest,
                         ::testing::Values(FLOAT32, FLOAT16, BFLOAT16),
                         [](const ::testing::TestParamInfo<DataType>& info) {
                           return DataType_Name(info.param);
                         });

// --- top-k
// --------------------------------------------------------------------

std::vector<float> DecodeDense(const std::string& payload, int64_t n) {
  std::vector<float> out(n, NAN);
  EXPECT_TRUE(DecodeSegments(TOPK_FLOAT32, ByteSegments{payload},
                             absl::MakeSpan(out), /*accumulate=*/false)
                  .ok());
  return out;
}

TEST(TopKTest, SendsTheLargestMagnitudesAndKeepsTheRest) {
  std::vector<float> accumulated = {0.5f, -4.0f, 1.0f, 3.0f, -1.0f, 0.0f};
  const std::vector<float> before = accumulated;
  std::string payload;
  EncodeTopK(absl::MakeSpan(accumulated), 3, &payload);
  ASSERT_EQ(payload.size(), 24u);
  ASSERT_TRUE(ValidatePayload(TOPK_FLOAT32, ByteSegments{payload}, 6).ok());
  // -4, 3, then the tie |1| = |-1| goes to the lower index.
  const std::vector<float> sent = DecodeDense(payload, 6);
  EXPECT_EQ(sent, (std::vector<float>{0, -4, 1, 3, 0, 0}));
  EXPECT_EQ(accumulated, (std::vector<float>{0.5f, 0, 0, 0, -1, 0}));
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(sent[i] + accumulated[i], before[i]) << i;  // nothing lost
  }
  std::string all;
  EncodeTopK(absl::MakeSpan(accumulated), 99, &all);  // k > n: everything
  EXPECT_EQ(DecodeDense(all, 6), (std::vector<float>{0.5f, 0, 0, 0, -1, 0}));
  EXPECT_EQ(accumulated, std::vector<float>(6, 0.0f));
}

// Error feedback loses nothing: what was sent over many pushes plus what is
// left equals the sum of the gradients, exactly (integer values).
TEST(TopKTest, ErrorFeedbackSendsEveryGradientEventually) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> value(-50, 50);
  constexpr int kN = 300;
  std::vector<float> residual(kN, 0.0f), sent_sum(kN, 0.0f),
      gradient_sum(kN, 0.0f);
  for (int step = 0; step < 40; ++step) {
    for (int i = 0; i < kN; ++i) {
      const float g = static_cast<float>(value(rng));
      residual[i] += g;
      gradient_sum[i] += g;
    }
    std::string payload;
    EncodeTopK(absl::MakeSpan(residual), 7, &payload);
    // Split anywhere: a received payload comes in slices.
    const ByteSegments segments = Split(payload, {5, 13, payload.size() / 2});
    ASSERT_TRUE(ValidatePayload(TOPK_FLOAT32, segments, kN).ok());
    ASSERT_TRUE(DecodeSegments(TOPK_FLOAT32, segments, absl::MakeSpan(sent_sum),
                               /*accumulate=*/true)
                    .ok());
  }
  for (int i = 0; i < kN; ++i) {
    ASSERT_EQ(sent_sum[i] + residual[i], gradient_sum[i]) << i;
  }
}

// A NaN in the residual is sent at once (for the server to refuse, as it
// does a dense one), not kept and grown step after step.
TEST(TopKTest, ANonFiniteResidualIsSentFirst) {
  std::vector<float> accumulated = {5.0f, NAN, -7.0f, 1.0f};
  std::string payload;
  EncodeTopK(absl::MakeSpan(accumulated), 1, &payload);
  EXPECT_EQ(FindNonFiniteSegments(TOPK_FLOAT32, ByteSegments{payload}), 1);
  EXPECT_EQ(accumulated[1], 0.0f);
}

TEST(TopKTest, MalformedPayloadsAreRefused) {
  auto payload = [](std::vector<uint32_t> indices, std::vector<float> values) {
    std::string out(reinterpret_cast<const char*>(indices.data()),
                    4 * indices.size());
    out.append(reinterpret_cast<const char*>(values.data()), 4 * values.size());
    return out;
  };
  auto check = [](const std::string& bytes, int64_t n) {
    return ValidatePayload(TOPK_FLOAT32, ByteSegments{bytes}, n);
  };
  EXPECT_TRUE(check("", 4).ok());  // nothing sent this time
  EXPECT_TRUE(check(payload({0, 3}, {1, 2}), 4).ok());
  EXPECT_THAT(check(payload({0, 3}, {1, 2}).substr(1), 4).message(),
              HasSubstr("expected 8 per sent element"));
  EXPECT_THAT(check(payload({0, 1, 2}, {1, 2, 3}), 2).message(),
              HasSubstr("at most 2 elements"));
  EXPECT_THAT(check(payload({1, 1}, {1, 2}), 4).message(),
              HasSubstr("index 1 is 1: indices must increase strictly"));
  EXPECT_THAT(check(payload({2, 0}, {1, 2}), 4).message(),
              HasSubstr("index 1 is 0"));
  EXPECT_THAT(check(payload({0, 4}, {1, 2}), 4).message(),
              HasSubstr("stay below 4"));
  std::vector<float> out(4, 7.0f);
  EXPECT_FALSE(DecodeSegments(TOPK_FLOAT32,
                              ByteSegments{payload({0, 4}, {1, 2})},
                              absl::MakeSpan(out), false)
                   .ok());
  EXPECT_EQ(out, std::vector<float>(4, 7.0f));  // untouched
  EXPECT_EQ(FindNonFiniteSegments(TOPK_FLOAT32,
                                  ByteSegments{payload({1, 3}, {1, NAN})}),
            3);  // the element, not the position in the payload
}

TEST(TensorCodecTest, HalfWidthLargeValuesOverflowOnlyInFloat16) {
  std::string wire;
  EncodeFromFloat32(FLOAT16, {1e5f, -1e5f, 1.0f}, &wire);
  EXPECT_EQ(FindNonFiniteSegments(FLOAT16, {wire}), 0);
  EncodeFromFloat32(BFLOAT16, {1e5f, -1e5f, 1.0f}, &wire);
  EXPECT_EQ(FindNonFiniteSegments(BFLOAT16, {wire}), -1);
}

TEST(TensorCodecTest, Float32MisalignedSegmentsDecode) {
  const std::vector<float> values = Values(1001, 3);
  std::string wire;
  EncodeFloat32(values, &wire);
  // Shift the payload by 1..3 bytes inside a bigger buffer so every segment
  // starts unaligned.
  for (size_t shift = 1; shift < 4; ++shift) {
    const std::string buffer = std::string(shift, 'x') + wire;
    const absl::string_view payload = absl::string_view(buffer).substr(shift);
    std::vector<float> out(values.size());
    ASSERT_TRUE(DecodeSegments(FLOAT32, Split(payload, {402, 2001}),
                               absl::MakeSpan(out), false)
                    .ok());
    EXPECT_EQ(out, values);
  }
}

TEST(TensorCodecTest, EmptyPayload) {
  std::vector<float> out;
  EXPECT_TRUE(DecodeSegments(FLOAT16, {}, absl::MakeSpan(out), true).ok());
  EXPECT_TRUE(
      DecodeSegments(FLOAT32, {"", ""}, absl::MakeSpan(out), false).ok());
  std::string wire = "junk";
  EncodeFromFloat32(BFLOAT16, {}, &wire);
  EXPECT_TRUE(wire.empty());
}

}  // namespace
}  // namespace pstrain
