// Sparse tables: where a sparse push is applied (sync: SparsePush sums it
// and CompleteSparseIfReadyLocked applies the step; async/ssp: SparsePush),
// and sparse pulls. Split from shard.cc so that "where is a push applied"
// has one answer per kind; the dense counterpart is shard_dense.cc.
#include <algorithm>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/protocol.h"
#include "common/status_text.h"
#include "common/transport/tensor_codec.h"
#include "ps_server/shard.h"
#include "ps_server/shard_internal.h"

namespace pstrain {

using shard_internal::DescribeMissing;
using shard_internal::QuorumMet;

// ---------------------------------------------------------------------------
// Sparse tables: validation, pull, push, completing a table's sync step, and
// catching a restored table up to a push.

void Shard::WaitForSparsePushStep(const SparsePushRequest& request,
                                  absl::Time until) {
  WaitForSparseTableStep(request.table(), request.step(), until);
  for (const SparsePushRequest& more : request.more()) {
    WaitForSparseTableStep(more.table(), request.step(), until);
  }
}

void Shard::WaitForSparseTableStep(absl::string_view name, int64_t step,
                                   absl::Time until) {
  const Model* model = model_.load();
  if (model == nullptr) return;
  auto it = model->sparse_index.find(name);
  if (it == model->sparse_index.end()) return;  // SparsePush refuses it
  const SparseState& table = *model->sparse[it->second];
  if (table.mode != ConsistencyMode::kSync) return;
  struct Reached {
    const SparseState* table;
    int64_t step;
    const std::atomic<bool>* released;
    static bool Check(Reached* r) {
      return r->table->version.load() >= r->step || r->released->load();
    }
  } reached{&table, step, &holds_released_};
  static_cast<void>(table.mu.LockWhenWithDeadline(
      absl::Condition(&Reached::Check, &reached), until));
  table.mu.Unlock();
}

absl::StatusOr<Shard::SparseState*> Shard::ValidateSparse(
    const Model& model, absl::string_view table, absl::Span<const uint64_t> ids,
    bool unique) const {
  auto it = model.sparse_index.find(table);
  if (it == model.sparse_index.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown sparse table ", QuoteForStatus(table)));
  }
  constexpr size_t kMaxIds = size_t{1} << 24;
  if (ids.size() > kMaxIds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sparse request for ", ids.size(), " ids; at most ", kMaxIds));
  }
  const SparseShards shards(table, options_.num_shards);
  for (uint64_t id : ids) {
    const int owner = shards.Of(id);
    if (owner != options_.shard_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", id, " of sparse table ", QuoteForStatus(table),
          " lives on shard ", owner, ", this is shard ", options_.shard_id));
    }
  }
  if (unique) {
    if (std::optional<uint64_t> id = FindDuplicateId(ids)) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", *id, " of sparse table ", QuoteForStatus(table),
                       " appears twice in one push: sum its gradients first"));
    }
  }
  return model.sparse[it->second].get();
}

bool Shard::CompleteSparseIfReadyLocked(SparseState& state,
                                        const Membership& membership) {
  const int64_t version = state.version.load();
  if (!QuorumMet(version, state.contributors, state.last_contributed,
                 membership, options_.replicas_to_aggregate)) {
    return false;
  }
  SettleEarlySparsePushesLocked(state, /*add=*/true);
  // Rows a worker did not touch count as a zero gradient from it, as in the
  // dense path: the mean is over every contributor. Applied in id order:
  // which rows a bounded table evicts must not depend on the hash map's
  // order, which changes from process to process.
  const int64_t dim = state.spec->dim();
  std::vector<uint64_t> ids;
  ids.reserve(state.gradient_sum.size());
  for (const auto& [id, sum] : state.gradient_sum) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  std::vector<float> grads;
  grads.reserve(ids.size() * dim);
  const float inverse = 1.0f / static_cast<float>(state.contributors);
  for (uint64_t id : ids) {
    for (float g : state.gradient_sum.find(id)->second) {
      grads.push_back(g * inverse);
    }
  }
  state.table->AdvanceStep(version);
  // Ids are unique (map keys) and lengths consistent; only a sum that
  // overflowed to infinity could be refused.
  if (absl::Status s = state.table->Push(ids, grads); !s.ok()) {
    ReportInternalError(absl::StrCat("sync step ", version, " of sparse table ",
                                     QuoteForStatus(state.spec->name())),
                        s);
  }
  OnStepCompleted(version, state.contributors);
  state.gradient_sum.clear();
  state.contributors = 0;
  state.version.store(version + 1);
  return true;
}

absl::StatusOr<SparseChangesResponse> Shard::SparseChanges(
    const SparseChangesRequest& request) {
  if (request.protocol_version() != kProtocolVersion) {
    return Reject(absl::FailedPreconditionError(absl::StrCat(
        "protocol version ", request.protocol_version(),
        " is not supported; this server speaks ", kProtocolVersion)));
  }
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) {
    return absl::FailedPreconditionError("no model is registered yet");
  }
  // Everything checked before anything (the marks) changes.
  if (request.since_size() > static_cast<int>(model->sparse.size()) ||
      request.table_index() < 0 ||
      request.table_index() > request.since_size() || request.max_bytes() < 0) {
    return Reject(absl::InvalidArgumentError(absl::StrCat(
        "changes request of ", request.since_size(), " tables (this model has ",
        model->sparse.size(), "), cursor at table ", request.table_index(),
        ", page of ", request.max_bytes(), " bytes")));
  }
  std::vector<const SparseTable*> tables;
  absl::flat_hash_set<std::string> asked;
  for (const TableChangeMark& since : request.since()) {
    auto it = model->sparse_index.find(since.table());
    if (it == model->sparse_index.end() ||
        !asked.insert(since.table()).second) {
      return Reject(absl::InvalidArgumentError(absl::StrCat(
          it == model->sparse_index.end() ? "unknown sparse table "
                                          : "sparse table asked twice: ",
          QuoteForStatus(since.table()))));
    }
    tables.push_back(model->sparse[it->second]->table.get());
  }
  SparseChangesResponse answer;
  if (request.mark()) {
    for (const std::unique_ptr<SparseState>& state : model->sparse) {
      absl::StatusOr<uint32_t> marked = state->table->MarkChanges();
      if (!marked.ok()) return marked.status();
      TableChangeMark* mark = answer.add_marks();
      mark->set_table(state->spec->name());
      mark->set_mark(*marked);
    }
  }
  // Pages of about 32 MiB at most, whatever was asked.
  constexpr int64_t kMaxPageBytes = int64_t{32} << 20;
  int64_t bytes_left = request.max_bytes() > 0
                           ? std::min(request.max_bytes(), kMaxPageBytes)
                           : kMaxPageBytes;
  SparseTable::ChangesCursor cursor{request.stripe(), request.slot()};
  int t = request.table_index();
  for (; t < request.since_size() && bytes_left > 0; ++t, cursor = {}) {
    absl::StatusOr<SparseTable::ChangesPage> page =
        tables[t]->ChangesSince(request.since(t).mark(), cursor, bytes_left);
    if (!page.ok()) {
      return absl::IsInvalidArgument(page.status()) ? Reject(page.status())
                                                    : page.status();
    }
    TableChanges* changes = answer.add_tables();
    changes->set_table(request.since(t).table());
    changes->mutable_ids()->Assign(page->ids.begin(), page->ids.end());
    changes->set_values(page->values.data(),
                        page->values.size() * sizeof(float));
    changes->mutable_evicted_ids()->Assign(page->evicted_ids.begin(),
                                           page->evicted_ids.end());
    bytes_left -= page->bytes;
    if (!page->done) {
      cursor = page->next;
      break;
    }
  }
  answer.set_done(t == request.since_size());
  answer.set_next_table_index(t);
  answer.set_next_stripe(cursor.stripe);
  answer.set_next_slot(cursor.slot);
  return answer;
}

void Shard::SparsePull(const SparsePullRequest& request, absl::Time deadline,
                       SparsePullDone done) {
  absl::StatusOr<const Model*> model =
      ValidateCommon(request.protocol_version(), request.worker_id(),
                     request.step(), /*allow_observer=*/true);
  if (!model.ok()) return done(Reject(model.status()), {});
  const std::vector<uint64_t> ids(request.ids().begin(), request.ids().end());
  absl::StatusOr<SparseState*> state =
      ValidateSparse(**model, request.table(), ids, /*unique=*/false);
  if (!state.ok()) return done(Reject(state.status()), {});
  SparseState* table = *state;
  // The answer is allocated from the request's size: bounded first.
  constexpr int64_t kMaxSparsePullBytes = int64_t{1} << 30;
  const int64_t answer_bytes = static_cast<int64_t>(ids.size()) *
                               table->spec->dim() * int64_t{sizeof(float)};
  if (answer_bytes > kMaxSparsePullBytes) {
    return done(
        Reject(absl::InvalidArgumentError(absl::StrCat(
            "sparse pull of ", ids.size(), " rows of dim ", table->spec->dim(),
            " would answer ", answer_bytes >> 20, " MiB; at most ",
            kMaxSparsePullBytes >> 20, " MiB: pull fewer ids at a time"))),
        {});
  }
  const int64_t step = request.step();
  const int worker = request.worker_id();
  auto answer = [table, ids, done = std::move(done)](absl::Status status) {
    if (!status.ok()) return done(std::move(status), {});
    SparsePullResponse response;
    std::string* values = response.mutable_values();
    values->resize(ids.size() * table->spec->dim() * sizeof(float));
    if (absl::Status pulled = table->table->Pull(
            ids, absl::MakeSpan(reinterpret_cast<float*>(values->data()),
                                ids.size() * table->spec->dim()));
        !pulled.ok()) {
      return done(std::move(pulled), {});
    }
    response.set_version(table->version.load());
    table->rows_pulled.fetch_add(ids.size());
    done(absl::OkStatus(), std::move(response));
  };
  if (table->mode == ConsistencyMode::kAsync) return answer(absl::OkStatus());

  auto waiter = std::make_unique<Waiter>();
  waiter->sparse = (*model)->sparse_index.at(request.table());
  waiter->step = step;
  // A lost gradient completed some step, or a fast-forward skipped some:
  // other pulls may wait for them.
  bool completed = false;
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (worker >= 0) {
      TouchLocked(worker);
      JoinIfPendingLocked(worker, step);
    }
    if (table->mode == ConsistencyMode::kSync) {
      const int64_t version = table->version.load();
      if (version + 1 < step &&
          (recovering_ || ConfirmLostStateLocked(worker, step))) {
        completed = FastForwardLocked(**model, step);
      } else if (version + 1 < step && fresh_) {
        const absl::Status behind =
            FreshShardBehindLocked("sparse pull", step, version);
        lock.Release();
        return answer(Reject(behind));
      } else if (version + 1 < step) {
        lock.Release();
        return answer(Reject(absl::OutOfRangeError(absl::StrCat(
            "sparse pull for step ", step, " but table ",
            QuoteForStatus(request.table()), " is at step ", version,
            ": a worker can be at most one step ahead"))));
      }
      // As for blocks: a member pulling step s has pushed s - 1.
      completed |= CreditLostGradientsLocked(**model, worker, step);
    }
    if (!WaiterReadyLocked(*waiter)) {
      if (shutting_down_) {
        lock.Release();
        return answer(absl::UnavailableError("the server is shutting down"));
      }
      waiter->deadline =
          std::min(deadline, absl::Now() + options_.max_pull_wait);
      waiter->answer = std::move(answer);
      waiters_.push_back(std::move(waiter));
      lock.Release();
      if (completed) ReleaseReadyWaiters();
      return;
    }
  }
  if (completed) ReleaseReadyWaiters();
  answer(absl::OkStatus());
}

absl::StatusOr<SparsePushResponse> Shard::SparsePush(
    const SparsePushRequest& request) {
  absl::StatusOr<const Model*> model =
      ValidateCommon(request.protocol_version(), request.worker_id(),
                     request.step(), /*allow_observer=*/false);
  if (!model.ok()) return Reject(model.status());
  // Every part (the request's own table, then `more`) is checked before any
  // is applied; each then has the request's worker and step.
  const int num_parts = 1 + request.more_size();
  std::vector<PreparedSparsePush> prepared;
  prepared.reserve(num_parts);
  absl::flat_hash_set<absl::string_view> tables;
  for (int i = 0; i < num_parts; ++i) {
    const SparsePushRequest& part = i == 0 ? request : request.more(i - 1);
    if (!tables.insert(part.table()).second) {
      return Reject(absl::InvalidArgumentError(
          absl::StrCat("sparse push: table ", QuoteForStatus(part.table()),
                       " appears twice in one push")));
    }
    absl::StatusOr<PreparedSparsePush> ready = PrepareSparsePush(**model, part);
    if (!ready.ok()) return ready.status();
    prepared.push_back(*std::move(ready));
  }
  absl::StatusOr<SparsePushResponse> response =
      ApplySparsePush(**model, request, std::move(prepared[0]));
  if (!response.ok()) return response;
  for (int i = 1; i < num_parts; ++i) {
    absl::StatusOr<SparsePushResponse> more =
        ApplySparsePush(**model, request, std::move(prepared[i]));
    if (!more.ok()) return more;
    *response->add_more() = *std::move(more);
  }
  return response;
}

absl::StatusOr<Shard::PreparedSparsePush> Shard::PrepareSparsePush(
    const Model& model, const SparsePushRequest& request) {
  std::vector<uint64_t> ids(request.ids().begin(), request.ids().end());
  absl::StatusOr<SparseState*> state =
      ValidateSparse(model, request.table(), ids, /*unique=*/true);
  if (!state.ok()) return Reject(state.status());
  SparseState& table = **state;
  const int64_t dim = table.spec->dim();
  const int64_t element_bytes = WireElementBytes(request.dtype());
  if (element_bytes == 0) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("sparse push: wire type ",
                     static_cast<int>(request.dtype()), " is not supported")));
  }
  ByteSegments payload;
  payload.push_back(request.gradients());
  if (request.gradients().size() !=
      static_cast<uint64_t>(ids.size() * dim * element_bytes)) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("sparse push to ", QuoteForStatus(request.table()), ": ",
                     request.gradients().size(), " gradient bytes for ",
                     ids.size(), " rows of dim ", dim, ", expected ",
                     ids.size() * dim * element_bytes)));
  }
  const int64_t bad = FindNonFiniteSegments(request.dtype(), payload);
  if (bad >= 0) {
    return Reject(absl::InvalidArgumentError(absl::StrCat(
        "sparse push to ", QuoteForStatus(request.table()), ": row ",
        ids[bad / dim],
        " has a NaN or infinite gradient; the push was not applied")));
  }
  std::vector<float> grads(ids.size() * dim);
  if (absl::Status s =
          DecodeSegments(request.dtype(), payload, absl::MakeSpan(grads),
                         /*accumulate=*/false);
      !s.ok()) {
    // Validated above, and nothing changed yet: refused as well as counted.
    ReportInternalError("decoding a validated sparse push", s);
    return absl::InternalError(
        absl::StrCat("sparse push not applied: ", s.message()));
  }
  return PreparedSparsePush{&table, std::move(ids), std::move(grads)};
}

absl::StatusOr<SparsePushResponse> Shard::ApplySparsePush(
    const Model& model, const SparsePushRequest& request,
    PreparedSparsePush prepared) {
  SparseState& table = *prepared.table;
  std::vector<uint64_t>& ids = prepared.ids;
  std::vector<float>& grads = prepared.grads;
  const int64_t rows = static_cast<int64_t>(ids.size());
  SparsePushResponse response;
  bool completed = false;
  {
    absl::MutexLock lock(&mu_);
    TouchLocked(request.worker_id());
  }
  if (table.mode == ConsistencyMode::kSync) {
    if (absl::Status ahead = CatchUpSparseForPush(model, table, request);
        !ahead.ok()) {
      return Reject(std::move(ahead));
    }
    const std::shared_ptr<const Membership> members = membership();
    absl::MutexLock lock(&table.mu);
    const int64_t version = table.version.load();
    if (request.step() > version) {
      return Reject(absl::FailedPreconditionError(absl::StrCat(
          "sparse push for step ", request.step(), " but table ",
          QuoteForStatus(table.spec->name()), " is at step ", version)));
    }
    if (request.step() < version) {
      const bool duplicate =
          table.last_contributed[request.worker_id()] >= request.step();
      response.set_duplicate(duplicate);
      response.set_late(!duplicate);
      (duplicate ? blocks_duplicate_ : blocks_late_).fetch_add(1);
      return response;
    }
    if (table.last_contributed[request.worker_id()] == version) {
      response.set_duplicate(true);
      blocks_duplicate_.fetch_add(1);
      return response;
    }
    AddSparseInWorkerOrderLocked(table, request.worker_id(),
                                 {std::move(ids), std::move(grads)});
    table.last_contributed[request.worker_id()] = version;
    ++table.contributors;
    completed = CompleteSparseIfReadyLocked(table, *members);
  } else {
    {
      absl::MutexLock lock(&table.mu);
      int64_t& last = table.last_step[request.worker_id()];
      if (request.step() <= last) {
        response.set_duplicate(true);
        blocks_duplicate_.fetch_add(1);
        return response;
      }
      last = request.step();
    }
    // PrepareSparsePush checked the ids (unique), sizes and values.
    const SparsePushResult pushed = table.table->PushChecked(ids, grads);
    response.set_rows_dropped(static_cast<int32_t>(pushed.dropped_unadmitted));
    absl::MutexLock lock(&mu_);
    WorkerState& w = workers_[request.worker_id()];
    w.next_step = std::max(w.next_step, request.step() + 1);
  }
  table.rows_pushed.fetch_add(rows);
  blocks_applied_.fetch_add(1);
  if (completed || options_.mode == ConsistencyMode::kSsp) {
    ReleaseReadyWaiters();
  }
  return response;
}

namespace {

int64_t HeldBytes(const std::vector<uint64_t>& ids,
                  const std::vector<float>& grads) {
  return static_cast<int64_t>(ids.size() * sizeof(uint64_t) +
                              grads.size() * sizeof(float));
}

void AddRows(const std::vector<uint64_t>& ids, const std::vector<float>& grads,
             int64_t dim,
             absl::flat_hash_map<uint64_t, std::vector<float>>& sums) {
  for (size_t i = 0; i < ids.size(); ++i) {
    std::vector<float>& sum = sums[ids[i]];
    if (sum.empty()) sum.assign(dim, 0.0f);
    for (int64_t j = 0; j < dim; ++j) sum[j] += grads[i * dim + j];
  }
}

}  // namespace

void Shard::AddSparseInWorkerOrderLocked(SparseState& table, int worker,
                                         EarlySparsePush push) {
  if (options_.sum_in_arrival_order) {
    return AddRows(push.ids, push.grads, table.spec->dim(), table.gradient_sum);
  }
  if (!table.early.IsNext(worker)) {
    early_gradients_.CountHeld(HeldBytes(push.ids, push.grads));
    table.early.Hold(worker, std::move(push));
    return;
  }
  const int64_t dim = table.spec->dim();
  AddRows(push.ids, push.grads, dim, table.gradient_sum);
  table.early.Added(
      worker,
      [&](const EarlySparsePush& early) {
        table.mu.AssertHeld();
        AddRows(early.ids, early.grads, dim, table.gradient_sum);
      },
      [&](EarlySparsePush early) {
        early_gradients_.CountHeld(-HeldBytes(early.ids, early.grads));
      });
}

void Shard::SettleEarlySparsePushesLocked(SparseState& table, bool add) {
  auto release = [&](EarlySparsePush early) {
    early_gradients_.CountHeld(-HeldBytes(early.ids, early.grads));
  };
  if (!add) return table.early.Reset(release);
  const int64_t dim = table.spec->dim();
  table.early.AddRest(
      [&](const EarlySparsePush& early) {
        table.mu.AssertHeld();
        AddRows(early.ids, early.grads, dim, table.gradient_sum);
      },
      release);
}

absl::Status Shard::CatchUpSparseForPush(const Model& model, SparseState& table,
                                         const SparsePushRequest& request) {
  const int64_t step = request.step();
  bool completed = false;
  absl::Status waiting;
  {
    absl::MutexLock lock(&mu_);
    const int64_t version = table.version.load();
    if (step <= version) return absl::OkStatus();
    if (recovering_ || ConfirmLostStateLocked(request.worker_id(), step)) {
      completed = FastForwardLocked(model, step);
    } else if (fresh_) {
      return FreshShardBehindLocked("sparse push", step, version);
    } else {
      // As for dense pushes: the worker pulled `step` from this shard's
      // previous life, which lost its step - 1 gradient.
      completed = CreditLostGradientsLocked(model, request.worker_id(), step);
    }
    if (table.version.load() < step && step == version + 1 &&
        version <= recovery_horizon_) {
      const std::shared_ptr<const Membership> members = membership_;
      absl::MutexLock table_lock(&table.mu);
      waiting = absl::UnavailableError(absl::StrCat(
          "sparse push for step ", step,
          " waits on this restored shard: table ",
          QuoteForStatus(table.spec->name()), " is still waiting for ",
          DescribeMissing(version, table.last_contributed, *members, "pushes"),
          "; retry"));
    }
  }
  if (completed) ReleaseReadyWaiters();
  return waiting;
}

}  // namespace pstrain
