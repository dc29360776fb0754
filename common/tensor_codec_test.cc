#include "common/tensor_codec.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

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

TEST(TensorCodecTest, ReservedTypesAreRefused) {
  std::vector<float> out(2);
  const absl::Status status =
      DecodeToFloat32(BFLOAT16, std::string(4, '\0'), absl::MakeSpan(out));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("BFLOAT16"), std::string::npos) << status;
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

}  // namespace
}  // namespace pstrain
