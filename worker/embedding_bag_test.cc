#include "worker/embedding_bag.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/gpu_test_support.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;
using Mode = EmbeddingBag::Mode;
using kernels::Backend;
using kernels::DeviceArray;

// Bags of a random batch: CSR offsets and ids, with empty bags and repeats
// within and across bags (ids from a small vocabulary).
struct Bags {
  std::vector<int64_t> offsets;
  std::vector<uint64_t> ids;
};

Bags RandomBags(std::mt19937_64& rng, int num_bags, int max_bag, int vocab) {
  Bags bags;
  bags.offsets.push_back(0);
  for (int b = 0; b < num_bags; ++b) {
    const int size = static_cast<int>(rng() % (max_bag + 1));  // 0 = empty
    for (int k = 0; k < size; ++k) {
      bags.ids.push_back(1000003ULL * (rng() % vocab) + 17);
    }
    bags.offsets.push_back(static_cast<int64_t>(bags.ids.size()));
  }
  return bags;
}

std::vector<float> RandomFloats(std::mt19937_64& rng, size_t n) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// The definition, on the host in double.
std::vector<double> NaiveForward(const std::vector<int64_t>& offsets,
                                 const std::vector<int64_t>& index,
                                 const std::vector<float>& rows, int64_t dim,
                                 Mode mode) {
  const int64_t num_bags = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<double> out(num_bags * dim, 0.0);
  for (int64_t b = 0; b < num_bags; ++b) {
    const int64_t n = offsets[b + 1] - offsets[b];
    for (int64_t j = offsets[b]; j < offsets[b + 1]; ++j) {
      const double w = mode == Mode::kMean ? 1.0 / n : 1.0;
      for (int64_t d = 0; d < dim; ++d) {
        out[b * dim + d] += w * rows[index[j] * dim + d];
      }
    }
  }
  return out;
}

std::vector<double> NaiveBackward(const std::vector<int64_t>& offsets,
                                  const std::vector<int64_t>& index,
                                  const std::vector<float>& dout,
                                  int64_t num_unique, int64_t dim, Mode mode) {
  const int64_t num_bags = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<double> grad(num_unique * dim, 0.0);
  for (int64_t b = 0; b < num_bags; ++b) {
    const int64_t n = offsets[b + 1] - offsets[b];
    for (int64_t j = offsets[b]; j < offsets[b + 1]; ++j) {
      const double w = mode == Mode::kMean ? 1.0 / n : 1.0;
      for (int64_t d = 0; d < dim; ++d) {
        grad[index[j] * dim + d] += w * dout[b * dim + d];
      }
    }
  }
  return grad;
}

// Runs on the CPU backend always, and on CUDA where a GPU is usable. Only
// "no GPU here" skips (a failure under PSTRAIN_REQUIRE_GPU=1); a GPU that is
// there but unusable (no kernel image for it, say) fails the test.
class EmbeddingBagTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() != "cpu") PSTRAIN_REQUIRE_GPU_OR_SKIP();
    absl::StatusOr<std::unique_ptr<Backend>> backend =
        kernels::CreateBackend(GetParam());
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
  }

  DeviceArray<float> Upload(const std::vector<float>& host) {
    absl::StatusOr<DeviceArray<float>> array =
        DeviceArray<float>::Create(backend_.get(), host.size());
    EXPECT_TRUE(array.ok()) << array.status();
    if (!host.empty()) {
      EXPECT_TRUE(
          backend_->CopyToDevice(host.data(), array->data(), array->bytes())
              .ok());
    }
    return *std::move(array);
  }

  std::vector<float> Download(const DeviceArray<float>& array, size_t n) {
    std::vector<float> host(n);
    if (n > 0) {
      absl::Status s =
          backend_->CopyToHost(array.data(), host.data(), n * sizeof(float));
      EXPECT_TRUE(s.ok()) << s;
    }
    return host;
  }

  EmbeddingBag MustCreate(Mode mode, int64_t dim, int64_t max_bags,
                          int64_t max_occurrences) {
    absl::StatusOr<EmbeddingBag> bag = EmbeddingBag::Create(
        backend_.get(), mode, dim, max_bags, max_occurrences);
    EXPECT_TRUE(bag.ok()) << bag.status();
    return *std::move(bag);
  }

  std::unique_ptr<Backend> backend_;
};

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want,
                double tolerance, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tolerance) << what << " at " << i;
  }
}

TEST_P(EmbeddingBagTest, ForwardAndBackwardMatchNaiveLoops) {
  std::mt19937_64 rng(3);
  for (Mode mode : {Mode::kSum, Mode::kMean}) {
    for (int64_t dim : {1, 7, 16}) {
      // One instance, reused across batches of different shapes.
      EmbeddingBag bag = MustCreate(mode, dim, 300, 300 * 6);
      for (int trial = 0; trial < 4; ++trial) {
        const int num_bags = trial == 0 ? 1 : 50 + 80 * trial;
        const int vocab = trial % 2 == 0 ? 5 : 400;
        const Bags bags = RandomBags(rng, num_bags, 6, vocab);
        const UniqueIds u = Deduplicate(bags.ids);
        const int64_t num_unique = static_cast<int64_t>(u.unique.size());
        const std::vector<float> rows = RandomFloats(rng, num_unique * dim);
        const std::vector<float> dout = RandomFloats(rng, num_bags * dim);

        ASSERT_TRUE(bag.SetBags(bags.offsets, u.index, num_unique).ok());
        EXPECT_EQ(bag.num_bags(), num_bags);
        EXPECT_EQ(bag.num_occurrences(), static_cast<int64_t>(bags.ids.size()));
        DeviceArray<float> d_rows = Upload(rows);
        // Poisoned outputs: every element must be written.
        DeviceArray<float> d_out =
            Upload(std::vector<float>(num_bags * dim, NAN));
        ASSERT_TRUE(bag.Forward(d_rows.data(), d_out.data()).ok());
        const std::string what =
            absl::StrCat(mode == Mode::kSum ? "sum" : "mean", " dim ", dim,
                         " trial ", trial);
        ExpectNear(Download(d_out, num_bags * dim),
                   NaiveForward(bags.offsets, u.index, rows, dim, mode), 1e-5,
                   "forward " + what);

        DeviceArray<float> d_dout = Upload(dout);
        DeviceArray<float> d_grad =
            Upload(std::vector<float>(num_unique * dim, NAN));
        ASSERT_TRUE(bag.Backward(d_dout.data(), d_grad.data()).ok());
        const std::vector<double> want =
            NaiveBackward(bags.offsets, u.index, dout, num_unique, dim, mode);
        ExpectNear(Download(d_grad, num_unique * dim), want, 1e-4,
                   "backward " + what);

        // Accumulating adds the same gradient once more.
        ASSERT_TRUE(bag.Backward(d_dout.data(), d_grad.data(),
                                 /*accumulate=*/true)
                        .ok());
        std::vector<double> twice = want;
        for (double& g : twice) g *= 2;
        ExpectNear(Download(d_grad, num_unique * dim), twice, 2e-4,
                   "accumulated backward " + what);
      }
    }
  }
}

TEST_P(EmbeddingBagTest, HandWrittenBags) {
  // Bags: {0, 1}, {}, {1, 1, 2}, {2}. Rows: r0 = 1, r1 = 10, r2 = 100.
  const std::vector<int64_t> offsets = {0, 2, 2, 5, 6};
  const std::vector<int64_t> index = {0, 1, 1, 1, 2, 2};
  DeviceArray<float> rows = Upload({1, 10, 100});
  DeviceArray<float> out = Upload(std::vector<float>(4, NAN));
  DeviceArray<float> dout = Upload({1, 2, 3, 4});
  DeviceArray<float> grad = Upload(std::vector<float>(3, NAN));

  EmbeddingBag sum = MustCreate(Mode::kSum, 1, 4, 6);
  ASSERT_TRUE(sum.SetBags(offsets, index, 3).ok());
  ASSERT_TRUE(sum.Forward(rows.data(), out.data()).ok());
  EXPECT_EQ(Download(out, 4), (std::vector<float>{11, 0, 120, 100}));
  ASSERT_TRUE(sum.Backward(dout.data(), grad.data()).ok());
  // r0: bag 0 (1); r1: bag 0 (1) + twice bag 2 (3 + 3); r2: bag 2 + bag 3.
  EXPECT_EQ(Download(grad, 3), (std::vector<float>{1, 7, 7}));

  EmbeddingBag mean = MustCreate(Mode::kMean, 1, 4, 6);
  ASSERT_TRUE(mean.SetBags(offsets, index, 3).ok());
  ASSERT_TRUE(mean.Forward(rows.data(), out.data()).ok());
  const std::vector<float> got = Download(out, 4);
  EXPECT_FLOAT_EQ(got[0], 5.5f);
  EXPECT_EQ(got[1], 0.0f);  // the mean of an empty bag is 0
  EXPECT_FLOAT_EQ(got[2], 40.0f);
  EXPECT_FLOAT_EQ(got[3], 100.0f);
  ASSERT_TRUE(mean.Backward(dout.data(), grad.data()).ok());
  const std::vector<float> g = Download(grad, 3);
  EXPECT_FLOAT_EQ(g[0], 0.5f);
  EXPECT_FLOAT_EQ(g[1], 0.5f + 2.0f);  // 1/2 + 2 * 3/3
  EXPECT_FLOAT_EQ(g[2], 1.0f + 4.0f);
}

TEST_P(EmbeddingBagTest, ManyDistinctBagSizes) {
  // Every bag size from 0 to 40 (in a shuffled order): the mean plan needs a
  // Scale group per size > 1.
  std::mt19937_64 rng(11);
  std::vector<int> sizes;
  for (int s = 0; s <= 40; ++s) sizes.push_back(s);
  std::shuffle(sizes.begin(), sizes.end(), rng);
  std::vector<int64_t> offsets = {0};
  std::vector<int64_t> index;
  const int64_t num_unique = 30;
  for (int s : sizes) {
    for (int k = 0; k < s; ++k) index.push_back(rng() % num_unique);
    offsets.push_back(static_cast<int64_t>(index.size()));
  }
  const int64_t dim = 3;
  const int64_t num_bags = static_cast<int64_t>(sizes.size());
  const std::vector<float> rows = RandomFloats(rng, num_unique * dim);
  const std::vector<float> dout = RandomFloats(rng, num_bags * dim);
  EmbeddingBag bag = MustCreate(Mode::kMean, dim, num_bags, index.size());
  ASSERT_TRUE(bag.SetBags(offsets, index, num_unique).ok());
  DeviceArray<float> d_rows = Upload(rows);
  DeviceArray<float> d_out = Upload(std::vector<float>(num_bags * dim));
  DeviceArray<float> d_dout = Upload(dout);
  DeviceArray<float> d_grad = Upload(std::vector<float>(num_unique * dim));
  ASSERT_TRUE(bag.Forward(d_rows.data(), d_out.data()).ok());
  ASSERT_TRUE(bag.Backward(d_dout.data(), d_grad.data()).ok());
  ExpectNear(Download(d_out, num_bags * dim),
             NaiveForward(offsets, index, rows, dim, Mode::kMean), 1e-5,
             "forward");
  ExpectNear(Download(d_grad, num_unique * dim),
             NaiveBackward(offsets, index, dout, num_unique, dim, Mode::kMean),
             1e-4, "backward");
}

TEST_P(EmbeddingBagTest, BackwardMatchesFiniteDifferences) {
  // L(rows) = sum over bags and dims of out * R, so dL/drows is Backward(R).
  std::mt19937_64 rng(5);
  const int64_t dim = 4;
  for (Mode mode : {Mode::kSum, Mode::kMean}) {
    const Bags bags = RandomBags(rng, 40, 5, 12);
    const UniqueIds u = Deduplicate(bags.ids);
    const int64_t num_unique = static_cast<int64_t>(u.unique.size());
    const int64_t num_bags = 40;
    std::vector<float> rows = RandomFloats(rng, num_unique * dim);
    const std::vector<float> r = RandomFloats(rng, num_bags * dim);
    EmbeddingBag bag = MustCreate(mode, dim, num_bags, bags.ids.size());
    ASSERT_TRUE(bag.SetBags(bags.offsets, u.index, num_unique).ok());
    DeviceArray<float> d_rows = Upload(rows);
    DeviceArray<float> d_out = Upload(std::vector<float>(num_bags * dim));
    DeviceArray<float> d_r = Upload(r);
    DeviceArray<float> d_grad = Upload(std::vector<float>(num_unique * dim));
    ASSERT_TRUE(bag.Backward(d_r.data(), d_grad.data()).ok());
    const std::vector<float> grad = Download(d_grad, num_unique * dim);

    const auto loss = [&]() {
      EXPECT_TRUE(
          backend_->CopyToDevice(rows.data(), d_rows.data(), d_rows.bytes())
              .ok());
      EXPECT_TRUE(bag.Forward(d_rows.data(), d_out.data()).ok());
      const std::vector<float> out = Download(d_out, num_bags * dim);
      double l = 0;
      for (size_t i = 0; i < out.size(); ++i) l += double(out[i]) * r[i];
      return l;
    };
    // L is linear in rows, so a large step loses nothing to curvature and
    // keeps float rounding small next to it.
    const float h = 0.25f;
    for (int64_t e = 0; e < num_unique * dim; ++e) {
      const float saved = rows[e];
      rows[e] = saved + h;
      const double plus = loss();
      rows[e] = saved - h;
      const double minus = loss();
      rows[e] = saved;
      EXPECT_NEAR((plus - minus) / (2 * h), grad[e], 1e-3)
          << (mode == Mode::kSum ? "sum" : "mean") << " element " << e;
    }
  }
}

TEST_P(EmbeddingBagTest, EmptyBatchAndAllEmptyBags) {
  EmbeddingBag bag = MustCreate(Mode::kMean, 2, 3, 4);
  DeviceArray<float> out = Upload(std::vector<float>(6, NAN));
  DeviceArray<float> grad = Upload(std::vector<float>(4, NAN));
  DeviceArray<float> rows = Upload({1, 2, 3, 4});
  // Three empty bags: zeros out, zero gradient.
  ASSERT_TRUE(bag.SetBags(std::vector<int64_t>{0, 0, 0, 0}, {}, 2).ok());
  ASSERT_TRUE(bag.Forward(rows.data(), out.data()).ok());
  EXPECT_EQ(Download(out, 6), std::vector<float>(6, 0.0f));
  DeviceArray<float> dout = Upload({1, 1, 1, 1, 1, 1});
  ASSERT_TRUE(bag.Backward(dout.data(), grad.data()).ok());
  EXPECT_EQ(Download(grad, 4), std::vector<float>(4, 0.0f));
  // No bags at all.
  ASSERT_TRUE(bag.SetBags(std::vector<int64_t>{0}, {}, 0).ok());
  EXPECT_TRUE(bag.Forward(rows.data(), out.data()).ok());
  EXPECT_TRUE(bag.Backward(dout.data(), grad.data()).ok());
}

TEST_P(EmbeddingBagTest, RejectsBadBagsOnTheHost) {
  EmbeddingBag bag = MustCreate(Mode::kSum, 2, 2, 3);
  DeviceArray<float> rows = Upload({1, 2, 3, 4});
  DeviceArray<float> out = Upload(std::vector<float>(4));
  const auto message = [&](std::vector<int64_t> offsets,
                           std::vector<int64_t> index, int64_t num_unique) {
    return std::string(bag.SetBags(offsets, index, num_unique).message());
  };
  EXPECT_THAT(message({}, {}, 1), HasSubstr("offsets is empty"));
  EXPECT_THAT(message({1, 1}, {0}, 1), HasSubstr("offsets[0] must be 0"));
  EXPECT_THAT(message({0, 2, 1}, {0, 0}, 1), HasSubstr("offsets decrease"));
  EXPECT_THAT(message({0, 1}, {0, 0}, 1), HasSubstr("offsets end at 1"));
  EXPECT_THAT(message({0, 1, 2}, {0, 2}, 2),
              HasSubstr("index[1] = 2 is outside [0, 2)"));
  EXPECT_THAT(message({0, 1, 1}, {-1}, 2), HasSubstr("index[0] = -1"));
  EXPECT_THAT(message({0, 0, 0, 0}, {}, 1), HasSubstr("more than max_bags"));
  EXPECT_THAT(message({0, 4}, {0, 0, 0, 0}, 1),
              HasSubstr("more than max_occurrences"));
  // A failed SetBags leaves no plan behind.
  const absl::Status s = bag.Forward(rows.data(), out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(bag.Backward(out.data(), rows.data()).code(),
            absl::StatusCode::kFailedPrecondition);

  EXPECT_FALSE(EmbeddingBag::Create(backend_.get(), Mode::kSum, 0, 1, 1).ok());
  EXPECT_FALSE(EmbeddingBag::Create(backend_.get(), Mode::kSum, 1, -1, 1).ok());
  EXPECT_FALSE(EmbeddingBag::Create(nullptr, Mode::kSum, 1, 1, 1).ok());
}

INSTANTIATE_TEST_SUITE_P(Backends, EmbeddingBagTest,
                         ::testing::Values("cpu", "cuda:0"),
                         [](const auto& info) {
                           return info.param == "cpu" ? std::string("cpu")
                                                      : std::string("cuda");
                         });

}  // namespace
}  // namespace pstrain
