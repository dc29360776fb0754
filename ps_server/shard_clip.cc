// Clipped sync steps (PushRequest.clip_max_norm: torch's clip_grad_norm_ of
// the job's mean gradient). The norm spans every shard, so a shard cannot
// apply such a step alone: each block holds its step's mean once the
// quorum is in (CompleteIfReadyLocked, shard_dense.cc) with its share of the
// squared norm; a worker gathers the shares of every shard (ClipNorm), and
// sends them all the coefficient (ApplyClip). Any worker may do it; the
// first ApplyClip of a step applies it. One extra round trip per step, only
// for clipped steps.
#include <cmath>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ps_server/shard.h"
#include "ps_server/shard_internal.h"

namespace pstrain {

namespace {

absl::Status NeedsSync(ConsistencyMode mode, absl::string_view call) {
  if (mode == ConsistencyMode::kSync) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(call, " is for clipped sync steps; this server runs ",
                   ConsistencyModeName(mode),
                   " (a worker clips its own gradient before it pushes)"));
}

}  // namespace

ClipNormResponse Shard::ClipAnswer(const Model& model, int64_t step,
                                   const std::vector<int>& locals) const {
  ClipNormResponse response;
  double sum_of_squares = 0;
  int max_norm_worker = std::numeric_limits<int>::max();
  for (int local : locals) {
    const Block& block = *model.blocks[local];
    absl::MutexLock lock(&block.mu);
    if (block.version.load() > step || !block.awaiting_clip.load()) {
      // A worker that did not gather the norm still learns it (a block
      // already past a later clipped step has none of this one's).
      response.set_applied(true);
      if (block.clip_applied_step == step) {
        response.set_applied_norm(block.clip_applied_norm);
      }
      continue;
    }
    sum_of_squares += block.clip_sum_of_squares;
    if (block.clip_worker < max_norm_worker) {
      max_norm_worker = block.clip_worker;
      response.set_max_norm(block.clip_max_norm);
    }
  }
  if (response.applied()) return ClipNormResponse(response);
  response.set_sum_of_squares(sum_of_squares);
  return response;
}

void Shard::ClipNorm(const ClipNormRequest& request, absl::Time deadline,
                     ClipNormDone done) {
  if (absl::Status s = NeedsSync(options_.mode, "ClipNorm"); !s.ok()) {
    return done(Reject(s));
  }
  absl::StatusOr<const Model*> model =
      ValidateCommon(request.protocol_version(), request.worker_id(),
                     request.step(), /*allow_observer=*/false);
  if (!model.ok()) return done(Reject(model.status()));
  const Model* m = *model;
  auto waiter = std::make_unique<Waiter>();
  waiter->clip = true;
  waiter->step = request.step();
  for (size_t i = 0; i < m->blocks.size(); ++i) {
    if (!m->blocks[i]->state_values) {
      waiter->locals.push_back(static_cast<int>(i));
    }
  }
  const int64_t step = request.step();
  const std::vector<int> locals = waiter->locals;
  {
    absl::ReleasableMutexLock lock(&mu_);
    TouchLocked(request.worker_id());
    if (!WaiterReadyLocked(*waiter)) {
      if (shutting_down_) {
        lock.Release();
        return done(absl::UnavailableError("the server is shutting down"));
      }
      waiter->deadline =
          std::min(deadline, absl::Now() + options_.max_pull_wait);
      waiter->answer = [this, m, step, locals,
                        done = std::move(done)](absl::Status status) {
        if (!status.ok()) return done(std::move(status));
        done(ClipAnswer(*m, step, locals));
      };
      waiters_.push_back(std::move(waiter));
      return;
    }
  }
  done(ClipAnswer(*m, step, locals));
}

absl::StatusOr<ApplyClipResponse> Shard::ApplyClip(
    const ApplyClipRequest& request) {
  if (absl::Status s = NeedsSync(options_.mode, "ApplyClip"); !s.ok()) {
    return Reject(s);
  }
  absl::StatusOr<const Model*> model =
      ValidateCommon(request.protocol_version(), request.worker_id(),
                     request.step(), /*allow_observer=*/false);
  if (!model.ok()) return Reject(model.status());
  const double coefficient = request.coefficient();
  if (!(coefficient > 0 && coefficient <= 1)) {
    return Reject(absl::InvalidArgumentError(absl::StrCat(
        "a clip coefficient is in (0, 1] (max_norm / (norm + 1e-6), at most "
        "1), got ",
        coefficient)));
  }
  // What every worker's ps.last_grad_norm reads (ClipNormResponse
  // .applied_norm); 0 from a client that does not send it.
  if (!(std::isfinite(request.norm()) && request.norm() >= 0)) {
    return Reject(absl::InvalidArgumentError(absl::StrCat(
        "a clipped step's norm is finite and >= 0, got ", request.norm())));
  }
  {
    absl::MutexLock lock(&mu_);
    TouchLocked(request.worker_id());
  }
  ApplyClipResponse response;
  for (const auto& block : (*model)->blocks) {
    absl::MutexLock lock(&block->mu);
    if (block->version.load() != request.step() ||
        !block->awaiting_clip.load()) {
      continue;
    }
    // Before the apply: the step's record carries the norm.
    block->clip_applied_step = request.step();
    block->clip_applied_norm = request.norm();
    ApplyStepLocked(*block, static_cast<float>(coefficient));
    response.set_blocks_applied(response.blocks_applied() + 1);
  }
  if (response.blocks_applied() > 0) ReleaseReadyWaiters();
  return response;
}

std::optional<int64_t> Shard::PendingClipStep() const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) return std::nullopt;
  for (const auto& block : model->blocks) {
    if (block->awaiting_clip.load()) return block->version.load();
  }
  return std::nullopt;
}

}  // namespace pstrain
