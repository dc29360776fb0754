#include "ps_server/block_values.h"

#include <vector>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

TEST(BlockValuesTest, WritesInPlaceWhenNoPullHoldsTheValues) {
  BlockValues values;
  values.Assign({1, 2, 3});
  const float* before = values.Read().data();
  bool copied = true;
  absl::Span<float> writable = values.Mutable(&copied);
  EXPECT_FALSE(copied);
  EXPECT_EQ(writable.data(), before);
  writable[0] = 7;
  EXPECT_EQ(values.Read()[0], 7);
}

TEST(BlockValuesTest, AHeldReferenceNeverChanges) {
  BlockValues values;
  values.Assign({1, 2, 3});
  BlockValues::Ref pulled = values.Share();
  bool copied = false;
  absl::Span<float> writable = values.Mutable(&copied);
  EXPECT_TRUE(copied);
  EXPECT_NE(writable.data(), pulled->data());
  // The update starts from the current values...
  EXPECT_EQ(std::vector<float>(writable.begin(), writable.end()),
            (std::vector<float>{1, 2, 3}));
  writable[1] = 20;
  // ...and the pull still sees the version it took.
  EXPECT_EQ(*pulled, (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(values.Read()[1], 20);
}

TEST(BlockValuesTest, TheTwoBuffersTakeTurnsOnceReleased) {
  BlockValues values;
  values.Assign({1, 2});
  const float* first = values.Read().data();
  BlockValues::Ref pulled = values.Share();
  const float* second = values.Mutable().data();
  ASSERT_NE(second, first);
  pulled.reset();  // the pull is sent
  pulled = values.Share();
  bool copied = false;
  // Back to the first buffer: no new memory at steady state.
  EXPECT_EQ(values.Mutable(&copied).data(), first);
  EXPECT_TRUE(copied);
  EXPECT_EQ(*pulled, (std::vector<float>{1, 2}));
}

TEST(BlockValuesTest, ASpareStillHeldIsNotReused) {
  BlockValues values;
  values.Assign({1});
  BlockValues::Ref old_pull = values.Share();
  values.Mutable()[0] = 2;
  BlockValues::Ref new_pull = values.Share();
  values.Mutable()[0] = 3;  // both earlier buffers are held
  EXPECT_EQ((*old_pull)[0], 1);
  EXPECT_EQ((*new_pull)[0], 2);
  EXPECT_EQ(values.Read()[0], 3);
}

TEST(BlockValuesTest, AssignLeavesHeldValuesAlone) {
  BlockValues values;
  values.Assign({1, 2});
  BlockValues::Ref pulled = values.Share();
  values.Assign({5, 6});
  EXPECT_EQ(*pulled, (std::vector<float>{1, 2}));
  EXPECT_EQ(values.size(), 2u);
  EXPECT_EQ(values.Read()[0], 5);
}

}  // namespace
}  // namespace pstrain
