#include "worker/unique_ids.h"

#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

void ExpectDedupValid(const std::vector<uint64_t>& ids, const UniqueIds& u) {
  ASSERT_EQ(u.index.size(), ids.size());
  std::set<uint64_t> distinct(ids.begin(), ids.end());
  EXPECT_EQ(u.unique.size(), distinct.size());
  EXPECT_EQ(std::set<uint64_t>(u.unique.begin(), u.unique.end()).size(),
            u.unique.size());
  // First-occurrence order: the k-th new id seen is unique[k].
  std::set<uint64_t> seen;
  size_t next = 0;
  for (size_t j = 0; j < ids.size(); ++j) {
    ASSERT_GE(u.index[j], 0);
    ASSERT_LT(u.index[j], static_cast<int64_t>(u.unique.size()));
    EXPECT_EQ(u.unique[u.index[j]], ids[j]);
    if (seen.insert(ids[j]).second) {
      EXPECT_EQ(u.index[j], static_cast<int64_t>(next)) << j;
      ++next;
    }
  }
}

TEST(DeduplicateTest, FirstOccurrenceOrder) {
  const std::vector<uint64_t> ids = {7, 3, 7, 7, 0, 3, ~uint64_t{0}, 0};
  const UniqueIds u = Deduplicate(ids);
  EXPECT_EQ(u.unique, (std::vector<uint64_t>{7, 3, 0, ~uint64_t{0}}));
  EXPECT_EQ(u.index, (std::vector<int64_t>{0, 1, 0, 0, 2, 1, 3, 2}));
}

TEST(DeduplicateTest, Empty) {
  const UniqueIds u = Deduplicate({});
  EXPECT_TRUE(u.unique.empty());
  EXPECT_TRUE(u.index.empty());
}

TEST(DeduplicateTest, RandomAndAdversarialIdsWithReuse) {
  std::mt19937_64 rng(1);
  IdDeduplicator dedup;
  UniqueIds u;
  // Sizes go up and down so that the reused table is both grown and only
  // partly cleared.
  for (int size : {1000, 10, 5000, 0, 300, 20000, 50}) {
    std::vector<uint64_t> ids(size);
    for (int j = 0; j < size; ++j) {
      switch (j % 3) {
        case 0:  // hashed-looking ids, repeats likely
          ids[j] = rng() % 97 * 0x9e3779b97f4a7c15ULL;
          break;
        case 1:  // small consecutive ids (LIBSVM)
          ids[j] = rng() % 500;
          break;
        default:  // ids equal in the low bits, which an unmixed table hates
          ids[j] = (rng() % 300) << 32;
      }
    }
    dedup.Run(ids, &u);
    ExpectDedupValid(ids, u);
    // Deterministic: the same ids give the same answer.
    const UniqueIds again = Deduplicate(ids);
    EXPECT_EQ(again.unique, u.unique);
    EXPECT_EQ(again.index, u.index);
  }
}

TEST(DeduplicateTest, EachArrayAloneInItsOwnStretch) {
  // Two arrays: the second's ids start at 4, its keys and index too.
  const std::vector<int64_t> ids = {7, 3, 7, 0, -5, 9, -5};
  const std::vector<int64_t> lengths = {4, 3};
  std::vector<uint64_t> keys(ids.size(), 0);
  std::vector<int64_t> index(ids.size(), -1);
  std::vector<int64_t> counts(2, -1);
  IdDeduplicator dedup;
  EXPECT_EQ(dedup.RunEach(ids, lengths, {10, -1}, keys.data(), index.data(),
                          counts.data()),
            -1);
  EXPECT_EQ(counts, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(std::vector<uint64_t>(keys.begin(), keys.begin() + 3),
            (std::vector<uint64_t>{7, 3, 0}));
  EXPECT_EQ(std::vector<uint64_t>(keys.begin() + 4, keys.begin() + 6),
            (std::vector<uint64_t>{static_cast<uint64_t>(-5), 9}));
  EXPECT_EQ(index, (std::vector<int64_t>{0, 1, 0, 2, 0, 1, 0}));
}

TEST(DeduplicateTest, EachStopsAtTheFirstArrayOutOfItsBounds) {
  const std::vector<int64_t> ids = {1, 2, 3, 10, -1};
  std::vector<uint64_t> keys(ids.size());
  std::vector<int64_t> index(ids.size());
  std::vector<int64_t> counts(3, -1);
  IdDeduplicator dedup;
  // Array 1 holds 10 with bound 10; array 2's -1 is out too, but later.
  EXPECT_EQ(dedup.RunEach(ids, {2, 2, 1}, {5, 10, 3}, keys.data(), index.data(),
                          counts.data()),
            1);
  EXPECT_EQ(counts, (std::vector<int64_t>{2, -1, -1}));
  EXPECT_EQ(dedup.RunEach(ids, {2, 2, 1}, {5, 11, 3}, keys.data(), index.data(),
                          counts.data()),
            2);
}

}  // namespace
}  // namespace pstrain
