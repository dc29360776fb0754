#include "ps_server/shard.h"

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/init.h"
#include "common/protocol.h"
#include "common/tensor_codec.h"

namespace pstrain {
namespace {

// How often a waiting sync pull checks whether its caller has gone away.
constexpr absl::Duration kCancellationCheck = absl::Milliseconds(100);

}  // namespace

struct Shard::Block {
  const BlockLocation* location = nullptr;
  const std::string* tensor_name = nullptr;
  mutable absl::Mutex mu;
  std::vector<float> value ABSL_GUARDED_BY(mu);
  std::vector<float> state ABSL_GUARDED_BY(mu);  // optimizer slots
  int64_t update_count ABSL_GUARDED_BY(mu) = 0;
  // sync only: the sum of this step's gradients, guarded by Shard::mu_.
  std::vector<float> gradient_sum;
};

struct Shard::Model {
  ModelSchema schema;
  Partition partition;
  std::vector<std::unique_ptr<Block>> blocks;  // this shard's, global order
  std::vector<int> local_of_global;            // -1 when on another shard
  int64_t num_elements = 0;
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
    : options_(options),
      optimizer_(std::move(optimizer)),
      contributed_(options.num_workers, false),
      last_step_(options.num_workers, -1) {}

Shard::~Shard() = default;

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
    absl::MutexLock state_lock(&mu_);
    response.set_version(version_);
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
    }
    if (options_.mode == ConsistencyMode::kSync) {
      block->gradient_sum.assign(loc.length, 0.0f);
    }
    model->local_of_global[g] = static_cast<int>(model->blocks.size());
    model->num_elements += loc.length;
    model->blocks.push_back(std::move(block));
  }
  model_owner_ = std::move(model);
  model_.store(model_owner_.get(), std::memory_order_release);
  response.set_created(true);
  response.set_version(0);
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

absl::StatusOr<std::vector<Shard::BlockPayload>> Shard::ValidatePushBlocks(
    const Model& model, const PushRequest& request, bool* nonfinite) const {
  *nonfinite = false;
  std::vector<BlockPayload> payloads;
  payloads.reserve(request.blocks_size());
  absl::flat_hash_set<int> seen;
  for (const TensorBlock& block : request.blocks()) {
    absl::StatusOr<int> global =
        model.partition.FindBlock(block.tensor(), block.block());
    if (!global.ok()) return global.status();
    const BlockLocation& loc = model.partition.blocks()[*global];
    const std::string where =
        absl::StrCat("tensor '", block.tensor(), "' block ", block.block());
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
    if (block.dtype() != FLOAT32) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": wire type ", DataType_Name(block.dtype()),
                       " is not supported by this server (float32 only)"));
    }
    const uint64_t expected = static_cast<uint64_t>(loc.length) * sizeof(float);
    if (block.data().size() != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": payload has ", block.data().size(), " bytes, expected ",
          expected, " (", loc.length, " float32 elements)"));
    }
    const int64_t bad = FindNonFinite(block.data());
    if (bad >= 0) {
      if (!options_.skip_nonfinite_gradients) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": gradient element ", loc.offset + bad,
                         " is NaN or infinite; the push was not applied"));
      }
      *nonfinite = true;
    }
    payloads.push_back({local, block.data()});
  }
  if (options_.mode == ConsistencyMode::kSync &&
      payloads.size() != model.blocks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a sync push must carry all ", model.blocks.size(),
                     " blocks this shard holds, got ", payloads.size()));
  }
  return payloads;
}

absl::Status Shard::Push(const PushRequest& request, PushResponse* response) {
  absl::StatusOr<const Model*> model = ValidateCommon(
      request.protocol_version(), request.worker_id(), request.step());
  if (!model.ok()) return Reject(model.status());
  bool nonfinite = false;
  absl::StatusOr<std::vector<BlockPayload>> payloads =
      ValidatePushBlocks(**model, request, &nonfinite);
  if (!payloads.ok()) return Reject(payloads.status());
  if (options_.mode == ConsistencyMode::kSync) {
    return PushSync(**model, request, *payloads, nonfinite, response);
  }
  return PushAsync(**model, request, *payloads, nonfinite, response);
}

namespace {

// dst[i] += src[i] for float32 wire bytes (unaligned: the protobuf string
// gives no alignment guarantee).
void AddWireFloats(absl::string_view src, float* dst) {
  const size_t n = src.size() / sizeof(float);
  const char* p = src.data();
  for (size_t i = 0; i < n; ++i) {
    float v;
    std::memcpy(&v, p + i * sizeof(float), sizeof(float));
    dst[i] += v;
  }
}

}  // namespace

absl::Status Shard::PushSync(const Model& model, const PushRequest& request,
                             const std::vector<BlockPayload>& payloads,
                             bool nonfinite, PushResponse* response) {
  const int worker = request.worker_id();
  absl::MutexLock lock(&mu_);
  if (request.step() < version_ ||
      (request.step() == version_ && contributed_[worker])) {
    // Every worker's push for a finished step was received, so this is a
    // retry of one already counted.
    pushes_duplicate_.fetch_add(1);
    response->set_duplicate(true);
    response->set_version(version_);
    return absl::OkStatus();
  }
  if (request.step() > version_) {
    return Reject(absl::FailedPreconditionError(absl::StrCat(
        "push for step ", request.step(), " but this shard is at step ",
        version_, ": a sync worker pushes the step it pulled")));
  }
  if (nonfinite) {
    nonfinite_skipped_.fetch_add(1);
  } else {
    for (const BlockPayload& p : payloads) {
      AddWireFloats(p.data, model.blocks[p.local]->gradient_sum.data());
    }
    ++finite_contributors_;
  }
  contributed_[worker] = true;
  ++contributors_;
  if (!nonfinite) pushes_applied_.fetch_add(1);
  if (contributors_ == options_.num_workers) ApplySyncStepLocked();
  response->set_duplicate(false);
  response->set_version(version_);
  return absl::OkStatus();
}

void Shard::ApplySyncStepLocked() {
  const Model* model = model_.load(std::memory_order_acquire);
  if (finite_contributors_ > 0) {
    const float inverse = 1.0f / static_cast<float>(finite_contributors_);
    for (const std::unique_ptr<Block>& block : model->blocks) {
      std::vector<float>& sum = block->gradient_sum;
      for (float& g : sum) g *= inverse;
      absl::MutexLock block_lock(&block->mu);
      ++block->update_count;
      optimizer_->Update(block->update_count, absl::MakeSpan(block->value), sum,
                         absl::MakeSpan(block->state));
      std::fill(sum.begin(), sum.end(), 0.0f);
    }
  }
  ++version_;  // releases the pulls waiting for this step
  std::fill(contributed_.begin(), contributed_.end(), false);
  contributors_ = 0;
  finite_contributors_ = 0;
}

absl::Status Shard::PushAsync(const Model& model, const PushRequest& request,
                              const std::vector<BlockPayload>& payloads,
                              bool nonfinite, PushResponse* response) {
  const int worker = request.worker_id();
  {
    absl::MutexLock lock(&mu_);
    if (request.pulled_version() < 0 || request.pulled_version() > version_) {
      return Reject(absl::InvalidArgumentError(absl::StrCat(
          "pulled_version must be in [0, ", version_,
          "] (this shard's version), got ", request.pulled_version())));
    }
    if (request.step() <= last_step_[worker]) {
      pushes_duplicate_.fetch_add(1);
      response->set_duplicate(true);
      response->set_version(version_);
      return absl::OkStatus();
    }
    // Claimed before applying so a concurrent retry is a duplicate; nothing
    // below can fail, so the claim never outlives a push that was not applied.
    last_step_[worker] = request.step();
  }
  if (nonfinite) {
    nonfinite_skipped_.fetch_add(1);
  } else {
    std::vector<float> gradient;
    for (const BlockPayload& p : payloads) {
      Block& block = *model.blocks[p.local];
      gradient.resize(p.data.size() / sizeof(float));
      std::memcpy(gradient.data(), p.data.data(), p.data.size());
      absl::MutexLock block_lock(&block.mu);
      ++block.update_count;
      optimizer_->Update(block.update_count, absl::MakeSpan(block.value),
                         gradient, absl::MakeSpan(block.state));
    }
  }
  absl::MutexLock lock(&mu_);
  if (!nonfinite) {
    const int64_t staleness = version_ - request.pulled_version();
    staleness_sum_ += staleness;
    staleness_max_ = std::max(staleness_max_, staleness);
    ++version_;
    pushes_applied_.fetch_add(1);
  }
  response->set_duplicate(false);
  response->set_version(version_);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> Shard::ResolvePullBlocks(
    const Model& model, const PullRequest& request) const {
  std::vector<int> locals;
  if (request.blocks_size() == 0) {
    locals.resize(model.blocks.size());
    for (size_t i = 0; i < locals.size(); ++i) locals[i] = static_cast<int>(i);
    return locals;
  }
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
    locals.push_back(local);
  }
  return locals;
}

void Shard::EncodeBlocks(const Model& model, const std::vector<int>& locals,
                         PullResponse* response) const {
  for (int local : locals) {
    const Block& block = *model.blocks[local];
    TensorBlock* out = response->add_blocks();
    out->set_tensor(*block.tensor_name);
    out->set_block(block.location->block);
    out->set_dtype(FLOAT32);
    absl::MutexLock block_lock(&block.mu);
    EncodeFloat32(block.value, out->mutable_data());
  }
}

void Shard::BeginShutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
}

absl::Status Shard::Pull(const PullRequest& request, absl::Time deadline,
                         PullResponse* response,
                         const std::function<bool()>& cancelled) {
  absl::StatusOr<const Model*> model = ValidateCommon(
      request.protocol_version(), request.worker_id(), request.step());
  if (!model.ok()) return Reject(model.status());
  absl::StatusOr<std::vector<int>> locals = ResolvePullBlocks(**model, request);
  if (!locals.ok()) return Reject(locals.status());

  const int64_t step = request.step();
  int64_t version;
  if (options_.mode == ConsistencyMode::kSync) {
    absl::MutexLock lock(&mu_);
    if (step > version_ + 1) {
      return Reject(absl::OutOfRangeError(
          absl::StrCat("pull for step ", step, " but this shard is at step ",
                       version_, ": a worker can be at most one step ahead")));
    }
    const absl::Time wait_until =
        std::min(deadline, absl::Now() + options_.max_pull_wait);
    auto released = [this, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return version_ >= step || shutting_down_;
    };
    // Woken by the last push of the step or by shutdown; the slices only
    // bound how late a cancelled caller is noticed.
    while (!mu_.AwaitWithDeadline(
        absl::Condition(&released),
        std::min(wait_until, absl::Now() + kCancellationCheck))) {
      if (cancelled != nullptr && cancelled()) {
        return absl::CancelledError("the caller cancelled the pull");
      }
      if (absl::Now() >= wait_until) {
        std::vector<int> missing;
        for (int w = 0; w < options_.num_workers; ++w) {
          if (!contributed_[w]) missing.push_back(w);
        }
        return absl::DeadlineExceededError(absl::StrCat(
            "step ", step, " is not complete: still waiting for the step ",
            version_, " gradients of workers [", absl::StrJoin(missing, ", "),
            "]"));
      }
    }
    if (shutting_down_ && version_ < step) {
      return absl::UnavailableError("the server is shutting down");
    }
    if (version_ > step) {
      return Reject(absl::FailedPreconditionError(
          absl::StrCat("pull for step ", step,
                       " but this shard is already at "
                       "step ",
                       version_)));
    }
    version = version_;
  } else {
    absl::MutexLock lock(&mu_);
    version = version_;
  }
  // Encoded outside mu_: in sync mode the step cannot advance before this
  // worker pushes, and block locks keep every block whole.
  response->set_version(version);
  EncodeBlocks(**model, *locals, response);
  pulls_served_.fetch_add(1);
  return absl::OkStatus();
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
  }
  stats.set_pushes_applied(pushes_applied_.load());
  stats.set_pushes_duplicate(pushes_duplicate_.load());
  stats.set_requests_rejected(requests_rejected_.load());
  stats.set_pulls_served(pulls_served_.load());
  stats.set_nonfinite_gradients_skipped(nonfinite_skipped_.load());
  absl::MutexLock lock(&mu_);
  stats.set_version(version_);
  stats.set_staleness_max(staleness_max_);
  const int64_t applied = pushes_applied_.load();
  if (options_.mode == ConsistencyMode::kAsync && applied > 0) {
    stats.set_staleness_mean(static_cast<double>(staleness_sum_) / applied);
  }
  return stats;
}

}  // namespace pstrain
