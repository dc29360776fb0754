// One parameter-server shard: its blocks of every dense tensor, their
// optimizer state, and the consistency protocol. This is the one place where
// a push is applied. It knows nothing of gRPC: the service adapts it.
//
// sync:  the shard is at version v (v updates applied). Push(step v) from
//        each worker is summed; when all num_workers have pushed, the mean
//        is applied once and the version becomes v + 1. Pull(step t) waits
//        (until a deadline) for version t and returns exactly that model.
// async: every push is applied on arrival, block by block under the block's
//        lock; the version counts applied pushes, and staleness (version at
//        apply - version the worker pulled) is recorded.
// Both:  a push is identified by (worker_id, step); a repeat is acknowledged
//        with duplicate=true and never applied twice. Every request is
//        validated completely before it touches state.
#ifndef PSTRAIN_PS_SERVER_SHARD_H_
#define PSTRAIN_PS_SERVER_SHARD_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/partition.h"
#include "proto/ps.pb.h"
#include "ps_server/optimizer.h"

namespace pstrain {

enum class ConsistencyMode { kSync, kAsync };

// "sync" | "async"; anything else is InvalidArgument naming --mode.
absl::StatusOr<ConsistencyMode> ParseConsistencyMode(absl::string_view name);
std::string ConsistencyModeName(ConsistencyMode mode);

struct ShardOptions {
  int shard_id = 0;
  int num_shards = 1;
  int num_workers = 1;
  ConsistencyMode mode = ConsistencyMode::kSync;
  OptimizerConfig optimizer;
  // A gradient with NaN/Inf is refused (false) or acknowledged and left out
  // of the update, counted in stats (true). In sync mode a skipped worker
  // still counts toward the step's quorum; the mean is over finite ones.
  bool skip_nonfinite_gradients = false;
  // Upper bound on how long a sync Pull waits for its step, whatever the
  // caller's deadline.
  absl::Duration max_pull_wait = absl::Minutes(2);
};

class Shard {
 public:
  static absl::StatusOr<std::unique_ptr<Shard>> Create(
      const ShardOptions& options);
  ~Shard();

  absl::StatusOr<RegisterModelResponse> Register(
      const RegisterModelRequest& request);
  // `deadline` is the caller's; the wait is also capped by max_pull_wait,
  // and ends early (CANCELLED) once `cancelled` returns true, e.g. because
  // the caller went away.
  absl::Status Pull(const PullRequest& request, absl::Time deadline,
                    PullResponse* response,
                    const std::function<bool()>& cancelled = nullptr);
  absl::Status Push(const PushRequest& request, PushResponse* response);
  StatsResponse Stats() const;

  // Releases every waiting pull with UNAVAILABLE and refuses new calls, so
  // the server can stop without waiting for workers that will never push.
  void BeginShutdown();

  // Counts a request refused before it reached the shard (e.g. by gRPC).
  void CountRejected() { requests_rejected_.fetch_add(1); }

 private:
  struct Block;
  struct Model;
  // A validated push payload: local block index and its float32 bytes.
  struct BlockPayload {
    int local = 0;
    absl::string_view data;
  };

  explicit Shard(const ShardOptions& options,
                 std::unique_ptr<Optimizer> optimizer);

  // Validation shared by every call; each returns the status to answer.
  absl::StatusOr<const Model*> ValidateCommon(uint32_t protocol_version,
                                              int worker_id,
                                              int64_t step) const;
  absl::StatusOr<std::vector<BlockPayload>> ValidatePushBlocks(
      const Model& model, const PushRequest& request, bool* nonfinite) const;
  absl::StatusOr<std::vector<int>> ResolvePullBlocks(
      const Model& model, const PullRequest& request) const;

  absl::Status PushSync(const Model& model, const PushRequest& request,
                        const std::vector<BlockPayload>& payloads,
                        bool nonfinite, PushResponse* response);
  absl::Status PushAsync(const Model& model, const PushRequest& request,
                         const std::vector<BlockPayload>& payloads,
                         bool nonfinite, PushResponse* response);
  // Applies the mean of the accumulated gradients: the end of a sync step.
  void ApplySyncStepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EncodeBlocks(const Model& model, const std::vector<int>& locals,
                    PullResponse* response) const;
  absl::Status Reject(absl::Status status);

  const ShardOptions options_;
  const std::unique_ptr<Optimizer> optimizer_;

  // Set once by the first successful Register, then immutable (the blocks'
  // values change under their own locks).
  absl::Mutex register_mu_;
  std::unique_ptr<Model> model_owner_ ABSL_GUARDED_BY(register_mu_);
  std::atomic<const Model*> model_{nullptr};

  mutable absl::Mutex mu_;
  int64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  // sync: who has pushed the current step, and how many of them were finite.
  std::vector<bool> contributed_ ABSL_GUARDED_BY(mu_);
  int contributors_ ABSL_GUARDED_BY(mu_) = 0;
  int finite_contributors_ ABSL_GUARDED_BY(mu_) = 0;
  // async: the last step applied per worker (-1: none).
  std::vector<int64_t> last_step_ ABSL_GUARDED_BY(mu_);
  int64_t staleness_sum_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t staleness_max_ ABSL_GUARDED_BY(mu_) = 0;

  std::atomic<int64_t> pushes_applied_{0};
  std::atomic<int64_t> pushes_duplicate_{0};
  std::atomic<int64_t> requests_rejected_{0};
  std::atomic<int64_t> pulls_served_{0};
  std::atomic<int64_t> nonfinite_skipped_{0};
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SHARD_H_
