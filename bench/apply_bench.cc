// How fast a shard applies updates, against the machine's memory bandwidth
// measured in the same run: each optimizer's Update over a block, and a
// memcpy of the same bytes (the floor no update can beat: an update reads
// the gradient and the parameters and writes the parameters, at least).
//
//   bazel build -c opt //bench:apply_bench && bazel-bin/bench/apply_bench
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "ps_server/optimizer.h"

ABSL_FLAG(int64_t, elements, 1 << 24, "Floats per block (64 MiB default).");
ABSL_FLAG(int, repeats, 15, "Timed repetitions (the median is reported).");

namespace pstrain {
namespace {

template <typename Fn>
double MedianSeconds(int repeats, Fn fn) {
  fn();  // warm: pages faulted in, caches in their steady state
  std::vector<double> seconds;
  for (int r = 0; r < repeats; ++r) {
    const absl::Time start = absl::Now();
    fn();
    seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

int Main() {
  const int64_t n = absl::GetFlag(FLAGS_elements);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  std::vector<float> param(n, 0.5f), grad(n, 1e-3f), copy(n);
  const double bytes = static_cast<double>(n) * sizeof(float);
  // memcpy reads one array and writes another: 2 arrays of traffic.
  const double memcpy_s = MedianSeconds(repeats, [&] {
    std::memcpy(copy.data(), grad.data(), n * sizeof(float));
  });
  const double memcpy_gbps = 2 * bytes / memcpy_s / 1e9;
  std::printf("apply_bench: %lld floats (%.0f MiB) per block, median of %d\n",
              static_cast<long long>(n), bytes / (1 << 20), repeats);
  std::printf("%-10s %10s %14s %12s %18s\n", "update", "ms", "Gfloats/s",
              "GB/s moved", "vs memcpy GB/s");
  std::printf("%-10s %10.3f %14s %12.2f %18s\n", "memcpy", memcpy_s * 1e3, "-",
              memcpy_gbps, "1.00");
  // The servers' own (--optimizer) and torch.optim's rules (what a
  // pstrain.torch worker hands them), as each is configured by default.
  for (const char* name :
       {"sgd", "momentum", "adam", "torch_sgd", "torch_momentum", "torch_adam",
        "torch_adamw", "torch_adagrad", "torch_rmsprop"}) {
    std::unique_ptr<Optimizer> optimizer;
    if (absl::StartsWith(name, "torch_")) {
      TorchOptimizer rule;
      const std::string rule_name = std::string(name).substr(6);
      rule.set_name(rule_name == "momentum" ? "sgd" : rule_name);
      rule.set_lr(1e-6);
      rule.set_momentum(rule_name == "momentum" ? 0.9 : 0);
      rule.set_beta1(0.9);
      rule.set_beta2(0.999);
      rule.set_eps(rule_name == "adagrad" ? 1e-10 : 1e-8);
      rule.set_alpha(0.99);
      rule.set_weight_decay(rule_name == "adamw" ? 0.01 : 0);
      optimizer = std::move(*Optimizer::CreateTorch(rule));
    } else {
      OptimizerConfig config;
      config.name = name;
      config.learning_rate = 1e-6f;
      optimizer = std::move(*Optimizer::Create(config));
    }
    const int slots = optimizer->state_per_element();
    std::vector<float> state(static_cast<size_t>(slots) * n, 0.0f);
    int64_t t = 0;
    const double s = MedianSeconds(repeats, [&] {
      optimizer->Update(++t, absl::MakeSpan(param), grad,
                        absl::MakeSpan(state));
    });
    // Traffic: read grad, read+write param, read+write each state slot.
    const double moved = bytes * (1 + 2 + 2 * slots);
    const double gbps = moved / s / 1e9;
    std::printf("%-10s %10.3f %14.2f %12.2f %18.2f\n", name, s * 1e3,
                n / s / 1e9, gbps, gbps / memcpy_gbps);
    std::printf(
        "{\"bench\":\"apply\",\"optimizer\":\"%s\",\"elements\":%lld,"
        "\"ms\":%.4f,\"gbps_moved\":%.3f,\"memcpy_gbps\":%.3f,"
        "\"ratio_vs_memcpy\":%.3f}\n",
        name, static_cast<long long>(n), s * 1e3, gbps, memcpy_gbps,
        gbps / memcpy_gbps);
  }
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pstrain::Main();
}
