// Dense blocks: where a dense push is applied (sync: PushSyncBlock sums it
// and CompleteIfReadyLocked applies the step; async/ssp: PushAsyncBlock),
// and what a restored shard lost. "Where is a push applied" has one answer
// per kind: here for dense blocks, shard_sparse.cc for sparse tables; dense
// pulls are in shard_pull.cc.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <iterator>
#include <limits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_text.h"
#include "common/transport/tensor_codec.h"
#include "glog/logging.h"
#include "ps_server/shard.h"
#include "ps_server/shard_internal.h"

namespace pstrain {
using shard_internal::AtomicMax;
using shard_internal::DescribeMissing;
using shard_internal::kNever;
using shard_internal::QuorumMet;

// ---------------------------------------------------------------------------
// Dense push: validation, summing (sync) or applying (async/ssp) a block's
// gradient, and completing a sync step.

absl::StatusOr<std::vector<Shard::BlockPush>> Shard::ValidatePushBlocks(
    const Model& model, const WirePushRequest& request, bool assign) const {
  for (size_t g = 0; g < request.group_lr.size(); ++g) {
    const double lr = request.group_lr[g];
    if (!std::isfinite(lr) || lr < 0 ||
        lr > std::numeric_limits<float>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group_lr[", g, "] must be a finite rate >= 0, got ", lr));
    }
  }
  for (size_t g = 0; g < request.group_momentum.size(); ++g) {
    const double momentum = request.group_momentum[g];
    if (!(momentum >= 0 && momentum < 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group_momentum[", g, "] must be in [0, 1), got ", momentum));
    }
  }
  if (!(request.clip_max_norm >= 0 &&
        request.clip_max_norm <= std::numeric_limits<float>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("clip_max_norm must be a finite norm >= 0, got ",
                     request.clip_max_norm));
  }
  if (request.clip_max_norm > 0 && options_.mode != ConsistencyMode::kSync) {
    return absl::InvalidArgumentError(
        "clip_max_norm clips a sync step's mean gradient; in async and ssp a "
        "worker clips its own gradient before it pushes");
  }
  if (!request.group_momentum.empty() &&
      request.group_momentum.size() != request.group_lr.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the push carries ", request.group_lr.size(), " group rate(s) and ",
        request.group_momentum.size(), " momentum(s): one of each per group"));
  }
  std::vector<BlockPush> pushes;
  pushes.reserve(request.blocks.size());
  absl::flat_hash_set<int> seen;
  for (const WireBlock& wire : request.blocks) {
    absl::StatusOr<int> global =
        model.partition.FindBlock(wire.tensor, wire.block);
    if (!global.ok()) return global.status();
    const BlockLocation& loc = model.partition.blocks()[*global];
    // Only built for an error: this runs for every block of every push.
    auto where = [&wire] {
      return absl::StrCat("tensor ", QuoteForStatus(wire.tensor), " block ",
                          wire.block);
    };
    const int local = model.local_of_global[*global];
    if (local < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), " lives on shard ", loc.shard,
                       ", this is shard ", options_.shard_id));
    }
    if (!seen.insert(local).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), " appears twice in one push"));
    }
    const Block& block = *model.blocks[local];
    if (!request.group_lr.empty() && block.lr_group >= 0 &&
        static_cast<size_t>(block.lr_group) >= request.group_lr.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), " is in param group ", block.lr_group,
                       " but the push "
                       "carries the rates of ",
                       request.group_lr.size(), " group(s)"));
    }
    if ((assign || block.state_values) && wire.dtype != FLOAT32) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), ": ", assign ? "assigned values" : "a STATE tensor's values",
          " travel as FLOAT32, got ", DataType_Name(wire.dtype)));
    }
    if (!assign && block.awaiting_values.load()) {
      return absl::FailedPreconditionError(absl::StrCat(
          where(),
          " has no values yet: its init is PROVIDED, set by a "
          "worker's Assign (pstrain.torch: worker 0's model) before "
          "anything is pushed"));
    }
    const int64_t element_bytes = WireElementBytes(wire.dtype);
    if (wire.dtype == TOPK_FLOAT32) {
      if (absl::Status s = ValidatePayload(wire.dtype, wire.data, loc.length);
          !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), ": ", s.message()));
      }
    } else if (element_bytes == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": wire type ", static_cast<int>(wire.dtype),
                       " is not supported by this server"));
    } else if (const uint64_t expected =
                   static_cast<uint64_t>(loc.length) * element_bytes;
               wire.data_size != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": payload has ", wire.data_size,
                       " bytes, expected ", expected, " (", loc.length, " ",
                       DataType_Name(wire.dtype), " elements)"));
    }
    if (wire.version < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), ": pulled version must be >= 0, got ", wire.version));
    }
    BlockPush push{local, &wire, false};
    const int64_t bad = FindNonFiniteSegments(wire.dtype, wire.data);
    if (bad >= 0) {
      if (!options_.skip_nonfinite_gradients) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), ": gradient element ", loc.offset + bad,
                         " is NaN or infinite; the push was not applied"));
      }
      push.nonfinite = true;
    }
    pushes.push_back(push);
  }
  return pushes;
}

void Shard::WaitForBlockStep(const Block& block, int64_t step,
                             absl::Time until) {
  struct Reached {
    const Block* block;
    int64_t step;
    const std::atomic<bool>* released;
    static bool Check(Reached* r) {
      return r->block->version.load() >= r->step || r->released->load();
    }
  } reached{&block, step, &holds_released_};
  // Versions change under the block's mutex, which re-checks the condition.
  // Whether it came or the time ran out, the push is tried again.
  static_cast<void>(block.mu.LockWhenWithDeadline(
      absl::Condition(&Reached::Check, &reached), until));
  block.mu.Unlock();
}

void Shard::WaitForPushStep(const WirePushRequest& request, absl::Time until) {
  if (options_.mode != ConsistencyMode::kSync) return;
  const Model* model = model_.load();
  if (model == nullptr) return;
  absl::StatusOr<std::vector<BlockPush>> pushes =
      ValidatePushBlocks(*model, request);
  if (!pushes.ok()) return;  // Push refuses it, with the reason
  for (const BlockPush& push : *pushes) {
    const Block& block = *model->blocks[push.local];
    if (block.version.load() < request.step) {
      WaitForBlockStep(block, request.step, until);
    }
  }
}

void Shard::WaitWhileFresh(absl::Time until) {
  // Whether the shard took the job's step or the time ran out, the push is
  // tried again.
  static_cast<void>(mu_.LockWhenWithDeadline(
      absl::Condition(this, &Shard::FreshWaitOverLocked), until));
  mu_.Unlock();
}

bool Shard::FastForwardLocked(const Model& model, int64_t step) {
  // A fresh shard takes the furthest step a worker came with: a worker
  // behind it has pushed its own step to this shard's previous life, and
  // waiting for that push again could wait on workers held by the one ahead.
  // Sync workers are at most a step apart (a pull one past the push), so a
  // step further than one past the nearest is no worker's: one bad client
  // cannot send the shard to a step the job never reaches.
  if (!ahead_of_fresh_.empty()) {
    step = std::min(furthest_ahead_of_fresh_, nearest_ahead_of_fresh_ + 1);
  }
  int64_t lost = 0;
  bool moved = false;
  // A replica that follows takes its dense steps from the leader's records
  // only: a step skipped here would be a record it then takes for a repeat.
  const bool leads = LeadsSteps();
  for (const auto& block : model.blocks) {
    if (!leads) break;
    absl::MutexLock block_lock(&block->mu);
    const int64_t version = block->version.load();
    if (version >= step) continue;
    lost = std::max(lost, step - version);
    moved = true;
    SkipBlockLocked(*block, step);
    // The backups skip with it: the next step's record is of `step`.
    if (options_.record_steps) {
      StepRecord record;
      record.set_local_block(block->local);
      record.set_step(version);
      record.set_skip_to(step);
      AddStepRecord(std::move(record), {});
    }
  }
  // Tables behind the workers' step skip to it like blocks; their rows
  // keep what the checkpoint restored.
  for (const auto& state : model.sparse) {
    if (state->mode != ConsistencyMode::kSync) continue;
    absl::MutexLock state_lock(&state->mu);
    const int64_t version = state->version.load();
    if (version >= step) continue;
    lost = std::max(lost, step - version);
    moved = true;
    updates_lost_.fetch_add(step - version);
    SettleEarlySparsePushesLocked(*state, /*add=*/false);
    state->gradient_sum.clear();
    state->contributors = 0;
    state->version.store(step);
  }
  if (moved) CountSkipLocked(step, lost);
  if (lost > 0) {
    LOG(WARNING) << "the workers are at step " << step
                 << ": this shard takes it, " << lost
                 << " step(s) behind (the updates since its checkpoint, or "
                    "all without one, died with its earlier life; counted "
                    "in steps_lost)";
  }
  recovering_ = false;
  fresh_ = false;
  ahead_of_fresh_.clear();
  furthest_ahead_of_fresh_ = 0;
  nearest_ahead_of_fresh_ = std::numeric_limits<int64_t>::max();
  recovery_horizon_ = std::max(recovery_horizon_, step);
  return moved;
}

void Shard::CountSkipLocked(int64_t step, int64_t lost) {
  if (step != skip_counted_to_) {
    skip_counted_to_ = step;
    skip_counted_lost_ = 0;
  }
  if (lost > skip_counted_lost_) {
    steps_lost_.fetch_add(lost - skip_counted_lost_);
    skip_counted_lost_ = lost;
  }
  AtomicMax(skipped_to_step_, step);
}

void Shard::SkipBlockLocked(Block& block, int64_t step) {
  updates_lost_.fetch_add(step - block.version.load());
  SettleEarlyGradientsLocked(block, /*add=*/false);
  block.step_hyper_worker = std::numeric_limits<int>::max();
  block.clip_worker = std::numeric_limits<int>::max();
  block.awaiting_clip.store(false);
  block.contributors = 0;
  block.finite_contributors = 0;
  block.lost_contributors = 0;
  block.version.store(step);
}

bool Shard::ConfirmLostStateLocked(int worker, int64_t step) {
  if (!fresh_ || worker < 0 || worker >= options_.num_workers) return false;
  ahead_of_fresh_.insert(worker);
  furthest_ahead_of_fresh_ = std::max(furthest_ahead_of_fresh_, step);
  nearest_ahead_of_fresh_ = std::min(nearest_ahead_of_fresh_, step);
  return static_cast<int>(ahead_of_fresh_.size()) == options_.num_workers;
}

absl::Status Shard::FreshShardBehindLocked(absl::string_view what, int64_t step,
                                           int64_t version) const {
  return absl::UnavailableError(absl::StrCat(
      what, " for step ", step, " but this shard holds step ", version,
      ": it started with no checkpoint while the job ran on, and takes the "
      "job's step once all ",
      options_.num_workers, " workers have come back (", ahead_of_fresh_.size(),
      " so far); retry"));
}

absl::StatusOr<PushResponse> Shard::Push(const WirePushRequest& request,
                                         absl::Time hold_until) {
  absl::StatusOr<const Model*> model =
      ValidateCommon(request.protocol_version, request.worker_id, request.step,
                     /*allow_observer=*/false);
  if (!model.ok()) return Reject(model.status());
  absl::StatusOr<std::vector<BlockPush>> pushes =
      ValidatePushBlocks(**model, request);
  if (!pushes.ok()) return Reject(pushes.status());
  const bool sync = options_.mode == ConsistencyMode::kSync;
  // A step completed here, or skipped by a fast-forward: pulls may wait
  // for it.
  bool completed_a_step = false;
  {
    absl::ReleasableMutexLock lock(&mu_);
    TouchLocked(request.worker_id);
    // async/ssp steps only identify a worker's pushes; one far ahead of its
    // last would make every later push look like a repeat.
    constexpr int64_t kMaxStepJump = int64_t{1} << 20;
    if (!sync &&
        request.step > workers_[request.worker_id].next_step + kMaxStepJump) {
      return Reject(absl::OutOfRangeError(absl::StrCat(
          "push for step ", request.step, " is far ahead of worker ",
          request.worker_id, "'s next step ",
          workers_[request.worker_id].next_step)));
    }
    if (sync) {
      // Checked for every block before any is applied, so a refused push
      // changes nothing.
      for (const BlockPush& push : *pushes) {
        const Block& block = *(*model)->blocks[push.local];
        const int64_t version = block.version.load();
        if (request.step <= version) continue;
        if (!LeadsSteps()) {
          // A forwarded push ahead of the leader's records here: they move
          // this block, nothing else may.
          lock.Release();
          return Reject(absl::UnavailableError(
              absl::StrCat("push for step ", request.step,
                           ": this replica follows the "
                           "primary's step records and has step ",
                           version, " yet; retry")));
        }
        if (recovering_ ||
            ConfirmLostStateLocked(request.worker_id, request.step)) {
          completed_a_step = FastForwardLocked(**model, request.step);
          break;
        }
        if (fresh_) {
          if (MayHold(hold_until)) {
            lock.Release();
            WaitWhileFresh(hold_until);
            return Push(request, hold_until);  // refused once it has passed
          }
          const absl::Status behind =
              FreshShardBehindLocked("push", request.step, version);
          lock.Release();
          return Reject(behind);
        }
        // A worker pushing s pulled s from this shard's previous life, so
        // its gradient of s - 1 was lost with it, as in Pull. The step
        // completes once every member's is given or lost; until then the
        // push is refused as retryable.
        const bool completed =
            CreditLostGradientsLocked(**model, request.worker_id, request.step);
        if (completed && block.version.load() >= request.step) {
          lock.Release();
          ReleaseReadyWaiters();
          return Push(request, hold_until);
        }
        absl::Status refused;
        // A replicated primary that took over may be a step behind what the
        // workers read from the one before it: they send that step's
        // pushes again (PsClient keeps them), and it completes.
        const bool replicated = options_.record_steps;
        if (request.step == version + 1 &&
            (version <= recovery_horizon_ || replicated)) {
          if (MayHold(hold_until)) {
            lock.Release();
            if (completed) ReleaseReadyWaiters();
            WaitForBlockStep(block, request.step, hold_until);
            return Push(request, hold_until);  // refused once it has passed
          }
          absl::MutexLock block_lock(&block.mu);
          refused = absl::UnavailableError(absl::StrCat(
              "push for step ", request.step, " waits on this ",
              version <= recovery_horizon_ ? "restored shard"
                                           : "shard, a step behind its "
                                             "previous primary",
              ": ", DescribeBlockWaitLocked(block, *membership_), "; retry"));
        } else {
          refused = absl::FailedPreconditionError(
              absl::StrCat("push for step ", request.step, " but tensor ",
                           QuoteForStatus(*block.tensor_name), " block ",
                           block.location->block, " is at step ", version,
                           ": a sync worker pushes the step it pulled"));
        }
        // The credit may have completed other blocks or tables.
        lock.Release();
        if (completed) ReleaseReadyWaiters();
        return Reject(std::move(refused));
      }
      recovering_ = false;
      fresh_ = false;
    }
  }

  PushResponse response;
  const std::shared_ptr<const Membership> members =
      sync ? membership() : nullptr;
  for (const BlockPush& push : *pushes) {
    Block& block = *(*model)->blocks[push.local];
    bool completed = false;
    const BlockResult result =
        sync ? PushSyncBlock(block, *members, request, push, &completed)
             : PushAsyncBlock(block, request, push);
    completed_a_step |= completed;
    switch (result) {
      case BlockResult::kApplied:
        response.set_blocks_applied(response.blocks_applied() + 1);
        break;
      case BlockResult::kDuplicate:
        response.set_blocks_duplicate(response.blocks_duplicate() + 1);
        break;
      case BlockResult::kLate:
        response.set_blocks_late(response.blocks_late() + 1);
        break;
    }
  }
  blocks_applied_.fetch_add(response.blocks_applied());
  blocks_duplicate_.fetch_add(response.blocks_duplicate());
  blocks_late_.fetch_add(response.blocks_late());
  if (!sync) {
    {
      absl::MutexLock lock(&mu_);
      WorkerState& state = workers_[request.worker_id];
      state.next_step = std::max(state.next_step, request.step + 1);
    }
    if (options_.mode == ConsistencyMode::kSsp) ReleaseReadyWaiters();
  } else if (completed_a_step) {
    ReleaseReadyWaiters();
  }
  return response;
}

absl::StatusOr<PushResponse> Shard::Assign(const WirePushRequest& request) {
  absl::StatusOr<const Model*> model =
      ValidateCommon(request.protocol_version, request.worker_id,
                     /*step=*/0, /*allow_observer=*/true);
  if (!model.ok()) return Reject(model.status());
  absl::StatusOr<std::vector<BlockPush>> pushes =
      ValidatePushBlocks(**model, request, /*assign=*/true);
  if (!pushes.ok()) return Reject(pushes.status());
  for (const BlockPush& push : *pushes) {
    if (push.nonfinite) {
      return Reject(absl::InvalidArgumentError(absl::StrCat(
          "tensor ", QuoteForStatus(*(*model)->blocks[push.local]->tensor_name),
          " block ", push.wire->block, ": assigned values must be finite")));
    }
  }
  PushResponse response;
  for (const BlockPush& push : *pushes) {
    Block& block = *(*model)->blocks[push.local];
    absl::MutexLock lock(&block.mu);
    if (!block.awaiting_values.load()) {
      response.set_blocks_duplicate(response.blocks_duplicate() + 1);
      continue;
    }
    if (absl::Status s =
            DecodeSegments(push.wire->dtype, push.wire->data,
                           MutableValues(block), /*accumulate=*/false);
        !s.ok()) {
      ReportInternalError(absl::StrCat("values assigned to ",
                                       QuoteForStatus(*block.tensor_name),
                                       " block ", block.location->block),
                          s);
    }
    block.awaiting_values.store(false);
    blocks_awaiting_values_.fetch_sub(1);
    response.set_blocks_applied(response.blocks_applied() + 1);
  }
  if (response.blocks_applied() > 0) ReleaseReadyWaiters();
  return response;
}

StepHyper Shard::HyperOfPush(const Block& block,
                             const WirePushRequest& request) {
  const size_t group = static_cast<size_t>(block.lr_group);
  if (block.lr_group < 0 || group >= request.group_lr.size()) {
    return block.optimizer->OwnHyper();
  }
  StepHyper hyper;
  hyper.lr = static_cast<float>(request.group_lr[group]);
  if (group < request.group_momentum.size()) {
    hyper.momentum = static_cast<float>(request.group_momentum[group]);
  }
  return hyper;
}

Shard::BlockResult Shard::PushSyncBlock(Block& block,
                                        const Membership& membership,
                                        const WirePushRequest& request,
                                        const BlockPush& push,
                                        bool* completed) {
  const int worker = request.worker_id;
  absl::MutexLock lock(&block.mu);
  const int64_t version = block.version.load();
  if (request.step < version) {
    // The step is over: a retry of a gradient it counted, or one it
    // completed without (backup workers, or a worker dropped by lease).
    return block.last_contributed[worker] >= request.step
               ? BlockResult::kDuplicate
               : BlockResult::kLate;
  }
  if (block.last_contributed[worker] == version) return BlockResult::kDuplicate;
  if (push.nonfinite) {
    nonfinite_skipped_.fetch_add(1);
  } else {
    ++block.finite_contributors;
  }
  if (request.clip_max_norm > 0 && !block.state_values &&
      worker < block.clip_worker) {
    block.clip_max_norm = request.clip_max_norm;
    block.clip_worker = worker;
  }
  if (block.lr_group >= 0 &&
      static_cast<size_t>(block.lr_group) < request.group_lr.size() &&
      worker < block.step_hyper_worker) {
    block.step_hyper = HyperOfPush(block, request);
    block.step_hyper_worker = worker;
  }
  AddInWorkerOrderLocked(block, worker, push);
  block.last_contributed[worker] = version;
  ++block.contributors;
  *completed = CompleteIfReadyLocked(block, membership);
  return BlockResult::kApplied;
}

void Shard::AddInWorkerOrderLocked(Block& block, int worker,
                                   const BlockPush& push) {
  if (options_.sum_in_arrival_order) {
    if (!push.nonfinite) {
      AddToStepSumLocked(block, push.wire->dtype, push.wire->data);
    }
    return;
  }
  if (!block.early.IsNext(worker)) {
    // Copied: the request's memory is gone once the push is answered.
    EarlyGradient early;
    early.dtype = push.wire->dtype;
    early.has_values = !push.nonfinite;
    if (early.has_values) {
      early.bytes = early_gradients_.Take();
      early.bytes.reserve(push.wire->data_size);
      for (absl::string_view segment : push.wire->data) {
        early.bytes.append(segment.data(), segment.size());
      }
      early_gradients_.CountHeld(static_cast<int64_t>(early.bytes.size()));
    }
    block.early.Hold(worker, std::move(early));
    return;
  }
  if (!push.nonfinite) {
    AddToStepSumLocked(block, push.wire->dtype, push.wire->data);
  }
  block.early.Added(
      worker,
      [&](const EarlyGradient& early) {
        block.mu.AssertHeld();
        if (early.has_values) {
          AddToStepSumLocked(block, early.dtype, ByteSegments{early.bytes});
        }
      },
      [&](EarlyGradient early) {
        early_gradients_.Give(std::move(early.bytes));
      });
}

void Shard::AddToStepSumLocked(Block& block, DataType dtype,
                               const ByteSegments& data) {
  if (block.gradient_sum.empty()) {
    // The last step's sum went with its record.
    if (options_.record_steps) block.gradient_sum = SpareStepSum();
    block.gradient_sum.resize(block.location->length);
  }
  // Validated on arrival: dtype supported and length exact, so this cannot
  // fail.
  if (absl::Status s =
          DecodeSegments(dtype, data, absl::MakeSpan(block.gradient_sum),
                         /*accumulate=*/block.sum_started);
      !s.ok()) {
    ReportInternalError(
        absl::StrCat("sync gradient for ", QuoteForStatus(*block.tensor_name),
                     " block ", block.location->block, " step ",
                     block.version.load()),
        s);
  }
  block.sum_started = true;
}

void Shard::SettleEarlyGradientsLocked(Block& block, bool add) {
  auto give_back = [&](EarlyGradient early) {
    early_gradients_.Give(std::move(early.bytes));
  };
  if (add) {
    block.early.AddRest(
        [&](const EarlyGradient& early) {
          block.mu.AssertHeld();
          if (early.has_values) {
            AddToStepSumLocked(block, early.dtype, ByteSegments{early.bytes});
          }
        },
        give_back);
  } else {
    block.early.Reset(give_back);
  }
  block.sum_started = false;
}

Shard::BlockResult Shard::PushAsyncBlock(Block& block,
                                         const WirePushRequest& request,
                                         const BlockPush& push) {
  absl::MutexLock lock(&block.mu);
  int64_t& last = block.last_step[request.worker_id];
  if (request.step <= last) return BlockResult::kDuplicate;
  CountUpdatesLostLocked(block, request.worker_id, request.step);
  last = request.step;
  if (push.nonfinite) {
    nonfinite_skipped_.fetch_add(1);
    return BlockResult::kApplied;
  }
  const int64_t version = block.version.load();
  if (block.state_values) {  // the pushed values are the new ones
    if (absl::Status s = DecodeSegments(push.wire->dtype, push.wire->data,
                                        MutableValues(block),
                                        /*accumulate=*/false);
        !s.ok()) {
      ReportInternalError(
          absl::StrCat("async values of worker ", request.worker_id, " for ",
                       QuoteForStatus(*block.tensor_name)),
          s);
    }
    block.version.store(version + 1);
    return BlockResult::kApplied;
  }
  // A version from the future is possible only after this shard restored an
  // older checkpoint: the gradient is then as fresh as it can be.
  const int64_t staleness = std::max<int64_t>(0, version - push.wire->version);
  staleness_sum_.fetch_add(staleness);
  AtomicMax(staleness_max_, staleness);
  async_applies_.fetch_add(1);
  const absl::Span<float> values = MutableValues(block);
  const StepHyper hyper = HyperOfPush(block, request);
  // Decoded a piece at a time into the update: the gradient is read once
  // from the received bytes and never written out whole.
  if (absl::Status s = DecodeSegmentsInPieces(
          push.wire->dtype, push.wire->data, block.location->length,
          [&](int64_t offset, absl::Span<const float> piece) {
            block.mu.AssertHeld();  // held by the caller of this callback
            block.optimizer->UpdateRange(version + 1, hyper, values, offset,
                                         piece, absl::MakeSpan(block.state),
                                         /*grad_scale=*/1.0f);
          });
      !s.ok()) {
    ReportInternalError(
        absl::StrCat("async gradient of worker ", request.worker_id, " for ",
                     QuoteForStatus(*block.tensor_name), " block ",
                     block.location->block, " step ", request.step),
        s);
  }
  block.version.store(version + 1);
  return BlockResult::kApplied;
}

bool Shard::CompleteIfReadyLocked(Block& block, const Membership& membership) {
  // A clipped step already in waits for its coefficient (ApplyClip).
  if (block.awaiting_clip.load()) return false;
  // A replica that follows applies the leader's record of the step
  // instead: it may not hold every gradient (ApplyStepRecords).
  if (!LeadsSteps()) return false;
  const int64_t version = block.version.load();
  if (!QuorumMet(version, block.contributors, block.last_contributed,
                 membership, options_.replicas_to_aggregate)) {
    return false;
  }
  // Resets sum_started for the next step; the sum stays for the update.
  SettleEarlyGradientsLocked(block, /*add=*/true);
  if (!block.state_values &&
      block.clip_worker != std::numeric_limits<int>::max()) {
    // Clipped: the step's mean is held, its share of the norm computed,
    // until a worker brings the coefficient of the job's norm. Its pulls
    // wait as for any step not applied; ClipNorm's waiters may go on.
    double sum_of_squares = 0;
    if (block.finite_contributors > 0) {
      const float scale = 1.0f / static_cast<float>(block.finite_contributors);
      for (float g : block.gradient_sum) {
        const double mean = g * scale;
        sum_of_squares += mean * mean;
      }
    }
    block.clip_sum_of_squares = sum_of_squares;
    block.awaiting_clip.store(true);
    return true;
  }
  ApplyStepLocked(block, 1.0f);
  return true;
}

void Shard::ApplyStepLocked(Block& block, float coefficient) {
  const int64_t version = block.version.load();
  if (block.finite_contributors > 0 && block.state_values) {
    // The mean of the pushed values is the tensor's new value.
    const float scale = 1.0f / static_cast<float>(block.finite_contributors);
    absl::Span<float> values = MutableValues(block);
    for (size_t i = 0; i < values.size(); ++i) {
      values[i] = block.gradient_sum[i] * scale;
    }
  } else if (block.finite_contributors > 0) {
    // The mean of the finite gradients (times a clip's coefficient), at the
    // step's rate.
    const StepHyper hyper =
        block.step_hyper_worker != std::numeric_limits<int>::max()
            ? block.step_hyper
            : block.optimizer->OwnHyper();
    const float scale =
        coefficient == 1.0f
            ? 1.0f / static_cast<float>(block.finite_contributors)
            : coefficient / static_cast<float>(block.finite_contributors);
    block.optimizer->UpdateRange(version + 1, hyper, MutableValues(block), 0,
                                 block.gradient_sum,
                                 absl::MakeSpan(block.state), scale);
  }
  if (block.finite_contributors == 0 && block.lost_contributors > 0) {
    // Every gradient of this step died with the shard's previous life: the
    // update is lost, as surely as a step a restore skipped.
    ++block.updates_lost;
    updates_lost_.fetch_add(1);
    AtomicMax(steps_lost_, block.updates_lost);
  }
  if (options_.record_steps && LeadsSteps()) {
    RecordStepLocked(block, coefficient);
  }
  block.step_hyper_worker = std::numeric_limits<int>::max();
  block.clip_worker = std::numeric_limits<int>::max();
  block.awaiting_clip.store(false);
  OnStepCompleted(version, block.contributors);
  block.contributors = 0;
  block.finite_contributors = 0;
  block.lost_contributors = 0;
  block.version.store(version + 1);
}

void Shard::CompleteReadyBlocks() {
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr || options_.mode != ConsistencyMode::kSync) return;
  const std::shared_ptr<const Membership> members = membership();
  bool completed = false;
  for (const auto& block : model->blocks) {
    absl::MutexLock lock(&block->mu);
    completed |= CompleteIfReadyLocked(*block, *members);
  }
  for (const auto& state : model->sparse) {
    if (state->mode != ConsistencyMode::kSync) continue;
    absl::MutexLock lock(&state->mu);
    completed |= CompleteSparseIfReadyLocked(*state, *members);
  }
  if (completed) ReleaseReadyWaiters();
}

// ---------------------------------------------------------------------------
// Gradients and updates a restored shard lost (dense blocks, and for
// CreditLostGradientsLocked sparse tables too).

void Shard::CountUpdatesLostLocked(Block& block, int worker, int64_t step) {
  if (block.unseen_since_restore.empty() ||
      !block.unseen_since_restore[worker]) {
    return;
  }
  block.unseen_since_restore[worker] = false;
  // A worker pushes every step to every block, so its steps between the
  // checkpoint's last one and this one were applied by the previous life
  // and lost with it.
  const int64_t lost = step - 1 - block.last_step[worker];
  if (lost <= 0) return;
  block.updates_lost += lost;
  updates_lost_.fetch_add(lost);
  AtomicMax(steps_lost_, block.updates_lost);
}

bool Shard::CreditLostGradientsLocked(const Model& model, int worker,
                                      int64_t step, bool skipped) {
  if (worker < 0 || step < 1 || (!skipped && step - 1 > recovery_horizon_) ||
      (*membership_)[worker] > step - 1) {
    return false;
  }
  bool completed = false;
  for (const auto& block : model.blocks) {
    absl::MutexLock block_lock(&block->mu);
    if (block->version.load() != step - 1 ||
        block->last_contributed[worker] == step - 1) {
      continue;
    }
    block->last_contributed[worker] = step - 1;
    // A skipped step is one this worker gave nothing to, as if its lease
    // had run out for that step: the step is short, nothing is lost.
    if (!skipped) {
      ++block->contributors;
      ++block->lost_contributors;
      gradients_lost_.fetch_add(1);
    }
    completed |= CompleteIfReadyLocked(*block, *membership_);
  }
  for (const auto& table : model.sparse) {
    if (table->mode != ConsistencyMode::kSync) continue;
    absl::MutexLock table_lock(&table->mu);
    if (table->version.load() != step - 1 ||
        table->last_contributed[worker] == step - 1) {
      continue;
    }
    table->last_contributed[worker] = step - 1;
    if (!skipped) {
      ++table->contributors;
      gradients_lost_.fetch_add(1);
    }
    completed |= CompleteSparseIfReadyLocked(*table, *membership_);
  }
  return completed;
}

}  // namespace pstrain
