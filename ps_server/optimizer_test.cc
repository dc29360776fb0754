#include "ps_server/optimizer.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

std::unique_ptr<Optimizer> Make(OptimizerConfig config) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(config);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return std::move(*opt);
}

TEST(OptimizerTest, SgdIsOneStepAgainstTheGradient) {
  OptimizerConfig config;
  config.learning_rate = 0.5f;
  auto sgd = Make(config);
  std::vector<float> w = {1, 2, 3};
  sgd->Update(1, absl::MakeSpan(w), std::vector<float>{2, -4, 0.5f}, {});
  EXPECT_EQ(w, (std::vector<float>{0, 4, 2.75f}));
}

TEST(OptimizerTest, MomentumMatchesClosedForm) {
  // Constant gradient g: v_t = g (1 - mu^t) / (1 - mu),
  // w_T = w_0 - lr * g * sum_t (1 - mu^t) / (1 - mu).
  OptimizerConfig config{"momentum", 0.1f, 0.9f};
  auto opt = Make(config);
  std::vector<float> w = {1.0f}, v(1, 0.0f);
  const float g = 2.0f;
  for (int t = 1; t <= 10; ++t) {
    opt->Update(t, absl::MakeSpan(w), std::vector<float>{g}, absl::MakeSpan(v));
  }
  double expected = 1.0;
  for (int t = 1; t <= 10; ++t) {
    expected -= 0.1 * g * (1 - std::pow(0.9, t)) / (1 - 0.9);
  }
  EXPECT_NEAR(w[0], expected, 1e-5);
  EXPECT_NEAR(v[0], g * (1 - std::pow(0.9, 10)) / 0.1, 1e-5);
}

TEST(OptimizerTest, AdamMatchesClosedForm) {
  // With a constant gradient g the bias-corrected moments are exactly g and
  // g^2, so each step moves w by lr * g / (|g| + eps) = lr * sign(g) (eps->0).
  OptimizerConfig config;
  config.name = "adam";
  config.learning_rate = 0.01f;
  config.epsilon = 1e-8f;
  auto opt = Make(config);
  ASSERT_EQ(opt->state_per_element(), 2);
  std::vector<float> w = {0.5f, -0.5f}, state(4, 0.0f);
  for (int t = 1; t <= 5; ++t) {
    opt->Update(t, absl::MakeSpan(w), std::vector<float>{3.0f, -0.25f},
                absl::MakeSpan(state));
  }
  EXPECT_NEAR(w[0], 0.5 - 5 * 0.01, 1e-6);
  EXPECT_NEAR(w[1], -0.5 + 5 * 0.01, 1e-6);
  // Raw (uncorrected) first moment after 5 steps: g (1 - beta1^5).
  EXPECT_NEAR(state[0], 3.0 * (1 - std::pow(0.9, 5)), 1e-5);
  EXPECT_NEAR(state[2], 9.0 * (1 - std::pow(0.999, 5)), 1e-5);
}

TEST(OptimizerTest, AdamFirstStepWithVaryingGradient) {
  // t = 1: m_hat = g, v_hat = g^2 -> w -= lr * g / (|g| + eps).
  OptimizerConfig config;
  config.name = "adam";
  config.learning_rate = 0.1f;
  config.epsilon = 0.5f;
  auto opt = Make(config);
  std::vector<float> w = {0.0f}, state(2, 0.0f);
  opt->Update(1, absl::MakeSpan(w), std::vector<float>{2.0f},
              absl::MakeSpan(state));
  EXPECT_NEAR(w[0], -0.1 * 2.0 / (2.0 + 0.5), 1e-6);
}

// A block updated piece by piece, as the server does while it decodes a
// gradient, ends bit-identical to one updated at once, state included.
TEST(OptimizerTest, UpdatingInRangesEqualsUpdatingTheWholeBlock) {
  for (const char* name : {"sgd", "momentum", "adam"}) {
    OptimizerConfig config;
    config.name = name;
    config.learning_rate = 0.01f;
    const std::unique_ptr<Optimizer> opt = Make(config);
    constexpr int kN = 1000;
    std::vector<float> whole(kN), pieces(kN), grad(kN);
    for (int i = 0; i < kN; ++i) {
      whole[i] = pieces[i] = std::sin(0.1f * i);
      grad[i] = std::cos(0.37f * i);
    }
    std::vector<float> whole_state(opt->state_per_element() * kN, 0.5f);
    std::vector<float> pieces_state = whole_state;
    for (int64_t t = 1; t <= 3; ++t) {
      opt->Update(t, absl::MakeSpan(whole), grad, absl::MakeSpan(whole_state));
      for (int offset = 0; offset < kN; offset += 300) {
        const int n = std::min(300, kN - offset);
        opt->UpdateRange(t, opt->OwnHyper(), absl::MakeSpan(pieces), offset,
                         absl::MakeConstSpan(grad).subspan(offset, n),
                         absl::MakeSpan(pieces_state), /*grad_scale=*/1.0f);
      }
    }
    EXPECT_EQ(pieces, whole) << name;
    EXPECT_EQ(pieces_state, whole_state) << name;
  }
}

// A sync step applies the mean of the workers' gradients by passing their
// sum and 1/W: bit-identical to applying the mean computed first. Odd
// lengths leave a tail after the vector lanes.
TEST(OptimizerTest, AScaledGradientEqualsTheGradientScaledFirst) {
  for (const char* name : {"sgd", "momentum", "adam"}) {
    OptimizerConfig config;
    config.name = name;
    config.learning_rate = 0.01f;
    const std::unique_ptr<Optimizer> opt = Make(config);
    constexpr int kN = 1003;
    constexpr float kScale = 1.0f / 3;
    std::vector<float> scaled(kN), first(kN), sum(kN), mean(kN);
    for (int i = 0; i < kN; ++i) {
      scaled[i] = first[i] = std::sin(0.1f * i);
      sum[i] = 3 * std::cos(0.37f * i);
      mean[i] = kScale * sum[i];
    }
    std::vector<float> scaled_state(opt->state_per_element() * kN, 0.5f);
    std::vector<float> first_state = scaled_state;
    for (int64_t t = 1; t <= 3; ++t) {
      opt->Update(t, absl::MakeSpan(scaled), sum, absl::MakeSpan(scaled_state),
                  kScale);
      opt->Update(t, absl::MakeSpan(first), mean, absl::MakeSpan(first_state));
    }
    EXPECT_EQ(scaled, first) << name;
    EXPECT_EQ(scaled_state, first_state) << name;
    EXPECT_NE(scaled[1], std::sin(0.1f)) << name;  // it did update
  }
}

TEST(OptimizerTest, BadConfigsNameTheFlag) {
  OptimizerConfig unknown;
  unknown.name = "adagrad2";
  EXPECT_NE(Optimizer::Create(unknown).status().message().find("--optimizer"),
            std::string::npos);
  OptimizerConfig bad_lr;
  bad_lr.learning_rate = -1;
  EXPECT_NE(
      Optimizer::Create(bad_lr).status().message().find("--learning_rate"),
      std::string::npos);
  OptimizerConfig bad_momentum{"momentum", 0.1f, 1.5f};
  EXPECT_NE(
      Optimizer::Create(bad_momentum).status().message().find("--momentum"),
      std::string::npos);
  OptimizerConfig bad_beta;
  bad_beta.name = "adam";
  bad_beta.beta2 = 1.0f;
  EXPECT_NE(Optimizer::Create(bad_beta).status().message().find("--adam_beta2"),
            std::string::npos);
}

}  // namespace
}  // namespace pstrain

namespace pstrain {
namespace {

TorchOptimizer Rule(const std::string& name) {
  TorchOptimizer rule;
  rule.set_name(name);
  rule.set_lr(0.01);
  rule.set_weight_decay(0.01);
  rule.set_momentum(name == "sgd" || name == "rmsprop" ? 0.9 : 0);
  rule.set_dampening(0);
  rule.set_nesterov(name == "sgd");
  rule.set_beta1(0.9);
  rule.set_beta2(0.999);
  rule.set_eps(1e-8);
  rule.set_lr_decay(0.01);
  rule.set_initial_accumulator_value(0.1);
  rule.set_alpha(0.99);
  rule.set_centered(name == "rmsprop");
  return rule;
}

// The torch rules, like the server's own, are elementwise: a block updated
// piece by piece ends bit-identical to one updated at once, and a scaled
// sum equals the mean passed first. (Their formulas are checked against
// torch.optim itself by //tests/python:torch_optimizers_test.)
TEST(TorchRuleTest, PiecesAndScalingChangeNothing) {
  for (const char* name : {"sgd", "adam", "adamw", "adagrad", "rmsprop"}) {
    auto made = Optimizer::CreateTorch(Rule(name));
    ASSERT_TRUE(made.ok()) << name << ": " << made.status();
    const Optimizer& opt = **made;
    constexpr int kN = 1003;
    constexpr float kScale = 1.0f / 3;
    std::vector<float> whole(kN), pieces(kN), mean(kN), sum(kN);
    for (int i = 0; i < kN; ++i) {
      whole[i] = pieces[i] = std::sin(0.1f * i);
      sum[i] = 3 * std::cos(0.37f * i);
      mean[i] = kScale * sum[i];
    }
    std::vector<float> whole_state(opt.state_per_element() * kN);
    opt.InitState(absl::MakeSpan(whole_state));
    std::vector<float> pieces_state = whole_state;
    const StepHyper hyper{0.02f, 0.85f};
    for (int64_t t = 1; t <= 3; ++t) {
      opt.UpdateRange(t, hyper, absl::MakeSpan(whole), 0, mean,
                      absl::MakeSpan(whole_state), 1.0f);
      for (int offset = 0; offset < kN; offset += 300) {
        const int n = std::min(300, kN - offset);
        opt.UpdateRange(t, hyper, absl::MakeSpan(pieces), offset,
                        absl::MakeConstSpan(sum).subspan(offset, n),
                        absl::MakeSpan(pieces_state), kScale);
      }
    }
    EXPECT_EQ(pieces, whole) << name;
    EXPECT_EQ(pieces_state, whole_state) << name;
    EXPECT_NE(whole[1], std::sin(0.1f)) << name;
  }
}

TEST(TorchRuleTest, AdagradStartsAtItsInitialAccumulator) {
  auto made = Optimizer::CreateTorch(Rule("adagrad"));
  ASSERT_TRUE(made.ok());
  std::vector<float> state(4);
  (*made)->InitState(absl::MakeSpan(state));
  EXPECT_EQ(state, std::vector<float>(4, 0.1f));
}

TEST(TorchRuleTest, BadOptionsAreNamed) {
  auto message = [](const TorchOptimizer& rule) {
    return std::string(Optimizer::CreateTorch(rule).status().message());
  };
  EXPECT_NE(message(Rule("lamb")).find("'lamb' is not one the servers run"),
            std::string::npos);
  TorchOptimizer rule = Rule("adam");
  rule.set_beta2(1.0);
  EXPECT_NE(message(rule).find("adam: betas[1] must be in [0, 1)"),
            std::string::npos);
  rule = Rule("sgd");
  rule.set_dampening(0.5);  // nesterov with dampening
  EXPECT_NE(message(rule).find("nesterov"), std::string::npos);
  rule = Rule("adagrad");
  rule.set_lr(-1);
  EXPECT_NE(message(rule).find("lr must be in [0"), std::string::npos);
}

}  // namespace
}  // namespace pstrain
