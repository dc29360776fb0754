#include "ps_server/rounded_blocks.h"

#include <memory>
#include <string>
#include <vector>

#include "common/transport/tensor_codec.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

std::string Rounded(const std::vector<float>& values, DataType dtype) {
  std::string out;
  EncodeFromFloat32(dtype, values, &out);
  return out;
}

TEST(RoundedBlocksTest, OneVersionIsRoundedOnceForEveryPull) {
  RoundedBlocks cache;
  const std::string w = "w";
  auto values = std::make_shared<std::vector<float>>(
      std::vector<float>{1.0f / 3, -2.5e-3f, 7.0f, 65519.0f});
  std::shared_ptr<const std::string> first =
      cache.Get(&w, 0, 4, values, BFLOAT16);
  EXPECT_EQ(*first, Rounded(*values, BFLOAT16));
  for (int worker = 1; worker < 8; ++worker) {
    EXPECT_EQ(cache.Get(&w, 0, 4, values, BFLOAT16), first);
  }
  EXPECT_EQ(cache.rounded(), 1);
  EXPECT_EQ(cache.reused(), 7);
  // Another dtype, another block: their own copies.
  EXPECT_EQ(*cache.Get(&w, 0, 4, values, FLOAT16), Rounded(*values, FLOAT16));
  EXPECT_EQ(*cache.Get(&w, 1, 4, values, BFLOAT16), *first);
  EXPECT_EQ(cache.rounded(), 3);
}

TEST(RoundedBlocksTest, ANewVersionOrBufferIsRoundedAgain) {
  RoundedBlocks cache;
  const std::string w = "w";
  auto values = std::make_shared<std::vector<float>>(
      std::vector<float>{1.0f / 3, 2.0f / 3});
  std::shared_ptr<const std::string> v4 = cache.Get(&w, 0, 4, values, BFLOAT16);
  // Written in place (no pull held the buffer): the version moved on.
  (*values)[0] = 5.0f / 7;
  std::shared_ptr<const std::string> v5 = cache.Get(&w, 0, 5, values, BFLOAT16);
  EXPECT_EQ(*v5, Rounded(*values, BFLOAT16));
  EXPECT_NE(*v5, *v4);
  // Replaced by another buffer at the same version (a restored state).
  auto restored =
      std::make_shared<std::vector<float>>(std::vector<float>{-1.0f / 3, 9.0f});
  EXPECT_EQ(*cache.Get(&w, 0, 5, restored, BFLOAT16),
            Rounded(*restored, BFLOAT16));
  EXPECT_EQ(cache.rounded(), 3);
  EXPECT_EQ(cache.reused(), 0);
}

}  // namespace
}  // namespace pstrain
