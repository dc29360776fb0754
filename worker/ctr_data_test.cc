#include "worker/ctr_data.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/ctr_metrics.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const ::testing::TestInfo* info =
      ::testing::UnitTest::GetInstance()->current_test_info();
  std::string test = absl::StrCat(info->test_suite_name(), "_", info->name());
  std::replace(test.begin(), test.end(), '/', '_');
  return absl::StrCat(::testing::TempDir(), "/", test, "_", name);
}

std::string WriteFile(const std::string& name, const std::string& content) {
  const std::string path = TempPath(name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
  out.close();
  EXPECT_TRUE(out.good()) << path;
  return path;
}

std::string Message(const absl::Status& status) {
  return std::string(status.message());
}

CtrDataset MustSynthetic(const SyntheticCtrOptions& options, int64_t first,
                         int64_t count, ShardSpec shard = {}) {
  absl::StatusOr<CtrDataset> data =
      MakeSyntheticCtr(options, first, count, shard);
  EXPECT_TRUE(data.ok()) << data.status();
  if (!data.ok()) return CtrDataset();
  EXPECT_TRUE(ValidateCtrDataset(*data).ok()) << ValidateCtrDataset(*data);
  return *std::move(data);
}

// Example i of `data` as a self-contained dataset, for comparing examples
// across datasets whose id offsets differ.
struct Example {
  float label;
  std::vector<float> dense;
  std::vector<std::vector<uint64_t>> bags;
  bool operator==(const Example& o) const {
    // Bitwise for floats: the sync contract needs identical bytes.
    return label == o.label && dense == o.dense && bags == o.bags;
  }
};

Example GetExample(const CtrDataset& data, int64_t i) {
  Example e;
  e.label = data.labels[i];
  e.dense.assign(data.dense.begin() + i * data.num_dense,
                 data.dense.begin() + (i + 1) * data.num_dense);
  for (int f = 0; f < data.num_fields; ++f) {
    e.bags.emplace_back(data.ids.begin() + data.BagBegin(i, f),
                        data.ids.begin() + data.BagEnd(i, f));
  }
  return e;
}

double PositiveRate(const CtrDataset& data) {
  double sum = 0;
  for (float y : data.labels) sum += y;
  return sum / data.size();
}

TEST(SyntheticCtrTest, DeterministicAndSeedDependent) {
  SyntheticCtrOptions options;
  const CtrDataset a = MustSynthetic(options, 0, 500);
  const CtrDataset b = MustSynthetic(options, 0, 500);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_EQ(a.dense, b.dense);
  EXPECT_EQ(a.offsets, b.offsets);
  EXPECT_EQ(a.ids, b.ids);
  options.seed = 2;
  const CtrDataset c = MustSynthetic(options, 0, 500);
  EXPECT_NE(a.labels, c.labels);
  EXPECT_NE(a.ids, c.ids);
}

TEST(SyntheticCtrTest, ShapeAndBagSizes) {
  SyntheticCtrOptions options;
  options.num_dense = 3;
  options.num_fields = 5;
  options.max_bag = 4;
  const CtrDataset data = MustSynthetic(options, 0, 2000);
  ASSERT_EQ(data.size(), 2000);
  EXPECT_EQ(data.num_dense, 3);
  EXPECT_EQ(data.num_fields, 5);
  std::map<int64_t, int> sizes;
  for (int64_t i = 0; i < data.size(); ++i) {
    for (int f = 0; f < data.num_fields; ++f) {
      ++sizes[data.BagEnd(i, f) - data.BagBegin(i, f)];
    }
  }
  // Sizes are uniform on [1, max_bag].
  ASSERT_EQ(sizes.size(), 4u);
  for (const auto& [size, n] : sizes) {
    EXPECT_GE(size, 1);
    EXPECT_LE(size, 4);
    EXPECT_NEAR(n, 2000 * 5 / 4, 150) << "size " << size;
  }
  // Dense values are log(1 + count) of integer counts.
  for (float x : data.dense) {
    EXPECT_GE(x, 0.0f);
    const double count = std::expm1(double(x));
    EXPECT_NEAR(count, std::round(count), 1e-3 * (1 + count));
  }
}

TEST(SyntheticCtrTest, ExampleDependsOnlyOnItsIndexAndShardsInterleave) {
  SyntheticCtrOptions options;
  const CtrDataset whole = MustSynthetic(options, 0, 300);
  // A window of the stream is the same examples.
  const CtrDataset window = MustSynthetic(options, 101, 57);
  ASSERT_EQ(window.size(), 57);
  for (int64_t r = 0; r < 57; ++r) {
    EXPECT_TRUE(GetExample(window, r) == GetExample(whole, 101 + r)) << r;
  }
  // Shard k of n over [first, first + count) holds exactly the examples with
  // global index i % n == k, in order: the union of shards is the whole.
  for (int n : {1, 2, 3, 7}) {
    const int64_t first = 13;
    const int64_t count = 250;
    int64_t total = 0;
    for (int k = 0; k < n; ++k) {
      const CtrDataset shard = MustSynthetic(options, first, count, {k, n});
      int64_t r = 0;
      for (int64_t i = first; i < first + count; ++i) {
        if (i % n != k) continue;
        ASSERT_LT(r, shard.size());
        EXPECT_TRUE(GetExample(shard, r) == GetExample(whole, i))
            << "shard " << k << "/" << n << " index " << i;
        ++r;
      }
      EXPECT_EQ(r, shard.size());
      total += shard.size();
    }
    EXPECT_EQ(total, count);
  }
  // An empty range and a shard with nothing in it are fine.
  EXPECT_EQ(MustSynthetic(options, 5, 0).size(), 0);
  EXPECT_EQ(MustSynthetic(options, 5, 1, {1, 3}).size(), 0);
  EXPECT_EQ(MustSynthetic(options, 5, 1, {1, 3}).offsets,
            std::vector<int64_t>{0});
}

TEST(SyntheticCtrTest, PositiveRateAndGroundTruth) {
  for (uint64_t seed : {1, 2, 3}) {
    SyntheticCtrOptions options;
    options.seed = seed;
    const CtrDataset data = MustSynthetic(options, 100000, 20000);
    absl::StatusOr<std::vector<double>> p =
        SyntheticCtrTrueProbabilities(options, data);
    ASSERT_TRUE(p.ok()) << p.status();
    const double rate = PositiveRate(data);
    double mean_p = 0;
    for (double q : *p) mean_p += q;
    mean_p /= data.size();
    const double auc = Auc(data.labels, *p);
    const double logloss = LogLoss(data.labels, *p);
    std::vector<double> constant(data.size(), rate);
    const double base_logloss = LogLoss(data.labels, constant);
    std::printf(
        "seed %d: positive rate %.4f, mean true p %.4f, true AUC %.4f, "
        "true logloss %.4f (constant predictor %.4f)\n",
        static_cast<int>(seed), rate, mean_p, auc, logloss, base_logloss);
    EXPECT_GE(rate, 0.15);
    EXPECT_LE(rate, 0.45);
    // The labels are Bernoulli(p): their mean matches within ~4 sigma.
    EXPECT_NEAR(rate, mean_p, 4 * std::sqrt(0.25 / data.size()));
    // The calibration (on examples 0..4095) carries over to other examples.
    EXPECT_NEAR(mean_p, options.positive_rate, 0.02);
    EXPECT_GE(auc, 0.75);
    EXPECT_LT(logloss, base_logloss - 0.05);
  }
}

TEST(SyntheticCtrTest, IdsFollowTheZipfLawExactly) {
  for (double exponent : {0.0, 1.1, 2.0}) {
    SyntheticCtrOptions options;
    options.num_dense = 0;
    options.num_fields = 2;
    options.max_bag = 1;
    options.vocab_per_field = 50;
    options.zipf_exponent = exponent;
    const int64_t n = 40000;
    const CtrDataset data = MustSynthetic(options, 0, n);
    // Every id of field f is CtrSyntheticId(f, r) for a raw id r < vocab.
    for (int f = 0; f < 2; ++f) {
      absl::flat_hash_map<uint64_t, int> raw_of;
      for (int r = 0; r < 50; ++r) raw_of[CtrSyntheticId(f, r)] = r;
      std::vector<double> counts(50, 0);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(data.BagEnd(i, f) - data.BagBegin(i, f), 1);
        const auto it = raw_of.find(data.ids[data.BagBegin(i, f)]);
        ASSERT_TRUE(it != raw_of.end()) << "field " << f << " example " << i;
        ++counts[it->second];
      }
      double norm = 0;
      for (int r = 0; r < 50; ++r) norm += std::pow(r + 1.0, -exponent);
      for (int r = 0; r < 50; ++r) {
        const double p = std::pow(r + 1.0, -exponent) / norm;
        // Five binomial standard deviations (plus one count).
        EXPECT_NEAR(counts[r], n * p, 5 * std::sqrt(n * p * (1 - p)) + 1)
            << "exponent " << exponent << " field " << f << " rank " << r;
      }
    }
  }
}

TEST(SyntheticCtrTest, DefaultIdsAreSkewed) {
  SyntheticCtrOptions options;
  const CtrDataset data = MustSynthetic(options, 0, 20000);
  absl::flat_hash_map<uint64_t, int64_t> counts;
  for (int64_t i = 0; i < data.size(); ++i) {
    for (int f = 0; f < data.num_fields; ++f) {
      for (int64_t k = data.BagBegin(i, f); k < data.BagEnd(i, f); ++k) {
        // Field in the key: the same id in two fields is two table rows.
        ++counts[data.ids[k] ^ (uint64_t(f) << 60)];
      }
    }
  }
  std::vector<int64_t> sorted;
  for (const auto& [id, c] : counts) sorted.push_back(c);
  std::sort(sorted.rbegin(), sorted.rend());
  // The top 1% of each field's vocabulary.
  const size_t top = options.num_fields * options.vocab_per_field / 100;
  int64_t top_sum = 0;
  int64_t total = 0;
  for (size_t k = 0; k < sorted.size(); ++k) {
    if (k < top) top_sum += sorted[k];
    total += sorted[k];
  }
  const double share = double(top_sum) / total;
  std::printf(
      "%zu distinct ids in %lld occurrences; top 1%% of the "
      "vocabulary (%zu ids) cover %.3f of occurrences\n",
      sorted.size(), static_cast<long long>(total), top, share);
  // Theory for s = 1.1, n = 10^4: H(100, 1.1) / H(10^4, 1.1) ~ 0.65.
  EXPECT_GT(share, 0.55);
  EXPECT_LT(sorted.size(),
            static_cast<size_t>(options.num_fields * options.vocab_per_field));
}

TEST(SyntheticCtrTest, EachFieldDrawsFromItsOwnVocabulary) {
  SyntheticCtrOptions options;
  options.num_fields = 3;
  options.field_vocab = {3, 40, 100000};
  const CtrDataset data = MustSynthetic(options, 0, 20000);
  std::vector<absl::flat_hash_map<uint64_t, int>> distinct(3);
  for (int64_t i = 0; i < data.size(); ++i) {
    for (int f = 0; f < 3; ++f) {
      for (int64_t k = data.BagBegin(i, f); k < data.BagEnd(i, f); ++k) {
        ++distinct[f][data.ids[k]];
      }
    }
  }
  EXPECT_EQ(distinct[0].size(), 3u);
  EXPECT_EQ(distinct[1].size(), 40u);  // 20000 draws reach all 40
  EXPECT_GT(distinct[2].size(), 1000u);
  for (uint64_t raw = 0; raw < 3; ++raw) {
    EXPECT_TRUE(distinct[0].contains(CtrSyntheticId(0, raw))) << raw;
  }
  SyntheticCtrOptions bad = options;
  bad.field_vocab = {3, 40};
  EXPECT_THAT(MakeSyntheticCtr(bad, 0, 10, {0, 1}).status().message(),
              HasSubstr("field_vocab has 2 entries for 3 fields"));
  bad.field_vocab = {3, 0, 5};
  EXPECT_THAT(MakeSyntheticCtr(bad, 0, 10, {0, 1}).status().message(),
              HasSubstr("vocab_per_field must be >= 1, got 0"));
}

TEST(SyntheticCtrTest, NoiseMixesTheProbabilityWithACoin) {
  SyntheticCtrOptions clean;
  SyntheticCtrOptions noisy = clean;
  noisy.noise = 0.3;
  const CtrDataset a = MustSynthetic(clean, 0, 5000);
  const CtrDataset b = MustSynthetic(noisy, 0, 5000);
  // Noise acts on labels only.
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.dense, b.dense);
  const std::vector<double> pa = *SyntheticCtrTrueProbabilities(clean, a);
  const std::vector<double> pb = *SyntheticCtrTrueProbabilities(noisy, b);
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_NEAR(pb[i], 0.7 * pa[i] + 0.15, 1e-12);
  }
  EXPECT_LT(Auc(b.labels, pb), Auc(a.labels, pa) - 0.05);
  SyntheticCtrOptions coin = clean;
  coin.noise = 1;
  const CtrDataset c = MustSynthetic(coin, 0, 5000);
  EXPECT_NEAR(PositiveRate(c), 0.5, 0.03);
}

TEST(SyntheticCtrTest, OtherShapesKeepTheRateAndSignal) {
  struct Case {
    int num_dense, num_fields, max_bag;
    double interaction, zipf;
  };
  for (const Case& c :
       {Case{0, 1, 1, 0, 1.1}, Case{13, 26, 1, 0, 1.1}, Case{4, 6, 3, 1.0, 1.1},
        Case{2, 3, 5, 0, 0.5}, Case{4, 0, 1, 0, 1.1}}) {
    SyntheticCtrOptions options;
    options.num_dense = c.num_dense;
    options.num_fields = c.num_fields;
    options.max_bag = c.max_bag;
    options.interaction = c.interaction;
    options.zipf_exponent = c.zipf;
    options.positive_rate = 0.3;
    const CtrDataset data = MustSynthetic(options, 0, 8000);
    const std::vector<double> p = *SyntheticCtrTrueProbabilities(options, data);
    const double auc = Auc(data.labels, p);
    std::printf(
        "dense %d fields %d max_bag %d interaction %.1f zipf %.1f: "
        "positive rate %.3f, true AUC %.3f\n",
        c.num_dense, c.num_fields, c.max_bag, c.interaction, c.zipf,
        PositiveRate(data), auc);
    EXPECT_NEAR(PositiveRate(data), 0.3, 0.04);
    EXPECT_GT(auc, 0.8);
  }
}

// The probabilities the generator returns are SyntheticCtrTrueProbabilities'
// exactly, and neither depends on which ids the truth's embedding cache
// still holds: examples generated one per call (every id computed afresh)
// get the same bits as in a run long enough to evict most of the cache
// (26 fields of up to 10M ids, ~2M draws).
TEST(SyntheticCtrTest, ProbabilitiesFromTheGeneratorAreTheTruthsExactly) {
  SyntheticCtrOptions options;
  options.num_dense = 13;
  options.num_fields = 26;
  options.field_vocab.assign(std::begin(kCriteoKaggleCardinalities),
                             std::end(kCriteoKaggleCardinalities));
  options.interaction = 0.5;
  constexpr int64_t kFirst = 1000;
  constexpr int64_t kCount = 40000;
  std::vector<double> generated;
  absl::StatusOr<CtrDataset> data =
      MakeSyntheticCtr(options, kFirst, kCount, {1, 2}, &generated);
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_EQ(generated.size(), data->size());
  EXPECT_EQ(*SyntheticCtrTrueProbabilities(options, *data), generated);
  for (int64_t r = 0; r < data->size(); r += 397) {
    std::vector<double> alone;
    ASSERT_TRUE(
        MakeSyntheticCtr(options, kFirst + 1 + 2 * r, 1, {0, 1}, &alone).ok());
    ASSERT_EQ(alone.size(), 1u);
    EXPECT_EQ(alone[0], generated[r]) << "example " << kFirst + 1 + 2 * r;
  }
  std::vector<double> none = {0.5};
  ASSERT_TRUE(MakeSyntheticCtr(options, kFirst, 1, {1, 2}, &none).ok());
  EXPECT_TRUE(none.empty());  // the shard has no example in that range
}

TEST(SyntheticCtrTest, RejectsBadOptions) {
  const auto error = [](SyntheticCtrOptions o, int64_t first = 0,
                        int64_t count = 10, ShardSpec shard = {}) {
    absl::StatusOr<CtrDataset> data = MakeSyntheticCtr(o, first, count, shard);
    EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
    return Message(data.status());
  };
  SyntheticCtrOptions o;
  EXPECT_THAT(error(o, -1), HasSubstr("first_index"));
  EXPECT_THAT(error(o, 0, -1), HasSubstr("count"));
  EXPECT_THAT(error(o, 0, 10, {2, 2}), HasSubstr("shard.index"));
  EXPECT_THAT(error(o, 0, 10, {0, 0}), HasSubstr("shard.count"));
  EXPECT_THAT(error(o, 1, std::numeric_limits<int64_t>::max()),
              HasSubstr("overflows"));
  o = {};
  o.num_fields = -1;
  EXPECT_THAT(error(o), HasSubstr("num_fields"));
  o = {};
  o.num_dense = -1;
  EXPECT_THAT(error(o), HasSubstr("num_dense"));
  o = {};
  o.vocab_per_field = 0;
  EXPECT_THAT(error(o), HasSubstr("vocab_per_field"));
  o = {};
  o.zipf_exponent = NAN;
  EXPECT_THAT(error(o), HasSubstr("zipf_exponent"));
  o = {};
  o.max_bag = 0;
  EXPECT_THAT(error(o), HasSubstr("max_bag"));
  o = {};
  o.dim_truth = 0;
  EXPECT_THAT(error(o), HasSubstr("dim_truth"));
  o = {};
  o.noise = 1.5;
  EXPECT_THAT(error(o), HasSubstr("noise"));
  o = {};
  o.positive_rate = 1;
  EXPECT_THAT(error(o), HasSubstr("positive_rate"));
  o = {};
  o.logit_scale = -1;
  EXPECT_THAT(error(o), HasSubstr("logit_scale"));

  SyntheticCtrOptions other;
  other.num_fields = 3;
  const CtrDataset data = MustSynthetic(other, 0, 10);
  EXPECT_THAT(Message(SyntheticCtrTrueProbabilities({}, data).status()),
              HasSubstr("fields"));
}

TEST(CtrDatasetTest, ValidateCatchesBrokenShapes) {
  const CtrDataset good = MustSynthetic({}, 0, 5);
  EXPECT_TRUE(ValidateCtrDataset(good).ok());
  CtrDataset bad = good;
  bad.dense.pop_back();
  EXPECT_THAT(Message(ValidateCtrDataset(bad)), HasSubstr("dense has"));
  bad = good;
  bad.offsets.back() += 1;
  EXPECT_THAT(Message(ValidateCtrDataset(bad)), HasSubstr("offsets end"));
  bad = good;
  bad.offsets[0] = 1;
  EXPECT_THAT(Message(ValidateCtrDataset(bad)), HasSubstr("offsets[0]"));
  bad = good;
  std::swap(bad.offsets[2], bad.offsets[3]);
  if (bad.offsets[2] != bad.offsets[3]) {
    EXPECT_THAT(Message(ValidateCtrDataset(bad)), HasSubstr("decrease"));
  }
  bad = good;
  bad.labels[0] = 0.5f;
  EXPECT_THAT(Message(ValidateCtrDataset(bad)), HasSubstr("not 0 or 1"));
  bad = good;
  bad.dense[0] = NAN;
  EXPECT_THAT(Message(ValidateCtrDataset(bad)), HasSubstr("not finite"));
  EXPECT_EQ(CtrTableName(3), "field3");
}

TEST(CriteoTsvTest, ParsesValuesEmptiesAndMultiHot) {
  const std::string path = WriteFile("a.tsv",
                                     "1\t5\t\t-3\t68fd1e64\t\tA,B\n"
                                     "\n"
                                     "0\t0\t2.5\t7\tx\ty\t\r\n"
                                     "0\t\t\t\t\t\t,\n");
  absl::StatusOr<CtrDataset> data = ReadCriteoTsv(path, 3, 3, {});
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_TRUE(ValidateCtrDataset(*data).ok());
  EXPECT_EQ(data->labels, (std::vector<float>{1, 0, 0}));
  EXPECT_EQ(data->dense, (std::vector<float>{float(std::log1p(5.0)), 0, 0,  //
                                             0, float(std::log1p(2.5)),
                                             float(std::log1p(7.0)), 0, 0, 0}));
  EXPECT_EQ(data->offsets,
            (std::vector<int64_t>{0, 1, 1, 3, 4, 5, 5, 5, 5, 5}));
  EXPECT_EQ(data->ids,
            (std::vector<uint64_t>{
                CtrCategoricalId(0, "68fd1e64"), CtrCategoricalId(2, "A"),
                CtrCategoricalId(2, "B"), CtrCategoricalId(0, "x"),
                CtrCategoricalId(1, "y")}));
  // Equal strings in different fields are different ids.
  EXPECT_NE(CtrCategoricalId(0, "x"), CtrCategoricalId(1, "x"));
  // Stable across builds and platforms (ids live in tables and checkpoints).
  EXPECT_EQ(CtrCategoricalId(0, ""), CtrCategoricalId(0, ""));
  EXPECT_NE(CtrCategoricalId(0, "a"), CtrCategoricalId(0, "b"));
}

TEST(CriteoTsvTest, RoundTripsSyntheticData) {
  SyntheticCtrOptions options;
  const CtrDataset data = MustSynthetic(options, 0, 400);
  const std::string path = TempPath("synthetic.tsv");
  ASSERT_TRUE(WriteCriteoTsv(path, data).ok());
  absl::StatusOr<CtrDataset> back =
      ReadCriteoTsv(path, options.num_dense, options.num_fields, {});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->labels, data.labels);
  EXPECT_EQ(back->dense, data.dense);  // bitwise: counts are written exactly
  EXPECT_EQ(back->offsets, data.offsets);
  // Ids are re-hashed from their hex text: a bijection per field.
  for (int f = 0; f < data.num_fields; ++f) {
    absl::flat_hash_map<uint64_t, uint64_t> forward;
    absl::flat_hash_map<uint64_t, uint64_t> reverse;
    for (int64_t i = 0; i < data.size(); ++i) {
      for (int64_t k = data.BagBegin(i, f); k < data.BagEnd(i, f); ++k) {
        const auto [it, fresh] = forward.emplace(data.ids[k], back->ids[k]);
        EXPECT_EQ(it->second, back->ids[k]);
        const auto [rit, rfresh] = reverse.emplace(back->ids[k], data.ids[k]);
        EXPECT_EQ(rit->second, data.ids[k]);
      }
    }
  }
  // Sharded reads interleave to the whole file.
  for (int n : {2, 3}) {
    int64_t total = 0;
    for (int k = 0; k < n; ++k) {
      absl::StatusOr<CtrDataset> shard =
          ReadCriteoTsv(path, options.num_dense, options.num_fields, {k, n});
      ASSERT_TRUE(shard.ok()) << shard.status();
      for (int64_t r = 0; r < shard->size(); ++r) {
        EXPECT_TRUE(GetExample(*shard, r) == GetExample(*back, r * n + k));
      }
      total += shard->size();
    }
    EXPECT_EQ(total, back->size());
  }
  CtrDataset negative = data;
  negative.dense[1] = -0.5f;
  EXPECT_THAT(Message(WriteCriteoTsv(path, negative)), HasSubstr("negative"));
}

TEST(CriteoTsvTest, ErrorsNameFileAndLine) {
  const auto error = [](const std::string& name, const std::string& content) {
    const std::string path = WriteFile(name, content);
    absl::StatusOr<CtrDataset> data = ReadCriteoTsv(path, 2, 2, {});
    EXPECT_FALSE(data.ok());
    return std::pair<std::string, std::string>(path, Message(data.status()));
  };
  const std::string ok = "1\t1\t2\ta\tb\n";
  {
    const auto [path, message] = error("columns.tsv", ok + "\n1\t1\t2\ta\n");
    EXPECT_THAT(message, HasSubstr(path + ":3: expected 5 tab-separated"));
    EXPECT_THAT(message, HasSubstr("got 4"));
  }
  {
    const auto [path, message] = error("label.tsv", ok + "2\t1\t2\ta\tb\n");
    EXPECT_THAT(message, HasSubstr(path + ":2: label '2' is not 0 or 1"));
  }
  {
    const auto [path, message] = error("int.tsv", ok + ok + "0\t1\tx1\ta\tb\n");
    EXPECT_THAT(message,
                HasSubstr(path + ":3: integer feature 2 'x1' is not a finite"));
  }
  {
    const auto [path, message] = error("inf.tsv", "0\tinf\t1\ta\tb\n");
    EXPECT_THAT(message, HasSubstr(path + ":1: integer feature 1 'inf'"));
  }
  {
    const auto [path, message] = error("empty.tsv", "\n\n");
    EXPECT_THAT(message, HasSubstr(path + ": no examples"));
  }
  absl::StatusOr<CtrDataset> missing =
      ReadCriteoTsv(TempPath("does_not_exist.tsv"), 2, 2, {});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  // A malformed line another shard keeps is not this shard's error.
  const std::string path = WriteFile("shard.tsv", ok + "bad line\n" + ok);
  EXPECT_TRUE(ReadCriteoTsv(path, 2, 2, {0, 2}).ok());
  EXPECT_FALSE(ReadCriteoTsv(path, 2, 2, {1, 2}).ok());
  EXPECT_FALSE(ReadCriteoTsv(path, -1, 2, {}).ok());
}

TEST(LibsvmCtrTest, ParsesBinaryFeatures) {
  const std::string path = WriteFile("a.svm",
                                     "1 3:1 7:1\n"
                                     "-1 2:1\r\n"
                                     "+1\n"
                                     "# only a comment\n"
                                     "0 0:1.0 5:1e0 # trailing comment\n"
                                     "\n");
  absl::StatusOr<CtrDataset> data = ReadLibsvmCtr(path, {});
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_TRUE(ValidateCtrDataset(*data).ok());
  EXPECT_EQ(data->num_fields, 1);
  EXPECT_EQ(data->num_dense, 0);
  EXPECT_EQ(data->labels, (std::vector<float>{1, 0, 1, 0}));
  EXPECT_EQ(data->offsets, (std::vector<int64_t>{0, 2, 3, 3, 5}));
  EXPECT_EQ(data->ids, (std::vector<uint64_t>{3, 7, 2, 0, 5}));

  absl::StatusOr<CtrDataset> odd = ReadLibsvmCtr(path, {1, 2});
  ASSERT_TRUE(odd.ok()) << odd.status();
  EXPECT_EQ(odd->labels, (std::vector<float>{0, 0}));
  EXPECT_EQ(odd->offsets, (std::vector<int64_t>{0, 1, 3}));
  EXPECT_EQ(odd->ids, (std::vector<uint64_t>{2, 0, 5}));
}

TEST(LibsvmCtrTest, ErrorsNameFileAndLine) {
  const auto error = [](const std::string& name, const std::string& content) {
    const std::string path = WriteFile(name, content);
    absl::StatusOr<CtrDataset> data = ReadLibsvmCtr(path, {});
    EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
    return std::pair<std::string, std::string>(path, Message(data.status()));
  };
  {
    const auto [path, message] = error("value.svm", "1 1:1\n0 3:0.5\n");
    EXPECT_THAT(message,
                HasSubstr(path + ":2: value '0.5' of index 3 is not 1"));
  }
  {
    const auto [path, message] = error("order.svm", "1 3:1 3:1\n");
    EXPECT_THAT(message, HasSubstr(path + ":1: index 3 does not increase"));
  }
  {
    const auto [path, message] = error("label.svm", "# c\n2 1:1\n");
    EXPECT_THAT(message, HasSubstr(path + ":2: label '2'"));
  }
  {
    const auto [path, message] = error("token.svm", "1 abc\n");
    EXPECT_THAT(message, HasSubstr(path + ":1: 'abc' is not index:value"));
  }
  {
    const auto [path, message] = error("negative.svm", "1 -3:1\n");
    EXPECT_THAT(message, HasSubstr(path + ":1: '-3:1' is not index:value"));
  }
  {
    const auto [path, message] = error("none.svm", "# nothing\n\n");
    EXPECT_THAT(message, HasSubstr(path + ": no examples"));
  }
}

// A worker that starts at step s (a resumed job, a rejoin) seeks to s's
// batch and reads what one that ran every step from 0 reads at step s.
TEST(CtrBatchCursorTest, SeekingToAStepsBatchReadsWhatRunningThereReads) {
  SyntheticCtrOptions options;
  options.num_fields = 2;
  const CtrDataset data = MustSynthetic(options, 0, 7);
  constexpr int64_t kRows = 3;
  CtrBatchCursor from_zero(&data);
  CtrDataset ran, sought;
  for (int64_t step = 0; step < 6; ++step) {
    from_zero.Next(kRows, &ran);
    CtrBatchCursor resumed(&data);
    resumed.Seek(step * kRows);
    resumed.Next(kRows, &sought);
    ASSERT_EQ(ran.size(), sought.size());
    for (int64_t r = 0; r < kRows; ++r) {
      EXPECT_TRUE(GetExample(ran, r) == GetExample(sought, r))
          << "step " << step << " row " << r;
    }
  }
}

TEST(CtrBatchCursorTest, WrapsAndRebasesOffsets) {
  SyntheticCtrOptions options;
  options.num_fields = 3;
  options.max_bag = 4;
  const CtrDataset data = MustSynthetic(options, 0, 5);
  CtrBatchCursor cursor(&data);
  CtrDataset batch;
  // 3, then 3 wrapping (3, 4, 0), then 12 wrapping twice more.
  std::vector<int64_t> expected_order;
  for (int64_t rows : {3, 3, 12}) {
    cursor.Next(rows, &batch);
    ASSERT_TRUE(ValidateCtrDataset(batch).ok()) << ValidateCtrDataset(batch);
    ASSERT_EQ(batch.size(), rows);
    EXPECT_EQ(batch.num_fields, 3);
    EXPECT_EQ(batch.num_dense, options.num_dense);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t source = static_cast<int64_t>(expected_order.size()) % 5;
      expected_order.push_back(source);
      EXPECT_TRUE(GetExample(batch, r) == GetExample(data, source))
          << "row " << r << " of a batch of " << rows;
    }
  }
  // One field's bags on their own.
  std::vector<int64_t> offsets;
  std::vector<uint64_t> ids;
  ExtractFieldBags(batch, 1, &offsets, &ids);
  ASSERT_EQ(offsets.size(), 13u);
  EXPECT_EQ(offsets[0], 0);
  EXPECT_EQ(offsets.back(), static_cast<int64_t>(ids.size()));
  for (int64_t r = 0; r < batch.size(); ++r) {
    EXPECT_EQ(std::vector<uint64_t>(ids.begin() + offsets[r],
                                    ids.begin() + offsets[r + 1]),
              GetExample(batch, r).bags[1]);
  }
}

TEST(GatherFieldBagsTest, EachFieldAsExtractFieldBagsGivesIt) {
  SyntheticCtrOptions options;
  options.num_fields = 3;
  options.max_bag = 4;
  const CtrDataset data = MustSynthetic(options, 0, 20);
  // Any rows, repeats and order of the caller's choosing.
  const std::vector<int64_t> rows = {7, 0, 19, 7, 3};
  std::vector<uint64_t> ids(rows.size() * 4 * 3);
  std::vector<int64_t> bag_offsets(rows.size() * 3);
  std::vector<int64_t> field_ids(4);
  ASSERT_TRUE(GatherFieldBags(data.offsets, data.ids, 3, rows,
                              absl::MakeSpan(ids), absl::MakeSpan(bag_offsets),
                              absl::MakeSpan(field_ids))
                  .ok());
  EXPECT_EQ(field_ids[0], 0);
  for (int f = 0; f < 3; ++f) {
    std::vector<uint64_t> expected_ids;
    std::vector<int64_t> expected_offsets;
    for (int64_t row : rows) {
      expected_offsets.push_back(static_cast<int64_t>(expected_ids.size()));
      const std::vector<uint64_t> bag = GetExample(data, row).bags[f];
      expected_ids.insert(expected_ids.end(), bag.begin(), bag.end());
    }
    EXPECT_EQ(std::vector<uint64_t>(ids.begin() + field_ids[f],
                                    ids.begin() + field_ids[f + 1]),
              expected_ids)
        << "field " << f;
    EXPECT_EQ(std::vector<int64_t>(bag_offsets.begin() + f * rows.size(),
                                   bag_offsets.begin() + (f + 1) * rows.size()),
              expected_offsets)
        << "field " << f;
  }
}

TEST(GatherFieldBagsTest, RefusesRowsOutsideTheSetAndTooLittleRoom) {
  SyntheticCtrOptions options;
  options.num_fields = 2;
  options.max_bag = 3;
  const CtrDataset data = MustSynthetic(options, 0, 4);
  std::vector<uint64_t> ids(4 * 3 * 2);
  std::vector<int64_t> bag_offsets(2 * 2);
  std::vector<int64_t> field_ids(3);
  for (int64_t bad : {int64_t{-1}, int64_t{4}}) {
    const std::vector<int64_t> rows = {0, bad};
    absl::Status status =
        GatherFieldBags(data.offsets, data.ids, 2, rows, absl::MakeSpan(ids),
                        absl::MakeSpan(bag_offsets), absl::MakeSpan(field_ids));
    EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
    EXPECT_THAT(status.message(), HasSubstr(absl::StrCat(
                                      "example ", bad, " of a data set of 4")));
  }
  const std::vector<int64_t> rows = {0, 1};
  absl::Status status = GatherFieldBags(
      data.offsets, data.ids, 2, rows, absl::MakeSpan(ids.data(), 0),
      absl::MakeSpan(bag_offsets), absl::MakeSpan(field_ids));
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(status.message(), HasSubstr("room for 0 ids"));
}

}  // namespace
}  // namespace pstrain
