// Who is in the job: leases, heartbeats, joining and leaving, and the job's
// start (sync and ssp steps wait for every expected worker). Part of Shard
// (shard.h lists its files).
#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status_text.h"
#include "glog/logging.h"
#include "ps_server/shard.h"
#include "ps_server/shard_internal.h"

namespace pstrain {
namespace {

// While a job waits for its workers: how often the server says for whom,
// and the longest an AwaitJobStart call is held.
constexpr absl::Duration kStartLogInterval = absl::Seconds(5);
constexpr absl::Duration kMaxStartWait = absl::Seconds(10);

}  // namespace

using shard_internal::kNever;

// ---------------------------------------------------------------------------
// Membership.

int64_t Shard::PredecessorsNextStepLocked(const Model& model, int worker) {
  const int64_t joined_at = workers_[worker].joined_at;
  int64_t lowest = kNever;
  int64_t highest = -1;
  bool behind = false;
  // A member's next step on an object at version v is v (it has not pushed
  // v yet) or v + 1 (it has, and the step waits for others).
  auto note = [&](int64_t last_contributed, int64_t version) {
    const int64_t next = std::max(last_contributed + 1, joined_at);
    lowest = std::min(lowest, next);
    highest = std::max(highest, next);
    behind |= next < version;
  };
  for (const auto& block : model.blocks) {
    absl::MutexLock lock(&block->mu);
    note(block->last_contributed[worker], block->version.load());
  }
  for (const auto& table : model.sparse) {
    if (table->mode != ConsistencyMode::kSync) continue;
    absl::MutexLock lock(&table->mu);
    note(table->last_contributed[worker], table->version.load());
  }
  if (highest < 0 || behind || lowest != highest) return -1;
  return lowest;
}

void Shard::PublishMembershipLocked() {
  auto membership = std::make_shared<Membership>(workers_.size(), kNever);
  for (size_t w = 0; w < workers_.size(); ++w) {
    if (workers_[w].member) (*membership)[w] = workers_[w].joined_at;
  }
  membership_ = std::move(membership);
}

std::shared_ptr<const Shard::Membership> Shard::membership() const {
  absl::MutexLock lock(&mu_);
  return membership_;
}

absl::Time Shard::StoppingLeaseStartLocked(absl::Duration hold) const {
  return LeaseNow() - options_.worker_lease +
         std::min(hold, options_.worker_lease);
}

bool Shard::TouchLocked(int worker) {
  if (leases_wait_for_a_worker_) {
    leases_wait_for_a_worker_ = false;
    // A member that left stopping gets its hold again, not a whole lease:
    // a new primary must not wait a lease for a worker long gone.
    for (WorkerState& other : workers_) {
      other.last_seen = other.stopping
                            ? StoppingLeaseStartLocked(other.StoppingHold())
                            : LeaseNow();
    }
  }
  WorkerState& state = workers_[worker];
  // A request of a worker that left stopping, still on its way, neither
  // brings it back nor lengthens its hold: only registering again does
  // (ResumeStoppedLocked).
  if (state.stopping) return false;
  state.last_seen = LeaseNow();
  // Back after its lease expired (or a new id): it rejoins at its next pull.
  if (!state.member) state.pending = true;
  if (state.seen) return false;
  state.seen = true;
  if (started_ || worker >= options_.num_workers) return false;
  if (++expected_seen_ < options_.num_workers) return false;
  started_ = true;
  started_at_ = absl::Now();
  LOG(INFO) << "all " << options_.num_workers
            << " workers have registered: the job starts after "
            << absl::StrFormat("%.3f s", absl::ToDoubleSeconds(started_at_ -
                                                               waiting_since_));
  return true;
}

void Shard::ResumeStoppedLocked(int worker) {
  if (!workers_[worker].stopping) return;
  // The job resumed with its servers kept: the others that stopped with it
  // get a whole lease from now to come back and take their places (a
  // restarted worker resumes in place), rather than lapsing at once
  // because this one trains again.
  for (WorkerState& other : workers_) {
    if (other.stopping) other.last_seen = LeaseNow();
  }
  workers_[worker].stopping = false;
}

void Shard::JoinIfPendingLocked(int worker, int64_t step) {
  WorkerState& state = workers_[worker];
  if (!state.pending) return;
  state.pending = false;
  state.member = true;
  state.joined_at = step;
  state.next_step = std::max(state.next_step, step);
  PublishMembershipLocked();
}

int64_t Shard::MinMemberClockLocked() const {
  int64_t min_clock = kNever;
  for (const WorkerState& state : workers_) {
    if (state.member) min_clock = std::min(min_clock, state.next_step);
  }
  return min_clock;
}

bool Shard::ExpireLeases() {
  // A backup does not drop workers: what it hears of them is what its
  // primary forwards, so a backup cut off from its primary saw every lease
  // run out, took over with no member, and ran steps ahead without workers
  // that were only a moment late in coming over (a mixed read in the netns
  // lab's backup_isolated trial). Once it took over, they start again when
  // the first worker reaches it: the workers reach it only once they
  // found their old primary gone, and a backup that took over while it was
  // itself cut off would otherwise count that time against them too.
  if (!LeadsSteps()) return false;
  absl::MutexLock lock(&mu_);
  if (leases_wait_for_a_worker_) return false;
  const absl::Time expired_before = LeaseNow() - options_.worker_lease;
  // Members that stopped (LeaveRequest.stopping) are held while nobody
  // trains: the job is stopping, and its step under way waits for a resume.
  bool any_training = false;
  for (const WorkerState& state : workers_) {
    any_training |= state.member && !state.stopping;
  }
  bool dropped = false;
  for (WorkerState& state : workers_) {
    // Before the job starts, a worker never heard from is missing, not
    // lapsed: the job waits for it (CheckJobStart bounds the wait).
    if (!started_ && !state.seen) continue;
    if (state.stopping && !any_training) continue;
    if ((state.member || state.pending) && state.last_seen < expired_before) {
      dropped |= state.member;
      state.member = false;
      state.stopping = false;
      state.pending = false;
      state.joined_at = kNever;
    }
  }
  if (dropped) PublishMembershipLocked();
  return dropped;
}

void Shard::CompleteStepsNowLeading() {
  {
    absl::MutexLock lock(&mu_);
    leases_wait_for_a_worker_ = true;
  }
  CompleteReadyBlocks();
}

absl::Status Shard::Heartbeat(const HeartbeatRequest& request) {
  if (request.worker_id() < 0 || request.worker_id() >= options_.max_workers) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("worker_id must be in [0, ", options_.max_workers,
                     "), got ", request.worker_id())));
  }
  bool started = false;
  bool moved = false;
  {
    absl::MutexLock lock(&mu_);
    started = TouchLocked(request.worker_id());
    const Model* model = model_.load();
    // A backup takes the step's record from its primary instead.
    if (options_.mode == ConsistencyMode::kSync && request.skip_to_step() > 0 &&
        model != nullptr && !fresh_ && !recovering_ && LeadsSteps()) {
      moved |= CreditLostGradientsLocked(*model, request.worker_id(),
                                         request.skip_to_step(),
                                         /*skipped=*/true);
    }
    // With nothing restored, every block is at step 0: a worker that has
    // pulled past it is ahead, and may be held where its next request to
    // this shard waits on the worker this shard refuses.
    if (options_.mode == ConsistencyMode::kSync && request.step() > 0 &&
        model != nullptr) {
      if (fresh_) {
        if (ConfirmLostStateLocked(request.worker_id(), request.step())) {
          moved |= FastForwardLocked(*model, request.step());
        }
      } else if (!recovering_) {
        // A restored shard that took the job's step (from a checkpoint, or
        // by a fast-forward) waits in it for every member. One that pulled
        // past it got that step from this shard's previous life, which had
        // its gradient: lost, as a push of that step would say. The
        // worker may never send that push: it can be held in a live
        // shard's next step, which waits on a worker held here.
        moved |= CreditLostGradientsLocked(*model, request.worker_id(),
                                           request.step(), /*skipped=*/false);
      }
    }
  }
  if (started) AnswerStartWaiters();
  if (moved) ReleaseReadyWaiters();
  return absl::OkStatus();
}

absl::Status Shard::Leave(const LeaveRequest& request) {
  if (request.worker_id() < 0 || request.worker_id() >= options_.max_workers) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("worker_id must be in [0, ", options_.max_workers,
                     "), got ", request.worker_id())));
  }
  if (!shard_internal::ValidStoppingGrace(request.stopping_grace_s())) {
    return Reject(absl::InvalidArgumentError(absl::StrCat(
        "stopping_grace_s must be in [0, ", shard_internal::kMaxStoppingGraceS,
        "] seconds, got ", request.stopping_grace_s())));
  }
  {
    absl::MutexLock lock(&mu_);
    WorkerState& state = workers_[request.worker_id()];
    if (request.stopping() && options_.mode == ConsistencyMode::kSync &&
        started_ && state.member) {
      // Held, not dropped (LeaveRequest.stopping): ExpireLeases drops it
      // once the hold is over and some other member still trains.
      state.stopping = true;
      state.stopping_grace = absl::Seconds(request.stopping_grace_s());
      state.last_seen = StoppingLeaseStartLocked(state.StoppingHold());
      return absl::OkStatus();
    }
    state.member = false;
    state.stopping = false;
    state.pending = false;
    state.joined_at = kNever;
    // One that leaves before the job starts is waited for again, as if it
    // had never come (a member from the first step, as Shard's constructor
    // makes it): the job is for every expected worker, and one that comes
    // back runs every step.
    if (!started_ && state.seen && request.worker_id() < options_.num_workers) {
      state.seen = false;
      --expected_seen_;
      state.member = true;
      state.joined_at = 0;
    }
    PublishMembershipLocked();
  }
  CompleteReadyBlocks();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// The job's start: sync and ssp steps wait for every expected worker.

std::vector<int> Shard::MissingWorkersLocked() const {
  std::vector<int> missing;
  for (int w = 0; w < options_.num_workers; ++w) {
    if (!workers_[w].seen) missing.push_back(w);
  }
  return missing;
}

JobStart Shard::JobStartLocked() const {
  JobStart start;
  start.set_started(started_);
  for (int w : MissingWorkersLocked()) start.add_missing_workers(w);
  start.set_num_workers(options_.num_workers);
  start.set_min_workers(options_.min_workers);
  start.set_waited_s(absl::ToDoubleSeconds(
      (started_ ? started_at_ : absl::Now()) - waiting_since_));
  start.set_startup_timeout_s(absl::ToDoubleSeconds(options_.startup_timeout));
  const int64_t first_step_ns = first_step_at_ns_.load();
  if (started_ && first_step_ns != 0) {
    start.set_first_step_after_start_s(
        std::max(0.0, absl::ToDoubleSeconds(absl::FromUnixNanos(first_step_ns) -
                                            started_at_)));
  }
  return start;
}

void Shard::AwaitJobStart(const AwaitJobStartRequest& request,
                          absl::Time deadline, JobStartDone done) {
  const int worker = request.worker_id();
  if (worker < -1 || worker >= options_.max_workers) {
    return done(Reject(absl::InvalidArgumentError(
        absl::StrCat("worker_id must be in [0, ", options_.max_workers,
                     ") or -1 for an observer, got ", worker))));
  }
  if (job_failed_.load(std::memory_order_acquire)) return done(job_failure_);
  JobStart answer;
  bool started = false;
  {
    absl::MutexLock lock(&mu_);
    if (worker >= 0) started = TouchLocked(worker);
    const absl::Time now = absl::Now();
    deadline = std::min(
        {deadline,
         now + std::min(absl::Milliseconds(request.wait_ms()), kMaxStartWait)});
    if (!started_ && deadline > now && !shutting_down_) {
      start_waiters_.push_back(StartWaiter{deadline, std::move(done)});
      return;
    }
    answer = JobStartLocked();
  }
  if (started) AnswerStartWaiters();
  done(std::move(answer));
}

void Shard::AnswerStartWaiters() {
  std::vector<StartWaiter> due;
  JobStart answer;
  {
    absl::MutexLock lock(&mu_);
    if (start_waiters_.empty()) return;
    if (started_) {
      due.swap(start_waiters_);
    } else {
      const absl::Time now = absl::Now();
      auto split = std::stable_partition(
          start_waiters_.begin(), start_waiters_.end(),
          [now](const StartWaiter& w) { return w.deadline > now; });
      std::move(split, start_waiters_.end(), std::back_inserter(due));
      start_waiters_.erase(split, start_waiters_.end());
    }
    if (due.empty()) return;
    answer = JobStartLocked();
  }
  for (StartWaiter& w : due) w.done(answer);
}

bool Shard::CheckJobStart() {
  absl::Status failure;
  {
    absl::MutexLock lock(&mu_);
    if (started_ || job_failed_.load()) return false;
    const absl::Time now = absl::Now();
    const std::vector<int> missing = MissingWorkersLocked();
    const int present = options_.num_workers - static_cast<int>(missing.size());
    const absl::Duration waited = now - waiting_since_;
    const std::string timeout_flag =
        absl::StrCat("--startup_timeout_s=",
                     absl::ToDoubleSeconds(options_.startup_timeout));
    if (waited < options_.startup_timeout) {
      if (now - last_wait_log_ >= kStartLogInterval) {
        last_wait_log_ = now;
        LOG(INFO) << "waiting for workers " << FormatIdList(missing) << " ("
                  << missing.size() << " of " << options_.num_workers
                  << " missing), " << absl::ToInt64Seconds(waited) << " s of "
                  << timeout_flag;
      }
      return false;
    }
    if (present < options_.min_workers) {
      failure = absl::FailedPreconditionError(absl::StrCat(
          "the job did not start: workers ", FormatIdList(missing),
          " did not register (or left before the start) within ", timeout_flag,
          " (", present, " of ", options_.num_workers, " did; --min_workers=",
          options_.min_workers, "); restart the servers to try again"));
    } else {
      // The job goes on without them; one that comes later joins at the
      // job's step like a restarted worker.
      for (int w : missing) {
        workers_[w].member = false;
        workers_[w].pending = false;
        workers_[w].joined_at = kNever;
      }
      PublishMembershipLocked();
      started_ = true;
      started_at_ = now;
      LOG(WARNING) << timeout_flag << " passed: the job starts with " << present
                   << " of " << options_.num_workers
                   << " workers (--min_workers=" << options_.min_workers
                   << "); workers " << FormatIdList(missing)
                   << " never registered, and every sync step without them "
                      "is counted as short";
      return true;
    }
  }
  FailJob(std::move(failure));
  return false;
}

void Shard::LogFirstStepOnce() {
  if (first_step_logged_ || first_step_at_ns_.load() == 0) return;
  first_step_logged_ = true;
  absl::MutexLock lock(&mu_);
  if (!started_) return;  // a restored shard's first step is not its job's
  LOG(INFO) << "the first step completed "
            << absl::StrFormat(
                   "%.1f ms",
                   absl::ToDoubleMilliseconds(
                       absl::FromUnixNanos(first_step_at_ns_.load()) -
                       started_at_))
            << " after the job started";
}

void Shard::FailJob(absl::Status failure) {
  std::vector<std::unique_ptr<Waiter>> waiting;
  std::vector<StartWaiter> starting;
  {
    absl::MutexLock lock(&mu_);
    if (job_failed_.load()) return;
    job_failure_ = failure;
    job_failed_.store(true, std::memory_order_release);
    waiting.swap(waiters_);
    starting.swap(start_waiters_);
  }
  LOG(ERROR) << failure.message();
  for (std::unique_ptr<Waiter>& w : waiting) w->answer(failure);
  for (StartWaiter& w : starting) w.done(failure);
}

void Shard::OnStepCompleted(int64_t version, int contributors) {
  if (version == 0) {
    int64_t none = 0;
    first_step_at_ns_.compare_exchange_strong(none,
                                              absl::ToUnixNanos(absl::Now()));
  }
  if (contributors >= options_.num_workers) return;
  int64_t last = last_short_step_.load();
  while (version > last) {
    if (last_short_step_.compare_exchange_weak(last, version)) {
      steps_short_.fetch_add(1);
      return;
    }
  }
}

}  // namespace pstrain
