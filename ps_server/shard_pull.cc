// Dense pulls, and the waiting every pull (dense or sparse) shares: a pull
// answered once its blocks reach its step (sync), at once (async), or once
// no member's clock is too far behind (ssp); the waiters the reaper and
// each completed step release. Part of Shard (shard.h lists its files).
#include <algorithm>
#include <atomic>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_text.h"
#include "glog/logging.h"
#include "ps_server/shard.h"
#include "ps_server/shard_internal.h"

namespace pstrain {

using shard_internal::AtomicMax;
using shard_internal::DescribeMissing;
using shard_internal::kNever;
using shard_internal::QuorumMet;

// ---------------------------------------------------------------------------
// Dense pull, and the waiting every pull (dense or sparse) shares.

absl::StatusOr<std::vector<int>> Shard::ResolvePullBlocks(
    const Model& model, const PullRequest& request) const {
  std::vector<int> locals;
  if (request.blocks_size() == 0) {
    locals.resize(model.blocks.size());
    for (size_t i = 0; i < locals.size(); ++i) locals[i] = static_cast<int>(i);
    return locals;
  }
  absl::flat_hash_set<int> seen;
  for (const BlockRef& ref : request.blocks()) {
    absl::StatusOr<int> global =
        model.partition.FindBlock(ref.tensor(), ref.block());
    if (!global.ok()) return global.status();
    const int local = model.local_of_global[*global];
    if (local < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", QuoteForStatus(ref.tensor()), " block ", ref.block(),
          " lives on shard ", model.partition.blocks()[*global].shard,
          ", this is shard ", options_.shard_id));
    }
    if (!seen.insert(local).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", QuoteForStatus(ref.tensor()), " block ",
                       ref.block(), " is requested twice"));
    }
    locals.push_back(local);
  }
  return locals;
}

absl::Span<float> Shard::MutableValues(Block& block) {
  bool copied = false;
  absl::Span<float> values = block.value.Mutable(&copied);
  if (copied) values_copied_for_pulls_.fetch_add(1);
  return values;
}

std::vector<PulledBlock> Shard::ShareBlocks(
    const Model& model, const std::vector<int>& locals) const {
  std::vector<PulledBlock> out(locals.size());
  for (size_t i = 0; i < locals.size(); ++i) {
    const Block& block = *model.blocks[locals[i]];
    out[i].tensor = block.tensor_name;
    out[i].block = block.location->block;
    out[i].state_values = block.state_values;
    absl::MutexLock lock(&block.mu);
    out[i].version = block.version.load();
    out[i].values = block.value.Share();
  }
  pulls_served_.fetch_add(1);
  return out;
}

bool Shard::WaiterReadyLocked(const Waiter& waiter) const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (waiter.sparse < 0 && blocks_awaiting_values_.load() > 0) {
    for (int local : waiter.locals) {
      if (model->blocks[local]->awaiting_values.load()) return false;
    }
  }
  if (options_.mode == ConsistencyMode::kAsync) return true;
  if (options_.mode == ConsistencyMode::kSsp) {
    const int64_t min_clock = MinMemberClockLocked();
    return min_clock == kNever ||
           waiter.step - min_clock <= options_.ssp_staleness;
  }
  if (waiter.sparse >= 0) {
    return model->sparse[waiter.sparse]->version.load() >= waiter.step;
  }
  if (waiter.clip) {
    // Every block has its clipped step in (or it was applied already).
    for (int local : waiter.locals) {
      const Block& block = *model->blocks[local];
      const int64_t version = block.version.load();
      if (version < waiter.step ||
          (version == waiter.step && !block.awaiting_clip.load())) {
        return false;
      }
    }
    return true;
  }
  for (int local : waiter.locals) {
    if (model->blocks[local]->version.load() < waiter.step) return false;
  }
  return true;
}

void Shard::Pull(const PullRequest& request, absl::Time deadline, PullDone done,
                 bool follows_own_push) {
  absl::StatusOr<const Model*> model =
      ValidateCommon(request.protocol_version(), request.worker_id(),
                     request.step(), /*allow_observer=*/true);
  if (!model.ok()) return done(Reject(model.status()), {});
  const int worker = request.worker_id();
  absl::StatusOr<std::vector<int>> locals = ResolvePullBlocks(**model, request);
  if (!locals.ok()) return done(Reject(locals.status()), {});
  const int64_t step = request.step();
  auto waiter = std::make_unique<Waiter>();
  waiter->locals = std::move(*locals);
  waiter->step = step;
  // A lost gradient completed some step, or a fast-forward skipped some:
  // other pulls may wait for them.
  bool completed = false;
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (worker >= 0) {
      TouchLocked(worker);
      workers_[worker].pulled_in_this_life =
          std::max(workers_[worker].pulled_in_this_life, step);
      if (options_.mode != ConsistencyMode::kAsync) {
        JoinIfPendingLocked(worker, step);
      }
    }
    if (options_.mode == ConsistencyMode::kSync) {
      // An observer reading a running job (PsClient::FinishObserverRead)
      // asks for the step after the furthest block it found, two past one
      // that lagged: it changes nothing, and its wait has a deadline.
      const int64_t ahead_at_most = worker >= 0 ? 1 : 2;
      for (int local : waiter->locals) {
        const Block& block = *(*model)->blocks[local];
        const int64_t version = block.version.load();
        if (version + ahead_at_most >= step) continue;
        if (recovering_ || ConfirmLostStateLocked(worker, step)) {
          completed = FastForwardLocked(**model, step);
          break;
        }
        if (fresh_) {
          const absl::Status behind =
              FreshShardBehindLocked("pull", step, version);
          lock.Release();
          return done(Reject(behind), {});
        }
        lock.Release();
        return done(Reject(absl::OutOfRangeError(absl::StrCat(
                        "pull for step ", step, " but tensor ",
                        QuoteForStatus(*block.tensor_name), " block ",
                        block.location->block, " is at step ", version,
                        ": a worker can be at most one step ahead"))),
                    {});
      }
      recovering_ = false;
      fresh_ = false;
      // A member pulling step s has pushed step s - 1 everywhere; a block
      // of a restored shard without its gradient for a step that was in
      // flight when the shard died lost it with the shard's previous life.
      // Waiting for it would wait forever, so it counts as given, like a
      // skipped non-finite one. Nowhere else: a client that pulls before it
      // pushes must not complete a step without its gradient.
      if (!follows_own_push) {
        completed |= CreditLostGradientsLocked(**model, worker, step);
      }
    }
    if (!WaiterReadyLocked(*waiter)) {
      if (shutting_down_) {
        lock.Release();
        return done(absl::UnavailableError("the server is shutting down"), {});
      }
      QueueBlocksWaiterLocked(std::move(waiter), *model, deadline,
                              std::move(done));
      lock.Release();
      if (completed) ReleaseReadyWaiters();
      return;
    }
    if (options_.mode == ConsistencyMode::kSsp) {
      const int64_t min_clock = MinMemberClockLocked();
      if (min_clock != kNever) AtomicMax(ssp_gap_max_, step - min_clock);
    }
  }
  if (completed) ReleaseReadyWaiters();
  done(absl::OkStatus(), ShareBlocks(**model, waiter->locals));
}

void Shard::PullOnBackup(const PullRequest& request, absl::Time deadline,
                         PullDone done) {
  absl::StatusOr<const Model*> model =
      ValidateCommon(request.protocol_version(), request.worker_id(),
                     request.step(), /*allow_observer=*/false);
  if (!model.ok()) return done(Reject(model.status()), {});
  if (options_.mode != ConsistencyMode::kSync) {
    return done(absl::FailedPreconditionError(
                    "a backup answers pulls in sync mode only"),
                {});
  }
  absl::StatusOr<std::vector<int>> locals = ResolvePullBlocks(**model, request);
  if (!locals.ok()) return done(Reject(locals.status()), {});
  auto waiter = std::make_unique<Waiter>();
  waiter->locals = std::move(*locals);
  waiter->step = request.step();
  waiter->replica_read = true;
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    if (replica_reads_ended_) {
      refused = absl::UnavailableError(
          "this replica is no backup any more: read from the primary");
    } else if (!WaiterReadyLocked(*waiter)) {
      if (!shutting_down_) {
        QueueBlocksWaiterLocked(std::move(waiter), *model, deadline,
                                std::move(done));
        return;
      }
      refused = absl::UnavailableError("the server is shutting down");
    }
  }
  // Answered outside the lock, as every pull is.
  if (!refused.ok()) return done(std::move(refused), {});
  done(absl::OkStatus(), ShareBlocks(**model, waiter->locals));
}

void Shard::QueueBlocksWaiterLocked(std::unique_ptr<Waiter> waiter,
                                    const Model* model, absl::Time deadline,
                                    PullDone done) {
  waiter->deadline = std::min(deadline, absl::Now() + options_.max_pull_wait);
  waiter->answer = [this, model, locals = waiter->locals,
                    done = std::move(done)](absl::Status status) {
    if (!status.ok()) return done(std::move(status), {});
    done(absl::OkStatus(), ShareBlocks(*model, locals));
  };
  waiters_.push_back(std::move(waiter));
}

void Shard::FailReplicaReads(const absl::Status& status) {
  std::vector<std::unique_ptr<Waiter>> reads;
  {
    absl::MutexLock lock(&mu_);
    replica_reads_ended_ = true;
    auto split = std::stable_partition(
        waiters_.begin(), waiters_.end(),
        [](const std::unique_ptr<Waiter>& w) { return !w->replica_read; });
    std::move(split, waiters_.end(), std::back_inserter(reads));
    waiters_.erase(split, waiters_.end());
  }
  for (std::unique_ptr<Waiter>& w : reads) w->answer(status);
}

void Shard::ReleaseReadyWaiters() {
  std::vector<std::unique_ptr<Waiter>> ready;
  {
    absl::MutexLock lock(&mu_);
    auto split = std::stable_partition(waiters_.begin(), waiters_.end(),
                                       [&](const std::unique_ptr<Waiter>& w) {
                                         mu_.AssertHeld();
                                         return !WaiterReadyLocked(*w);
                                       });
    std::move(split, waiters_.end(), std::back_inserter(ready));
    waiters_.erase(split, waiters_.end());
    if (options_.mode == ConsistencyMode::kSsp && !ready.empty()) {
      const int64_t min_clock = MinMemberClockLocked();
      for (const auto& w : ready) {
        if (min_clock != kNever) AtomicMax(ssp_gap_max_, w->step - min_clock);
      }
    }
  }
  // Answered outside the lock: copying blocks and sending take time.
  for (std::unique_ptr<Waiter>& w : ready) w->answer(absl::OkStatus());
}

std::string Shard::DescribeWait(const Waiter& waiter) const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (waiter.clip) {
    const std::shared_ptr<const Membership> members = membership();
    for (int local : waiter.locals) {
      const Block& block = *model->blocks[local];
      absl::MutexLock lock(&block.mu);
      if (block.version.load() > waiter.step || block.awaiting_clip.load()) {
        continue;
      }
      return absl::StrCat("the norm of clipped step ", waiter.step,
                          " waits: ", DescribeBlockWaitLocked(block, *members));
    }
    return "the clipped step completed as the deadline passed";
  }
  if (waiter.sparse < 0) {
    for (int local : waiter.locals) {
      const Block& block = *model->blocks[local];
      if (!block.awaiting_values.load()) continue;
      return absl::StrCat("tensor ", QuoteForStatus(*block.tensor_name),
                          " has no values yet: its init is PROVIDED and no "
                          "worker has assigned them (pstrain.torch: worker "
                          "0 does, at its start)");
    }
  }
  if (options_.mode == ConsistencyMode::kSsp) {
    absl::MutexLock lock(&mu_);
    std::vector<int> behind;
    for (size_t w = 0; w < workers_.size(); ++w) {
      if (workers_[w].member &&
          waiter.step - workers_[w].next_step > options_.ssp_staleness) {
        behind.push_back(static_cast<int>(w));
      }
    }
    return absl::StrCat("waiting for workers [", absl::StrJoin(behind, ", "),
                        "] to come within ", options_.ssp_staleness, " steps");
  }
  const std::shared_ptr<const Membership> members = membership();
  if (waiter.sparse >= 0) {
    const SparseState& table = *model->sparse[waiter.sparse];
    absl::MutexLock lock(&table.mu);
    return absl::StrCat(
        "sparse table ", QuoteForStatus(table.spec->name()),
        " is still waiting for ",
        DescribeMissing(table.version.load(), table.last_contributed, *members,
                        "pushes"));
  }
  for (int local : waiter.locals) {
    const Block& block = *model->blocks[local];
    absl::MutexLock lock(&block.mu);
    if (block.version.load() >= waiter.step) continue;
    return DescribeBlockWaitLocked(block, *members);
  }
  return "the step completed as the deadline passed";
}

std::string Shard::DescribeBlockWaitLocked(const Block& block,
                                           const Membership& members) const {
  return absl::StrCat(
      "tensor ", QuoteForStatus(*block.tensor_name), " block ",
      block.location->block, " is still waiting for ",
      DescribeMissing(block.version.load(), block.last_contributed, members,
                      "gradients"));
}

}  // namespace pstrain
