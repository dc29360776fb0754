#include "common/partition.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

ModelSchema TwoTensorSchema(int64_t block_elements) {
  ModelSchema schema;
  schema.set_seed(7);
  schema.set_block_elements(block_elements);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("w");
  w->add_shape(10);
  w->add_shape(3);  // 30 elements
  DenseTensorSpec* b = schema.add_dense();
  b->set_name("b");
  b->add_shape(3);
  return schema;
}

TEST(PartitionTest, BlocksCoverEveryElementOnceWithShortTail) {
  absl::StatusOr<Partition> p = Partition::Create(TwoTensorSchema(8), 3);
  ASSERT_TRUE(p.ok()) << p.status();
  // w: 8, 8, 8, 6; b: 3.
  ASSERT_EQ(p->blocks().size(), 5u);
  int64_t covered = 0;
  for (const BlockLocation& loc : p->blocks()) {
    if (loc.tensor == 0) {
      EXPECT_EQ(loc.offset, covered);
      covered += loc.length;
    }
  }
  EXPECT_EQ(covered, 30);
  EXPECT_EQ(p->blocks()[3].length, 6);
  EXPECT_EQ(p->blocks()[4].length, 3);
  EXPECT_EQ(p->blocks()[4].offset, 0);
}

TEST(PartitionTest, RoundRobinOverShards) {
  absl::StatusOr<Partition> p = Partition::Create(TwoTensorSchema(8), 3);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->BlocksOfShard(0), (std::vector<int>{0, 3}));
  EXPECT_EQ(p->BlocksOfShard(1), (std::vector<int>{1, 4}));
  EXPECT_EQ(p->BlocksOfShard(2), (std::vector<int>{2}));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(p->blocks()[i].shard, i % 3);
}

TEST(PartitionTest, MoreShardsThanBlocksLeavesSomeEmpty) {
  absl::StatusOr<Partition> p = Partition::Create(TwoTensorSchema(100), 4);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->BlocksOfShard(2).size(), 0u);
  EXPECT_EQ(p->BlocksOfShard(3).size(), 0u);
}

TEST(PartitionTest, FindBlockNamesWhatIsUnknown) {
  absl::StatusOr<Partition> p = Partition::Create(TwoTensorSchema(8), 2);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p->FindBlock("w", 2), 2);
  EXPECT_EQ(*p->FindBlock("b", 0), 4);
  absl::StatusOr<int> unknown = p->FindBlock("nope", 0);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("'nope'"), std::string::npos);
  EXPECT_FALSE(p->FindBlock("w", 4).ok());
  EXPECT_FALSE(p->FindBlock("w", -1).ok());
}

TEST(PartitionTest, ValidateSchemaRefusesBadSchemas) {
  ModelSchema empty;
  empty.set_block_elements(4);
  EXPECT_FALSE(ValidateSchema(empty).ok());

  ModelSchema dup = TwoTensorSchema(8);
  dup.mutable_dense(1)->set_name("w");
  EXPECT_NE(ValidateSchema(dup).message().find("duplicate"), std::string::npos);

  ModelSchema zero_dim = TwoTensorSchema(8);
  zero_dim.mutable_dense(0)->set_shape(1, 0);
  EXPECT_FALSE(ValidateSchema(zero_dim).ok());

  ModelSchema huge = TwoTensorSchema(8);
  huge.mutable_dense(0)->set_shape(0, int64_t{1} << 30);
  huge.mutable_dense(0)->set_shape(1, int64_t{1} << 30);
  EXPECT_FALSE(ValidateSchema(huge).ok());

  ModelSchema no_blocks = TwoTensorSchema(0);
  EXPECT_FALSE(ValidateSchema(no_blocks).ok());

  EXPECT_TRUE(ValidateSchema(TwoTensorSchema(8)).ok());
}

TEST(PartitionTest, FirstSchemaDifferenceNamesIt) {
  const ModelSchema a = TwoTensorSchema(8);
  EXPECT_EQ(FirstSchemaDifference(a, a), "");
  ModelSchema b = a;
  b.mutable_dense(1)->set_shape(0, 4);
  EXPECT_EQ(FirstSchemaDifference(a, b), "tensor 1 ('b'): shape [3] vs [4]");
  ModelSchema c = a;
  c.set_seed(8);
  EXPECT_EQ(FirstSchemaDifference(a, c), "seed 7 vs 8");
  ModelSchema d = a;
  d.mutable_dense()->RemoveLast();
  EXPECT_EQ(FirstSchemaDifference(a, d), "tensor count 2 vs 1");
}

ModelSchema SchemaOfElements(std::vector<int64_t> sizes) {
  ModelSchema schema;
  for (size_t i = 0; i < sizes.size(); ++i) {
    DenseTensorSpec* tensor = schema.add_dense();
    tensor->set_name(absl::StrCat("t", i));
    tensor->add_shape(sizes[i]);
  }
  return schema;
}

TEST(ResolvedBlockElementsTest, SmallModelsGetSmallBlocksAndLargeOnesLarge) {
  // The Fashion-MNIST MLP (784-256-128-10): 8192, so about 30 block groups.
  EXPECT_EQ(ResolvedBlockElements(SchemaOfElements(
                {784 * 256, 256, 256 * 128, 128, 128 * 10, 10})),
            8192);
  EXPECT_EQ(ResolvedBlockElements(SchemaOfElements({1})), 8192);
  // About 16 blocks between the bounds, whatever the tensors.
  EXPECT_EQ(ResolvedBlockElements(SchemaOfElements({1 << 20})), 65536);
  EXPECT_EQ(ResolvedBlockElements(SchemaOfElements({1 << 19, 1 << 19})), 65536);
  EXPECT_EQ(ResolvedBlockElements(SchemaOfElements({(1 << 20) - 1})), 32768);
  // The 23 MB GPU MLP keeps 512 KiB blocks.
  EXPECT_EQ(ResolvedBlockElements(SchemaOfElements({5800000})), 131072);
}

}  // namespace
}  // namespace pstrain
