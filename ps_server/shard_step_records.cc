// Step records (ShardOptions::record_steps): a replicated sync shard's
// primary records each dense step it applies, and its backups apply the
// record instead of summing every worker's push themselves
// (ps_server/replication.h, "Sync steps").
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "ps_server/shard.h"
#include "ps_server/shard_internal.h"

namespace pstrain {

void Shard::RecordStepLocked(Block& block, float coefficient) {
  const int64_t version = block.version.load();
  StepRecord record;
  record.set_local_block(block.local);
  record.set_step(version);
  record.set_contributors(block.contributors);
  record.set_finite_contributors(block.finite_contributors);
  record.set_lost_contributors(block.lost_contributors);
  for (size_t w = 0; w < block.last_contributed.size(); ++w) {
    if (block.last_contributed[w] == version) {
      record.add_workers(static_cast<int>(w));
    }
  }
  if (block.step_hyper_worker != std::numeric_limits<int>::max()) {
    record.set_has_hyper(true);
    record.set_lr(block.step_hyper.lr);
    if (block.step_hyper.momentum.has_value()) {
      record.set_has_momentum(true);
      record.set_momentum(*block.step_hyper.momentum);
    }
  }
  record.set_coefficient(coefficient);
  if (block.awaiting_clip.load() && block.clip_applied_step == version) {
    record.set_clipped(true);
    record.set_clip_norm(block.clip_applied_norm);
  }
  std::vector<float> sum;
  if (block.finite_contributors > 0) {
    record.set_has_sum(true);
    // The update is applied: the sum is not read again this step, and the
    // next step's first gradient takes new memory (SpareStepSum).
    sum = std::move(block.gradient_sum);
    block.gradient_sum.clear();
  }
  AddStepRecord(std::move(record), std::move(sum));
}

void Shard::AddStepRecord(StepRecord record, std::vector<float> sum) {
  absl::MutexLock lock(&step_records_mu_);
  ++unconfirmed_steps_[record.step()];
  step_records_.push_back(QueuedStepRecord{
      std::move(record), std::move(sum),
      step_records_made_.load(std::memory_order_relaxed), absl::Now()});
  step_records_made_.fetch_add(1, std::memory_order_acq_rel);
}

std::vector<float> Shard::SpareStepSum() {
  absl::MutexLock lock(&step_records_mu_);
  if (spare_step_sums_.empty()) return {};
  std::vector<float> sum = std::move(spare_step_sums_.back());
  spare_step_sums_.pop_back();
  return sum;
}

Shard::TakenStepRecords Shard::TakeStepRecords(int64_t max_sum_bytes,
                                               int64_t before_step) {
  TakenStepRecords taken;
  absl::MutexLock lock(&step_records_mu_);
  // Records passed over (their block has one on its way, or in this take:
  // two steps of a block in one take could apply out of order with a
  // message still out; or one of `before_step` on, and every later one of
  // its block) go back in front, in order.
  std::vector<QueuedStepRecord> passed;
  absl::flat_hash_set<int> held_blocks;
  int64_t bytes = 0;
  while (!step_records_.empty()) {
    QueuedStepRecord& front = step_records_.front();
    const int block = front.record.local_block();
    if (blocks_on_way_.contains(block) || held_blocks.contains(block) ||
        front.record.step() >= before_step) {
      held_blocks.insert(block);
      passed.push_back(std::move(front));
      step_records_.pop_front();
      continue;
    }
    const int64_t size = static_cast<int64_t>(front.sum.size() * sizeof(float));
    if (taken.records.records_size() > 0 && bytes + size > max_sum_bytes) {
      break;
    }
    bytes += size;
    blocks_on_way_.insert(block);
    step_records_on_way_.insert(front.place);
    taken.places.push_back(front.place);
    taken.made.push_back(front.made);
    *taken.records.add_records() = std::move(front.record);
    taken.sums.push_back(std::move(front.sum));
    step_records_.pop_front();
  }
  for (auto it = passed.rbegin(); it != passed.rend(); ++it) {
    step_records_.push_front(std::move(*it));
  }
  return taken;
}

void Shard::ReturnStepRecords(TakenStepRecords taken) {
  absl::MutexLock lock(&step_records_mu_);
  for (int i = taken.records.records_size() - 1; i >= 0; --i) {
    QueuedStepRecord back{std::move(*taken.records.mutable_records(i)),
                          std::move(taken.sums[i]), taken.places[i],
                          taken.made[i]};
    blocks_on_way_.erase(back.record.local_block());
    step_records_on_way_.erase(back.place);
    // Another take may have been confirmed or returned meanwhile: the
    // queue stays in the order the records were made.
    auto at =
        std::lower_bound(step_records_.begin(), step_records_.end(), back.place,
                         [](const QueuedStepRecord& q, int64_t place) {
                           return q.place < place;
                         });
    step_records_.insert(at, std::move(back));
  }
}

void Shard::ConfirmStepRecords(TakenStepRecords taken) {
  absl::MutexLock lock(&step_records_mu_);
  for (int i = 0; i < taken.records.records_size(); ++i) {
    blocks_on_way_.erase(taken.records.records(i).local_block());
    step_records_on_way_.erase(taken.places[i]);
    auto step = unconfirmed_steps_.find(taken.records.records(i).step());
    if (step != unconfirmed_steps_.end() && --step->second == 0) {
      unconfirmed_steps_.erase(step);
    }
  }
  for (std::vector<float>& sum : taken.sums) {
    if (sum.capacity() > 0) spare_step_sums_.push_back(std::move(sum));
  }
}

int64_t Shard::StepRecordsConfirmed() const {
  absl::MutexLock lock(&step_records_mu_);
  int64_t confirmed = step_records_made_.load(std::memory_order_acquire);
  if (!step_records_.empty()) {
    confirmed = std::min(confirmed, step_records_.front().place);
  }
  if (!step_records_on_way_.empty()) {
    confirmed = std::min(confirmed, *step_records_on_way_.begin());
  }
  return confirmed;
}

int64_t Shard::OldestUnconfirmedStep() const {
  absl::MutexLock lock(&step_records_mu_);
  return unconfirmed_steps_.empty() ? std::numeric_limits<int64_t>::max()
                                    : unconfirmed_steps_.begin()->first;
}

bool Shard::HasStepRecords() const {
  absl::MutexLock lock(&step_records_mu_);
  return std::any_of(
      step_records_.begin(), step_records_.end(),
      [this](const QueuedStepRecord& q)
          ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_records_mu_) {
            return !blocks_on_way_.contains(q.record.local_block());
          });
}

absl::Status Shard::ApplyStepRecords(const StepRecords& records,
                                     absl::string_view sums) {
  if (!options_.record_steps) {
    return absl::FailedPreconditionError(
        "step records for a shard that takes none (only a replicated sync "
        "shard does)");
  }
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) {
    return absl::FailedPreconditionError(
        "step records for a shard that holds no model");
  }
  // Everything is checked before anything is applied: each record must
  // fit the model, and follow the block's step or the record before it.
  absl::flat_hash_map<int, int64_t> next_step;
  int64_t sum_bytes = 0;
  for (const StepRecord& r : records.records()) {
    if (r.local_block() < 0 ||
        r.local_block() >= static_cast<int>(model->blocks.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("step record of block ", r.local_block(),
                       ": this shard has ", model->blocks.size()));
    }
    const Block& block = *model->blocks[r.local_block()];
    const std::string where = absl::StrCat("step record of block ",
                                           r.local_block(), " step ", r.step());
    if (r.contributors() < 0 || r.finite_contributors() < 0 ||
        r.lost_contributors() < 0 ||
        r.finite_contributors() > r.contributors() ||
        r.has_sum() != (r.finite_contributors() > 0) ||
        !(r.coefficient() >= 0 && r.coefficient() <= 1) ||
        (r.clipped() &&
         !(std::isfinite(r.clip_norm()) && r.clip_norm() >= 0)) ||
        (r.skip_to() != 0 && (r.skip_to() <= r.step() || r.has_sum()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": inconsistent counts, coefficient or clip norm"));
    }
    for (int w : r.workers()) {
      if (w < 0 || w >= options_.max_workers) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": worker ", w, " out of range"));
      }
    }
    if ((r.has_hyper() && !(std::isfinite(r.lr()) && r.lr() >= 0)) ||
        (r.has_momentum() && !(r.momentum() >= 0 && r.momentum() < 1))) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": rate ", r.lr(), " or momentum ", r.momentum(),
                       " out of range"));
    }
    auto [it, first] = next_step.try_emplace(r.local_block(), 0);
    if (first) it->second = block.version.load();
    if (r.step() > it->second) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": this replica's block is at step ", it->second,
                       "; a record before it is missing"));
    }
    if (r.step() == it->second) {
      it->second = r.skip_to() != 0 ? r.skip_to() : it->second + 1;
    }
    if (r.has_sum()) {
      sum_bytes += block.location->length * static_cast<int64_t>(sizeof(float));
    }
  }
  if (sum_bytes != static_cast<int64_t>(sums.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("step records: ", sums.size(),
                     " bytes of sums, the records need ", sum_bytes));
  }

  bool applied = false;
  int64_t skipped_to = 0, steps_skipped = 0;
  absl::flat_hash_set<int> workers;
  const char* next_sum = sums.data();
  for (const StepRecord& r : records.records()) {
    Block& block = *model->blocks[r.local_block()];
    const int64_t length = block.location->length;
    const char* sum = next_sum;
    if (r.has_sum()) next_sum += length * sizeof(float);
    absl::MutexLock lock(&block.mu);
    // A repeat: the state a catch-up brought, or a record sent again after
    // its answer was lost.
    if (r.step() != block.version.load()) continue;
    if (r.skip_to() != 0) {
      SkipBlockLocked(block, r.skip_to());
      skipped_to = std::max(skipped_to, r.skip_to());
      steps_skipped = std::max(steps_skipped, r.skip_to() - r.step());
      applied = true;
      continue;
    }
    // What this replica summed of the step (pushes forwarded one by one)
    // gives way to what the leader applied.
    SettleEarlyGradientsLocked(block, /*add=*/false);
    if (r.has_sum()) {
      block.gradient_sum.resize(length);
      std::memcpy(block.gradient_sum.data(), sum, length * sizeof(float));
    }
    block.contributors = r.contributors();
    block.finite_contributors = r.finite_contributors();
    block.lost_contributors = r.lost_contributors();
    for (int w : r.workers()) {
      block.last_contributed[w] = r.step();
      workers.insert(w);
    }
    if (r.has_hyper()) {
      block.step_hyper.lr = r.lr();
      block.step_hyper.momentum =
          r.has_momentum() ? std::optional<float>(r.momentum()) : std::nullopt;
      block.step_hyper_worker = 0;
    } else {
      block.step_hyper_worker = std::numeric_limits<int>::max();
    }
    if (r.clipped()) {
      block.clip_applied_step = r.step();
      block.clip_applied_norm = r.clip_norm();
    }
    ApplyStepLocked(block, r.coefficient());
    applied = true;
  }
  bool started = false;
  {
    absl::MutexLock lock(&mu_);
    if (skipped_to > 0) CountSkipLocked(skipped_to, steps_skipped);
    // The leader's state is this shard's now: nothing of it is lost (a
    // fresh shard would take a step that workers' heartbeats show).
    fresh_ = false;
    // A worker the leader counted in a step was heard from: its lease here
    // is as fresh (its pushes that came with pulls reached the leader only).
    for (int w : workers) started |= TouchLocked(w);
  }
  if (started) AnswerStartWaiters();
  if (applied) ReleaseReadyWaiters();
  return absl::OkStatus();
}

}  // namespace pstrain
