#include "worker/idx_data.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

std::string TestPath(const std::string& name) {
  const ::testing::TestInfo* info =
      ::testing::UnitTest::GetInstance()->current_test_info();
  // Parameterized test names contain '/', which must not become directories.
  std::string test = info->name();
  std::replace(test.begin(), test.end(), '/', '_');
  return absl::StrCat(::testing::TempDir(), "/", test, "_", name);
}

std::string WriteRaw(const std::string& name, const std::string& bytes) {
  const std::string path = TestPath(name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  out.close();
  EXPECT_TRUE(out.good()) << path;
  return path;
}

std::string WriteGzip(const std::string& name, const std::string& bytes) {
  const std::string path = TestPath(name);
  gzFile file = gzopen(path.c_str(), "wb");
  EXPECT_NE(file, nullptr) << path;
  EXPECT_EQ(gzwrite(file, bytes.data(), bytes.size()),
            static_cast<int>(bytes.size()));
  EXPECT_EQ(gzclose(file), Z_OK);
  return path;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string BigEndian(uint32_t value) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>(value >> (24 - 8 * i));
  return out;
}

// count images of rows x cols; pixel j of image i is (i * 7 + j) % 256.
std::string Images(uint32_t count, uint32_t rows, uint32_t cols) {
  std::string out =
      BigEndian(0x803) + BigEndian(count) + BigEndian(rows) + BigEndian(cols);
  for (uint32_t i = 0; i < count; ++i) {
    for (uint32_t j = 0; j < rows * cols; ++j) {
      out.push_back(static_cast<char>((i * 7 + j) % 256));
    }
  }
  return out;
}

std::string Labels(const std::vector<uint8_t>& labels) {
  std::string out = BigEndian(0x801) + BigEndian(labels.size());
  for (uint8_t label : labels) out.push_back(static_cast<char>(label));
  return out;
}

std::string Message(const absl::Status& status) {
  return std::string(status.message());
}

void ExpectExamples(const ExampleSource& source) {
  ASSERT_EQ(source.size(), 5);
  ASSERT_EQ(source.num_features(), 6);
  const std::vector<int64_t> indices = {4, 0, 2};
  std::vector<float> features(3 * 6);
  std::vector<int32_t> labels(3);
  ASSERT_TRUE(source.Gather(indices, features.data(), labels.data()).ok());
  EXPECT_EQ(labels, (std::vector<int32_t>{9, 3, 0}));
  for (int r = 0; r < 3; ++r) {
    for (int j = 0; j < 6; ++j) {
      EXPECT_FLOAT_EQ(features[r * 6 + j],
                      ((indices[r] * 7 + j) % 256) / 255.0f);
    }
  }
}

TEST(IdxTest, ReadsRawAndGzippedFilesAlike) {
  const std::string images = Images(5, 2, 3);
  const std::string labels = Labels({3, 1, 0, 2, 9});
  for (bool gzip : {false, true}) {
    SCOPED_TRACE(gzip ? "gzip" : "raw");
    auto write = gzip ? WriteGzip : WriteRaw;
    absl::StatusOr<std::unique_ptr<ExampleSource>> source =
        OpenIdx(write("images", images), write("labels", labels), 0);
    ASSERT_TRUE(source.ok()) << source.status();
    EXPECT_EQ((*source)->num_classes(), 10);  // inferred: 9 + 1
    ExpectExamples(**source);
    // Raw files stay on disk; gzipped ones are held inflated, as bytes.
    EXPECT_EQ((*source)->resident_bytes(),
              5 * 4 + (gzip ? static_cast<int64_t>(images.size()) : 0));
  }
}

TEST(IdxTest, PixelsSpanZeroToOne) {
  std::string images = BigEndian(0x803) + BigEndian(1) + BigEndian(1) +
                       BigEndian(2) + std::string("\x00\xff", 2);
  absl::StatusOr<std::unique_ptr<ExampleSource>> source =
      OpenIdx(WriteRaw("images", images), WriteRaw("labels", Labels({1})), 2);
  ASSERT_TRUE(source.ok()) << source.status();
  std::vector<float> features(2);
  int32_t label;
  const std::vector<int64_t> first = {0};
  ASSERT_TRUE((*source)->Gather(first, features.data(), &label).ok());
  EXPECT_EQ(features, (std::vector<float>{0.0f, 1.0f}));
}

struct BadInput {
  std::string what;
  std::string images;  // bytes of the images file
  std::string labels;
  bool gzip;
  int64_t num_classes;
  bool blame_labels;  // the error names the labels file (else images)
  std::string message;
};

void PrintTo(const BadInput& b, std::ostream* os) { *os << b.what; }

class IdxBadInputTest : public ::testing::TestWithParam<BadInput> {};

TEST_P(IdxBadInputTest, OneLineNamingTheFile) {
  const BadInput& b = GetParam();
  auto write = b.gzip ? WriteGzip : WriteRaw;
  const std::string images = write("images", b.images);
  const std::string labels = write("labels", b.labels);
  absl::StatusOr<std::unique_ptr<ExampleSource>> source =
      OpenIdx(images, labels, b.num_classes);
  ASSERT_FALSE(source.ok());
  const std::string message = Message(source.status());
  EXPECT_THAT(message, HasSubstr((b.blame_labels ? labels : images) + ":"));
  EXPECT_THAT(message, HasSubstr(b.message));
  EXPECT_EQ(message.find('\n'), std::string::npos);
}

std::string Truncated(std::string bytes, size_t drop) {
  bytes.resize(bytes.size() - drop);
  return bytes;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, IdxBadInputTest,
    ::testing::ValuesIn(std::vector<BadInput>{
        {"ImagesTruncated", Truncated(Images(5, 2, 3), 1),
         Labels({0, 0, 0, 0, 0}), false, 0, false, "truncated"},
        {"ImagesTruncatedInHeader", Truncated(Images(5, 2, 3), 35),
         Labels({0, 0, 0, 0, 0}), false, 0, false, "header"},
        {"ImagesTrailingBytes", Images(5, 2, 3) + "x", Labels({0, 0, 0, 0, 0}),
         false, 0, false, "1 bytes after"},
        {"ImagesWrongMagic", Labels({0, 0, 0, 0, 0}), Labels({0, 0, 0, 0, 0}),
         false, 0, false, "magic number 0x00000801, expected 0x00000803"},
        {"ImagesEmpty", "", Labels({0}), false, 0, false, "too short"},
        {"ZeroDimension", Images(0, 2, 3), Labels({0}), false, 0, false,
         "dimension 0 is 0"},
        {"LabelsWrongMagic", Images(5, 2, 3), Images(5, 2, 3), false, 0, true,
         "expected 0x00000801"},
        {"LabelsTruncated", Images(5, 2, 3),
         Truncated(Labels({0, 0, 0, 0, 0}), 2), false, 0, true, "truncated"},
        {"LabelOutOfRange", Images(5, 2, 3), Labels({0, 1, 9, 0, 0}), false, 4,
         true, "label 9 (example 2) is out of range [0, 4): set --num_classes"},
        {"CountsDisagree", Images(5, 2, 3), Labels({0, 0, 0, 0}), false, 0,
         false, "5 images, but"},
        {"GzipCountsDisagree", Images(5, 2, 3), Labels({0, 0, 0}), true, 0,
         false, "5 images, but"},
        {"GzipTruncatedContent", Truncated(Images(5, 2, 3), 4),
         Labels({0, 0, 0, 0, 0}), true, 0, false, "truncated"},
    }),
    [](const ::testing::TestParamInfo<BadInput>& info) {
      return info.param.what;
    });

TEST(IdxTest, DamagedGzipStreamsAreRejected) {
  const std::string labels = WriteRaw("labels", Labels({0, 1, 2, 3, 4}));
  const std::string good = ReadAll(WriteGzip("good", Images(5, 2, 3)));
  ASSERT_GT(good.size(), 30u);

  // Cut short: the stream ends before its trailer.
  const std::string cut = WriteRaw("cut.gz", good.substr(0, good.size() - 12));
  absl::StatusOr<std::unique_ptr<ExampleSource>> source =
      OpenIdx(cut, labels, 0);
  ASSERT_FALSE(source.ok());
  EXPECT_THAT(Message(source.status()), HasSubstr(cut + ": corrupt or "
                                                        "truncated gzip"));

  // A flipped byte in the stored checksum: the data inflates, the check fails.
  std::string flipped = good;
  flipped[flipped.size() - 6] ^= 0x55;
  const std::string bad_crc = WriteRaw("crc.gz", flipped);
  source = OpenIdx(bad_crc, labels, 0);
  ASSERT_FALSE(source.ok());
  EXPECT_THAT(Message(source.status()),
              HasSubstr(bad_crc + ": corrupt or truncated gzip"));
}

TEST(IdxTest, MissingFileIsNotFoundNamingIt) {
  const std::string labels = WriteRaw("labels", Labels({0}));
  const std::string missing = TestPath("nope");
  absl::StatusOr<std::unique_ptr<ExampleSource>> source =
      OpenIdx(missing, labels, 0);
  EXPECT_EQ(source.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(source.status()), HasSubstr(missing + ": cannot open"));
}

TEST(IdxTest, FindsAnMnistLayoutDirectory) {
  const std::string dir = TestPath("dir");
  ASSERT_EQ(system(("mkdir -p " + dir).c_str()), 0);
  absl::StatusOr<IdxDataset> found = FindIdxDataset(dir);
  EXPECT_EQ(found.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(found.status()), HasSubstr("train-images-idx3-ubyte"));
  for (const char* name :
       {"train-images-idx3-ubyte.gz", "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz"}) {
    std::ofstream(dir + "/" + name) << "x";
  }
  found = FindIdxDataset(dir);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->train_images, dir + "/train-images-idx3-ubyte.gz");
  EXPECT_EQ(found->train_labels, dir + "/train-labels-idx1-ubyte");
  EXPECT_EQ(found->test_labels, dir + "/t10k-labels-idx1-ubyte.gz");
}

// The real data set, when its Debian package is installed.
TEST(IdxTest, FashionMnistFromDebian) {
  absl::StatusOr<IdxDataset> found =
      FindIdxDataset("/usr/share/datasets/fashion-mnist");
  if (!found.ok()) GTEST_SKIP() << found.status();
  absl::StatusOr<std::unique_ptr<ExampleSource>> test =
      OpenIdx(found->test_images, found->test_labels, 0);
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ((*test)->size(), 10000);
  EXPECT_EQ((*test)->num_features(), 784);
  EXPECT_EQ((*test)->num_classes(), 10);
}

}  // namespace
}  // namespace pstrain
