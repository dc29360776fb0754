// One parameter-server shard: its blocks of every dense tensor, their
// optimizer state, and the consistency protocol. This is the one place where
// a push is applied. It knows nothing of gRPC: the service adapts it.
//
// Blocks are the unit of transfer, locking and consistency. Each block has a
// version: the number of updates applied to it.
// sync:  a block at version v sums each worker's step-v gradient; when all
//        num_workers have pushed it, the mean is applied once and the block
//        moves to v + 1. Pull(step t) answers once every requested block is
//        at version t (or fails at its deadline), so it returns exactly the
//        model after t updates.
// async: every push is applied on arrival under the block's lock; staleness
//        (block version at apply - version the worker pulled) is recorded.
// Both:  a block push is identified by (worker_id, step); a repeat is
//        acknowledged as a duplicate and never applied twice. Every request
//        is validated completely before it touches state.
#ifndef PSTRAIN_PS_SERVER_SHARD_H_
#define PSTRAIN_PS_SERVER_SHARD_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/partition.h"
#include "common/wire.h"
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
  // still counts toward the block's quorum; the mean is over finite ones.
  bool skip_nonfinite_gradients = false;
  // Upper bound on how long a sync Pull waits for its step, whatever the
  // caller's deadline.
  absl::Duration max_pull_wait = absl::Minutes(2);
};

// A copy of one block's values, taken under its lock, ready to send.
struct PulledBlock {
  const std::string* tensor = nullptr;  // owned by the registered schema
  int64_t block = 0;
  int64_t version = 0;
  std::vector<float> values;
};

class Shard {
 public:
  // Called exactly once per Pull: inline when the blocks are ready, else
  // later from the push that completes the step, the deadline reaper, or
  // BeginShutdown.
  using PullDone =
      std::function<void(absl::Status, std::vector<PulledBlock> blocks)>;

  static absl::StatusOr<std::unique_ptr<Shard>> Create(
      const ShardOptions& options);
  ~Shard();  // fails waiting pulls (as BeginShutdown) and stops the reaper

  absl::StatusOr<RegisterModelResponse> Register(
      const RegisterModelRequest& request);
  // `deadline` is the caller's; a sync wait is also capped by max_pull_wait.
  void Pull(const PullRequest& request, absl::Time deadline, PullDone done);
  absl::StatusOr<PushResponse> Push(const WirePushRequest& request);
  StatsResponse Stats() const;

  // Counts a request refused before it reached the shard (unparseable).
  void CountRejected() { requests_rejected_.fetch_add(1); }

  // Answers every waiting pull UNAVAILABLE, so the server can stop without
  // waiting for workers that will never push.
  void BeginShutdown();

 private:
  struct Block;
  struct Model;
  struct Waiter;
  // A validated block of a push: its local index and the wire block.
  struct BlockPush {
    int local = 0;
    const WireBlock* wire = nullptr;
    bool nonfinite = false;
  };

  Shard(const ShardOptions& options, std::unique_ptr<Optimizer> optimizer);

  absl::Status Reject(absl::Status status);
  // Validation shared by every call.
  absl::StatusOr<const Model*> ValidateCommon(uint32_t protocol_version,
                                              int worker_id,
                                              int64_t step) const;
  absl::StatusOr<std::vector<BlockPush>> ValidatePushBlocks(
      const Model& model, const WirePushRequest& request) const;
  absl::StatusOr<std::vector<int>> ResolvePullBlocks(
      const Model& model, const PullRequest& request) const;

  // Applies one block of a push; returns false for a duplicate.
  bool PushSyncBlock(Block& block, const WirePushRequest& request,
                     const BlockPush& push);
  bool PushAsyncBlock(Block& block, const WirePushRequest& request,
                      const BlockPush& push);

  std::vector<PulledBlock> CopyBlocks(const Model& model,
                                      const std::vector<int>& locals) const;
  // Answers the waiting pulls whose blocks have all reached their step.
  void ReleaseReadyWaiters();
  // Fails waiters past their deadline; runs on reaper_ until shutdown.
  void ReapExpiredWaiters();
  std::string DescribeMissing(const Waiter& waiter) const;

  const ShardOptions options_;
  const std::unique_ptr<Optimizer> optimizer_;

  // Set once by the first successful Register, then immutable (the blocks'
  // values change under their own locks).
  absl::Mutex register_mu_;
  std::unique_ptr<Model> model_owner_ ABSL_GUARDED_BY(register_mu_);
  std::atomic<const Model*> model_{nullptr};

  // Sync pulls waiting for their step. A pull checks block versions and
  // enqueues under waiters_mu_; a completed block publishes its version and
  // then scans under waiters_mu_, so no wake-up is lost.
  mutable absl::Mutex waiters_mu_;
  std::vector<std::unique_ptr<Waiter>> waiters_ ABSL_GUARDED_BY(waiters_mu_);
  bool shutting_down_ ABSL_GUARDED_BY(waiters_mu_) = false;
  std::thread reaper_;

  std::atomic<int64_t> blocks_applied_{0};
  std::atomic<int64_t> blocks_duplicate_{0};
  std::atomic<int64_t> requests_rejected_{0};
  mutable std::atomic<int64_t> pulls_served_{0};
  std::atomic<int64_t> nonfinite_skipped_{0};
  std::atomic<int64_t> staleness_sum_{0};
  std::atomic<int64_t> staleness_max_{0};
  std::atomic<int64_t> async_applies_{0};
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SHARD_H_
