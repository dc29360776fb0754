#include "ps_server/shard.h"

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/init.h"
#include "common/protocol.h"
#include "common/tensor_codec.h"

namespace pstrain {
namespace {

// How often expired sync pulls are answered; a late answer is at most this
// much past the caller's deadline.
constexpr absl::Duration kReaperInterval = absl::Milliseconds(20);

void AtomicMax(std::atomic<int64_t>& target, int64_t value) {
  int64_t current = target.load();
  while (value > current && !target.compare_exchange_weak(current, value)) {
  }
}

}  // namespace

struct Shard::Block {
  const BlockLocation* location = nullptr;
  const std::string* tensor_name = nullptr;
  // Updates applied. Written under mu; read without it by pulls deciding
  // whether to wait.
  std::atomic<int64_t> version{0};

  mutable absl::Mutex mu;
  std::vector<float> value ABSL_GUARDED_BY(mu);
  std::vector<float> state ABSL_GUARDED_BY(mu);  // optimizer slots
  // sync: this step's gradient sum and who has contributed to it.
  std::vector<float> gradient_sum ABSL_GUARDED_BY(mu);
  std::vector<bool> contributed ABSL_GUARDED_BY(mu);
  int contributors ABSL_GUARDED_BY(mu) = 0;
  int finite_contributors ABSL_GUARDED_BY(mu) = 0;
  // async: the last step applied per worker (-1: none).
  std::vector<int64_t> last_step ABSL_GUARDED_BY(mu);
};

struct Shard::Model {
  ModelSchema schema;
  Partition partition;
  std::vector<std::unique_ptr<Block>> blocks;  // this shard's, global order
  std::vector<int> local_of_global;            // -1 when on another shard
  int64_t num_elements = 0;
};

struct Shard::Waiter {
  std::vector<int> locals;
  int64_t step = 0;
  absl::Time deadline;
  PullDone done;
};

absl::StatusOr<ConsistencyMode> ParseConsistencyMode(absl::string_view name) {
  if (name == "sync") return ConsistencyMode::kSync;
  if (name == "async") return ConsistencyMode::kAsync;
  return absl::InvalidArgumentError(
      absl::StrCat("--mode must be sync or async, got '", name, "'"));
}

std::string ConsistencyModeName(ConsistencyMode mode) {
  return mode == ConsistencyMode::kSync ? "sync" : "async";
}

absl::StatusOr<std::unique_ptr<Shard>> Shard::Create(
    const ShardOptions& options) {
  if (options.num_shards < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_shards must be >= 1, got ", options.num_shards));
  }
  if (options.shard_id < 0 || options.shard_id >= options.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shard_id must be in [0, ", options.num_shards,
                     "), got ", options.shard_id));
  }
  if (options.num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_workers must be >= 1, got ", options.num_workers));
  }
  if (options.max_pull_wait <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max pull wait must be positive");
  }
  absl::StatusOr<std::unique_ptr<Optimizer>> optimizer =
      Optimizer::Create(options.optimizer);
  if (!optimizer.ok()) return optimizer.status();
  return std::unique_ptr<Shard>(new Shard(options, std::move(*optimizer)));
}

Shard::Shard(const ShardOptions& options, std::unique_ptr<Optimizer> optimizer)
    : options_(options), optimizer_(std::move(optimizer)) {
  if (options_.mode == ConsistencyMode::kSync) {
    reaper_ = std::thread([this] { ReapExpiredWaiters(); });
  }
}

Shard::~Shard() {
  BeginShutdown();
  if (reaper_.joinable()) reaper_.join();
}

absl::Status Shard::Reject(absl::Status status) {
  requests_rejected_.fetch_add(1);
  return status;
}

absl::StatusOr<RegisterModelResponse> Shard::Register(
    const RegisterModelRequest& request) {
  if (request.protocol_version() != kProtocolVersion) {
    return Reject(absl::FailedPreconditionError(absl::StrCat(
        "protocol version ", request.protocol_version(),
        " is not supported; this server speaks ", kProtocolVersion)));
  }
  if (request.num_shards() != options_.num_shards) {
    return Reject(absl::FailedPreconditionError(absl::StrCat(
        "client expects ", request.num_shards(),
        " shards but this server was started with --num_shards=",
        options_.num_shards, ": --ps_hosts must list every shard in order")));
  }
  if (request.num_workers() != options_.num_workers) {
    return Reject(absl::FailedPreconditionError(
        absl::StrCat("client expects ", request.num_workers(),
                     " workers but this server was started with --num_workers=",
                     options_.num_workers)));
  }
  if (absl::Status s = ValidateSchema(request.schema()); !s.ok()) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("invalid model schema: ", s.message())));
  }

  absl::MutexLock lock(&register_mu_);
  RegisterModelResponse response;
  response.set_mode(ConsistencyModeName(options_.mode));
  if (model_owner_ != nullptr) {
    const std::string difference =
        FirstSchemaDifference(model_owner_->schema, request.schema());
    if (!difference.empty()) {
      return Reject(absl::FailedPreconditionError(absl::StrCat(
          "a different model is already registered on this shard: ",
          difference)));
    }
    response.set_created(false);
    return response;
  }

  absl::StatusOr<Partition> partition =
      Partition::Create(request.schema(), options_.num_shards);
  if (!partition.ok()) return Reject(partition.status());
  auto model = std::make_unique<Model>();
  model->schema = request.schema();
  model->partition = std::move(*partition);
  const std::vector<BlockLocation>& all = model->partition.blocks();
  model->local_of_global.assign(all.size(), -1);
  const int slots = optimizer_->state_per_element();
  const bool sync = options_.mode == ConsistencyMode::kSync;
  for (int g : model->partition.BlocksOfShard(options_.shard_id)) {
    const BlockLocation& loc = all[g];
    const DenseTensorSpec& tensor = model->schema.dense(loc.tensor);
    auto block = std::make_unique<Block>();
    block->location = &loc;
    block->tensor_name = &tensor.name();
    {
      absl::MutexLock block_lock(&block->mu);
      block->value.resize(loc.length);
      FillInitialValues(tensor.init(), model->schema.seed(), tensor.name(),
                        loc.offset, absl::MakeSpan(block->value));
      block->state.assign(slots * loc.length, 0.0f);
      if (sync) {
        block->gradient_sum.assign(loc.length, 0.0f);
        block->contributed.assign(options_.num_workers, false);
      } else {
        block->last_step.assign(options_.num_workers, -1);
      }
    }
    model->local_of_global[g] = static_cast<int>(model->blocks.size());
    model->num_elements += loc.length;
    model->blocks.push_back(std::move(block));
  }
  model_owner_ = std::move(model);
  model_.store(model_owner_.get(), std::memory_order_release);
  response.set_created(true);
  return response;
}

absl::StatusOr<const Shard::Model*> Shard::ValidateCommon(
    uint32_t protocol_version, int worker_id, int64_t step) const {
  if (protocol_version != kProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "protocol version ", protocol_version,
        " is not supported; this server speaks ", kProtocolVersion));
  }
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) {
    return absl::FailedPreconditionError(
        "no model is registered on this shard: call RegisterModel first");
  }
  if (worker_id < 0 || worker_id >= options_.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat("worker_id must be in [0, ",
                                                   options_.num_workers,
                                                   "), got ", worker_id));
  }
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step must be >= 0, got ", step));
  }
  return model;
}

absl::StatusOr<std::vector<Shard::BlockPush>> Shard::ValidatePushBlocks(
    const Model& model, const WirePushRequest& request) const {
  std::vector<BlockPush> pushes;
  pushes.reserve(request.blocks.size());
  absl::flat_hash_set<int> seen;
  for (const WireBlock& wire : request.blocks) {
    absl::StatusOr<int> global =
        model.partition.FindBlock(wire.tensor, wire.block);
    if (!global.ok()) return global.status();
    const BlockLocation& loc = model.partition.blocks()[*global];
    const std::string where =
        absl::StrCat("tensor '", wire.tensor, "' block ", wire.block);
    const int local = model.local_of_global[*global];
    if (local < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " lives on shard ", loc.shard, ", this is shard ",
                       options_.shard_id));
    }
    if (!seen.insert(local).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " appears twice in one push"));
    }
    const int64_t element_bytes = WireElementBytes(wire.dtype);
    if (element_bytes == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": wire type ", static_cast<int>(wire.dtype),
                       " is not supported by this server"));
    }
    const uint64_t expected = static_cast<uint64_t>(loc.length) * element_bytes;
    if (wire.data_size != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": payload has ", wire.data_size,
                       " bytes, expected ", expected, " (", loc.length, " ",
                       DataType_Name(wire.dtype), " elements)"));
    }
    BlockPush push{local, &wire, false};
    const int64_t bad = FindNonFiniteSegments(wire.dtype, wire.data);
    if (bad >= 0) {
      if (!options_.skip_nonfinite_gradients) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": gradient element ", loc.offset + bad,
                         " is NaN or infinite; the push was not applied"));
      }
      push.nonfinite = true;
    }
    if (options_.mode == ConsistencyMode::kAsync &&
        (wire.version < 0 ||
         wire.version > model.blocks[local]->version.load())) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": pulled version must be in [0, ",
          model.blocks[local]->version.load(), "], got ", wire.version));
    }
    pushes.push_back(push);
  }
  return pushes;
}

absl::StatusOr<PushResponse> Shard::Push(const WirePushRequest& request) {
  absl::StatusOr<const Model*> model =
      ValidateCommon(request.protocol_version, request.worker_id, request.step);
  if (!model.ok()) return Reject(model.status());
  absl::StatusOr<std::vector<BlockPush>> pushes =
      ValidatePushBlocks(**model, request);
  if (!pushes.ok()) return Reject(pushes.status());
  if (options_.mode == ConsistencyMode::kSync) {
    // Checked for every block before any is applied, so a refused push
    // changes nothing.
    for (const BlockPush& push : *pushes) {
      const Block& block = *(*model)->blocks[push.local];
      const int64_t version = block.version.load();
      if (request.step > version) {
        return Reject(absl::FailedPreconditionError(absl::StrCat(
            "push for step ", request.step, " but tensor '", *block.tensor_name,
            "' block ", block.location->block, " is at step ", version,
            ": a sync worker pushes the step it pulled")));
      }
    }
  }
  PushResponse response;
  bool completed_a_step = false;
  for (const BlockPush& push : *pushes) {
    Block& block = *(*model)->blocks[push.local];
    const int64_t before = block.version.load();
    const bool applied = options_.mode == ConsistencyMode::kSync
                             ? PushSyncBlock(block, request, push)
                             : PushAsyncBlock(block, request, push);
    if (applied) {
      response.set_blocks_applied(response.blocks_applied() + 1);
    } else {
      response.set_blocks_duplicate(response.blocks_duplicate() + 1);
    }
    completed_a_step |= block.version.load() != before;
  }
  blocks_applied_.fetch_add(response.blocks_applied());
  blocks_duplicate_.fetch_add(response.blocks_duplicate());
  if (completed_a_step && options_.mode == ConsistencyMode::kSync) {
    ReleaseReadyWaiters();
  }
  return response;
}

bool Shard::PushSyncBlock(Block& block, const WirePushRequest& request,
                          const BlockPush& push) {
  const int worker = request.worker_id;
  absl::MutexLock lock(&block.mu);
  const int64_t version = block.version.load();
  // A step behind the block, or a worker already counted for this one: every
  // worker's gradient for a finished step was received, so this is a retry.
  if (request.step < version || block.contributed[worker]) return false;
  if (push.nonfinite) {
    nonfinite_skipped_.fetch_add(1);
  } else {
    // Validated above: dtype supported and length exact, so this cannot fail.
    DecodeSegments(push.wire->dtype, push.wire->data,
                   absl::MakeSpan(block.gradient_sum), /*accumulate=*/true)
        .IgnoreError();
    ++block.finite_contributors;
  }
  block.contributed[worker] = true;
  if (++block.contributors < options_.num_workers) return true;

  // The last gradient of the step: apply the mean once.
  if (block.finite_contributors > 0) {
    const float inverse = 1.0f / static_cast<float>(block.finite_contributors);
    for (float& g : block.gradient_sum) g *= inverse;
    optimizer_->Update(version + 1, absl::MakeSpan(block.value),
                       block.gradient_sum, absl::MakeSpan(block.state));
  }
  std::fill(block.gradient_sum.begin(), block.gradient_sum.end(), 0.0f);
  std::fill(block.contributed.begin(), block.contributed.end(), false);
  block.contributors = 0;
  block.finite_contributors = 0;
  block.version.store(version + 1);
  return true;
}

bool Shard::PushAsyncBlock(Block& block, const WirePushRequest& request,
                           const BlockPush& push) {
  // Reused per thread: no allocation per push once warm.
  thread_local std::vector<float> gradient;
  if (!push.nonfinite) {
    gradient.resize(block.location->length);
    DecodeSegments(push.wire->dtype, push.wire->data, absl::MakeSpan(gradient),
                   /*accumulate=*/false)
        .IgnoreError();  // validated: cannot fail
  }
  absl::MutexLock lock(&block.mu);
  int64_t& last = block.last_step[request.worker_id];
  if (request.step <= last) return false;
  last = request.step;
  if (push.nonfinite) {
    nonfinite_skipped_.fetch_add(1);
    return true;
  }
  const int64_t version = block.version.load();
  const int64_t staleness = version - push.wire->version;
  staleness_sum_.fetch_add(staleness);
  AtomicMax(staleness_max_, staleness);
  async_applies_.fetch_add(1);
  optimizer_->Update(version + 1, absl::MakeSpan(block.value), gradient,
                     absl::MakeSpan(block.state));
  block.version.store(version + 1);
  return true;
}

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
          "tensor '", ref.tensor(), "' block ", ref.block(), " lives on shard ",
          model.partition.blocks()[*global].shard, ", this is shard ",
          options_.shard_id));
    }
    if (!seen.insert(local).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", ref.tensor(),
                                                     "' block ", ref.block(),
                                                     " is requested twice"));
    }
    locals.push_back(local);
  }
  return locals;
}

std::vector<PulledBlock> Shard::CopyBlocks(
    const Model& model, const std::vector<int>& locals) const {
  std::vector<PulledBlock> out(locals.size());
  for (size_t i = 0; i < locals.size(); ++i) {
    const Block& block = *model.blocks[locals[i]];
    out[i].tensor = block.tensor_name;
    out[i].block = block.location->block;
    absl::MutexLock lock(&block.mu);
    out[i].version = block.version.load();
    out[i].values = block.value;
  }
  pulls_served_.fetch_add(1);
  return out;
}

void Shard::Pull(const PullRequest& request, absl::Time deadline,
                 PullDone done) {
  absl::StatusOr<const Model*> model = ValidateCommon(
      request.protocol_version(), request.worker_id(), request.step());
  if (!model.ok()) return done(Reject(model.status()), {});
  absl::StatusOr<std::vector<int>> locals = ResolvePullBlocks(**model, request);
  if (!locals.ok()) return done(Reject(locals.status()), {});
  if (options_.mode == ConsistencyMode::kAsync) {
    return done(absl::OkStatus(), CopyBlocks(**model, *locals));
  }

  const int64_t step = request.step();
  {
    absl::ReleasableMutexLock lock(&waiters_mu_);
    bool ready = true;
    for (int local : *locals) {
      const Block& block = *(*model)->blocks[local];
      const int64_t version = block.version.load();
      const std::string where = absl::StrCat("tensor '", *block.tensor_name,
                                             "' block ", block.location->block);
      if (version > step) {
        lock.Release();
        return done(Reject(absl::FailedPreconditionError(
                        absl::StrCat("pull for step ", step, " but ", where,
                                     " is already at step ", version))),
                    {});
      }
      if (version + 1 < step) {
        lock.Release();
        return done(Reject(absl::OutOfRangeError(absl::StrCat(
                        "pull for step ", step, " but ", where, " is at step ",
                        version, ": a worker can be at most one step ahead"))),
                    {});
      }
      ready &= version == step;
    }
    if (!ready) {
      if (shutting_down_) {
        lock.Release();
        return done(absl::UnavailableError("the server is shutting down"), {});
      }
      auto waiter = std::make_unique<Waiter>();
      waiter->locals = std::move(*locals);
      waiter->step = step;
      waiter->deadline =
          std::min(deadline, absl::Now() + options_.max_pull_wait);
      waiter->done = std::move(done);
      waiters_.push_back(std::move(waiter));
      return;
    }
  }
  done(absl::OkStatus(), CopyBlocks(**model, *locals));
}

void Shard::ReleaseReadyWaiters() {
  const Model* model = model_.load(std::memory_order_acquire);
  std::vector<std::unique_ptr<Waiter>> ready;
  {
    absl::MutexLock lock(&waiters_mu_);
    auto is_ready = [model](const std::unique_ptr<Waiter>& w) {
      for (int local : w->locals) {
        if (model->blocks[local]->version.load() < w->step) return false;
      }
      return true;
    };
    auto split = std::stable_partition(
        waiters_.begin(), waiters_.end(),
        [&](const std::unique_ptr<Waiter>& w) { return !is_ready(w); });
    std::move(split, waiters_.end(), std::back_inserter(ready));
    waiters_.erase(split, waiters_.end());
  }
  // Answered outside the lock: copying blocks and sending take time.
  for (std::unique_ptr<Waiter>& w : ready) {
    w->done(absl::OkStatus(), CopyBlocks(*model, w->locals));
  }
}

std::string Shard::DescribeMissing(const Waiter& waiter) const {
  const Model* model = model_.load(std::memory_order_acquire);
  for (int local : waiter.locals) {
    const Block& block = *model->blocks[local];
    absl::MutexLock lock(&block.mu);
    if (block.version.load() >= waiter.step) continue;
    std::vector<int> missing;
    for (int w = 0; w < options_.num_workers; ++w) {
      if (!block.contributed[w]) missing.push_back(w);
    }
    return absl::StrCat(
        "tensor '", *block.tensor_name, "' block ", block.location->block,
        " is still waiting for the step ", block.version.load(),
        " gradients of workers [", absl::StrJoin(missing, ", "), "]");
  }
  return "the step completed as the deadline passed";
}

void Shard::ReapExpiredWaiters() {
  while (true) {
    std::vector<std::unique_ptr<Waiter>> expired;
    bool stop = false;
    {
      absl::MutexLock lock(&waiters_mu_);
      waiters_mu_.AwaitWithTimeout(absl::Condition(&shutting_down_),
                                   kReaperInterval);
      stop = shutting_down_;
      const absl::Time now = absl::Now();
      auto split = std::stable_partition(waiters_.begin(), waiters_.end(),
                                         [&](const std::unique_ptr<Waiter>& w) {
                                           return !stop && w->deadline > now;
                                         });
      std::move(split, waiters_.end(), std::back_inserter(expired));
      waiters_.erase(split, waiters_.end());
    }
    for (std::unique_ptr<Waiter>& w : expired) {
      if (stop) {
        w->done(absl::UnavailableError("the server is shutting down"), {});
      } else {
        w->done(
            absl::DeadlineExceededError(absl::StrCat(
                "step ", w->step, " is not complete: ", DescribeMissing(*w))),
            {});
      }
    }
    if (stop) return;
  }
}

void Shard::BeginShutdown() {
  std::vector<std::unique_ptr<Waiter>> waiting;
  {
    absl::MutexLock lock(&waiters_mu_);
    shutting_down_ = true;
    waiting.swap(waiters_);
  }
  for (std::unique_ptr<Waiter>& w : waiting) {
    w->done(absl::UnavailableError("the server is shutting down"), {});
  }
}

StatsResponse Shard::Stats() const {
  StatsResponse stats;
  stats.set_shard_id(options_.shard_id);
  stats.set_num_shards(options_.num_shards);
  stats.set_mode(ConsistencyModeName(options_.mode));
  const Model* model = model_.load(std::memory_order_acquire);
  stats.set_model_registered(model != nullptr);
  if (model != nullptr) {
    stats.set_num_blocks(model->blocks.size());
    stats.set_num_elements(model->num_elements);
    int64_t min_version = model->blocks.empty() ? 0 : INT64_MAX;
    for (const auto& block : model->blocks) {
      min_version = std::min(min_version, block->version.load());
    }
    stats.set_version(min_version);
  }
  stats.set_blocks_applied(blocks_applied_.load());
  stats.set_blocks_duplicate(blocks_duplicate_.load());
  stats.set_requests_rejected(requests_rejected_.load());
  stats.set_pulls_served(pulls_served_.load());
  stats.set_nonfinite_gradients_skipped(nonfinite_skipped_.load());
  stats.set_staleness_max(staleness_max_.load());
  const int64_t applies = async_applies_.load();
  if (applies > 0) {
    stats.set_staleness_mean(static_cast<double>(staleness_sum_.load()) /
                             applies);
  }
  return stats;
}

}  // namespace pstrain
