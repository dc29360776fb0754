// ps_bench's timing harness (ps_bench.h): an operation run on client
// threads at once, warmed up, then timed per operation and as a whole.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "bench/transport/ps_bench.h"
#include "glog/logging.h"

namespace pstrain::bench::ps_bench {
namespace {

using Clock = std::chrono::steady_clock;

// Runs `op` on `clients` threads at once, each `iterations` times or, with
// iterations == 0, until `min_seconds` have passed and kMinIterations are
// done. The clock starts once every thread is ready. Every operation is
// bounded by its own deadline, so the joins are too.
absl::StatusOr<PhaseResult> RunConcurrently(int clients, int64_t iterations,
                                            double min_seconds,
                                            const Operation& op) {
  struct PerClient {
    std::vector<double> latencies_us;
    absl::Status status;
    Clock::time_point end;
  };
  std::vector<PerClient> per_client(clients);
  absl::Mutex mu;
  int ready = 0;
  bool go = false;
  Clock::time_point start;
  const auto min_duration = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(min_seconds));
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      Clock::time_point begin;
      {
        absl::MutexLock lock(&mu);
        ++ready;
        mu.Await(absl::Condition(&go));
        begin = start;
      }
      PerClient& mine = per_client[c];
      if (iterations > 0) mine.latencies_us.reserve(iterations);
      for (int64_t i = 0;; ++i) {
        const Clock::time_point now = Clock::now();
        if (iterations > 0
                ? i >= iterations
                : i >= kMinIterations && now - begin >= min_duration) {
          break;
        }
        mine.status = op(c);
        const Clock::time_point done = Clock::now();
        if (!mine.status.ok()) break;
        mine.latencies_us.push_back(
            std::chrono::duration<double, std::micro>(done - now).count());
      }
      mine.end = Clock::now();
    });
  }
  {
    // Threads only start here, so this wait is short; the bound is for the
    // rule, and on expiry the threads are still released and joined.
    absl::MutexLock lock(&mu);
    const auto all_ready = [&]() { return ready == clients; };
    mu.AwaitWithTimeout(absl::Condition(&all_ready), kStartTimeout);
    start = Clock::now();
    go = true;
  }
  for (std::thread& thread : threads) thread.join();
  PhaseResult result;
  Clock::time_point last = start;
  for (PerClient& mine : per_client) {
    if (!mine.status.ok()) return mine.status;
    last = std::max(last, mine.end);
    result.operations += static_cast<int64_t>(mine.latencies_us.size());
    result.latencies_us.insert(result.latencies_us.end(),
                               mine.latencies_us.begin(),
                               mine.latencies_us.end());
  }
  result.seconds = std::chrono::duration<double>(last - start).count();
  std::sort(result.latencies_us.begin(), result.latencies_us.end());
  return result;
}

}  // namespace

absl::StatusOr<PhaseResult> MeasurePhase(const std::string& name, int64_t size,
                                         int clients, const Operation& op) {
  const int64_t warmup = absl::GetFlag(FLAGS_warmup);
  if (warmup > 0) {
    absl::StatusOr<PhaseResult> warm = RunConcurrently(clients, warmup, 0, op);
    if (!warm.ok()) {
      return absl::Status(warm.status().code(),
                          absl::StrCat(name, " (warm-up, ", size,
                                       " bytes): ", warm.status().message()));
    }
  }
  absl::StatusOr<PhaseResult> result =
      RunConcurrently(clients, absl::GetFlag(FLAGS_iterations),
                      absl::GetFlag(FLAGS_phase_seconds), op);
  if (!result.ok()) {
    return absl::Status(
        result.status().code(),
        absl::StrCat(name, " (", size, " bytes): ", result.status().message()));
  }
  LOG(INFO) << absl::StrFormat("%-14s %10d B: %6d ops in %.3f s, p50 %.1f us",
                               name, size, result->operations, result->seconds,
                               result->PercentileUs(50));
  return result;
}

}  // namespace pstrain::bench::ps_bench
