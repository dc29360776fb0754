// Checkpoints: Restore rebuilds a shard from a saved one, Snapshot takes one.
// Part of Shard (shard.h lists its files).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_text.h"
#include "ps_server/checkpoint.h"
#include "ps_server/shard.h"
#include "ps_server/shard_internal.h"

namespace pstrain {

absl::Status Shard::Restore(const RestoredShard& restored) {
  if (restored.optimizer != options_.optimizer.name) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint was written with --optimizer=", restored.optimizer,
        ", this server runs --optimizer=", options_.optimizer.name,
        ": their state does not carry over"));
  }
  absl::MutexLock lock(&register_mu_);
  if (model_owner_ != nullptr) {
    return absl::FailedPreconditionError(
        "a model is already registered; restore before serving");
  }
  if (absl::Status s = InstallModel(restored.schema); !s.ok()) return s;
  const Model& model = *model_owner_;
  if (restored.blocks.size() != model.blocks.size()) {
    return absl::DataLossError(
        absl::StrCat("the checkpoint holds ", restored.blocks.size(),
                     " blocks of this shard, expected ", model.blocks.size()));
  }
  for (const BlockSnapshot& saved : restored.blocks) {
    const int local =
        saved.global_block >= 0 &&
                saved.global_block <
                    static_cast<int64_t>(model.local_of_global.size())
            ? model.local_of_global[saved.global_block]
            : -1;
    if (local < 0) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint block ", saved.global_block, " is not on this shard"));
    }
    Block& block = *model.blocks[local];
    absl::MutexLock block_lock(&block.mu);
    if (saved.value.size() != block.value.size() ||
        saved.optimizer_state.size() != block.state.size()) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint block ", saved.global_block, " has ", saved.value.size(),
          "+", saved.optimizer_state.size(), " floats, expected ",
          block.value.size(), "+", block.state.size()));
    }
    block.value.Assign(saved.value);
    if (block.awaiting_values.exchange(false)) {
      blocks_awaiting_values_.fetch_sub(1);
    }
    block.state = saved.optimizer_state;
    block.version.store(saved.version);
    // Workers beyond either job's size start with no history.
    for (size_t w = 0;
         w < std::min(saved.last_step.size(), block.last_step.size()); ++w) {
      block.last_step[w] = saved.last_step[w];
    }
    block.unseen_since_restore.assign(block.last_step.size(), true);
  }
  int64_t newest = 0;
  int64_t oldest = restored.blocks.empty() ? 0 : restored.blocks[0].version;
  for (const BlockSnapshot& saved : restored.blocks) {
    newest = std::max(newest, saved.version);
    oldest = std::min(oldest, saved.version);
  }
  // Tables come back with their rows and step; from a checkpoint without
  // sparse rows (an older ps_server's) they start afresh at the dense step,
  // so the two kinds of state move forward together.
  if (!restored.sparse.empty() &&
      restored.sparse.size() != model.sparse.size()) {
    return absl::DataLossError(
        absl::StrCat("the checkpoint holds ", restored.sparse.size(),
                     " sparse tables, the schema has ", model.sparse.size()));
  }
  int64_t tables_behind = 0;  // steps, like FastForwardLocked's count
  for (size_t t = 0; t < model.sparse.size(); ++t) {
    SparseState& table = *model.sparse[t];
    absl::MutexLock table_lock(&table.mu);
    if (restored.sparse.empty()) {
      table.version.store(oldest);
      continue;
    }
    const SparseTableSnapshot& saved = restored.sparse[t];
    const int64_t dim = saved.dim;
    if (table.mode != ConsistencyMode::kSync) {
      // An async table's version is not a step: it comes back as saved,
      // with no steps to count lost.
      table.version.store(saved.version);
    }
    for (size_t r = 0; r < saved.ids.size(); ++r) {
      if (absl::Status s = table.table->LoadRow(
              saved.ids[r],
              absl::MakeConstSpan(saved.values).subspan(r * dim, dim),
              absl::MakeConstSpan(saved.states)
                  .subspan(r * saved.state_floats, saved.state_floats),
              saved.update_counts[r]);
          !s.ok()) {
        return absl::DataLossError(
            absl::StrCat("sparse table ", QuoteForStatus(saved.name), " row ",
                         saved.ids[r], ": ", s.message()));
      }
    }
    // A checkpoint copies objects one by one while steps go on, and a CTR
    // step pushes its tables after its dense blocks: a table can come back
    // more than a step behind the blocks, where no worker will ask for its
    // old steps again. It skips to the blocks' step (its rows stay), like a
    // fast-forward, and the steps it skips count as lost.
    if (table.mode != ConsistencyMode::kSync) continue;
    tables_behind = std::max(tables_behind, oldest - saved.version);
    updates_lost_.fetch_add(std::max<int64_t>(0, oldest - saved.version));
    table.version.store(std::max(saved.version, oldest));
    newest = std::max(newest, table.version.load());
  }
  steps_lost_.fetch_add(tables_behind);
  absl::MutexLock state_lock(&mu_);
  recovering_ = options_.mode == ConsistencyMode::kSync;
  fresh_ = false;
  recovery_horizon_ = newest;
  life_start_version_ = oldest;
  // The job was running: its workers are coming back, not starting, so
  // each expected one holds a lease from now, as after any restart.
  if (!started_) {
    started_ = true;
    started_at_ = absl::Now();
    for (WorkerState& worker : workers_) worker.last_seen = LeaseNow();
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardSnapshot> Shard::Snapshot(int64_t sequence) const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) {
    return absl::FailedPreconditionError("no model is registered yet");
  }
  if (blocks_awaiting_values_.load() > 0) {
    // Zeros saved in their place would restore as the model's values.
    return absl::FailedPreconditionError(
        "tensors with init PROVIDED have no values yet (a worker's Assign "
        "sets them)");
  }
  ShardSnapshot snapshot;
  snapshot.schema = model->schema;
  snapshot.mode = ConsistencyModeName(options_.mode);
  snapshot.optimizer = options_.optimizer.name;
  snapshot.shard_id = options_.shard_id;
  snapshot.num_shards = options_.num_shards;
  snapshot.sequence = sequence;
  const std::vector<int>& globals =
      model->partition.BlocksOfShard(options_.shard_id);
  snapshot.blocks.resize(globals.size());
  for (size_t i = 0; i < globals.size(); ++i) {
    const Block& block = *model->blocks[i];
    BlockSnapshot& out = snapshot.blocks[i];
    out.global_block = globals[i];
    absl::MutexLock lock(&block.mu);
    out.version = block.version.load();
    const absl::Span<const float> values = block.value.Read();
    out.value.assign(values.begin(), values.end());
    out.optimizer_state = block.state;
    out.last_step = block.last_step;
  }
  for (const auto& state : model->sparse) {
    SparseTableSnapshot& out = snapshot.sparse.emplace_back();
    out.name = state->spec->name();
    out.dim = state->table->dim();
    out.state_floats = state->table->state_per_element() * out.dim;
    // Held so that a sync step cannot complete between reading the version
    // and the rows; async rows change under the visit, each consistent on
    // its own, as blocks are.
    absl::MutexLock lock(&state->mu);
    out.version = state->version.load();
    state->table->ForEachRow([&out](uint64_t id, absl::Span<const float> value,
                                    absl::Span<const float> row_state,
                                    int64_t update_count) {
      out.ids.push_back(id);
      out.update_counts.push_back(update_count);
      out.values.insert(out.values.end(), value.begin(), value.end());
      out.states.insert(out.states.end(), row_state.begin(), row_state.end());
    });
  }
  return snapshot;
}

}  // namespace pstrain
