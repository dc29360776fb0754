// gemm_bench: the CPU backend's Gemm (OpenBLAS behind the Backend
// interface, what --device=cpu trains with) against cblas_sgemm called
// directly on the same shapes in the same run (goal: >= 0.9x), and against
// the exact hand-written kernel it replaced (--device=cpu_reference).
// The backend adds one argument check to the cblas call, so on a quiet
// machine the ratio is 1.0 within noise; on a shared one, read the "all
// shapes" line (sums of the fastest runs) rather than single shapes.
//
//   bazel run -c opt //bench:gemm_bench -- [--threads=1,0] [--min_seconds=0.2]
//
// Shapes: every GEMM of one training step of the Fashion-MNIST MLP
// 784-256-128-10 at batch 64 and 128 (forward, weight gradient, input
// gradient) and the big ones of the small CNN (conv:16:3, conv:32:3 on
// 28x28x1 at batch 128, as im2col GEMMs). Per shape and thread count: the
// fastest of --repeats interleaved runs, as GFLOP/s, and the ratios.
// Table, then one JSON line.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu_backend.h"

ABSL_FLAG(std::string, threads, "1,0",
          "OpenBLAS thread counts to measure, comma-separated (0: every core "
          "this process may use).");
ABSL_FLAG(double, min_seconds, 0.2,
          "Each measurement repeats the call for at least this long.");
ABSL_FLAG(int, repeats, 5, "Runs per case; the fastest is reported.");

namespace pstrain {
namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  std::string name;
  bool trans_a, trans_b;
  int64_t m, n, k;
};

std::vector<Shape> Shapes() {
  std::vector<Shape> shapes;
  // The MLP: forward y = x W, weight gradient dW = x^T dy, input gradient
  // dx = dy W^T, per layer.
  const int64_t dims[] = {784, 256, 128, 10};
  for (int64_t batch : {64, 128}) {
    for (int l = 0; l < 3; ++l) {
      const int64_t in = dims[l], out = dims[l + 1];
      const std::string layer = absl::StrCat("mlp b", batch, " fc", l);
      shapes.push_back({layer + " fwd", false, false, batch, out, in});
      shapes.push_back({layer + " dW", true, false, in, out, batch});
      if (l > 0) shapes.push_back({layer + " dx", false, true, batch, in, out});
    }
  }
  // The CNN at batch 128: conv0 (28x28x1 -> 26x26x16, K = 3*3*1) and conv1
  // (13x13x16 -> 11x11x32, K = 3*3*16), then the 800 -> 64 dense layer.
  const int64_t rows0 = 128 * 26 * 26, rows1 = 128 * 11 * 11;
  shapes.push_back({"cnn b128 conv0 fwd", false, false, rows0, 16, 9});
  shapes.push_back({"cnn b128 conv0 dW", true, false, 9, 16, rows0});
  shapes.push_back({"cnn b128 conv1 fwd", false, false, rows1, 32, 144});
  shapes.push_back({"cnn b128 conv1 dW", true, false, 144, 32, rows1});
  shapes.push_back({"cnn b128 conv1 dcol", false, true, rows1, 144, 32});
  shapes.push_back({"cnn b128 fc0 fwd", false, false, 128, 64, 800});
  return shapes;
}

// Seconds per call of `call`, averaged over a run of at least
// --min_seconds.
double TimeRun(const std::function<void()>& call) {
  int64_t calls = 0;
  const Clock::time_point start = Clock::now();
  double elapsed = 0;
  do {
    call();
    ++calls;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < absl::GetFlag(FLAGS_min_seconds));
  return elapsed / calls;
}

// The fastest of --repeats runs of each call, the runs interleaved (a, b,
// c, a, b, c, ...) so that load from other processes on a shared machine
// hits all of them alike; the minimum is the least disturbed run.
std::vector<double> FastestInterleaved(
    const std::vector<std::function<void()>>& calls) {
  for (const auto& call : calls) call();  // warm caches and thread pools
  std::vector<double> best(calls.size(), 1e30);
  for (int r = 0; r < std::max(1, absl::GetFlag(FLAGS_repeats)); ++r) {
    for (size_t i = 0; i < calls.size(); ++i) {
      best[i] = std::min(best[i], TimeRun(calls[i]));
    }
  }
  return best;
}

void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "gemm_bench: %s\n", status.ToString().c_str());
    std::exit(1);
  }
}

int Run() {
  std::vector<int> thread_counts;
  for (absl::string_view item :
       absl::StrSplit(absl::GetFlag(FLAGS_threads), ',', absl::SkipEmpty())) {
    int threads = 0;
    if (!absl::SimpleAtoi(item, &threads) || threads < 0) {
      std::fprintf(stderr, "gemm_bench: --threads: bad entry '%s'\n",
                   std::string(item).c_str());
      return 2;
    }
    thread_counts.push_back(threads);
  }
  kernels::CpuBackend blas(kernels::CpuGemm::kBlas);
  kernels::CpuBackend reference(kernels::CpuGemm::kReference);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);

  std::printf("gemm_bench: %d cores available; OpenBLAS %s\n\n",
              kernels::AvailableCores(), openblas_get_config());
  std::printf("%-22s %7s %22s %9s %9s %9s %8s %8s\n", "shape", "threads",
              "m x n x k", "backend", "cblas", "ref", "be/cblas", "be/ref");
  std::printf("%-22s %7s %22s %9s %9s %9s\n", "", "", "", "GFLOP/s", "GFLOP/s",
              "GFLOP/s");
  std::vector<std::string> json_rows;
  double worst_ratio = 1e9;
  // Sums over every shape and thread count: one call of each, as in a mix.
  double total_backend_s = 0, total_cblas_s = 0, total_reference_s = 0;
  for (int threads_flag : thread_counts) {
    const int threads = kernels::SetCpuGemmThreads(threads_flag);
    for (const Shape& s : Shapes()) {
      std::vector<float> a(s.m * s.k), b(s.k * s.n), c(s.m * s.n);
      for (float& x : a) x = uniform(rng);
      for (float& x : b) x = uniform(rng);
      const double flops = 2.0 * s.m * s.n * s.k;
      const std::vector<double> seconds = FastestInterleaved({
          [&] {
            Check(blas.Gemm(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, a.data(),
                            b.data(), 0.0f, c.data()));
          },
          [&] {
            cblas_sgemm(CblasRowMajor, s.trans_a ? CblasTrans : CblasNoTrans,
                        s.trans_b ? CblasTrans : CblasNoTrans, s.m, s.n, s.k,
                        1.0f, a.data(), s.trans_a ? s.m : s.k, b.data(),
                        s.trans_b ? s.k : s.n, 0.0f, c.data(), s.n);
          },
          // The reference is single-threaded whatever OpenBLAS is set to.
          [&] {
            Check(reference.Gemm(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f,
                                 a.data(), b.data(), 0.0f, c.data()));
          },
      });
      const double backend_s = seconds[0];
      const double cblas_s = seconds[1];
      const double reference_s = seconds[2];
      total_backend_s += backend_s;
      total_cblas_s += cblas_s;
      total_reference_s += reference_s;
      const double vs_cblas = cblas_s / backend_s;
      const double vs_reference = reference_s / backend_s;
      worst_ratio = std::min(worst_ratio, vs_cblas);
      const std::string dims =
          absl::StrCat(s.trans_a ? "T" : "N", s.trans_b ? "T " : "N ", s.m, "x",
                       s.n, "x", s.k);
      std::printf("%-22s %7d %22s %9.2f %9.2f %9.2f %7.2fx %7.2fx\n",
                  s.name.c_str(), threads, dims.c_str(),
                  flops / backend_s * 1e-9, flops / cblas_s * 1e-9,
                  flops / reference_s * 1e-9, vs_cblas, vs_reference);
      std::fflush(stdout);
      json_rows.push_back(
          absl::StrCat("{\"shape\":\"", s.name, "\",\"threads\":", threads,
                       ",\"m\":", s.m, ",\"n\":", s.n, ",\"k\":", s.k,
                       ",\"trans_a\":", s.trans_a, ",\"trans_b\":", s.trans_b,
                       ",\"backend_gflops\":", flops / backend_s * 1e-9,
                       ",\"cblas_gflops\":", flops / cblas_s * 1e-9,
                       ",\"reference_gflops\":", flops / reference_s * 1e-9,
                       ",\"backend_vs_cblas\":", vs_cblas,
                       ",\"backend_vs_reference\":", vs_reference, "}"));
    }
  }
  const double mix_vs_cblas = total_cblas_s / total_backend_s;
  const double mix_vs_reference = total_reference_s / total_backend_s;
  std::printf(
      "\nall shapes, one call each: backend/cblas %.3fx (goal >= 0.9), "
      "backend/reference %.2fx; worst single shape backend/cblas %.3fx\n",
      mix_vs_cblas, mix_vs_reference, worst_ratio);
  std::printf(
      "{\"bench\":\"gemm\",\"mix_backend_vs_cblas\":%.4f,"
      "\"mix_backend_vs_reference\":%.4f,\"worst_backend_vs_cblas\":%.4f,"
      "\"rows\":[%s]}\n",
      mix_vs_cblas, mix_vs_reference, worst_ratio,
      absl::StrJoin(json_rows, ",").c_str());
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "CPU backend Gemm vs cblas_sgemm vs the reference kernel.");
  absl::ParseCommandLine(argc, argv);
  return pstrain::Run();
}
