#include "common/init.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

InitSpec Spec(InitSpec::Kind kind, float scale, float value = 0) {
  InitSpec spec;
  spec.set_kind(kind);
  spec.set_scale(scale);
  spec.set_value(value);
  return spec;
}

TEST(InitTest, AnyBlockingGivesTheSameValues) {
  const InitSpec spec = Spec(InitSpec::NORMAL, 0.5f);
  std::vector<float> whole(1000);
  FillInitialValues(spec, 42, "fc0/weight", 0, absl::MakeSpan(whole));
  std::vector<float> pieces(1000);
  for (int64_t offset = 0; offset < 1000; offset += 333) {
    const int64_t n = std::min<int64_t>(333, 1000 - offset);
    FillInitialValues(spec, 42, "fc0/weight", offset,
                      absl::MakeSpan(pieces).subspan(offset, n));
  }
  EXPECT_EQ(whole, pieces);
}

TEST(InitTest, SeedAndNameChangeTheValues) {
  const InitSpec spec = Spec(InitSpec::UNIFORM, 1.0f);
  std::vector<float> a(16), b(16), c(16);
  FillInitialValues(spec, 1, "x", 0, absl::MakeSpan(a));
  FillInitialValues(spec, 2, "x", 0, absl::MakeSpan(b));
  FillInitialValues(spec, 1, "y", 0, absl::MakeSpan(c));
  EXPECT_NE(a, b);
  EXPECT_NE(a, c);
}

TEST(InitTest, DistributionsHaveTheirMoments) {
  const int n = 200000;
  std::vector<float> u(n), g(n);
  FillInitialValues(Spec(InitSpec::UNIFORM, 2.0f), 3, "u", 0,
                    absl::MakeSpan(u));
  FillInitialValues(Spec(InitSpec::NORMAL, 2.0f), 3, "g", 0, absl::MakeSpan(g));
  double u_mean = 0, u_var = 0, g_mean = 0, g_var = 0;
  float u_max = 0;
  for (int i = 0; i < n; ++i) {
    u_mean += u[i];
    u_var += u[i] * u[i];
    g_mean += g[i];
    g_var += g[i] * g[i];
    u_max = std::max(u_max, std::abs(u[i]));
  }
  u_mean /= n;
  g_mean /= n;
  u_var = u_var / n - u_mean * u_mean;
  g_var = g_var / n - g_mean * g_mean;
  EXPECT_NEAR(u_mean, 0, 0.02);
  EXPECT_NEAR(u_var, 4.0 / 3.0, 0.03);  // (2a)^2/12 with a = 2
  EXPECT_LE(u_max, 2.0f);
  EXPECT_NEAR(g_mean, 0, 0.02);
  EXPECT_NEAR(g_var, 4.0, 0.06);
}

TEST(InitTest, ConstantAndZeros) {
  std::vector<float> v(5, 3.0f);
  FillInitialValues(Spec(InitSpec::CONSTANT, 0, 0.25f), 1, "c", 0,
                    absl::MakeSpan(v));
  EXPECT_EQ(v, std::vector<float>(5, 0.25f));
  FillInitialValues(Spec(InitSpec::ZEROS, 1.0f), 1, "z", 0, absl::MakeSpan(v));
  EXPECT_EQ(v, std::vector<float>(5, 0.0f));
}

}  // namespace
}  // namespace pstrain
