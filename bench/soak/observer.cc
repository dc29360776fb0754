// observer: reads a probe-model job from outside, as worker -1 (never a
// member, never pushes). For bench/soak/soak.sh.
//
//   observer --ps_hosts=H0,H1 --num_workers=8 --probe_elements=65536
//            --block_elements=8192 [--expect_updates=T |
//            --expect_shard_versions]
//
// Prints one line per shard with its Stats:
//   shard=0 version=... blocks_applied=... blocks_duplicate=...
//   requests_rejected=... late=... members=... steps_short=...
//   steps_lost=... gradients_lost=... updates_lost=... elements=...
// With --expect_updates=T (T >= 0) it also registers the probe schema (the
// same one the workers register), pulls the whole tensor and checks the
// probe's exact invariant: with SGD at learning rate 1 and a gradient of
// exactly 1 per element per update, every element is -T. It prints
//   check elements=N expected=-T min=... max=... mismatches=M
//         missing_block_steps=X (the updates short of T, summed over blocks)
// and exits 1 when M > 0 (0 otherwise; 2 on a bad flag, 3 when the servers
// cannot be read). --expect_shard_versions checks the same with T taken per
// shard, the version of the shard holding the element's block: in sync mode a
// step applies one unit update, in async mode every applied push does, so
// either way an element is minus its shard's version unless an update was
// applied twice or lost after being counted.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/cli.h"
#include "common/partition.h"
#include "kernels/backend.h"
#include "worker/client/ps_client.h"
#include "worker/model.h"

ABSL_FLAG(std::string, ps_hosts, "", "host:port of every shard, in order.");
ABSL_FLAG(int, num_workers, 1, "The job's --num_workers.");
ABSL_FLAG(int64_t, probe_elements, 1000, "The workers' --probe_elements.");
ABSL_FLAG(int64_t, block_elements, pstrain::kBlockElementsByModel,
          "The workers' --block_elements (0: by model size, as theirs).");
ABSL_FLAG(uint64_t, seed, 1, "The workers' --seed.");
ABSL_FLAG(int64_t, expect_updates, -1,
          "Check that every element is minus this (the number of unit "
          "updates applied); -1: only print stats.");
ABSL_FLAG(bool, expect_shard_versions, false,
          "Check that every element is minus the version of its shard.");
ABSL_FLAG(double, rpc_timeout_s, 30, "Deadline of each call.");
ABSL_FLAG(double, retry_window_s, 0,
          "How long failed calls are retried (a replicated shard's calls "
          "move to its next replica when one fails); 0: not at all.");

namespace pstrain {
namespace {

int Main() {
  PsClientOptions options;
  options.hosts =
      absl::StrSplit(absl::GetFlag(FLAGS_ps_hosts), ',', absl::SkipEmpty());
  options.rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_rpc_timeout_s));
  options.connect_timeout = options.rpc_timeout;
  options.retry_window = absl::Seconds(absl::GetFlag(FLAGS_retry_window_s));
  options.heartbeat_interval = absl::ZeroDuration();
  options.connections_per_shard = 1;
  if (options.hosts.empty()) {
    ExitOnFlagErrors({absl::InvalidArgumentError("--ps_hosts is required")});
  }
  absl::StatusOr<std::unique_ptr<PsClient>> client = PsClient::Create(options);
  ExitOnFlagErrors({client.status()});

  absl::StatusOr<std::vector<StatsResponse>> stats = (*client)->Stats();
  if (!stats.ok()) {
    std::fprintf(stderr, "observer: stats: %s\n",
                 stats.status().ToString().c_str());
    return 3;
  }
  for (const StatsResponse& s : *stats) {
    std::printf(
        "shard=%d version=%lld blocks_applied=%lld blocks_duplicate=%lld "
        "requests_rejected=%lld late=%lld members=%d steps_short=%lld "
        "steps_lost=%lld gradients_lost=%lld updates_lost=%lld "
        "elements=%lld\n",
        s.shard_id(), static_cast<long long>(s.version()),
        static_cast<long long>(s.blocks_applied()),
        static_cast<long long>(s.blocks_duplicate()),
        static_cast<long long>(s.requests_rejected()),
        static_cast<long long>(s.late_gradients_dropped()), s.members(),
        static_cast<long long>(s.steps_short()),
        static_cast<long long>(s.steps_lost()),
        static_cast<long long>(s.gradients_lost()),
        static_cast<long long>(s.updates_lost()),
        static_cast<long long>(s.num_elements()));
  }
  const int64_t expected_updates = absl::GetFlag(FLAGS_expect_updates);
  const bool per_shard = absl::GetFlag(FLAGS_expect_shard_versions);
  if (expected_updates < 0 && !per_shard) return 0;

  // The workers' schema, built the way they build it.
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::CreateBackend("cpu");
  ExitOnFlagErrors({backend.status()});
  const int64_t elements = absl::GetFlag(FLAGS_probe_elements);
  absl::StatusOr<std::unique_ptr<Model>> probe =
      CreateProbeModel(backend->get(), elements);
  ExitOnFlagErrors({probe.status()});
  ModelSchema schema;
  schema.set_seed(absl::GetFlag(FLAGS_seed));
  schema.set_block_elements(absl::GetFlag(FLAGS_block_elements));
  *schema.add_dense() = (*probe)->Params()[0];
  schema.set_block_elements(ResolvedBlockElements(schema));
  absl::StatusOr<Registration> registered = (*client)->Register(
      schema, absl::GetFlag(FLAGS_num_workers), /*worker_id=*/-1);
  if (!registered.ok()) {
    std::fprintf(stderr, "observer: register: %s\n",
                 registered.status().ToString().c_str());
    return 3;
  }
  std::vector<float> w(elements, NAN);
  absl::StatusOr<int64_t> pulled = (*client)->Pull(0, {w.data()});
  if (!pulled.ok()) {
    std::fprintf(stderr, "observer: pull: %s\n",
                 pulled.status().ToString().c_str());
    return 3;
  }
  const int64_t block_elements = schema.block_elements();
  const int num_shards = static_cast<int>(stats->size());
  auto expected_at = [&](int64_t i) {
    if (!per_shard) return -static_cast<float>(expected_updates);
    const int shard = ShardOfBlock(i / block_elements, num_shards);
    return -static_cast<float>((*stats)[shard].version());
  };
  int64_t mismatches = 0;
  float lo = INFINITY, hi = -INFINITY;
  // Updates short of the expected, in block-steps (a block's elements move
  // together): what the shards' updates_lost + gradients_lost / W should
  // account for.
  double missing_block_steps = 0;
  for (int64_t i = 0; i < elements; ++i) {
    mismatches += w[i] != expected_at(i);
    lo = std::fmin(lo, w[i]);
    hi = std::fmax(hi, w[i]);
    if (i % block_elements == 0) missing_block_steps += w[i] - expected_at(i);
  }
  std::printf(
      "check elements=%lld expected=%s min=%.1f max=%.1f "
      "mismatches=%lld missing_block_steps=%.3f\n",
      static_cast<long long>(elements),
      per_shard ? "-shard_version" : absl::StrCat(-expected_updates).c_str(),
      lo, hi, static_cast<long long>(mismatches), missing_block_steps);
  return mismatches == 0 ? 0 : 1;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  pstrain::InitProgram(argc, argv,
                       "observer: reads a probe job's stats and checks its "
                       "exact invariant");
  return pstrain::Main();
}
