#include "common/transport/data_plane.h"

#include <string>

#include "gtest/gtest.h"

namespace pstrain {
namespace data_plane {
namespace {

TEST(DataPlaneHeaderTest, RequestRoundTrips) {
  char raw[kRequestHeaderBytes];
  EncodeRequestHeader({Method::kPull, 120000, (uint64_t{5} << 32) + 7}, raw);
  absl::StatusOr<RequestHeader> header =
      DecodeRequestHeader(raw, uint64_t{1} << 40);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->method, Method::kPull);
  EXPECT_EQ(header->timeout_ms, 120000u);
  EXPECT_EQ(header->body_bytes, (uint64_t{5} << 32) + 7);
}

TEST(DataPlaneHeaderTest, ResponseRoundTrips) {
  char raw[kResponseHeaderBytes];
  EncodeResponseHeader({absl::StatusCode::kUnavailable, 12}, raw);
  absl::StatusOr<ResponseHeader> header = DecodeResponseHeader(raw, 100);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->code, absl::StatusCode::kUnavailable);
  EXPECT_EQ(header->body_bytes, 12u);
}

TEST(DataPlaneHeaderTest, ABodyOverTheLimitIsRefusedBeforeItIsRead) {
  char raw[kRequestHeaderBytes];
  EncodeRequestHeader({Method::kPush, 0, 1001}, raw);
  absl::StatusOr<RequestHeader> header = DecodeRequestHeader(raw, 1000);
  EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(header.status().message().find("over the limit of 1000"),
            std::string::npos)
      << header.status();
}

TEST(DataPlaneHeaderTest, ForeignBytesAreRefusedByName) {
  // The first bytes of an HTTP/2 client preface.
  char raw[kRequestHeaderBytes] = "PRI * HTTP/2.0\r\n\r\nSM\r";
  absl::StatusOr<RequestHeader> header = DecodeRequestHeader(raw, 1000);
  EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(header.status().message().find("bad magic"), std::string::npos);
}

TEST(DataPlaneHeaderTest, UnknownMethodsAndReservedBytesAreRefused) {
  char raw[kRequestHeaderBytes];
  EncodeRequestHeader({Method::kPush, 0, 1}, raw);
  raw[4] = 9;
  EXPECT_FALSE(DecodeRequestHeader(raw, 1000).ok());
  EncodeRequestHeader({Method::kPush, 0, 1}, raw);
  raw[13] = 1;
  EXPECT_FALSE(DecodeRequestHeader(raw, 1000).ok());
}

TEST(DataPlaneHeaderTest, AResponseWithAnUnknownCodeIsDataLoss) {
  char raw[kResponseHeaderBytes];
  EncodeResponseHeader({absl::StatusCode::kOk, 0}, raw);
  raw[4] = 17;
  EXPECT_EQ(DecodeResponseHeader(raw, 10).status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(DataPlaneHeaderTest, OnlyPullAndPushPullMayAskForPayloadsApart) {
  char raw[kRequestHeaderBytes];
  for (Method method : {Method::kPull, Method::kPushPull}) {
    EncodeRequestHeader({method, 0, 1, /*payloads_apart=*/true}, raw);
    absl::StatusOr<RequestHeader> header = DecodeRequestHeader(raw, 1000);
    ASSERT_TRUE(header.ok()) << header.status();
    EXPECT_TRUE(header->payloads_apart);
  }
  EncodeRequestHeader({Method::kPush, 0, 1, /*payloads_apart=*/true}, raw);
  EXPECT_EQ(DecodeRequestHeader(raw, 1000).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LengthPrefixedTest, SplitsHeadFromRest) {
  std::string bytes(kLengthPrefixBytes, '\0');
  EncodeLengthPrefix(3, bytes.data());
  bytes += "abcdef";
  absl::StatusOr<LengthPrefixed> parts = SplitLengthPrefixed(bytes, "body");
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_EQ(parts->head, "abc");
  EXPECT_EQ(parts->rest, "def");
}

TEST(LengthPrefixedTest, ALengthPastTheEndOrNoPrefixIsRefusedByName) {
  std::string bytes(kLengthPrefixBytes, '\0');
  EncodeLengthPrefix(7, bytes.data());
  bytes += "abcdef";
  absl::StatusOr<LengthPrefixed> parts =
      SplitLengthPrefixed(bytes, "PushPull body");
  EXPECT_EQ(parts.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parts.status().message().find("PushPull body says its first part "
                                          "is 7 bytes; only 6 follow"),
            std::string::npos)
      << parts.status();
  EXPECT_EQ(SplitLengthPrefixed("ab", "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace data_plane
}  // namespace pstrain
