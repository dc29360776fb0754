#include "worker/client/sparse_row_cache.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::ElementsAre;

constexpr int64_t kDim = 2;

TEST(SparseRowCacheTest, ARowServesThePullsWithinItsBoundThenIsPulledAgain) {
  SparseRowCache cache(/*max_staleness_steps=*/2, /*max_bytes=*/1 << 20);
  const std::vector<uint64_t> ids = {7, 9};
  std::vector<float> out(4, -1);
  EXPECT_THAT(cache.Lookup(0, kDim, 10, ids, out.data()), ElementsAre(0, 1));
  const std::vector<float> pulled = {1, 2, 3, 4};
  const std::vector<size_t> both = {0, 1};
  cache.Insert(0, kDim, 10, ids, both, pulled.data());
  for (int64_t step : {10, 11, 12}) {
    std::fill(out.begin(), out.end(), -1);
    EXPECT_TRUE(cache.Lookup(0, kDim, step, ids, out.data()).empty()) << step;
    EXPECT_EQ(out, pulled);
  }
  // Step 13 is 3 steps after the pull: both rows are pulled again.
  EXPECT_THAT(cache.Lookup(0, kDim, 13, ids, out.data()), ElementsAre(0, 1));
  EXPECT_EQ(cache.stats().hits, 6);
  EXPECT_EQ(cache.stats().misses, 4);
  EXPECT_EQ(cache.stats().bytes_saved, 6 * kDim * 4);
}

TEST(SparseRowCacheTest, TablesAreApartAndOnlyWhatWasMissingIsKept) {
  SparseRowCache cache(1, 1 << 20);
  const std::vector<uint64_t> ids = {5};
  const std::vector<float> row = {8, 8};
  const std::vector<size_t> first = {0};
  cache.Insert(/*table=*/1, kDim, 0, ids, first, row.data());
  std::vector<float> out(2, 0);
  EXPECT_THAT(cache.Lookup(/*table=*/0, kDim, 0, ids, out.data()),
              ElementsAre(0));
  EXPECT_TRUE(cache.Lookup(1, kDim, 1, ids, out.data()).empty());
  EXPECT_THAT(out, ElementsAre(8, 8));
}

TEST(SparseRowCacheTest, WhenFullStaleRowsMakeRoomAndFreshOnesAreNotEvicted) {
  // Room for two rows.
  SparseRowCache cache(1, 2 * SparseRowCache::RowBytes(kDim));
  const std::vector<float> rows = {1, 1, 2, 2};
  const std::vector<size_t> both = {0, 1};
  const std::vector<uint64_t> old_ids = {1, 2};
  cache.Insert(0, kDim, 0, old_ids, both, rows.data());
  // At step 1 both are fresh: a third row is not kept.
  const std::vector<uint64_t> third = {3};
  const std::vector<size_t> one = {0};
  cache.Insert(0, kDim, 1, third, one, rows.data());
  EXPECT_EQ(cache.stats().rows_not_kept, 1);
  EXPECT_EQ(cache.stats().bytes_held, 2 * SparseRowCache::RowBytes(kDim));
  // At step 2 both are past their bound: they make room.
  cache.Insert(0, kDim, 2, third, one, rows.data());
  EXPECT_EQ(cache.stats().rows_dropped, 2);
  EXPECT_EQ(cache.stats().bytes_held, SparseRowCache::RowBytes(kDim));
  std::vector<float> out(2, 0);
  EXPECT_TRUE(cache.Lookup(0, kDim, 2, third, out.data()).empty());
  EXPECT_THAT(out, ElementsAre(1, 1));
  cache.Clear();
  EXPECT_EQ(cache.stats().bytes_held, 0);
  EXPECT_THAT(cache.Lookup(0, kDim, 2, third, out.data()), ElementsAre(0));
}

}  // namespace
}  // namespace pstrain
