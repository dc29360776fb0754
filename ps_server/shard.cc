#include "ps_server/shard.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/init.h"
#include "common/protocol.h"
#include "common/status_text.h"
#include "common/tensor_codec.h"
#include "glog/logging.h"
#include "ps_server/checkpoint.h"

namespace pstrain {
namespace {

// How often the reaper answers expired pulls and checks leases: a late
// answer is at most this much past its deadline.
constexpr absl::Duration kReaperInterval = absl::Milliseconds(20);
constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
// A model of more blocks is refused: every shard holds the whole block
// layout, and a block's bookkeeping outweighs its values when blocks are
// tiny. 2^20 blocks of the workers' default 2^17 elements is 2^37
// parameters.
constexpr int64_t kMaxModelBlocks = int64_t{1} << 20;
// What a block of this shard costs beyond its floats and per-worker steps:
// the Block (lock, counters, five vectors), its allocations with the
// allocator's overhead, and the index entries pointing at it. ps_server
// grew by ~870 bytes per block of one float (sync, 2 workers); the
// hostile-input test's guard case measures it again and checks that the
// guard counts at least that much.
constexpr int64_t kBlockOverheadBytes = 1024;
// What every shard holds per block of the whole model (its BlockLocation
// and index entries).
constexpr int64_t kLayoutBytesPerBlock = 64;

void AtomicMax(std::atomic<int64_t>& target, int64_t value) {
  int64_t current = target.load();
  while (value > current && !target.compare_exchange_weak(current, value)) {
  }
}

// Whether a sync step at `version` (of a block or a table) may be applied.
// It needs at least one gradient, and then every member counted in the
// step's quorum must have given its own (a count is not enough: gradients
// of workers whose lease lapsed since are in the sum too), unless
// --replicas_to_aggregate gradients are in. When every member has lapsed,
// the gradients already in are the quorum: waiting for nobody would hold
// the step, and every pull of the next one, forever.
bool QuorumMet(int64_t version, int contributors,
               const std::vector<int64_t>& last_contributed,
               const std::vector<int64_t>& membership,
               int replicas_to_aggregate) {
  if (contributors == 0) return false;
  if (replicas_to_aggregate > 0 && contributors >= replicas_to_aggregate) {
    return true;
  }
  for (size_t w = 0; w < membership.size(); ++w) {
    if (membership[w] <= version && last_contributed[w] != version) {
      return false;
    }
  }
  return true;
}

// What a sync step at `version` still waits for, e.g. "the step 3
// gradients of workers [1]"; `what` names a contribution ("gradients").
std::string DescribeMissing(int64_t version,
                            const std::vector<int64_t>& last_contributed,
                            const std::vector<int64_t>& membership,
                            absl::string_view what) {
  std::vector<int> missing;
  for (size_t w = 0; w < membership.size(); ++w) {
    if (membership[w] <= version && last_contributed[w] != version) {
      missing.push_back(static_cast<int>(w));
    }
  }
  if (missing.empty()) {
    return absl::StrCat("a first step ", version, " ", what,
                        ": no member is left in its quorum, the next worker "
                        "to push it completes it");
  }
  return absl::StrCat("the step ", version, " ", what, " of workers [",
                      absl::StrJoin(missing, ", "), "]");
}

}  // namespace

struct Shard::Model {
  ModelSchema schema;
  Partition partition;
  std::vector<std::unique_ptr<SparseState>> sparse;  // schema order
  absl::flat_hash_map<std::string, int> sparse_index;
  std::vector<std::unique_ptr<Block>> blocks;  // this shard's, global order
  std::vector<int> local_of_global;            // -1 when on another shard
  int64_t num_elements = 0;
};

// A pull waiting for its step: for dense blocks `locals`, or for sparse
// table `sparse`. `answer` is called once, with OK when the pull may proceed
// (it then copies what was asked for) or with why it may not.
struct Shard::Waiter {
  std::vector<int> locals;
  int sparse = -1;
  int64_t step = 0;
  absl::Time deadline;
  std::function<void(absl::Status)> answer;
};

struct Shard::WorkerState {
  bool member = false;   // counted in quorums from joined_at
  bool pending = false;  // (re)joining: a member from its next pull
  int64_t joined_at = kNever;
  uint64_t incarnation = 0;  // 0: not yet seen
  absl::Time last_seen;
  // One past the last step pushed here: the ssp clock, and where a
  // restarted async/ssp worker resumes so its pushes are not repeats.
  int64_t next_step = 0;
};

absl::StatusOr<ConsistencyMode> ParseConsistencyMode(absl::string_view name) {
  if (name == "sync") return ConsistencyMode::kSync;
  if (name == "async") return ConsistencyMode::kAsync;
  if (name == "ssp") return ConsistencyMode::kSsp;
  return absl::InvalidArgumentError(
      absl::StrCat("--mode must be sync, async or ssp, got '", name, "'"));
}

std::string ConsistencyModeName(ConsistencyMode mode) {
  switch (mode) {
    case ConsistencyMode::kSync:
      return "sync";
    case ConsistencyMode::kAsync:
      return "async";
    case ConsistencyMode::kSsp:
      return "ssp";
  }
  return "?";
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
  if (options.max_workers != 0 && options.max_workers < options.num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_workers must be >= --num_workers (",
                     options.num_workers, "), got ", options.max_workers));
  }
  if (options.ssp_staleness < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--staleness must be >= 0, got ", options.ssp_staleness));
  }
  if (options.replicas_to_aggregate < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--replicas_to_aggregate must be >= 0, got ",
                     options.replicas_to_aggregate));
  }
  if (options.worker_lease <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--worker_lease_s must be positive");
  }
  if (options.max_pull_wait <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max_pull_wait_s must be positive");
  }
  absl::StatusOr<std::unique_ptr<Optimizer>> optimizer =
      Optimizer::Create(options.optimizer);
  if (!optimizer.ok()) return optimizer.status();
  ShardOptions resolved = options;
  if (resolved.max_workers == 0) resolved.max_workers = options.num_workers;
  return std::unique_ptr<Shard>(new Shard(resolved, std::move(*optimizer)));
}

Shard::Shard(const ShardOptions& options, std::unique_ptr<Optimizer> optimizer)
    : options_(options), optimizer_(std::move(optimizer)) {
  {
    absl::MutexLock lock(&mu_);
    workers_.resize(options_.max_workers);
    const absl::Time now = absl::Now();
    for (int w = 0; w < options_.max_workers; ++w) {
      workers_[w].last_seen = now;  // the lease of an expected worker starts
      if (w < options_.num_workers) {
        workers_[w].member = true;
        workers_[w].joined_at = 0;
      }
    }
    PublishMembershipLocked();
  }
  reaper_ = std::thread([this] { RunReaper(); });
}

Shard::~Shard() {
  BeginShutdown();
  if (reaper_.joinable()) reaper_.join();
}

absl::Status Shard::Reject(absl::Status status) {
  requests_rejected_.fetch_add(1);
  return status;
}

void Shard::ReportInternalError(absl::string_view what,
                                const absl::Status& status) {
  internal_errors_.fetch_add(1);
  LOG(ERROR) << "internal error, validation and apply disagree: " << what
             << ": " << status;
  // `bazel test` sets TEST_TMPDIR for a test and every process it starts: a
  // disagreement then fails the test where it happens.
  static const bool under_test = std::getenv("TEST_TMPDIR") != nullptr;
  CHECK(!under_test) << "internal error under test: " << what << ": " << status;
}

// ---------------------------------------------------------------------------
// Registration and the model.

absl::Status Shard::CheckModelFits(const ModelSchema& schema) const {
  if (absl::Status s = ValidateSchema(schema); !s.ok()) return s;
  // Counted from the schema, as Partition::Create will lay it out (blocks
  // round-robin over the shards), so that nothing is allocated for a model
  // that is refused.
  const int64_t block_elements = schema.block_elements();
  int64_t model_blocks = 0;
  for (const DenseTensorSpec& tensor : schema.dense()) {
    // ValidateSchema bounds each tensor to 2^40 elements: no overflow.
    model_blocks += (NumElements(tensor) + block_elements - 1) / block_elements;
  }
  if (model_blocks > kMaxModelBlocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model has ", model_blocks, " blocks of block_elements ",
        block_elements, "; at most ", kMaxModelBlocks,
        " are allowed: use a larger block_elements (a worker's "
        "--block_elements)"));
  }
  int64_t shard_blocks = 0, shard_elements = 0, global = 0;
  for (const DenseTensorSpec& tensor : schema.dense()) {
    const int64_t elements = NumElements(tensor);
    for (int64_t offset = 0; offset < elements;
         offset += block_elements, ++global) {
      if (global % options_.num_shards != options_.shard_id) continue;
      ++shard_blocks;
      shard_elements += std::min(block_elements, elements - offset);
    }
  }
  // Values, optimizer state and (sync) the step's gradient sum, plus what
  // each block costs beyond its floats: with tiny blocks that is most of it.
  const int64_t floats_per_element = 1 + optimizer_->state_per_element() + 1;
  const int64_t per_block =
      kBlockOverheadBytes + options_.max_workers * int64_t{sizeof(int64_t)};
  const int64_t bytes = shard_elements * 4 * floats_per_element +
                        shard_blocks * per_block +
                        model_blocks * kLayoutBytesPerBlock;
  if (bytes > options_.max_shard_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the model needs ", bytes >> 20, " MiB on this shard (", shard_elements,
        " elements with optimizer state in ", shard_blocks,
        " blocks of at most ", block_elements, " elements, each block ",
        per_block, " bytes of bookkeeping); --max_shard_memory_gb allows ",
        options_.max_shard_bytes >> 20,
        " MiB: use more shards or a larger block_elements"));
  }
  return absl::OkStatus();
}

absl::Status Shard::InstallModel(const ModelSchema& schema) {
  if (absl::Status s = CheckModelFits(schema); !s.ok()) return s;
  absl::StatusOr<Partition> partition =
      Partition::Create(schema, options_.num_shards);
  if (!partition.ok()) return partition.status();
  auto model = std::make_unique<Model>();
  model->schema = schema;
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
      if (options_.mode == ConsistencyMode::kSync) {
        block->gradient_sum.assign(loc.length, 0.0f);
        block->last_contributed.assign(options_.max_workers, -1);
      } else {
        block->last_step.assign(options_.max_workers, -1);
      }
    }
    model->local_of_global[g] = static_cast<int>(model->blocks.size());
    model->num_elements += loc.length;
    model->blocks.push_back(std::move(block));
  }
  for (const SparseTableSpec& spec : model->schema.sparse()) {
    SparseTableOptions table_options;
    table_options.name = spec.name();
    table_options.dim = spec.dim();
    table_options.init = spec.init();
    table_options.seed = model->schema.seed();
    const SparseOptimizer& o = spec.optimizer();
    table_options.optimizer.name = o.name();
    table_options.optimizer.learning_rate = o.learning_rate();
    table_options.optimizer.initial_accumulator = o.initial_accumulator();
    table_options.optimizer.beta1 = o.beta1();
    table_options.optimizer.beta2 = o.beta2();
    table_options.optimizer.epsilon = o.epsilon();
    table_options.optimizer.ftrl_alpha = o.ftrl_alpha();
    table_options.optimizer.ftrl_beta = o.ftrl_beta();
    table_options.optimizer.ftrl_l1 = o.ftrl_l1();
    table_options.optimizer.ftrl_l2 = o.ftrl_l2();
    table_options.max_rows = options_.sparse_max_rows;
    table_options.admit_after = options_.sparse_admit_after;
    absl::StatusOr<std::unique_ptr<SparseTable>> table =
        SparseTable::Create(table_options);
    if (!table.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse table ", QuoteForStatus(spec.name()), ": ",
                       table.status().message()));
    }
    auto state = std::make_unique<SparseState>();
    state->spec = &spec;
    state->table = std::move(*table);
    {
      absl::MutexLock state_lock(&state->mu);
      state->last_contributed.assign(options_.max_workers, -1);
      state->last_step.assign(options_.max_workers, -1);
    }
    model->sparse_index[spec.name()] = static_cast<int>(model->sparse.size());
    model->sparse.push_back(std::move(state));
  }
  register_mu_.AssertHeld();
  model_owner_ = std::move(model);
  model_.store(model_owner_.get(), std::memory_order_release);
  return absl::OkStatus();
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
  const bool elastic = options_.max_workers > options_.num_workers;
  if (!elastic && request.num_workers() != options_.num_workers) {
    return Reject(absl::FailedPreconditionError(
        absl::StrCat("client expects ", request.num_workers(),
                     " workers but this server was started with --num_workers=",
                     options_.num_workers, " (and no larger --max_workers)")));
  }
  const int worker = request.worker_id();
  if (worker < -1 || worker >= options_.max_workers) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("worker_id must be in [0, ", options_.max_workers,
                     ") or -1 for an observer, got ", worker)));
  }
  if (absl::Status s = ValidateSchema(request.schema()); !s.ok()) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("invalid model schema: ", s.message())));
  }

  RegisterModelResponse response;
  response.set_mode(ConsistencyModeName(options_.mode));
  {
    absl::MutexLock lock(&register_mu_);
    if (model_owner_ != nullptr) {
      const std::string difference =
          FirstSchemaDifference(model_owner_->schema, request.schema());
      if (!difference.empty()) {
        return Reject(absl::FailedPreconditionError(absl::StrCat(
            "a different model is already registered on this shard: ",
            difference)));
      }
      response.set_created(false);
    } else {
      if (absl::Status s = InstallModel(request.schema()); !s.ok()) {
        return Reject(s);
      }
      response.set_created(true);
    }
  }
  const Model* model = model_.load(std::memory_order_acquire);
  if (options_.mode == ConsistencyMode::kSync) {
    // A joining worker starts at the step the job is at.
    int64_t step = 0;
    for (const auto& block : model->blocks) {
      step = std::max(step, block->version.load());
    }
    response.set_step(step);
  } else if (worker >= 0) {
    absl::MutexLock lock(&mu_);
    response.set_step(workers_[worker].next_step);
  }

  if (worker >= 0) {
    bool dropped = false;
    {
      absl::MutexLock lock(&mu_);
      WorkerState& state = workers_[worker];
      const bool restarted =
          state.incarnation != 0 && state.incarnation != request.incarnation();
      if (restarted || !state.member) {
        // Its predecessor's step must not wait for it: it joins afresh at
        // the step of its next pull.
        dropped = state.member;
        state.member = false;
        state.joined_at = kNever;
        state.pending = true;
        PublishMembershipLocked();
      }
      state.incarnation = request.incarnation();
      state.last_seen = absl::Now();
    }
    if (dropped) CompleteReadyBlocks();
  }
  return response;
}

// ---------------------------------------------------------------------------
// Membership.

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

void Shard::TouchLocked(int worker) {
  WorkerState& state = workers_[worker];
  state.last_seen = absl::Now();
  // Back after its lease expired (or a new id): it rejoins at its next pull.
  if (!state.member) state.pending = true;
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
  absl::MutexLock lock(&mu_);
  const absl::Time expired_before = absl::Now() - options_.worker_lease;
  bool dropped = false;
  for (WorkerState& state : workers_) {
    if ((state.member || state.pending) && state.last_seen < expired_before) {
      dropped |= state.member;
      state.member = false;
      state.pending = false;
      state.joined_at = kNever;
    }
  }
  if (dropped) PublishMembershipLocked();
  return dropped;
}

absl::Status Shard::Heartbeat(const HeartbeatRequest& request) {
  if (request.worker_id() < 0 || request.worker_id() >= options_.max_workers) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("worker_id must be in [0, ", options_.max_workers,
                     "), got ", request.worker_id())));
  }
  absl::MutexLock lock(&mu_);
  TouchLocked(request.worker_id());
  return absl::OkStatus();
}

absl::Status Shard::Leave(const LeaveRequest& request) {
  if (request.worker_id() < 0 || request.worker_id() >= options_.max_workers) {
    return Reject(absl::InvalidArgumentError(
        absl::StrCat("worker_id must be in [0, ", options_.max_workers,
                     "), got ", request.worker_id())));
  }
  {
    absl::MutexLock lock(&mu_);
    WorkerState& state = workers_[request.worker_id()];
    state.member = false;
    state.pending = false;
    state.joined_at = kNever;
    PublishMembershipLocked();
  }
  CompleteReadyBlocks();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Push.

absl::StatusOr<const Shard::Model*> Shard::ValidateCommon(
    uint32_t protocol_version, int worker_id, int64_t step,
    bool allow_observer) const {
  if (protocol_version != kProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "protocol version ", protocol_version,
        " is not supported; this server speaks ", kProtocolVersion));
  }
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) {
    // NOT_FOUND tells a client to register (again, after a restart).
    return absl::NotFoundError(
        "no model is registered on this shard: call RegisterModel first");
  }
  if ((worker_id < 0 && !(allow_observer && worker_id == -1)) ||
      worker_id >= options_.max_workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker_id must be in [0, ", options_.max_workers, ")",
        allow_observer ? " or -1 for an observer" : "", ", got ", worker_id));
  }
  // Steps count updates; 2^53 leaves every step + 1 exact and safe.
  constexpr int64_t kMaxStep = int64_t{1} << 53;
  if (step < 0 || step >= kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat("step must be in [0, 2^53), got ", step));
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

void Shard::FastForwardLocked(const Model& model, int64_t step) {
  int64_t lost = 0;
  for (const auto& block : model.blocks) {
    absl::MutexLock block_lock(&block->mu);
    const int64_t version = block->version.load();
    if (version >= step) continue;
    lost = std::max(lost, step - version);
    updates_lost_.fetch_add(step - version);
    block->contributors = 0;
    block->finite_contributors = 0;
    block->version.store(step);
  }
  // Tables behind the workers' step skip to it like blocks; their rows
  // keep what the checkpoint restored.
  for (const auto& state : model.sparse) {
    absl::MutexLock state_lock(&state->mu);
    const int64_t version = state->version.load();
    if (version >= step) continue;
    lost = std::max(lost, step - version);
    updates_lost_.fetch_add(step - version);
    state->gradient_sum.clear();
    state->contributors = 0;
    state->version.store(step);
  }
  steps_lost_.fetch_add(lost);
  recovering_ = false;
  recovery_horizon_ = std::max(recovery_horizon_, step);
}

absl::StatusOr<PushResponse> Shard::Push(const WirePushRequest& request) {
  absl::StatusOr<const Model*> model =
      ValidateCommon(request.protocol_version, request.worker_id, request.step,
                     /*allow_observer=*/false);
  if (!model.ok()) return Reject(model.status());
  absl::StatusOr<std::vector<BlockPush>> pushes =
      ValidatePushBlocks(**model, request);
  if (!pushes.ok()) return Reject(pushes.status());
  const bool sync = options_.mode == ConsistencyMode::kSync;
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
        if (recovering_) {
          FastForwardLocked(**model, request.step);
          break;
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
          return Push(request);
        }
        absl::Status refused;
        if (request.step == version + 1 && version <= recovery_horizon_) {
          absl::MutexLock block_lock(&block.mu);
          refused = absl::UnavailableError(absl::StrCat(
              "push for step ", request.step, " waits on this restored shard: ",
              DescribeBlockWaitLocked(block, *membership_), "; retry"));
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
    }
  }

  PushResponse response;
  bool completed_a_step = false;
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
    // Validated above: dtype supported and length exact, so this cannot fail.
    // The first finite gradient of a step overwrites what the last step
    // left, which saves clearing the sum after every step.
    if (absl::Status s =
            DecodeSegments(push.wire->dtype, push.wire->data,
                           absl::MakeSpan(block.gradient_sum),
                           /*accumulate=*/block.finite_contributors > 0);
        !s.ok()) {
      ReportInternalError(
          absl::StrCat("sync gradient of worker ", worker, " for ",
                       QuoteForStatus(*block.tensor_name), " block ",
                       block.location->block, " step ", version),
          s);
    }
    ++block.finite_contributors;
  }
  block.last_contributed[worker] = version;
  ++block.contributors;
  *completed = CompleteIfReadyLocked(block, membership);
  return BlockResult::kApplied;
}

bool Shard::CompleteIfReadyLocked(Block& block, const Membership& membership) {
  const int64_t version = block.version.load();
  if (!QuorumMet(version, block.contributors, block.last_contributed,
                 membership, options_.replicas_to_aggregate)) {
    return false;
  }
  if (block.finite_contributors > 1) {
    const float inverse = 1.0f / static_cast<float>(block.finite_contributors);
    for (float& g : block.gradient_sum) g *= inverse;
  }
  if (block.finite_contributors > 0) {
    optimizer_->Update(version + 1, absl::MakeSpan(block.value),
                       block.gradient_sum, absl::MakeSpan(block.state));
  }
  block.contributors = 0;
  block.finite_contributors = 0;
  block.version.store(version + 1);
  return true;
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
    absl::MutexLock lock(&state->mu);
    completed |= CompleteSparseIfReadyLocked(*state, *members);
  }
  if (completed) ReleaseReadyWaiters();
}

// ---------------------------------------------------------------------------
// Sparse tables.

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
  for (uint64_t id : ids) {
    const int owner = SparseShardOf(table, id, options_.num_shards);
    if (owner != options_.shard_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", id, " of sparse table ", QuoteForStatus(table),
          " lives on shard ", owner, ", this is shard ", options_.shard_id));
    }
  }
  if (unique) {
    absl::flat_hash_set<uint64_t> seen;
    seen.reserve(ids.size());
    for (uint64_t id : ids) {
      if (!seen.insert(id).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "row ", id, " of sparse table ", QuoteForStatus(table),
            " appears twice in one push: sum its gradients first"));
      }
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
  // Rows a worker did not touch count as a zero gradient from it, as in the
  // dense path: the mean is over every contributor.
  const int64_t dim = state.spec->dim();
  std::vector<uint64_t> ids;
  std::vector<float> grads;
  ids.reserve(state.gradient_sum.size());
  grads.reserve(state.gradient_sum.size() * dim);
  const float inverse = 1.0f / static_cast<float>(state.contributors);
  for (auto& [id, sum] : state.gradient_sum) {
    ids.push_back(id);
    for (float g : sum) grads.push_back(g * inverse);
  }
  // Ids are unique (map keys) and lengths consistent; only a sum that
  // overflowed to infinity could be refused.
  if (absl::Status s = state.table->Push(ids, grads); !s.ok()) {
    ReportInternalError(absl::StrCat("sync step ", version, " of sparse table ",
                                     QuoteForStatus(state.spec->name())),
                        s);
  }
  state.gradient_sum.clear();
  state.contributors = 0;
  state.version.store(version + 1);
  return true;
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
  if (options_.mode == ConsistencyMode::kAsync) return answer(absl::OkStatus());

  auto waiter = std::make_unique<Waiter>();
  waiter->sparse = (*model)->sparse_index.at(request.table());
  waiter->step = step;
  bool completed = false;
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (worker >= 0) {
      TouchLocked(worker);
      JoinIfPendingLocked(worker, step);
    }
    if (options_.mode == ConsistencyMode::kSync) {
      const int64_t version = table->version.load();
      if (version + 1 < step && recovering_) {
        FastForwardLocked(**model, step);
      } else if (version + 1 < step) {
        lock.Release();
        return answer(Reject(absl::OutOfRangeError(absl::StrCat(
            "sparse pull for step ", step, " but table ",
            QuoteForStatus(request.table()), " is at step ", version,
            ": a worker can be at most one step ahead"))));
      }
      // As for blocks: a member pulling step s has pushed s - 1.
      completed = CreditLostGradientsLocked(**model, worker, step);
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
  const std::vector<uint64_t> ids(request.ids().begin(), request.ids().end());
  absl::StatusOr<SparseState*> state =
      ValidateSparse(**model, request.table(), ids, /*unique=*/true);
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
  SparsePushResponse response;
  bool completed = false;
  {
    absl::MutexLock lock(&mu_);
    TouchLocked(request.worker_id());
  }
  if (options_.mode == ConsistencyMode::kSync) {
    if (absl::Status ahead = CatchUpSparseForPush(**model, table, request);
        !ahead.ok()) {
      return Reject(std::move(ahead));
    }
    const std::shared_ptr<const Membership> members = membership();
    absl::MutexLock lock(&table.mu);
    const int64_t version = table.version.load();
    if (request.step() > version) {
      return Reject(absl::FailedPreconditionError(absl::StrCat(
          "sparse push for step ", request.step(), " but table ",
          QuoteForStatus(request.table()), " is at step ", version)));
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
    for (size_t i = 0; i < ids.size(); ++i) {
      std::vector<float>& sum = table.gradient_sum[ids[i]];
      if (sum.empty()) sum.assign(dim, 0.0f);
      for (int64_t j = 0; j < dim; ++j) sum[j] += grads[i * dim + j];
    }
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
    SparsePushResult pushed;
    // Validated above (unique ids, sizes, finite): this cannot fail.
    if (absl::Status s = table.table->Push(ids, grads, &pushed); !s.ok()) {
      ReportInternalError(
          absl::StrCat("async push of worker ", request.worker_id(), " step ",
                       request.step(), " to sparse table ",
                       QuoteForStatus(table.spec->name())),
          s);
    }
    response.set_rows_dropped(static_cast<int32_t>(pushed.dropped_unadmitted));
    absl::MutexLock lock(&mu_);
    WorkerState& w = workers_[request.worker_id()];
    w.next_step = std::max(w.next_step, request.step() + 1);
  }
  table.rows_pushed.fetch_add(ids.size());
  blocks_applied_.fetch_add(1);
  if (completed || options_.mode == ConsistencyMode::kSsp) {
    ReleaseReadyWaiters();
  }
  return response;
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
  // A version from the future is possible only after this shard restored an
  // older checkpoint: the gradient is then as fresh as it can be.
  const int64_t staleness = std::max<int64_t>(0, version - push.wire->version);
  staleness_sum_.fetch_add(staleness);
  AtomicMax(staleness_max_, staleness);
  async_applies_.fetch_add(1);
  // Decoded a piece at a time into the update: the gradient is read once
  // from the received bytes and never written out whole.
  if (absl::Status s = DecodeSegmentsInPieces(
          push.wire->dtype, push.wire->data, block.location->length,
          [&](int64_t offset, absl::Span<const float> piece) {
            block.mu.AssertHeld();  // held by the caller of this callback
            optimizer_->UpdateRange(version + 1, absl::MakeSpan(block.value),
                                    offset, piece, absl::MakeSpan(block.state));
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

// ---------------------------------------------------------------------------
// Pull.

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

bool Shard::WaiterReadyLocked(const Waiter& waiter) const {
  if (options_.mode == ConsistencyMode::kSsp) {
    const int64_t min_clock = MinMemberClockLocked();
    return min_clock == kNever ||
           waiter.step - min_clock <= options_.ssp_staleness;
  }
  const Model* model = model_.load(std::memory_order_acquire);
  if (waiter.sparse >= 0) {
    return model->sparse[waiter.sparse]->version.load() >= waiter.step;
  }
  for (int local : waiter.locals) {
    if (model->blocks[local]->version.load() < waiter.step) return false;
  }
  return true;
}

void Shard::Pull(const PullRequest& request, absl::Time deadline,
                 PullDone done) {
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
  bool completed = false;  // a lost gradient completed some block's step
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (worker >= 0) {
      TouchLocked(worker);
      if (options_.mode != ConsistencyMode::kAsync) {
        JoinIfPendingLocked(worker, step);
      }
    }
    if (options_.mode == ConsistencyMode::kSync) {
      for (int local : waiter->locals) {
        const Block& block = *(*model)->blocks[local];
        const int64_t version = block.version.load();
        if (version + 1 >= step) continue;
        if (recovering_) {
          FastForwardLocked(**model, step);
          break;
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
      // A member pulling step s has pushed step s - 1 everywhere; a block
      // of a restored shard without its gradient for a step that was in
      // flight when the shard died lost it with the shard's previous life.
      // Waiting for it would wait forever, so it counts as given, like a
      // skipped non-finite one. Nowhere else: a client that pulls before it
      // pushes must not complete a step without its gradient.
      completed = CreditLostGradientsLocked(**model, worker, step);
    }
    if (options_.mode != ConsistencyMode::kAsync &&
        !WaiterReadyLocked(*waiter)) {
      if (shutting_down_) {
        lock.Release();
        return done(absl::UnavailableError("the server is shutting down"), {});
      }
      waiter->deadline =
          std::min(deadline, absl::Now() + options_.max_pull_wait);
      const Model* m = *model;
      std::vector<int> locals = waiter->locals;
      waiter->answer = [this, m, locals = std::move(locals),
                        done = std::move(done)](absl::Status status) {
        if (!status.ok()) return done(std::move(status), {});
        done(absl::OkStatus(), CopyBlocks(*m, locals));
      };
      waiters_.push_back(std::move(waiter));
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
  done(absl::OkStatus(), CopyBlocks(**model, waiter->locals));
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
  const Model* model = model_.load(std::memory_order_acquire);
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

absl::Status Shard::CatchUpSparseForPush(const Model& model, SparseState& table,
                                         const SparsePushRequest& request) {
  const int64_t step = request.step();
  bool completed = false;
  absl::Status waiting;
  {
    absl::MutexLock lock(&mu_);
    const int64_t version = table.version.load();
    if (step <= version) return absl::OkStatus();
    if (recovering_) {
      FastForwardLocked(model, step);
      return absl::OkStatus();
    }
    // As for dense pushes: the worker pulled `step` from this shard's
    // previous life, which lost its step - 1 gradient.
    completed = CreditLostGradientsLocked(model, request.worker_id(), step);
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

bool Shard::CreditLostGradientsLocked(const Model& model, int worker,
                                      int64_t step) {
  if (worker < 0 || step < 1 || step - 1 > recovery_horizon_ ||
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
    ++block->contributors;
    gradients_lost_.fetch_add(1);
    completed |= CompleteIfReadyLocked(*block, *membership_);
  }
  for (const auto& table : model.sparse) {
    absl::MutexLock table_lock(&table->mu);
    if (table->version.load() != step - 1 ||
        table->last_contributed[worker] == step - 1) {
      continue;
    }
    table->last_contributed[worker] = step - 1;
    ++table->contributors;
    gradients_lost_.fetch_add(1);
    completed |= CompleteSparseIfReadyLocked(*table, *membership_);
  }
  return completed;
}

void Shard::RunReaper() {
  while (true) {
    bool stop = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&shutting_down_), kReaperInterval);
      stop = shutting_down_;
    }
    if (stop) return;
    if (ExpireLeases()) {
      CompleteReadyBlocks();
      ReleaseReadyWaiters();  // ssp: a dropped laggard no longer holds others
    }
    std::vector<std::unique_ptr<Waiter>> expired;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      auto split = std::stable_partition(
          waiters_.begin(), waiters_.end(),
          [&](const std::unique_ptr<Waiter>& w) { return w->deadline > now; });
      std::move(split, waiters_.end(), std::back_inserter(expired));
      waiters_.erase(split, waiters_.end());
    }
    for (std::unique_ptr<Waiter>& w : expired) {
      w->answer(absl::DeadlineExceededError(absl::StrCat(
          "step ", w->step, " is not complete: ", DescribeWait(*w))));
    }
  }
}

void Shard::BeginShutdown() {
  std::vector<std::unique_ptr<Waiter>> waiting;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    waiting.swap(waiters_);
  }
  for (std::unique_ptr<Waiter>& w : waiting) {
    w->answer(absl::UnavailableError("the server is shutting down"));
  }
}

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
    block.value = saved.value;
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
    tables_behind = std::max(tables_behind, oldest - saved.version);
    updates_lost_.fetch_add(std::max<int64_t>(0, oldest - saved.version));
    table.version.store(std::max(saved.version, oldest));
    newest = std::max(newest, table.version.load());
  }
  steps_lost_.fetch_add(tables_behind);
  absl::MutexLock state_lock(&mu_);
  recovering_ = options_.mode == ConsistencyMode::kSync;
  recovery_horizon_ = newest;
  return absl::OkStatus();
}

absl::StatusOr<ShardSnapshot> Shard::Snapshot(int64_t sequence) const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) {
    return absl::FailedPreconditionError("no model is registered yet");
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
    out.value = block.value;
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

int64_t Shard::MinVersion() const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr || model->blocks.empty()) return 0;
  int64_t min_version = kNever;
  for (const auto& block : model->blocks) {
    min_version = std::min(min_version, block->version.load());
  }
  return min_version;
}

StatsResponse Shard::Stats() const {
  StatsResponse stats;
  stats.set_shard_id(options_.shard_id);
  stats.set_num_shards(options_.num_shards);
  stats.set_mode(ConsistencyModeName(options_.mode));
  const Model* model = model_.load(std::memory_order_acquire);
  stats.set_model_registered(model != nullptr);
  stats.set_num_workers(options_.num_workers);
  if (model != nullptr) {
    *stats.mutable_schema() = model->schema;
    stats.set_num_blocks(model->blocks.size());
    stats.set_num_elements(model->num_elements);
    for (const auto& state : model->sparse) {
      const SparseTableStats table = state->table->Stats();
      SparseStats* out = stats.add_sparse();
      out->set_name(state->spec->name());
      out->set_version(state->version.load());
      out->set_rows(table.rows);
      out->set_rows_created(table.rows_created);
      out->set_rows_evicted(table.rows_evicted);
      out->set_pulls_unadmitted(table.pulls_unadmitted);
      out->set_pushes_dropped_unadmitted(table.pushes_dropped_unadmitted);
      out->set_ids_pending_admission(table.ids_pending_admission);
      out->set_memory_bytes(table.memory_bytes);
      out->set_rows_pulled(state->rows_pulled.load());
      out->set_rows_pushed(state->rows_pushed.load());
    }
  }
  stats.set_version(MinVersion());
  stats.set_blocks_applied(blocks_applied_.load());
  stats.set_blocks_duplicate(blocks_duplicate_.load());
  stats.set_late_gradients_dropped(blocks_late_.load());
  stats.set_requests_rejected(requests_rejected_.load());
  stats.set_pulls_served(pulls_served_.load());
  stats.set_nonfinite_gradients_skipped(nonfinite_skipped_.load());
  stats.set_staleness_max(staleness_max_.load());
  const int64_t applies = async_applies_.load();
  if (applies > 0) {
    stats.set_staleness_mean(static_cast<double>(staleness_sum_.load()) /
                             applies);
  }
  stats.set_steps_lost(steps_lost_.load());
  stats.set_gradients_lost(gradients_lost_.load());
  stats.set_updates_lost(updates_lost_.load());
  stats.set_internal_errors(internal_errors_.load());
  stats.set_ssp_gap_max(ssp_gap_max_.load());
  absl::MutexLock lock(&mu_);
  int members = 0;
  for (const WorkerState& state : workers_) members += state.member;
  stats.set_members(members);
  stats.set_waiting_pulls(waiters_.size());
  return stats;
}

}  // namespace pstrain
