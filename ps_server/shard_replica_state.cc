// Replica catch-up: the whole state of a shard, exported by a primary at a
// quiet moment and installed by a replica that joins its set. Part of Shard
// (shard.h lists its files).
//
// A checkpoint (shard_restore.cc) keeps what a restarted process can go on
// from, and the job makes up the rest (lost steps are counted); a replica
// must hold exactly what the primary holds, so this also carries the
// workers' places, the sync de-duplication steps and the restart state.
// Floats go in the host's byte order: the replicas of a shard run one build.
#include <cstring>
#include <deque>
#include <iterator>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_text.h"
#include "ps_server/shard.h"
#include "ps_server/shard_internal.h"

namespace pstrain {
namespace {

absl::string_view FloatBytes(absl::Span<const float> values) {
  return absl::string_view(reinterpret_cast<const char*>(values.data()),
                           values.size() * sizeof(float));
}

}  // namespace

bool Shard::QuietForTransfer() const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) return true;
  {
    // A sync shard not yet met by its workers (restored, or started with
    // nothing) may skip to their step at any request, a pull too, which
    // the change gate does not hold: a skip while the state is on its way
    // would miss the joiner. The workers' first request ends it.
    absl::MutexLock lock(&mu_);
    if (recovering_ || fresh_) return false;
  }
  for (const auto& block : model->blocks) {
    if (block->awaiting_clip.load()) return false;
    absl::MutexLock lock(&block->mu);
    if (block->contributors > 0 || block->lost_contributors > 0 ||
        block->sum_started || !block->early.AtStepStart()) {
      return false;
    }
  }
  for (const auto& table : model->sparse) {
    absl::MutexLock lock(&table->mu);
    if (table->contributors > 0 || !table->gradient_sum.empty() ||
        !table->early.AtStepStart()) {
      return false;
    }
  }
  return true;
}

int64_t Shard::StepUnderWay() const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) return 0;
  int64_t step = std::numeric_limits<int64_t>::max();
  for (const auto& block : model->blocks) {
    step = std::min(step, block->version.load());
  }
  for (const auto& table : model->sparse) {
    if (table->mode != ConsistencyMode::kSync) continue;
    step = std::min(step, table->version.load());
  }
  return step == std::numeric_limits<int64_t>::max() ? 0 : step;
}

absl::StatusOr<ReplicaStateExport> Shard::ExportReplicaState(
    int64_t chunk_bytes) const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) {
    return absl::FailedPreconditionError("no model is registered yet");
  }
  // A deque: what was added to a chunk stays where it is as chunks are
  // added.
  std::deque<ReplicaStateChunk> chunks(1);
  ReplicaStateExport out_state;
  out_state.floats.resize(1);
  int64_t bytes_in_chunk = 0;
  // A new chunk once the current one holds `chunk_bytes`. The first holds
  // only what installs the model, so that the joiner installs it while the
  // rest are on their way (ReplicaSet::SendState).
  auto room_for = [&](int64_t bytes) -> ReplicaStateChunk& {
    if (chunks.size() == 1 ||
        (bytes_in_chunk > 0 && bytes_in_chunk + bytes > chunk_bytes)) {
      chunks.emplace_back();
      out_state.floats.emplace_back();
      bytes_in_chunk = 0;
    }
    bytes_in_chunk += bytes;
    return chunks.back();
  };

  ReplicaShardMeta& meta = *chunks[0].mutable_meta();
  *meta.mutable_schema() = model->schema;
  meta.set_job_final_version(job_final_version_.load());
  meta.set_skipped_to_step(skipped_to_step_.load());
  meta.set_steps_lost(steps_lost_.load());
  meta.set_gradients_lost(gradients_lost_.load());
  meta.set_updates_lost(updates_lost_.load());
  {
    absl::MutexLock lock(&mu_);
    for (const WorkerState& w : workers_) {
      ReplicaWorkerState& out = *meta.add_workers();
      out.set_member(w.member);
      out.set_pending(w.pending);
      out.set_joined_at(w.joined_at);
      out.set_incarnation(w.incarnation);
      out.set_seen(w.seen);
      out.set_next_step(w.next_step);
      out.set_pulled_in_this_life(w.pulled_in_this_life);
      out.set_stopping(w.stopping);
      out.set_stopping_grace_s(absl::ToDoubleSeconds(w.stopping_grace));
    }
    meta.set_started(started_);
    meta.set_expected_seen(expected_seen_);
    meta.set_fresh(fresh_);
    meta.set_recovering(recovering_);
    meta.set_life_start_version(life_start_version_);
    meta.set_recovery_horizon(recovery_horizon_);
  }

  const std::vector<int>& globals =
      model->partition.BlocksOfShard(options_.shard_id);
  for (size_t i = 0; i < globals.size(); ++i) {
    const Block& block = *model->blocks[i];
    absl::MutexLock lock(&block.mu);
    const int64_t bytes =
        static_cast<int64_t>(block.value.size() + block.state.size()) *
        sizeof(float);
    ReplicaStateChunk& chunk = room_for(bytes);
    std::vector<absl::string_view>& floats = out_state.floats.back();
    ReplicaBlockState& out = *chunk.add_blocks();
    out.set_global_block(globals[i]);
    out.set_version(block.version.load());
    out.set_awaiting_values(block.awaiting_values.load());
    if (!out.awaiting_values()) {
      BlockValues::Ref values = block.value.Share();
      floats.push_back(FloatBytes(*values));
      out_state.values.push_back(std::move(values));
    }
    floats.push_back(FloatBytes(block.state));
    out.mutable_last_step()->Add(block.last_step.begin(),
                                 block.last_step.end());
    out.mutable_last_contributed()->Add(block.last_contributed.begin(),
                                        block.last_contributed.end());
    for (bool unseen : block.unseen_since_restore) {
      out.add_unseen_since_restore(unseen);
    }
    out.set_updates_lost(block.updates_lost);
  }

  for (size_t t = 0; t < model->sparse.size(); ++t) {
    const SparseState& state = *model->sparse[t];
    const int64_t dim = state.table->dim();
    const int64_t state_floats = state.table->state_per_element() * dim;
    const int64_t row_bytes = 16 + (dim + state_floats) * sizeof(float);
    absl::MutexLock lock(&state.mu);
    ReplicaSparseRows* rows = nullptr;
    auto open_rows = [&](int64_t bytes) {
      rows = room_for(bytes).add_sparse();
      rows->set_table(static_cast<int>(t));
    };
    open_rows(0);
    rows->set_version(state.version.load());
    rows->mutable_last_step()->Add(state.last_step.begin(),
                                   state.last_step.end());
    rows->mutable_last_contributed()->Add(state.last_contributed.begin(),
                                          state.last_contributed.end());
    // Least recently used first (ForEachRow's order), so that loading them
    // in order leaves the joiner's eviction order the primary's.
    state.table->ForEachRow([&](uint64_t id, absl::Span<const float> value,
                                absl::Span<const float> row_state,
                                int64_t update_count) {
      if (bytes_in_chunk + row_bytes > chunk_bytes && rows->ids_size() > 0) {
        open_rows(row_bytes);
      } else {
        bytes_in_chunk += row_bytes;
      }
      rows->add_ids(id);
      rows->add_update_counts(update_count);
      rows->mutable_values()->append(
          reinterpret_cast<const char*>(value.data()),
          value.size() * sizeof(float));
      rows->mutable_states()->append(
          reinterpret_cast<const char*>(row_state.data()),
          row_state.size() * sizeof(float));
    });
    // After the rows, so that loading them cannot age a count away.
    constexpr int64_t kSightingBytes = 12;
    state.table->ForEachSighting([&](uint64_t id, uint32_t count) {
      if (bytes_in_chunk + kSightingBytes > chunk_bytes &&
          (rows->ids_size() > 0 || rows->sighting_ids_size() > 0)) {
        open_rows(kSightingBytes);
      } else {
        bytes_in_chunk += kSightingBytes;
      }
      rows->add_sighting_ids(id);
      rows->add_sighting_counts(count);
    });
  }
  // The last chunk makes the joiner a backup, so it goes alone once every
  // other is in: it carries nothing, so no copy waits for that turn.
  if (chunks.size() > 1) {
    chunks.emplace_back();
    out_state.floats.emplace_back();
  }
  for (size_t c = 0; c < chunks.size(); ++c) {
    chunks[c].set_index(static_cast<int64_t>(c));
    chunks[c].set_total_chunks(static_cast<int64_t>(chunks.size()));
  }
  chunks.back().set_last(true);
  out_state.chunks.assign(std::make_move_iterator(chunks.begin()),
                          std::make_move_iterator(chunks.end()));
  return out_state;
}

absl::Status Shard::ImportReplicaChunk(const ReplicaStateChunk& chunk,
                                       absl::string_view floats) {
  if (chunk.has_meta()) {
    const ReplicaShardMeta& meta = chunk.meta();
    absl::MutexLock lock(&register_mu_);
    if (model_owner_ != nullptr) {
      return absl::FailedPreconditionError(
          "this replica already holds a model; a catch-up starts empty");
    }
    if (absl::Status s = ValidateSchema(meta.schema()); !s.ok()) return s;
    // Every block's values and optimizer state come in the chunks.
    if (absl::Status s =
            InstallModel(meta.schema(), InitialValues::kArriveWithState);
        !s.ok()) {
      return s;
    }
    job_final_version_.store(meta.job_final_version());
    skipped_to_step_.store(meta.skipped_to_step());
    steps_lost_.store(meta.steps_lost());
    gradients_lost_.store(meta.gradients_lost());
    updates_lost_.store(meta.updates_lost());
    absl::MutexLock state_lock(&mu_);
    if (meta.workers_size() != static_cast<int>(workers_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("the primary has room for ", meta.workers_size(),
                       " workers, this replica for ", workers_.size(),
                       ": their --num_workers/--max_workers differ"));
    }
    for (size_t w = 0; w < workers_.size(); ++w) {
      const ReplicaWorkerState& in = meta.workers(static_cast<int>(w));
      WorkerState& out = workers_[w];
      out.member = in.member();
      out.pending = in.pending();
      out.joined_at = in.joined_at();
      out.incarnation = in.incarnation();
      out.seen = in.seen();
      // Leases run on each replica's own clock: from now, as after a
      // restart.
      out.last_seen = LeaseNow();
      out.next_step = in.next_step();
      out.pulled_in_this_life = in.pulled_in_this_life();
      out.stopping = in.stopping();
      // As Leave takes it; 0 (a replica that predates it) is no grace.
      out.stopping_grace =
          shard_internal::ValidStoppingGrace(in.stopping_grace_s())
              ? absl::Seconds(in.stopping_grace_s())
              : absl::ZeroDuration();
    }
    started_ = meta.started();
    if (started_) started_at_ = absl::Now();
    expected_seen_ = meta.expected_seen();
    fresh_ = meta.fresh();
    recovering_ = meta.recovering();
    life_start_version_ = meta.life_start_version();
    recovery_horizon_ = meta.recovery_horizon();
    PublishMembershipLocked();
  }
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) {
    return absl::FailedPreconditionError(
        "a state chunk came before the one that installs the model");
  }
  // The next `count` floats that followed the chunk, copied into new
  // memory; an error when fewer are left.
  size_t floats_used = 0;
  auto next_floats =
      [&](size_t count, int64_t global_block,
          absl::string_view what) -> absl::StatusOr<std::vector<float>> {
    const size_t bytes = count * sizeof(float);
    if (floats.size() - floats_used < bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", global_block, ": too few ", what,
                       " bytes, expected ", bytes));
    }
    const char* begin = floats.data() + floats_used;
    floats_used += bytes;
    // As bytes: the floats are not aligned for float in the chunk.
    std::vector<float> out(count);
    if (bytes > 0) std::memcpy(out.data(), begin, bytes);
    return out;
  };
  for (const ReplicaBlockState& in : chunk.blocks()) {
    const int local =
        in.global_block() >= 0 &&
                in.global_block() <
                    static_cast<int64_t>(model->local_of_global.size())
            ? model->local_of_global[in.global_block()]
            : -1;
    if (local < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", in.global_block(), " is not on this shard"));
    }
    Block& block = *model->blocks[local];
    absl::MutexLock lock(&block.mu);
    // Same mode, same --max_workers: the same per-worker vectors.
    if (static_cast<size_t>(in.last_step_size()) != block.last_step.size() ||
        static_cast<size_t>(in.last_contributed_size()) !=
            block.last_contributed.size() ||
        static_cast<size_t>(in.unseen_since_restore_size()) !=
            block.unseen_since_restore.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", in.global_block(), ": its per-worker steps do not fit"));
    }
    const int64_t length = block.location->length;
    if (in.awaiting_values()) {
      // Still awaiting worker 0's (PROVIDED): zeros, as on the primary.
      block.value.Assign(std::vector<float>(length));
    } else {
      absl::StatusOr<std::vector<float>> values =
          next_floats(length, in.global_block(), "value");
      if (!values.ok()) return values.status();
      block.value.Assign(*std::move(values));
      if (block.awaiting_values.exchange(false)) {
        blocks_awaiting_values_.fetch_sub(1);
      }
    }
    const int64_t state_length =
        block.state_values ? 0 : block.optimizer->state_per_element() * length;
    absl::StatusOr<std::vector<float>> state =
        next_floats(state_length, in.global_block(), "optimizer state");
    if (!state.ok()) return state.status();
    block.state = *std::move(state);
    block.version.store(in.version());
    block.last_step.assign(in.last_step().begin(), in.last_step().end());
    block.last_contributed.assign(in.last_contributed().begin(),
                                  in.last_contributed().end());
    block.unseen_since_restore.assign(in.unseen_since_restore().begin(),
                                      in.unseen_since_restore().end());
    block.updates_lost = in.updates_lost();
  }
  for (const ReplicaSparseRows& in : chunk.sparse()) {
    if (in.table() < 0 ||
        in.table() >= static_cast<int>(model->sparse.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse table ", in.table(), " is not in the schema"));
    }
    SparseState& state = *model->sparse[in.table()];
    const int64_t dim = state.table->dim();
    const int64_t state_floats = state.table->state_per_element() * dim;
    const int64_t n = in.ids_size();
    if (in.update_counts_size() != n ||
        static_cast<int64_t>(in.values().size()) != n * dim * 4 ||
        static_cast<int64_t>(in.states().size()) != n * state_floats * 4) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse table ", QuoteForStatus(state.spec->name()),
                       ": rows of the wrong size"));
    }
    absl::MutexLock lock(&state.mu);
    if (in.last_step_size() > 0) {
      if (static_cast<size_t>(in.last_step_size()) != state.last_step.size() ||
          static_cast<size_t>(in.last_contributed_size()) !=
              state.last_contributed.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("sparse table ", QuoteForStatus(state.spec->name()),
                         ": its per-worker steps do not fit"));
      }
      state.version.store(in.version());
      state.last_step.assign(in.last_step().begin(), in.last_step().end());
      state.last_contributed.assign(in.last_contributed().begin(),
                                    in.last_contributed().end());
    }
    std::vector<float> value(dim), row_state(state_floats);
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(value.data(), in.values().data() + r * dim * 4, dim * 4);
      std::memcpy(row_state.data(), in.states().data() + r * state_floats * 4,
                  state_floats * 4);
      if (absl::Status s = state.table->LoadRow(
              in.ids(static_cast<int>(r)), value, row_state,
              in.update_counts(static_cast<int>(r)));
          !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sparse table ", QuoteForStatus(state.spec->name()), " row ",
            in.ids(static_cast<int>(r)), ": ", s.message()));
      }
    }
    if (in.sighting_ids_size() != in.sighting_counts_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse table ", QuoteForStatus(state.spec->name()),
                       ": ", in.sighting_ids_size(), " sighted ids, ",
                       in.sighting_counts_size(), " counts"));
    }
    for (int k = 0; k < in.sighting_ids_size(); ++k) {
      if (absl::Status s = state.table->LoadSighting(in.sighting_ids(k),
                                                     in.sighting_counts(k));
          !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("sparse table ", QuoteForStatus(state.spec->name()),
                         ": ", s.message()));
      }
    }
  }
  if (floats_used != floats.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the chunk's floats are ", floats.size(),
                     " bytes, its blocks take ", floats_used));
  }
  if (chunk.last()) {
    // The chunks before it may have come in any order; none may be missing.
    for (const auto& block : model->blocks) {
      absl::MutexLock lock(&block->mu);
      if (static_cast<int64_t>(block->value.size()) !=
          block->location->length) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the state ended without block ", block->location->block,
            " of tensor ", QuoteForStatus(*block->tensor_name)));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace pstrain
