#include "common/safetensors.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

// A file built by hand: the header text exactly as given, then `data`.
std::string RawFile(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

std::string ParseError(const std::string& bytes) {
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes, "m.st");
  EXPECT_FALSE(file.ok());
  return file.ok() ? "" : std::string(file.status().message());
}

TEST(SafetensorsTest, RoundTripKeepsTensorsOrderAndMetadata) {
  SafetensorsFile file;
  const std::vector<float> w = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -7.0f};
  const std::vector<uint64_t> ids = {3, (uint64_t{1} << 63) + 5};
  const std::vector<int64_t> counts = {-1, 42};
  file.tensors.push_back(SafetensorsTensor::F32("fc0/weight", {2, 3}, w));
  file.tensors.push_back(SafetensorsTensor::U64("emb/ids", {2}, ids));
  file.tensors.push_back(SafetensorsTensor::I64("emb/counts", {2}, counts));
  file.tensors.push_back(SafetensorsTensor::F32("empty", {0, 4}, {}));
  file.metadata["step"] = "12";
  absl::StatusOr<std::string> bytes = SerializeSafetensors(file);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes->data(), 8);
  EXPECT_EQ((8 + header_length) % 8, 0u) << "data must start 8-byte aligned";

  absl::StatusOr<SafetensorsFile> back = ParseSafetensors(*bytes, "m.st");
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->tensors.size(), 4u);
  EXPECT_EQ(back->tensors[0].name, "fc0/weight");
  EXPECT_EQ(back->tensors[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(back->tensors[0].AsF32(), w);
  EXPECT_EQ(back->Find("emb/ids")->dtype, SafetensorsDtype::kU64);
  EXPECT_EQ(back->Find("emb/ids")->AsU64(), ids);
  EXPECT_EQ(back->Find("emb/counts")->AsI64(), counts);
  EXPECT_EQ(back->Find("empty")->NumElements(), 0);
  EXPECT_EQ(back->metadata.at("step"), "12");
  EXPECT_EQ(back->Find("nope"), nullptr);
}

TEST(SafetensorsTest, WriterRefusesDataThatDoesNotMatchTheShape) {
  SafetensorsFile file;
  const std::vector<float> three = {1, 2, 3};
  file.tensors.push_back(SafetensorsTensor::F32("w", {2, 2}, three));
  absl::StatusOr<std::string> bytes = SerializeSafetensors(file);
  ASSERT_FALSE(bytes.ok());
  EXPECT_THAT(bytes.status().message(), HasSubstr("'w'"));

  SafetensorsFile twice;
  twice.tensors.push_back(
      SafetensorsTensor::F32("w", {1}, absl::MakeConstSpan(three.data(), 1)));
  twice.tensors.push_back(twice.tensors[0]);
  EXPECT_FALSE(SerializeSafetensors(twice).ok());
}

TEST(SafetensorsTest, AcceptsFilesFromOtherWriters) {
  // Unpadded header, tensors stored in an order different from the header's
  // key order, no metadata.
  const float a[2] = {1, 2};
  const float b[1] = {3};
  std::string data(reinterpret_cast<const char*>(b), 4);
  data.append(reinterpret_cast<const char*>(a), 8);
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(
      RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
              R"("b":{"shape":[],"dtype":"F32","data_offsets":[0,4]}})",
              data),
      "m.st");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->Find("a")->AsF32(), (std::vector<float>{1, 2}));
  EXPECT_EQ(file->Find("b")->AsF32(), (std::vector<float>{3}));
}

TEST(SafetensorsTest, RefusesTruncatedFilesAndBadLengths) {
  EXPECT_THAT(ParseError("abc"), HasSubstr("too short"));
  // Header length past the end of the file.
  std::string past(8, '\0');
  past[0] = 100;
  past += "{}";
  EXPECT_THAT(ParseError(past), HasSubstr("header length says 100"));
  // A valid file with its last bytes cut off.
  SafetensorsFile file;
  const std::vector<float> w(16, 1.0f);
  file.tensors.push_back(SafetensorsTensor::F32("w", {16}, w));
  std::string bytes = *SerializeSafetensors(file);
  bytes.resize(bytes.size() - 4);
  std::string message = ParseError(bytes);
  EXPECT_THAT(message, HasSubstr("m.st"));
  EXPECT_THAT(message, HasSubstr("tensor 'w'"));
  EXPECT_THAT(message, HasSubstr("truncated"));
}

TEST(SafetensorsTest, RefusesBadHeaders) {
  const std::string four(4, '\0');
  EXPECT_THAT(ParseError(RawFile("[1,2]", "")), HasSubstr("start with '{'"));
  EXPECT_THAT(ParseError(RawFile("{\"w\": ", "")), HasSubstr("not JSON"));
  EXPECT_THAT(ParseError(RawFile(
                  R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                  four)),
              HasSubstr("key 'w' twice"));
  EXPECT_THAT(
      ParseError(RawFile(
          R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", four)),
      HasSubstr("dtype F16 is not supported"));
  EXPECT_THAT(
      ParseError(RawFile(
          R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", four)),
      HasSubstr("non-negative"));
  EXPECT_THAT(ParseError(RawFile(R"({"w":{"dtype":"F32","shape":[1]}})", four)),
              HasSubstr("no data_offsets"));
  EXPECT_THAT(
      ParseError(RawFile(
          R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})",
          four)),
      HasSubstr("unknown field 'x'"));
  EXPECT_THAT(
      ParseError(RawFile(
          R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", four)),
      HasSubstr("begin <= end"));
  EXPECT_THAT(ParseError(RawFile(R"({"__metadata__":{"k":1}})", "")),
              HasSubstr("not a string"));
  EXPECT_THAT(ParseError(RawFile(
                  R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],)"
                  R"("data_offsets":[0,4]}})",
                  four)),
              HasSubstr("more elements than can be addressed"));
}

TEST(SafetensorsTest, RefusesOffsetsThatDoNotTileTheData) {
  const std::string eight(8, '\0');
  // Size disagrees with the shape.
  EXPECT_THAT(
      ParseError(RawFile(
          R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight)),
      HasSubstr("needs 12"));
  // Past the end of the data.
  EXPECT_THAT(
      ParseError(RawFile(
          R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight)),
      HasSubstr("past the data"));
  // Overlapping.
  EXPECT_THAT(ParseError(RawFile(
                  R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  eight)),
              HasSubstr("overlap"));
  // A hole.
  EXPECT_THAT(
      ParseError(RawFile(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight)),
      HasSubstr("unused"));
  // Bytes after the last tensor.
  EXPECT_THAT(
      ParseError(RawFile(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight)),
      HasSubstr("trailing"));
}

TEST(SafetensorsTest, EveryTruncationFailsAndNoByteFlipCrashes) {
  SafetensorsFile file;
  const std::vector<float> w = {1, 2, 3, 4, 5, 6};
  const std::vector<uint64_t> ids = {7, 9};
  file.tensors.push_back(SafetensorsTensor::F32("w", {2, 3}, w));
  file.tensors.push_back(SafetensorsTensor::U64("t/ids", {2}, ids));
  file.metadata["step"] = "3";
  const std::string bytes = *SerializeSafetensors(file);
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(ParseSafetensors(bytes.substr(0, n), "m.st").ok()) << n;
  }
  // Whatever a corrupt byte does, the reader answers (OK or an error) and
  // what it accepts is self-consistent.
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (const char value : {'\0', '\xff', '"', '9', '{', ']', ','}) {
      std::string corrupt = bytes;
      corrupt[i] = value;
      absl::StatusOr<SafetensorsFile> parsed =
          ParseSafetensors(corrupt, "m.st");
      if (!parsed.ok()) continue;
      for (const SafetensorsTensor& tensor : parsed->tensors) {
        const int64_t element = tensor.dtype == SafetensorsDtype::kF32 ? 4 : 8;
        EXPECT_EQ(static_cast<int64_t>(tensor.data.size()),
                  tensor.NumElements() * element);
      }
    }
  }
}

TEST(SafetensorsTest, ReadingAMissingFileNamesIt) {
  absl::StatusOr<SafetensorsFile> file =
      ReadSafetensorsFile("/nonexistent/model.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(),
              HasSubstr("/nonexistent/model.safetensors"));
}

}  // namespace
}  // namespace pstrain
