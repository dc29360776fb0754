// The shard's life: creation and destruction, registration and the model,
// the validation every request shares, the reaper and shutdown, and stats.
// The rest of Shard is listed at the top of shard.h.
#include "ps_server/shard.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/init.h"
#include "common/protocol.h"
#include "common/status_text.h"
#include "glog/logging.h"
#include "ps_server/shard_internal.h"

namespace pstrain {
namespace {

// How often the reaper answers expired pulls and checks leases: a late
// answer is at most this much past its deadline.
constexpr absl::Duration kReaperInterval = absl::Milliseconds(20);
// A reaper tick may come this late on a busy machine and still count in
// full toward leases; beyond it, the server was not running (see
// Shard::lease_clock_ns_).
constexpr absl::Duration kLateTick = absl::Milliseconds(100);
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

}  // namespace

using shard_internal::AtomicMax;
using shard_internal::kNever;

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
  if (options.startup_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--startup_timeout_s must be positive");
  }
  if (options.min_workers < 0 || options.min_workers > options.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--min_workers must be in [1, --num_workers=", options.num_workers,
        "] (0: all of them), got ", options.min_workers));
  }
  if (options.max_pull_wait <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max_pull_wait_s must be positive");
  }
  absl::StatusOr<std::unique_ptr<Optimizer>> optimizer =
      Optimizer::Create(options.optimizer);
  if (!optimizer.ok()) return optimizer.status();
  ShardOptions resolved = options;
  if (resolved.max_workers == 0) resolved.max_workers = options.num_workers;
  if (resolved.min_workers == 0) resolved.min_workers = options.num_workers;
  return std::unique_ptr<Shard>(new Shard(resolved, std::move(*optimizer)));
}

Shard::Shard(const ShardOptions& options, std::unique_ptr<Optimizer> optimizer)
    : options_(options), optimizer_(std::move(optimizer)) {
  {
    absl::MutexLock lock(&mu_);
    workers_.resize(options_.max_workers);
    const absl::Time now = absl::Now();
    for (int w = 0; w < options_.max_workers; ++w) {
      // Expected workers are members from the first step; their leases
      // start at their first contact (sync/ssp) or now (async).
      workers_[w].last_seen = LeaseNow();
      if (w < options_.num_workers) {
        workers_[w].member = true;
        workers_[w].joined_at = 0;
      }
    }
    PublishMembershipLocked();
    waiting_since_ = now;
    last_wait_log_ = now;
    started_ = options_.mode == ConsistencyMode::kAsync;
    // A sync shard that starts with nothing restored may be a restart that
    // lost its state (no checkpoint yet, or none kept): its workers then
    // come at the job's step s, not 0. Once all of them have, it takes that
    // step with its initial values (FastForwardLocked, counted in
    // steps_lost) rather than end the job. A new job's first contact is at
    // the step it holds and clears this.
    fresh_ = options_.mode == ConsistencyMode::kSync;
    if (started_) started_at_ = now;
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

absl::StatusOr<std::vector<std::unique_ptr<Optimizer>>>
Shard::MakeTensorOptimizers(const ModelSchema& schema) const {
  std::vector<std::unique_ptr<Optimizer>> optimizers(schema.dense_size());
  for (int t = 0; t < schema.dense_size(); ++t) {
    const DenseTensorSpec& tensor = schema.dense(t);
    if (!tensor.has_optimizer()) continue;
    if (tensor.role() == DenseTensorSpec::STATE) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", QuoteForStatus(tensor.name()),
                       " is STATE (its pushes are values): it has no "
                       "optimizer"));
    }
    absl::StatusOr<std::unique_ptr<Optimizer>> made =
        Optimizer::CreateTorch(tensor.optimizer());
    if (!made.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", QuoteForStatus(tensor.name()), ": ",
                       made.status().message()));
    }
    optimizers[t] = std::move(*made);
  }
  return optimizers;
}

namespace {

// Which update rule the registered model's trained tensors follow, for the
// log: a model registered with the workers' torch optimizers (pstrain.torch's
// optimizer=) takes none of --optimizer and --learning_rate, which the
// server's first lines still show.
std::string DescribeUpdateRules(const ModelSchema& schema,
                                const OptimizerConfig& flags) {
  int trained = 0, own = 0;
  std::vector<std::string> rules;
  for (const DenseTensorSpec& tensor : schema.dense()) {
    if (tensor.role() == DenseTensorSpec::STATE) continue;
    ++trained;
    if (!tensor.has_optimizer()) continue;
    ++own;
    const std::string rule = absl::StrCat(tensor.optimizer().name(), " lr ",
                                          tensor.optimizer().lr());
    if (std::find(rules.begin(), rules.end(), rule) == rules.end()) {
      rules.push_back(rule);
    }
  }
  const std::string servers = absl::StrCat(
      "--optimizer=", flags.name, " --learning_rate=", flags.learning_rate);
  if (trained == 0) return "no trained dense tensor";
  if (own == 0) return absl::StrCat("every trained dense tensor by ", servers);
  return absl::StrCat(
      own, " of ", trained,
      " trained dense tensors by the workers' torch optimizer (",
      absl::StrJoin(rules, ", "), ", then the rates their pushes carry)",
      own == trained ? absl::StrCat("; ", servers, " applies to none")
                     : absl::StrCat(", the rest by ", servers));
}

}  // namespace

int64_t Shard::SharedTableBudget(const ModelSchema& schema) const {
  if (options_.sparse_memory_bytes <= 0) return 0;
  int64_t own = 0, sharing = 0;
  for (const SparseTableSpec& table : schema.sparse()) {
    own += table.max_bytes();
    if (table.max_bytes() == 0) ++sharing;
  }
  if (sharing == 0) return 0;
  const int64_t left = options_.sparse_memory_bytes - own;
  return left > 0 ? left / sharing : -1;
}

SparseTableOptions Shard::TableOptions(const ModelSchema& schema,
                                       const SparseTableSpec& spec) const {
  SparseTableOptions o;
  o.name = spec.name();
  o.dim = spec.dim();
  o.init = spec.init();
  o.seed = schema.seed();
  const SparseOptimizer& opt = spec.optimizer();
  o.optimizer.name = opt.name();
  o.optimizer.learning_rate = opt.learning_rate();
  o.optimizer.initial_accumulator = opt.initial_accumulator();
  o.optimizer.beta1 = opt.beta1();
  o.optimizer.beta2 = opt.beta2();
  o.optimizer.epsilon = opt.epsilon();
  o.optimizer.ftrl_alpha = opt.ftrl_alpha();
  o.optimizer.ftrl_beta = opt.ftrl_beta();
  o.optimizer.ftrl_l1 = opt.ftrl_l1();
  o.optimizer.ftrl_l2 = opt.ftrl_l2();
  o.max_rows = options_.sparse_max_rows;
  o.max_bytes =
      spec.max_bytes() > 0 ? spec.max_bytes() : SharedTableBudget(schema);
  o.admit_after = options_.sparse_admit_after;
  o.ttl = options_.sparse_row_ttl;
  o.ttl_steps = options_.sparse_row_ttl_steps;
  return o;
}

absl::Status Shard::CheckModelFits(
    const ModelSchema& schema,
    const std::vector<std::unique_ptr<Optimizer>>& tensor_optimizers,
    std::string* estimate) const {
  if (absl::Status s = ValidateSchema(schema); !s.ok()) return s;
  if (options_.replicated) {
    for (const SparseTableSpec& table : schema.sparse()) {
      if (table.max_bytes() > 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "table ", QuoteForStatus(table.name()), " has a budget (max_bytes ",
            table.max_bytes(),
            "), which replicated servers (--replicas > 1) cannot keep yet: a "
            "backup does not see the pulls that keep rows in its primary's "
            "table, so it would evict other rows; leave max_bytes at 0"));
      }
    }
  }
  if (options_.sparse_row_ttl_steps > 0) {
    for (const SparseTableSpec& table : schema.sparse()) {
      absl::StatusOr<ConsistencyMode> mode =
          TableConsistencyMode(options_.mode, table.name(), table.mode());
      if (mode.ok() && *mode != ConsistencyMode::kSync) {
        // Its steps are each worker's own count, which any client could
        // move as far as it likes.
        return absl::InvalidArgumentError(absl::StrCat(
            "table ", QuoteForStatus(table.name()), " is ",
            ConsistencyModeName(*mode),
            ": --sparse_row_ttl_steps counts the steps of sync tables, "
            "which the servers complete; give the servers a TTL in time "
            "(--sparse_row_ttl) instead"));
      }
    }
  }
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
  // Values twice (a pull still sending one version while an update writes
  // the other, block_values.h), optimizer state and (sync) the step's
  // gradient sum, plus what each block costs beyond its floats: with tiny
  // blocks that is most of it.
  int64_t shard_blocks = 0, shard_elements = 0, shard_floats = 0, global = 0;
  for (int t = 0; t < schema.dense_size(); ++t) {
    const int64_t elements = NumElements(schema.dense(t));
    const Optimizer& optimizer =
        tensor_optimizers[t] != nullptr ? *tensor_optimizers[t] : *optimizer_;
    const int64_t floats_per_element = 2 + optimizer.state_per_element() + 1;
    for (int64_t offset = 0; offset < elements;
         offset += block_elements, ++global) {
      if (ShardOfBlock(global, options_.num_shards) != options_.shard_id) {
        continue;
      }
      const int64_t length = std::min(block_elements, elements - offset);
      ++shard_blocks;
      shard_elements += length;
      shard_floats += length * floats_per_element;
    }
  }
  const int64_t per_block =
      kBlockOverheadBytes + options_.max_workers * int64_t{sizeof(int64_t)};
  const int64_t dense_bytes = shard_floats * 4 + shard_blocks * per_block +
                              model_blocks * kLayoutBytesPerBlock;
  // Each sparse table's most, where it has one (SparseTable::RowBound).
  auto mib = [](int64_t b) {
    return absl::StrFormat("%.1f MiB", b / 1048576.0);
  };
  const int64_t shared = SharedTableBudget(schema);
  int64_t bytes = dense_bytes;
  bool unbounded = false;
  std::vector<std::string> tables;
  for (const SparseTableSpec& table : schema.sparse()) {
    const SparseTableOptions options = TableOptions(schema, table);
    const int64_t row_bytes = SparseTable::RowBytes(options);
    if (table.max_bytes() == 0 && shared != 0 && shared < row_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "--sparse_memory_gb allows ", mib(options_.sparse_memory_bytes),
          " for the embedding tables; after the tables' own budgets "
          "(max_bytes)",
          " each table without one gets ", std::max<int64_t>(shared, 0),
          " bytes", ", and table ", QuoteForStatus(table.name()), " needs ",
          row_bytes,
          " bytes a row: raise --sparse_memory_gb or lower the budgets"));
    }
    const int64_t most = SparseTable::RowBound(options) * row_bytes;
    bytes += most;
    unbounded = unbounded || most == 0;
    tables.push_back(absl::StrCat(
        "table ", QuoteForStatus(table.name()),
        most > 0 ? absl::StrCat(" up to ", mib(most), " (",
                                row_bytes > 0 ? most / row_bytes : 0,
                                " rows of up to ", row_bytes, " bytes)")
                 : absl::StrCat(" unbounded (no max_bytes, no "
                                "--sparse_max_rows: it grows with the ids it "
                                "is sent, up to ",
                                row_bytes, " bytes a row)")));
  }
  if (estimate != nullptr) {
    *estimate = absl::StrCat("dense ", mib(dense_bytes), " (", shard_elements,
                             " elements in ", shard_blocks,
                             " blocks, with optimizer state)");
    for (const std::string& t : tables) absl::StrAppend(estimate, "; ", t);
    absl::StrAppend(estimate, unbounded ? "; at least " : "; at most ",
                    mib(bytes), " of --max_shard_memory_gb's ",
                    mib(options_.max_shard_bytes));
  }
  if (bytes > options_.max_shard_bytes && bytes > dense_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the model may need ", mib(bytes), " on this shard: ",
        absl::StrJoin(tables, "; "), ", dense ", mib(dense_bytes),
        "; --max_shard_memory_gb allows ", mib(options_.max_shard_bytes),
        ": give the tables smaller budgets (max_bytes), or use more shards"));
  }
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

absl::Status Shard::InstallModel(const ModelSchema& schema,
                                 InitialValues values) {
  absl::StatusOr<std::vector<std::unique_ptr<Optimizer>>> tensor_optimizers =
      MakeTensorOptimizers(schema);
  if (!tensor_optimizers.ok()) return tensor_optimizers.status();
  std::string estimate;
  if (absl::Status s = CheckModelFits(schema, *tensor_optimizers, &estimate);
      !s.ok()) {
    return s;
  }
  // Before the job starts: what this shard may hold (README.md, "Memory").
  LOG(INFO) << "shard " << options_.shard_id << " memory: " << estimate;
  absl::StatusOr<Partition> partition =
      Partition::Create(schema, options_.num_shards);
  if (!partition.ok()) return partition.status();
  auto model = std::make_unique<Model>();
  model->schema = schema;
  model->partition = std::move(*partition);
  const std::vector<BlockLocation>& all = model->partition.blocks();
  model->local_of_global.assign(all.size(), -1);
  model->tensor_optimizers = std::move(*tensor_optimizers);
  for (int g : model->partition.BlocksOfShard(options_.shard_id)) {
    const BlockLocation& loc = all[g];
    const DenseTensorSpec& tensor = model->schema.dense(loc.tensor);
    auto block = std::make_unique<Block>();
    block->location = &loc;
    block->local = static_cast<int>(model->blocks.size());
    block->tensor_name = &tensor.name();
    block->state_values = tensor.role() == DenseTensorSpec::STATE;
    if (model->tensor_optimizers[loc.tensor] != nullptr) {
      block->optimizer = model->tensor_optimizers[loc.tensor].get();
      block->lr_group = tensor.optimizer().group();
    } else {
      // The server's --optimizer follows the rate of group 0 where pushes
      // carry one (the C++ worker's --lr_schedule).
      block->optimizer = optimizer_.get();
      block->lr_group = block->state_values ? -1 : 0;
    }
    const int slots = block->optimizer->state_per_element();
    if (tensor.init().kind() == InitSpec::PROVIDED) {
      block->awaiting_values.store(true);
      blocks_awaiting_values_.fetch_add(1);
    }
    {
      absl::MutexLock block_lock(&block->mu);
      if (values == InitialValues::kFromSchema) {
        std::vector<float> initial(loc.length);
        FillInitialValues(tensor.init(), model->schema.seed(), tensor.name(),
                          loc.offset, absl::MakeSpan(initial));
        block->value.Assign(std::move(initial));
        block->state.assign(block->state_values ? 0 : slots * loc.length, 0.0f);
        block->optimizer->InitState(absl::MakeSpan(block->state));
      }
      if (options_.mode == ConsistencyMode::kSync) {
        // gradient_sum is allocated by the first gradient (AddToStepSumLocked):
        // a replica catching up pays for its model's memory once, not twice,
        // while the job's changes are held.
        block->last_contributed.assign(options_.max_workers, -1);
      } else {
        block->last_step.assign(options_.max_workers, -1);
        // Counted as after a restore (Restore sets it again): a worker
        // whose first push here is of step s > 0 pushed its steps before s
        // to this shard's previous life, which died with them (an async
        // worker pushes every block every step). In a new job every first
        // push is of step 0, and nothing is counted.
        block->unseen_since_restore.assign(options_.max_workers, true);
      }
    }
    model->local_of_global[g] = static_cast<int>(model->blocks.size());
    model->num_elements += loc.length;
    model->blocks.push_back(std::move(block));
  }
  for (const SparseTableSpec& spec : model->schema.sparse()) {
    const SparseTableOptions table_options = TableOptions(model->schema, spec);
    absl::StatusOr<std::unique_ptr<SparseTable>> table =
        SparseTable::Create(table_options);
    if (!table.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse table ", QuoteForStatus(spec.name()), ": ",
                       table.status().message()));
    }
    absl::StatusOr<ConsistencyMode> mode =
        TableConsistencyMode(options_.mode, spec.name(), spec.mode());
    if (!mode.ok()) return mode.status();
    auto state = std::make_unique<SparseState>();
    state->spec = &spec;
    state->mode = *mode;
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
  // Registered, restored or caught up: the server's first lines name
  // --optimizer, which a model of the workers' torch optimizers ignores.
  LOG(INFO) << "shard " << options_.shard_id << ": model installed; "
            << DescribeUpdateRules(schema, options_.optimizer);
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
  if (job_failed_.load(std::memory_order_acquire)) return Reject(job_failure_);

  RegisterModelResponse response;
  response.set_mode(ConsistencyModeName(options_.mode));
  response.set_torch_optimizers(true);
  response.set_optimizer(options_.optimizer.name);
  response.set_learning_rate(options_.optimizer.learning_rate);
  {
    absl::MutexLock lock(&register_mu_);
    if (model_owner_ != nullptr) {
      const std::string difference =
          FirstSchemaDifference(model_owner_->schema, request.schema());
      if (!difference.empty()) {
        return Reject(absl::FailedPreconditionError(absl::StrCat(
            "a different model is already registered on this shard (the "
            "registered one's first, then this request's): ",
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
    if (const std::optional<int64_t> clip = PendingClipStep();
        clip.has_value()) {
      response.set_clip_pending(true);
      response.set_clip_pending_step(*clip);
    }
  } else if (worker >= 0) {
    absl::MutexLock lock(&mu_);
    response.set_step(workers_[worker].next_step);
  }

  if (worker >= 0) {
    bool dropped = false;
    bool started = false;
    {
      absl::MutexLock lock(&mu_);
      ResumeStoppedLocked(worker);
      WorkerState& state = workers_[worker];
      const bool restarted =
          state.incarnation != 0 && state.incarnation != request.incarnation();
      const int64_t resume_step =
          restarted && state.member && options_.mode == ConsistencyMode::kSync
              ? PredecessorsNextStepLocked(*model, worker)
              : -1;
      if (resume_step >= 0) {
        // It takes its predecessor's place: the step the job is at waits
        // for it as it waited for its predecessor, and it recomputes the
        // same gradient from the same model and examples.
        response.set_resumes_in_place(true);
        response.set_resume_step(resume_step);
      } else if (restarted || !state.member) {
        // Its predecessor's step must not wait for it: it joins afresh at
        // the step of its next pull.
        dropped = state.member;
        state.member = false;
        state.joined_at = kNever;
        state.pending = true;
        PublishMembershipLocked();
      }
      state.incarnation = request.incarnation();
      started = TouchLocked(worker);
    }
    if (dropped) CompleteReadyBlocks();
    if (started) AnswerStartWaiters();
  }
  return response;
}

// ---------------------------------------------------------------------------
// Validation every request shares, dense and sparse, push and pull.

absl::StatusOr<const Shard::Model*> Shard::ValidateCommon(
    uint32_t protocol_version, int worker_id, int64_t step,
    bool allow_observer) const {
  if (protocol_version != kProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "protocol version ", protocol_version,
        " is not supported; this server speaks ", kProtocolVersion));
  }
  const Model* model = model_.load(std::memory_order_acquire);
  if (job_failed_.load(std::memory_order_acquire)) return job_failure_;
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

// ---------------------------------------------------------------------------
// The reaper and shutdown.

void Shard::RunReaper() {
  auto last_tick = std::chrono::steady_clock::now();
  while (true) {
    bool stop = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&shutting_down_), kReaperInterval);
      stop = shutting_down_;
    }
    if (stop) return;
    // Lateness past kLateTick is time the server did not run: it does not
    // count toward any lease.
    const auto tick = std::chrono::steady_clock::now();
    const absl::Duration elapsed = absl::FromChrono(tick - last_tick);
    last_tick = tick;
    const absl::Duration counted =
        std::min(elapsed, kReaperInterval + kLateTick);
    if (lease_clock_holds_.load(std::memory_order_acquire) == 0) {
      lease_clock_ns_.fetch_add(absl::ToInt64Nanoseconds(counted),
                                std::memory_order_acq_rel);
    }
    if (elapsed - counted > absl::Seconds(1)) {
      LOG(WARNING) << "this server did not run for "
                   << absl::FormatDuration(elapsed - counted)
                   << " (stopped, paused or starved); no worker's lease "
                      "counts that time";
    }
    if (CheckJobStart()) CompleteReadyBlocks();
    AnswerStartWaiters();
    LogFirstStepOnce();
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
  std::vector<StartWaiter> starting;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    holds_released_.store(true);
    waiting.swap(waiters_);
    starting.swap(start_waiters_);
  }
  // A push held on a block (WaitForBlockStep) waits on the block's mutex,
  // which re-checks its condition when released.
  if (const Model* model = model_.load(); model != nullptr) {
    for (const auto& block : model->blocks) absl::MutexLock touch(&block->mu);
  }
  const absl::Status stopping =
      absl::UnavailableError("the server is shutting down");
  for (std::unique_ptr<Waiter>& w : waiting) w->answer(stopping);
  for (StartWaiter& w : starting) w.done(stopping);
}

// ---------------------------------------------------------------------------
// Stats.

int64_t Shard::MinVersion() const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr || model->blocks.empty()) return 0;
  int64_t min_version = kNever;
  for (const auto& block : model->blocks) {
    min_version = std::min(min_version, block->version.load());
  }
  return min_version;
}

int64_t Shard::StateVersion() const {
  const Model* model = model_.load(std::memory_order_acquire);
  if (model == nullptr) return 0;
  // A model smaller than one block per shard leaves some shards nothing:
  // they have no step (not step 0, which would read as behind the job).
  if (model->blocks.empty() && model->sparse.empty()) return -1;
  if (!model->blocks.empty() || model->sparse.empty()) return MinVersion();
  if (options_.mode != ConsistencyMode::kSync) return -1;
  int64_t min_version = kNever;
  for (const auto& state : model->sparse) {
    if (state->mode != ConsistencyMode::kSync) continue;
    min_version = std::min(min_version, state->version.load());
  }
  // Only async tables here: no step to report.
  return min_version == kNever ? -1 : min_version;
}

bool Shard::RebuiltWithLossesBefore(int worker, int64_t version) {
  if (options_.mode != ConsistencyMode::kSync || worker < 0 ||
      worker >= options_.max_workers) {
    return false;
  }
  absl::MutexLock lock(&mu_);
  const bool rebuilt = workers_[worker].pulled_in_this_life < version &&
                       life_start_version_ < version &&
                       updates_lost_.load() + gradients_lost_.load() > 0;
  if (rebuilt) final_model_rebuilt_.store(true);
  return rebuilt;
}

absl::Status Shard::NoteJobFinalVersion(int worker_id, int64_t version) {
  absl::StatusOr<const Model*> model =
      ValidateCommon(kProtocolVersion, worker_id, version,
                     /*allow_observer=*/true);
  if (absl::IsNotFound(model.status())) return model.status();
  if (!model.ok()) return Reject(model.status());
  AtomicMax(job_final_version_, version);
  if (options_.mode != ConsistencyMode::kSync || worker_id < 0) {
    return absl::OkStatus();
  }
  HeartbeatRequest at_step;
  at_step.set_worker_id(worker_id);
  at_step.set_step(version);
  return Heartbeat(at_step);
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
      out->set_mode(ConsistencyModeName(state->mode));
      out->set_version(state->version.load());
      out->set_rows(table.rows);
      out->set_rows_created(table.rows_created);
      out->set_rows_evicted(table.rows_evicted);
      out->set_rows_expired(table.rows_expired);
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
  stats.set_job_final_version(job_final_version_.load());
  stats.set_gradients_lost(gradients_lost_.load());
  stats.set_updates_lost(updates_lost_.load());
  stats.set_internal_errors(internal_errors_.load());
  stats.set_values_copied_for_pulls(values_copied_for_pulls_.load());
  stats.set_early_gradient_bytes_peak(early_gradients_.peak_held_bytes());
  stats.set_early_gradient_bytes(early_gradients_.held_bytes());
  stats.set_ssp_gap_max(ssp_gap_max_.load());
  stats.set_steps_short(steps_short_.load());
  absl::MutexLock lock(&mu_);
  *stats.mutable_job_start() = JobStartLocked();
  int members = 0;
  for (const WorkerState& state : workers_) members += state.member;
  stats.set_members(members);
  stats.set_waiting_pulls(waiters_.size());
  return stats;
}

}  // namespace pstrain
