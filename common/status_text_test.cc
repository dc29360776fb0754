#include "common/status_text.h"

#include <string>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

TEST(QuoteForStatusTest, ShortTextIsQuotedAsIs) {
  EXPECT_EQ(QuoteForStatus("w"), "'w'");
  EXPECT_EQ(QuoteForStatus(""), "''");
  EXPECT_EQ(QuoteForStatus("layer0/kernel"), "'layer0/kernel'");
}

TEST(QuoteForStatusTest, LongTextIsCutAndItsLengthSaid) {
  const std::string name(70000, 'a');
  const std::string quoted = QuoteForStatus(name);
  EXPECT_EQ(quoted, "'" + std::string(128, 'a') + "...' (70000 bytes)");
  EXPECT_EQ(QuoteForStatus("abcdef", 3), "'abc...' (6 bytes)");
}

TEST(QuoteForStatusTest, UnprintableBytesAreEscaped) {
  EXPECT_EQ(QuoteForStatus(std::string("a\n\xff'", 4)), "'a\\n\\xff\\''");
  // Escaping at most quadruples what is kept.
  const std::string binary(1000, '\x01');
  EXPECT_LE(QuoteForStatus(binary).size(), 4 * 128 + 32u);
}

}  // namespace
}  // namespace pstrain
