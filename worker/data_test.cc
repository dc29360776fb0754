#include "worker/data.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

// A file under the test's temp dir, named after the running test so that
// tests never see each other's files.
std::string WriteFile(const std::string& name, const std::string& content) {
  const ::testing::TestInfo* info =
      ::testing::UnitTest::GetInstance()->current_test_info();
  // Parameterized test names contain '/', which must not become directories.
  std::string test = absl::StrCat(info->test_suite_name(), "_", info->name());
  std::replace(test.begin(), test.end(), '/', '_');
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/", test, "_", name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
  out.close();
  EXPECT_TRUE(out.good()) << path;
  return path;
}

// gMock prints an absl::string_view as a character dump; a string reads.
std::string Message(const absl::Status& status) {
  return std::string(status.message());
}

Dataset MustSynthetic(const SyntheticOptions& options, int64_t first,
                      int64_t count, ShardSpec shard = {}) {
  absl::StatusOr<Dataset> data =
      MakeSyntheticClassification(options, first, count, shard);
  EXPECT_TRUE(data.ok()) << data.status();
  return data.ok() ? *std::move(data) : Dataset();
}

std::vector<float> Row(const Dataset& data, int64_t r) {
  return std::vector<float>(
      data.features.begin() + r * data.num_features,
      data.features.begin() + (r + 1) * data.num_features);
}

void ExpectSameData(const Dataset& a, const Dataset& b) {
  EXPECT_EQ(a.num_features, b.num_features);
  EXPECT_EQ(a.num_classes, b.num_classes);
  EXPECT_EQ(a.labels, b.labels);
  // Bitwise: the sync contract needs identical bytes, not close values.
  EXPECT_EQ(a.features, b.features);
}

TEST(SyntheticTest, SameSeedGivesIdenticalData) {
  SyntheticOptions options;
  ExpectSameData(MustSynthetic(options, 0, 500),
                 MustSynthetic(options, 0, 500));
}

TEST(SyntheticTest, DifferentSeedGivesDifferentData) {
  SyntheticOptions a;
  SyntheticOptions b;
  b.seed = a.seed + 1;
  const Dataset da = MustSynthetic(a, 0, 500);
  const Dataset db = MustSynthetic(b, 0, 500);
  EXPECT_NE(da.features, db.features);
  EXPECT_NE(da.labels, db.labels);
}

TEST(SyntheticTest, ExampleDependsOnlyOnItsIndex) {
  SyntheticOptions options;
  const Dataset all = MustSynthetic(options, 0, 200);
  const Dataset window = MustSynthetic(options, 137, 40);
  ASSERT_EQ(window.size(), 40);
  for (int64_t r = 0; r < window.size(); ++r) {
    EXPECT_EQ(Row(window, r), Row(all, 137 + r)) << r;
    EXPECT_EQ(window.labels[r], all.labels[137 + r]) << r;
  }
}

TEST(SyntheticTest, ShardsInterleaveToTheUnshardedStream) {
  SyntheticOptions options;
  options.num_features = 5;
  // An odd start, so that shard 0 does not simply begin at first_index.
  const int64_t first = 1001;
  const int64_t count = 301;
  const Dataset all = MustSynthetic(options, first, count);
  ASSERT_EQ(all.size(), count);
  std::vector<Dataset> shards;
  for (int k = 0; k < 3; ++k) {
    shards.push_back(MustSynthetic(options, first, count, {k, 3}));
  }
  int64_t total = 0;
  for (const Dataset& shard : shards) total += shard.size();
  EXPECT_EQ(total, count);
  // Walking the global indices in order, taking each from its shard's next
  // row, must reproduce the single-process stream exactly.
  std::vector<int64_t> next_row(3, 0);
  for (int64_t r = 0; r < count; ++r) {
    const int64_t i = first + r;
    const Dataset& shard = shards[i % 3];
    const int64_t position = next_row[i % 3]++;
    ASSERT_LT(position, shard.size());
    EXPECT_EQ(Row(shard, position), Row(all, r)) << "global index " << i;
    EXPECT_EQ(shard.labels[position], all.labels[r]) << "global index " << i;
  }
}

TEST(SyntheticTest, EmptyShardAndEmptyRange) {
  SyntheticOptions options;
  EXPECT_EQ(MustSynthetic(options, 10, 0).size(), 0);
  // Index 10 belongs to shard 10 % 4 == 2; shard 3 gets nothing.
  const Dataset empty = MustSynthetic(options, 10, 1, {3, 4});
  EXPECT_EQ(empty.size(), 0);
  EXPECT_EQ(empty.num_features, options.num_features);
  EXPECT_EQ(MustSynthetic(options, 10, 1, {2, 4}).size(), 1);
}

TEST(SyntheticTest, FeaturesAreStandardNormal) {
  SyntheticOptions options;
  options.num_features = 16;
  const Dataset data = MustSynthetic(options, 0, 8000);
  double sum = 0, sum_sq = 0;
  int64_t beyond_1_96 = 0;
  for (float x : data.features) {
    ASSERT_TRUE(std::isfinite(x));
    sum += x;
    sum_sq += static_cast<double>(x) * x;
    beyond_1_96 += std::fabs(x) > 1.96;
  }
  const double n = data.features.size();
  EXPECT_NEAR(sum / n, 0.0, 0.02);
  EXPECT_NEAR(sum_sq / n, 1.0, 0.03);
  EXPECT_NEAR(beyond_1_96 / n, 0.05, 0.005);
}

TEST(SyntheticTest, EveryClassIsPresent) {
  SyntheticOptions options;
  options.num_classes = 4;
  options.label_noise = 0;
  const Dataset data = MustSynthetic(options, 0, 2000);
  std::vector<int64_t> counts(4, 0);
  for (int32_t label : data.labels) {
    ASSERT_GE(label, 0);
    ASSERT_LT(label, 4);
    ++counts[label];
  }
  for (int c = 0; c < 4; ++c) {
    // Not degenerate: a random teacher leaves no class nearly empty.
    EXPECT_GT(counts[c], 2000 / 4 / 4) << "class " << c;
  }
}

TEST(SyntheticTest, NoiseReplacesTheRightFractionOfLabels) {
  SyntheticOptions clean;
  clean.label_noise = 0;
  const Dataset reference = MustSynthetic(clean, 0, 20000);
  for (double noise : {0.0, 0.3, 1.0}) {
    SyntheticOptions noisy = clean;
    noisy.label_noise = noise;
    const Dataset data = MustSynthetic(noisy, 0, 20000);
    // Noise touches labels only.
    EXPECT_EQ(data.features, reference.features);
    int64_t agree = 0;
    for (int64_t r = 0; r < data.size(); ++r) {
      agree += data.labels[r] == reference.labels[r];
    }
    // The clean labels are argmax(T x), so the agreement is exactly the
    // accuracy of the teacher itself, which is the best achievable.
    EXPECT_NEAR(static_cast<double>(agree) / data.size(),
                SyntheticBestAccuracy(noisy), 0.015)
        << "label_noise " << noise;
  }
}

TEST(SyntheticTest, BestAccuracy) {
  SyntheticOptions options;
  options.num_classes = 4;
  options.label_noise = 0;
  EXPECT_DOUBLE_EQ(SyntheticBestAccuracy(options), 1.0);
  options.label_noise = 0.2;
  EXPECT_DOUBLE_EQ(SyntheticBestAccuracy(options), 0.85);
  options.label_noise = 1;
  EXPECT_DOUBLE_EQ(SyntheticBestAccuracy(options), 0.25);
}

// A linear model must be able to learn the task, or training on it proves
// nothing; a perceptron is the simplest one that needs no gradients.
TEST(SyntheticTest, LabelsAreLinearlyLearnable) {
  SyntheticOptions options;
  options.num_features = 8;
  options.num_classes = 4;
  options.label_noise = 0;
  const Dataset train = MustSynthetic(options, 0, 4000);
  const Dataset test = MustSynthetic(options, 4000, 2000);
  const int64_t f = options.num_features;
  const int64_t c = options.num_classes;
  std::vector<double> w(c * f, 0.0), w_sum(c * f, 0.0);
  auto predict = [&](const std::vector<double>& weights, const float* x) {
    int64_t best = 0;
    double best_score = -1e300;
    for (int64_t k = 0; k < c; ++k) {
      double score = 0;
      for (int64_t j = 0; j < f; ++j) score += weights[k * f + j] * x[j];
      if (score > best_score) best_score = score, best = k;
    }
    return best;
  };
  for (int epoch = 0; epoch < 10; ++epoch) {
    for (int64_t r = 0; r < train.size(); ++r) {
      const float* x = &train.features[r * f];
      const int64_t guess = predict(w, x);
      const int64_t label = train.labels[r];
      if (guess != label) {
        for (int64_t j = 0; j < f; ++j) {
          w[label * f + j] += x[j];
          w[guess * f + j] -= x[j];
        }
      }
      for (size_t k = 0; k < w.size(); ++k) w_sum[k] += w[k];
    }
  }
  int64_t correct = 0;
  for (int64_t r = 0; r < test.size(); ++r) {
    correct += predict(w_sum, &test.features[r * f]) == test.labels[r];
  }
  EXPECT_GE(static_cast<double>(correct) / test.size(), 0.95);
}

TEST(SyntheticTest, RejectsBadOptions) {
  struct Case {
    std::string name;
    SyntheticOptions options;
    int64_t first;
    int64_t count;
    ShardSpec shard;
  };
  auto with = [](auto mutate) {
    SyntheticOptions options;
    mutate(options);
    return options;
  };
  const std::vector<Case> cases = {
      {"num_features", with([](auto& o) { o.num_features = 0; }), 0, 1, {}},
      {"num_classes", with([](auto& o) { o.num_classes = 1; }), 0, 1, {}},
      {"label_noise", with([](auto& o) { o.label_noise = -0.1; }), 0, 1, {}},
      {"label_noise", with([](auto& o) { o.label_noise = 1.5; }), 0, 1, {}},
      {"label_noise",
       with([](auto& o) { o.label_noise = std::nan(""); }),
       0,
       1,
       {}},
      {"shard.count", {}, 0, 1, {0, 0}},
      {"shard.index", {}, 0, 1, {3, 3}},
      {"shard.index", {}, 0, 1, {-1, 3}},
      {"count", {}, 0, -1, {}},
      {"first_index", {}, -5, 1, {}},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Dataset> data =
        MakeSyntheticClassification(c.options, c.first, c.count, c.shard);
    EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument)
        << c.name;
    EXPECT_THAT(Message(data.status()), HasSubstr(c.name));
  }
}

std::string ToCsv(const Dataset& data, bool header) {
  std::string out;
  if (header) {
    out += "label";
    for (int64_t j = 0; j < data.num_features; ++j)
      absl::StrAppend(&out, ",x", j);
    out += "\n";
  }
  for (int64_t r = 0; r < data.size(); ++r) {
    absl::StrAppend(&out, data.labels[r]);
    // %.9g round-trips every float exactly.
    for (float x : Row(data, r))
      absl::StrAppend(&out, absl::StrFormat(",%.9g", x));
    out += "\n";
  }
  return out;
}

// Zeros are left out, as LIBSVM writers do, so the reader must restore them.
std::string ToLibsvm(const Dataset& data) {
  std::string out = "# written by data_test\n";
  for (int64_t r = 0; r < data.size(); ++r) {
    absl::StrAppend(&out, data.labels[r]);
    const std::vector<float> row = Row(data, r);
    for (size_t j = 0; j < row.size(); ++j) {
      if (row[j] != 0)
        absl::StrAppend(&out, absl::StrFormat(" %d:%.9g", j + 1, row[j]));
    }
    out += "\n";
  }
  return out;
}

// Synthetic data with exact zeros sprinkled in, including a whole column.
Dataset SparseData(int64_t rows) {
  SyntheticOptions options;
  options.num_features = 6;
  options.num_classes = 3;
  Dataset data = MustSynthetic(options, 0, rows);
  for (int64_t r = 0; r < data.size(); ++r) {
    data.features[r * 6 + 2] = 0;
    if (r % 2 == 0) data.features[r * 6 + 4] = 0;
  }
  return data;
}

TEST(CsvTest, RoundTripWithAndWithoutHeader) {
  const Dataset data = SparseData(50);
  for (bool header : {true, false}) {
    const std::string path =
        WriteFile(header ? "h.csv" : "nh.csv", ToCsv(data, header));
    for (int64_t width : {int64_t{6}, int64_t{0}}) {
      absl::StatusOr<Dataset> read = ReadCsv(path, width, 3, {});
      ASSERT_TRUE(read.ok()) << read.status();
      ExpectSameData(*read, data);
    }
  }
}

TEST(CsvTest, ShardsInterleave) {
  const Dataset data = SparseData(31);
  const std::string path = WriteFile("d.csv", ToCsv(data, true));
  for (int k = 0; k < 3; ++k) {
    // Inferring the width must work even in shards that skip example 0.
    absl::StatusOr<Dataset> shard = ReadCsv(path, 0, 3, {k, 3});
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ(shard->num_features, 6);
    ASSERT_EQ(shard->size(), (31 - k + 2) / 3);
    for (int64_t r = 0; r < shard->size(); ++r) {
      EXPECT_EQ(Row(*shard, r), Row(data, 3 * r + k));
      EXPECT_EQ(shard->labels[r], data.labels[3 * r + k]);
    }
  }
}

TEST(CsvTest, ToleratesBlankLinesWhitespaceAndCrlf) {
  const std::string path = WriteFile(
      "ws.csv", "\xEF\xBB\xBFy, a ,b\r\n\r\n 1, 0.5 ,-2\r\n\n0,3e2,  .25\r\n");
  absl::StatusOr<Dataset> read = ReadCsv(path, 0, 2, {});
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->num_features, 2);
  EXPECT_EQ(read->labels, (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(read->features, (std::vector<float>{0.5f, -2.0f, 300.0f, 0.25f}));
}

TEST(CsvTest, HeaderIsAnyFirstLineWithText) {
  // An unnamed index column, as pandas writes it, still makes a header.
  const std::string path = WriteFile("idx.csv", ",a,b\n1,2,3\n");
  absl::StatusOr<Dataset> read = ReadCsv(path, 0, 2, {});
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->size(), 1);
  EXPECT_EQ(read->num_features, 2);
  // Only the first line may be a header.
  const std::string twice = WriteFile("twice.csv", "y,a\n0,1\ny,a\n");
  EXPECT_THAT(Message(ReadCsv(twice, 0, 2, {}).status()),
              HasSubstr(twice + ":3: "));
}

TEST(CsvTest, EmptyShardIsFineButNoExamplesIsAnError) {
  const std::string one = WriteFile("one.csv", "a,b\n1,2\n");
  absl::StatusOr<Dataset> empty = ReadCsv(one, 0, 2, {1, 2});
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->size(), 0);
  EXPECT_EQ(empty->num_features, 1);

  for (const std::string& content : {std::string(""), std::string("a,b\n\n")}) {
    const std::string path = WriteFile("none.csv", content);
    EXPECT_EQ(ReadCsv(path, 0, 2, {}).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(CsvTest, MissingFileIsNotFound) {
  EXPECT_EQ(
      ReadCsv(::testing::TempDir() + "/no/such.csv", 0, 2, {}).status().code(),
      absl::StatusCode::kNotFound);
  EXPECT_EQ(ReadLibsvm(::testing::TempDir() + "/no/such.svm", 0, 2, {})
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST(LibsvmTest, RoundTrip) {
  const Dataset data = SparseData(40);
  const std::string path = WriteFile("d.svm", ToLibsvm(data));
  absl::StatusOr<Dataset> read = ReadLibsvm(path, 6, 3, {});
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameData(*read, data);
}

TEST(LibsvmTest, ShardsInterleave) {
  const Dataset data = SparseData(31);
  const std::string path = WriteFile("d.svm", ToLibsvm(data));
  for (int k = 0; k < 3; ++k) {
    absl::StatusOr<Dataset> shard = ReadLibsvm(path, 6, 3, {k, 3});
    ASSERT_TRUE(shard.ok()) << shard.status();
    ASSERT_EQ(shard->size(), (31 - k + 2) / 3);
    for (int64_t r = 0; r < shard->size(); ++r) {
      EXPECT_EQ(Row(*shard, r), Row(data, 3 * r + k));
      EXPECT_EQ(shard->labels[r], data.labels[3 * r + k]);
    }
  }
}

TEST(LibsvmTest, PlusMinusOneLabelsAndComments) {
  const std::string path = WriteFile("pm.svm",
                                     "# a comment line\n"
                                     "+1 1:0.5 3:2   # trailing comment\n"
                                     "\n"
                                     "-1\t2:-1\n"
                                     "1 1:1\n"
                                     "0 3:4\n");
  absl::StatusOr<Dataset> read = ReadLibsvm(path, 0, 2, {});
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->num_features, 3);
  EXPECT_EQ(read->labels, (std::vector<int32_t>{1, 0, 1, 0}));
  EXPECT_EQ(read->features,
            (std::vector<float>{0.5f, 0, 2, 0, -1, 0, 1, 0, 0, 0, 0, 4}));
  // -1 means class 0 only in the binary convention.
  EXPECT_EQ(ReadLibsvm(path, 0, 3, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LibsvmTest, InferredWidthIsTheLargestIndexInTheWholeFile) {
  // Index 9 occurs only in example 1, which shard 0 of 2 does not keep.
  const std::string path = WriteFile("w.svm", "0 1:1\n1 2:1 9:3\n0 3:1\n");
  for (int k = 0; k < 2; ++k) {
    absl::StatusOr<Dataset> read = ReadLibsvm(path, 0, 2, {k, 2});
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->num_features, 9) << "shard " << k;
    EXPECT_EQ(read->size(), k == 0 ? 2 : 1);
  }
  // A width given explicitly may be larger than any index used.
  absl::StatusOr<Dataset> wide = ReadLibsvm(path, 12, 2, {});
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_EQ(wide->num_features, 12);
  EXPECT_EQ(wide->features.size(), 36u);
}

TEST(LibsvmTest, NoExamplesIsAnError) {
  const std::string comments = WriteFile("c.svm", "# nothing\n\n");
  EXPECT_EQ(ReadLibsvm(comments, 3, 2, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Examples without any feature leave the width unknowable.
  const std::string bare = WriteFile("b.svm", "0\n1\n");
  EXPECT_EQ(ReadLibsvm(bare, 0, 2, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Dataset> zeros = ReadLibsvm(bare, 2, 2, {});
  ASSERT_TRUE(zeros.ok()) << zeros.status();
  EXPECT_EQ(zeros->features, std::vector<float>(4, 0.0f));
}

TEST(ReaderTest, RejectsBadOptions) {
  const std::string path = WriteFile("ok.csv", "0,1\n");
  EXPECT_THAT(Message(ReadCsv(path, -1, 2, {}).status()),
              HasSubstr("num_features"));
  EXPECT_THAT(Message(ReadCsv(path, 1, 1, {}).status()),
              HasSubstr("num_classes"));
  EXPECT_THAT(Message(ReadLibsvm(path, 1, 2, {2, 2}).status()),
              HasSubstr("shard.index"));
  EXPECT_THAT(Message(ReadLibsvm(path, 1, 2, {0, 0}).status()),
              HasSubstr("shard.count"));
}

struct Malformed {
  std::string what;
  bool libsvm;
  int64_t num_features;
  std::string content;
  int line;  // where the error is
  std::string message;
};

// Readable names in failure messages instead of a byte dump.
void PrintTo(const Malformed& m, std::ostream* os) { *os << m.what; }

class MalformedTest : public ::testing::TestWithParam<Malformed> {};

TEST_P(MalformedTest, ErrorNamesFileAndLine) {
  const Malformed& m = GetParam();
  const std::string path =
      WriteFile(m.libsvm ? "bad.svm" : "bad.csv", m.content);
  const absl::StatusOr<Dataset> read =
      m.libsvm ? ReadLibsvm(path, m.num_features, 3, {})
               : ReadCsv(path, m.num_features, 3, {});
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(read.status()),
              HasSubstr(absl::StrCat(path, ":", m.line, ": ")));
  EXPECT_THAT(Message(read.status()), HasSubstr(m.message));
}

INSTANTIATE_TEST_SUITE_P(
    Readers, MalformedTest,
    ::testing::ValuesIn(std::vector<Malformed>{
        {"CsvTooFewColumns", false, 2, "0,1,2\n1,2\n", 2, "columns"},
        {"CsvTooManyColumns", false, 0, "y,a\n\n0,1\n1,2,3\n", 4, "columns"},
        {"CsvTrailingComma", false, 2, "0,1,2,\n", 1, "columns"},
        {"CsvNotANumber", false, 2, "0,1,2\n1,x,2\n", 2, "column 2"},
        {"CsvEmptyField", false, 2, "0,1,2\n1,,2\n", 2, "column 2"},
        {"CsvNaN", false, 2, "0,1,2\n\n2,1,nan\n", 3, "finite"},
        {"CsvInf", false, 2, "0,1,2\n2,-inf,1\n", 2, "finite"},
        {"CsvOverflow", false, 2, "0,1,2\n2,1e40,1\n", 2, "finite"},
        {"CsvLabelOutOfRange", false, 2, "h\n0,1,2\n3,1,2\n", 3, "range"},
        {"CsvNegativeLabel", false, 2, "0,1,2\n-1,1,2\n", 2, "range"},
        {"CsvLabelNotInteger", false, 2, "0,1,2\n1.5,1,2\n", 2, "integer"},
        {"CsvOnlyLabels", false, 0, "0\n1\n", 1, "num_features"},
        {"SvmLabelNotInteger", true, 0, "0 1:1\nx 1:1\n", 2, "integer"},
        {"SvmLabelOutOfRange", true, 0, "# c\n3 1:1\n", 2, "range"},
        {"SvmNoColon", true, 0, "0 1:1\n1 2\n", 2, "index:value"},
        {"SvmBadIndex", true, 0, "0 a:1\n", 1, "index:value"},
        {"SvmZeroIndex", true, 0, "0 0:1\n", 1, "range"},
        {"SvmIndexTooLarge", true, 3, "0 1:1\n\n1 4:1\n", 3, "range"},
        {"SvmIndexNotIncreasing", true, 0, "0 1:1\n1 3:1 2:1\n", 2, "increase"},
        {"SvmRepeatedIndex", true, 0, "0 2:1 2:1\n", 1, "increase"},
        {"SvmBadValue", true, 0, "0 1:1\n1 2:abc\n", 2, "not a number"},
        {"SvmEmptyValue", true, 0, "0 1:\n", 1, "not a number"},
        {"SvmNaN", true, 0, "0 1:1\n1 2:NaN\n", 2, "finite"},
    }),
    [](const ::testing::TestParamInfo<Malformed>& info) {
      return info.param.what;
    });

TEST(BatchCursorTest, WrapsAround) {
  Dataset data;
  data.num_features = 2;
  data.num_classes = 5;
  for (int r = 0; r < 5; ++r) {
    data.labels.push_back(r);
    data.features.push_back(10 * r);
    data.features.push_back(10 * r + 1);
  }
  BatchCursor cursor(&data);
  auto next = [&](int64_t rows) {
    std::vector<float> features(rows * 2, -1);
    std::vector<int32_t> labels(rows, -1);
    cursor.Next(rows, features.data(), labels.data());
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(features[2 * r], 10 * labels[r]);
      EXPECT_EQ(features[2 * r + 1], 10 * labels[r] + 1);
    }
    return labels;
  };
  EXPECT_EQ(next(3), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(next(3), (std::vector<int32_t>{3, 4, 0}));
  EXPECT_EQ(next(2), (std::vector<int32_t>{1, 2}));
  // Larger than the dataset: wraps more than once.
  EXPECT_EQ(next(12),
            (std::vector<int32_t>{3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4}));
  EXPECT_EQ(next(0), (std::vector<int32_t>{}));
  EXPECT_EQ(next(1), (std::vector<int32_t>{0}));
}

TEST(BatchCursorTest, EmptyDatasetIsANoOp) {
  Dataset empty;
  empty.num_features = 3;
  BatchCursor cursor(&empty);
  std::vector<float> features(6, 7.0f);
  std::vector<int32_t> labels(2, 7);
  cursor.Next(2, features.data(), labels.data());
  EXPECT_EQ(features, std::vector<float>(6, 7.0f));
  EXPECT_EQ(labels, std::vector<int32_t>(2, 7));
}

TEST(ReaderTest, InfersClassesOrNamesTheFlag) {
  const std::string path = WriteFile("c.csv", "0,1\n9,2\n3,3\n");
  absl::StatusOr<Dataset> inferred = ReadCsv(path, 0, 0, {});
  ASSERT_TRUE(inferred.ok()) << inferred.status();
  EXPECT_EQ(inferred->num_classes, 10);
  const std::string svm = WriteFile("c.svm", "0 1:1\n2 1:1\n");
  absl::StatusOr<Dataset> inferred_svm = ReadLibsvm(svm, 0, 0, {});
  ASSERT_TRUE(inferred_svm.ok()) << inferred_svm.status();
  EXPECT_EQ(inferred_svm->num_classes, 3);
  // Too small a count given explicitly: the message says which flag to set.
  EXPECT_THAT(Message(ReadCsv(path, 0, 4, {}).status()),
              HasSubstr("label 9 is out of range [0, 4): set --num_classes"));
}

TEST(InferNumClassesTest, IsLargestLabelPlusOneAndAtLeastTwo) {
  EXPECT_EQ(InferNumClasses(std::vector<int32_t>{0, 4, 2}), 5);
  EXPECT_EQ(InferNumClasses(std::vector<int32_t>{0, 0}), 2);
  EXPECT_EQ(InferNumClasses(std::vector<int32_t>{}), 2);
}

TEST(InMemorySourceTest, GathersRowsByGlobalIndex) {
  Dataset data;
  data.num_features = 2;
  data.num_classes = 5;
  for (int r = 0; r < 5; ++r) {
    data.labels.push_back(r);
    data.features.push_back(10 * r);
    data.features.push_back(10 * r + 1);
  }
  const InMemorySource source(std::move(data));
  EXPECT_EQ(source.size(), 5);
  EXPECT_EQ(source.resident_bytes(), 5 * 2 * 4 + 5 * 4);
  std::vector<float> features(6);
  std::vector<int32_t> labels(3);
  const std::vector<int64_t> indices = {4, 0, 4};
  ASSERT_TRUE(source.Gather(indices, features.data(), labels.data()).ok());
  EXPECT_EQ(labels, (std::vector<int32_t>{4, 0, 4}));
  EXPECT_EQ(features, (std::vector<float>{40, 41, 0, 1, 40, 41}));
  const std::vector<int64_t> outside = {5};
  EXPECT_EQ(source.Gather(outside, features.data(), labels.data()).code(),
            absl::StatusCode::kOutOfRange);
}

TEST(EpochPermutationTest, IsAPermutationFixedBySeedAndEpoch) {
  const std::vector<int64_t> a = EpochPermutation(1000, 7, 0);
  std::vector<int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_EQ(EpochPermutation(1000, 7, 0), a);
  EXPECT_NE(EpochPermutation(1000, 7, 1), a);
  EXPECT_NE(EpochPermutation(1000, 8, 0), a);
  // Shuffled, not merely rotated: few elements stay where they were.
  int64_t fixed = 0;
  for (int64_t i = 0; i < 1000; ++i) fixed += a[i] == i;
  EXPECT_LT(fixed, 20);
  EXPECT_TRUE(EpochPermutation(0, 7, 0).empty());
}

// The sync contract: for any worker count, the workers' slices of step s
// together are exactly the single process's global batch of step s.
TEST(EpochPlanTest, WorkerSlicesMakeUpTheSingleProcessBatch) {
  constexpr int64_t kExamples = 103;
  constexpr int64_t kGlobalBatch = 12;
  EpochPlan::Options single_options;
  single_options.num_examples = kExamples;
  single_options.worker_batch = kGlobalBatch;
  single_options.seed = 3;
  absl::StatusOr<EpochPlan> single = EpochPlan::Create(single_options);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(single->steps_per_epoch(), 8);  // 103 / 12, the rest left out
  for (int workers : {2, 3, 4, 6}) {
    std::vector<EpochPlan> plans;
    for (int k = 0; k < workers; ++k) {
      EpochPlan::Options options = single_options;
      options.worker_batch = kGlobalBatch / workers;
      options.num_workers = workers;
      options.worker_index = k;
      plans.push_back(*EpochPlan::Create(options));
    }
    for (int64_t step = 0; step < 30; ++step) {  // several epochs
      const absl::Span<const int64_t> global = single->WorkerIndices(step);
      std::vector<int64_t> joined;
      for (EpochPlan& plan : plans) {
        const absl::Span<const int64_t> part = plan.WorkerIndices(step);
        joined.insert(joined.end(), part.begin(), part.end());
      }
      ASSERT_EQ(joined, std::vector<int64_t>(global.begin(), global.end()))
          << workers << " workers, step " << step;
    }
  }
}

TEST(EpochPlanTest, EachEpochVisitsDistinctExamplesInANewOrder) {
  EpochPlan::Options options;
  options.num_examples = 40;
  options.worker_batch = 10;
  absl::StatusOr<EpochPlan> plan = EpochPlan::Create(options);
  ASSERT_TRUE(plan.ok());
  std::vector<int64_t> epoch0, epoch1;
  for (int64_t step = 0; step < 8; ++step) {
    const absl::Span<const int64_t> batch = plan->WorkerIndices(step);
    (step < 4 ? epoch0 : epoch1)
        .insert((step < 4 ? epoch0 : epoch1).end(), batch.begin(), batch.end());
  }
  EXPECT_NE(epoch0, epoch1);
  std::sort(epoch0.begin(), epoch0.end());
  std::sort(epoch1.begin(), epoch1.end());
  EXPECT_EQ(epoch0, epoch1);  // all 40, each once
  EXPECT_EQ(epoch0.front(), 0);
  EXPECT_EQ(epoch0.back(), 39);

  options.shuffle = false;
  plan = EpochPlan::Create(options);
  ASSERT_TRUE(plan.ok());
  const absl::Span<const int64_t> in_order = plan->WorkerIndices(5);
  EXPECT_EQ(std::vector<int64_t>(in_order.begin(), in_order.end()),
            (std::vector<int64_t>{10, 11, 12, 13, 14, 15, 16, 17, 18, 19}));
}

TEST(EpochPlanTest, RejectsABatchLargerThanTheData) {
  EpochPlan::Options options;
  options.num_examples = 10;
  options.worker_batch = 6;
  options.num_workers = 2;
  EXPECT_THAT(Message(EpochPlan::Create(options).status()),
              HasSubstr("larger than the training set"));
  options.worker_index = 2;
  options.num_examples = 100;
  EXPECT_EQ(EpochPlan::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pstrain
