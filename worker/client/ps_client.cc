// PsClient's life and the job's: connecting, registering, the start wait,
// heartbeats, leaving, and what the servers say about the job.

#include "worker/client/ps_client.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "absl/random/distributions.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/consistency_mode.h"
#include "common/protocol.h"
#include "common/status_text.h"
#include "common/transport/connection_check.h"
#include "common/transport/socket.h"
#include "glog/logging.h"
#include "worker/client/ps_client_internal.h"

namespace pstrain {

using ps_client_internal::Deserialize;

template <typename Response>
std::vector<PsClient::Call> PsClient::CallsToEveryShard(
    const std::string& request, std::vector<Response>* responses) const {
  std::vector<Call> calls(num_shards());
  responses->assign(num_shards(), Response());
  for (int s = 0; s < num_shards(); ++s) {
    calls[s].shard = s;
    calls[s].flat = request;
    calls[s].on_response = [responses,
                            s](absl::Span<const absl::string_view> bytes) {
      return Deserialize(bytes, &(*responses)[s]);
    };
  }
  return calls;
}

absl::StatusOr<std::unique_ptr<PsClient>> PsClient::CreateObserver(
    const PsClientOptions& options, const ModelSchema& schema,
    int num_workers) {
  absl::StatusOr<std::unique_ptr<PsClient>> client = Create(options);
  if (!client.ok()) return client.status();
  if (absl::StatusOr<Registration> observing =
          (*client)->Register(schema, num_workers, -1);
      !observing.ok()) {
    return observing.status();
  }
  return client;
}

absl::StatusOr<std::unique_ptr<PsClient>> PsClient::CreateFinalModelReader(
    ConsistencyMode mode, const PsClientOptions& options,
    const ModelSchema& schema, int num_workers) {
  if (mode == ConsistencyMode::kSync) return std::unique_ptr<PsClient>();
  return CreateObserver(options, schema, num_workers);
}

std::vector<absl::Status> PsClientOptionsProblems(
    const PsClientOptions& options) {
  std::vector<absl::Status> problems;
  size_t replicas = 0;
  for (const std::string& shard : options.hosts) {
    const std::vector<std::string> set = absl::StrSplit(shard, '|');
    bool bad = false;
    for (const std::string& host : set) {
      if (host.empty() || host.find(':') == std::string::npos) {
        problems.push_back(absl::InvalidArgumentError(absl::StrCat(
            "--ps_hosts entries must be host:port",
            set.size() > 1 ? " (a replicated shard's: host:port|host:port)"
                           : "",
            ", got '", shard, "'")));
        bad = true;
        break;
      }
    }
    if (bad) break;
    if (replicas != 0 && set.size() != replicas) {
      problems.push_back(absl::InvalidArgumentError(absl::StrCat(
          "--ps_hosts: every shard must list as many replicas; '", shard,
          "' lists ", set.size(), ", an earlier shard ", replicas)));
      break;
    }
    replicas = set.size();
  }
  if (options.connections_per_shard < 0 || options.connections_per_shard > 64) {
    problems.push_back(absl::InvalidArgumentError(
        absl::StrCat("--connections_per_shard must be in [0, 64] (0: by "
                     "host), got ",
                     options.connections_per_shard)));
  }
  if (options.data_requests_in_flight < 0 ||
      options.data_requests_in_flight > 1024) {
    problems.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--data_requests_in_flight must be in [0, 1024] (0: by host), "
        "got ",
        options.data_requests_in_flight)));
  }
  if (options.gradient_wire_type != TOPK_FLOAT32 &&
      WireElementBytes(options.gradient_wire_type) == 0) {
    problems.push_back(
        absl::InvalidArgumentError("unsupported gradient wire type"));
  }
  if (options.parameter_wire_type != FLOAT32 &&
      options.parameter_wire_type != BFLOAT16 &&
      options.parameter_wire_type != FLOAT16) {
    problems.push_back(
        absl::InvalidArgumentError("unsupported parameter wire type"));
  }
  if (!(options.gradient_topk_fraction > 0 &&
        options.gradient_topk_fraction <= 1)) {
    problems.push_back(absl::InvalidArgumentError(
        absl::StrCat("--gradient_topk_fraction must be in (0, 1], got ",
                     options.gradient_topk_fraction)));
  }
  if (options.sparse_row_cache_steps < 0) {
    problems.push_back(absl::InvalidArgumentError(
        absl::StrCat("--sparse_cache_steps must be >= 0 (0: no cache), got ",
                     options.sparse_row_cache_steps)));
  }
  if (options.sparse_row_cache_steps > 0 &&
      options.sparse_row_cache_bytes < SparseRowCache::RowBytes(1)) {
    problems.push_back(absl::InvalidArgumentError(
        absl::StrCat("--sparse_cache_mb must hold at least one row with "
                     "--sparse_cache_steps > 0, got ",
                     options.sparse_row_cache_bytes, " bytes")));
  }
  return problems;
}

absl::StatusOr<std::unique_ptr<PsClient>> PsClient::Create(
    const PsClientOptions& options) {
  if (options.hosts.empty()) {
    return absl::InvalidArgumentError("--ps_hosts lists no servers");
  }
  if (std::vector<absl::Status> problems = PsClientOptionsProblems(options);
      !problems.empty()) {
    return problems.front();
  }
  return std::unique_ptr<PsClient>(new PsClient(options));
}

PsClient::PsClient(const PsClientOptions& options)
    : options_(options),
      incarnation_(absl::Uniform<uint64_t>(
          absl::BitGen(), 1, std::numeric_limits<uint64_t>::max())),
      connections_(options.connections_per_shard > 0
                       ? options.connections_per_shard
                       : kConnectionsOnThisHost) {
  for (const std::string& shard : options.hosts) {
    replica_hosts_.push_back(absl::StrSplit(shard, '|'));
  }
  replicas_ = static_cast<int>(replica_hosts_.front().size());
  if (options.sparse_row_cache_steps > 0) {
    row_cache_ = std::make_unique<SparseRowCache>(
        options.sparse_row_cache_steps, options.sparse_row_cache_bytes);
  }
  current_replica_ = std::make_unique<std::atomic<int>[]>(options.hosts.size());
  for (size_t s = 0; s < options.hosts.size(); ++s) current_replica_[s] = 0;
  for (const std::vector<std::string>& set : replica_hosts_) {
    for (const std::string& host : set) {
      for (int c = 0; c < connections_; ++c) {
        grpc::ChannelArguments args;
        args.SetMaxReceiveMessageSize(options.max_message_bytes);
        args.SetMaxSendMessageSize(options.max_message_bytes);
        // A private subchannel pool and a distinct argument make each channel
        // its own TCP connection instead of sharing one.
        args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
        ApplyGrpcTuning(options.grpc_tuning, &args);
        args.SetInt("pstrain.connection_index", c);
        channels_.push_back(grpc::CreateCustomChannel(
            host,
            options.credentials != nullptr ? options.credentials
                                           : grpc::InsecureChannelCredentials(),
            args));
        stubs_.push_back(std::make_unique<grpc::GenericStub>(channels_.back()));
        push_streams_.push_back(std::make_unique<CallStream>());
        pull_streams_.push_back(std::make_unique<CallStream>());
        data_slots_.push_back(std::make_unique<DataSlot>());
      }
    }
  }
  absl::MutexLock lock(&data_ports_mu_);
  data_ports_.assign(options.hosts.size(), 0);
  data_push_pull_.assign(options.hosts.size(), false);
  data_port_tls_.assign(options.hosts.size(), false);
  replica_data_ports_.assign(options.hosts.size(), {});
  backup_reads_off_until_.assign(options.hosts.size(), absl::InfinitePast());
  primary_on_this_host_ =
      std::make_unique<std::atomic<int>[]>(options.hosts.size());
  for (size_t s = 0; s < options.hosts.size(); ++s) {
    primary_on_this_host_[s] = -1;
  }
  backup_read_failures_.assign(options.hosts.size(), 0);
  data_failed_ports_.assign(options.hosts.size(), 0);
  data_failed_at_.assign(options.hosts.size(), absl::InfinitePast());
  server_lives_ = std::vector<std::atomic<uint64_t>>(options.hosts.size());
}

PsClient::~PsClient() { StopHeartbeats(); }

void PsClient::Interrupt() {
  absl::MutexLock lock(&interrupt_mu_);
  ++interrupts_;
  for (grpc::ClientContext* context : active_contexts_) context->TryCancel();
  for (const DataLink* link : active_links_) link->Abort();
}

uint64_t PsClient::interrupts() const {
  absl::MutexLock lock(&interrupt_mu_);
  return interrupts_;
}

void PsClient::Track(grpc::ClientContext* context, uint64_t epoch) {
  absl::MutexLock lock(&interrupt_mu_);
  // gRPC cancels a call whose context was cancelled before it started.
  if (interrupts_ != epoch) context->TryCancel();
  active_contexts_.insert(context);
}

void PsClient::Untrack(grpc::ClientContext* context) {
  absl::MutexLock lock(&interrupt_mu_);
  active_contexts_.erase(context);
}

void PsClient::Track(const DataLink* link, uint64_t epoch) {
  absl::MutexLock lock(&interrupt_mu_);
  if (interrupts_ != epoch) link->Abort();
  active_links_.insert(link);
}

void PsClient::Untrack(const DataLink* link) {
  absl::MutexLock lock(&interrupt_mu_);
  active_links_.erase(link);
}

bool PsClient::SleepUnlessInterrupted(absl::Duration duration,
                                      uint64_t epoch) const {
  const absl::Time until = absl::Now() + duration;
  absl::MutexLock lock(&interrupt_mu_);
  auto interrupted = [this, epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(
                         interrupt_mu_) { return interrupts_ != epoch; };
  return !interrupt_mu_.AwaitWithDeadline(absl::Condition(&interrupted), until);
}

// Between tries of a registration cut by a server going away.
constexpr absl::Duration kReregisterPause = absl::Milliseconds(200);

absl::StatusOr<std::vector<RegisterModelResponse>> PsClient::RegisterCalls(
    bool wait_out_dying_servers, absl::Time give_up) {
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = schema_;
  request.set_num_shards(num_shards());
  request.set_num_workers(num_workers_);
  request.set_worker_id(worker_id_);
  request.set_incarnation(incarnation_);
  std::vector<RegisterModelResponse> responses;
  std::vector<Call> calls =
      CallsToEveryShard(request.SerializeAsString(), &responses);
  // Servers may still be starting. Not with replicas: a replica that is
  // gone would hold the call until the connect timeout, where the next
  // replica may be the primary (a failed call moves on to it, and the
  // loop below waits out replicas not up yet).
  for (Call& call : calls) call.wait_for_ready = replicas_ == 1;
  // A server that dies in the middle of the call (UNAVAILABLE at once, not
  // a deadline) is waited for like one not up yet: registering again is
  // harmless, and the connect timeout (or the caller's `give_up`, sooner)
  // still bounds the whole wait.
  give_up = std::min(give_up, absl::Now() + options_.connect_timeout);
  const uint64_t epoch = interrupts();
  while (true) {
    const absl::Status s =
        RunAll("RegisterModel", calls, give_up - absl::Now());
    if (s.ok()) break;
    if (!wait_out_dying_servers || !absl::IsUnavailable(s) ||
        absl::Now() + kReregisterPause >= give_up ||
        !SleepUnlessInterrupted(kReregisterPause, epoch)) {
      return s;
    }
    LOG(WARNING) << "registering again after " << s;
  }
  absl::MutexLock lock(&data_ports_mu_);
  for (int s = 0; s < num_shards(); ++s) {
    data_ports_[s] = responses[s].data_port();
    data_push_pull_[s] = responses[s].data_push_pull();
    data_port_tls_[s] = responses[s].data_port_tls();
    replica_data_ports_[s].assign(responses[s].replica_data_ports().begin(),
                                  responses[s].replica_data_ports().end());
  }
  return responses;
}

absl::Status PsClient::RegisterOnShards(absl::Time give_up) {
  return RegisterCalls(/*wait_out_dying_servers=*/false, give_up).status();
}

namespace {

// Why a TLS handshake that reached the server failed, from gRPC's text of
// the channel's last error (Debian 12's gRPC 1.51 and later); plaintext and
// TLS talking past each other are found by DiagnoseConnection's probe.
std::string CertificateHint(absl::string_view error) {
  if (absl::StrContains(error, "certificate verify failed")) {
    return "the server's certificate is not signed by the CA in --tls_ca";
  }
  if (absl::StrContains(error, "not in peer certificate") ||
      absl::StrContains(error, "does not name")) {
    return "the server's certificate does not name the address dialled "
           "(set --tls_server_name to a name it holds)";
  }
  return "the server refused the handshake: it wants a client certificate "
         "signed by its --tls_client_ca (--tls_cert/--tls_key)";
}

}  // namespace

absl::Status PsClient::CheckTransports() {
  // A refused handshake looks to gRPC like a server still starting, so
  // registration (wait_for_ready) would wait out the whole connect timeout.
  // A call that does not wait tells them apart: it fails at once with the
  // handshake's error. A few tries ride out a server between listen() and
  // serving; a shard not listening yet is left to registration's wait.
  constexpr int kTries = 3;
  constexpr absl::Duration kBetweenTries = absl::Milliseconds(300);
  const uint64_t epoch = interrupts();
  for (int s = 0; s < num_shards(); ++s) {
    std::string host;
    int port;
    if (!SplitHostPort(HostOf(s), &host, &port).ok() ||
        !ConnectTcp(host, port, 0, absl::Now() + absl::Seconds(1)).ok()) {
      continue;
    }
    absl::Status last;
    for (int t = 0; t < kTries; ++t) {
      std::vector<Call> calls(1);
      calls[0].shard = s;
      calls[0].flat = StatsRequest().SerializeAsString();
      calls[0].on_response = [](absl::Span<const absl::string_view>) {
        return absl::OkStatus();
      };
      last = RunAll("Stats", calls, absl::Seconds(5), /*retry=*/false);
      // Any answer, an error included (a token refused, say), came through
      // the transport: registration reports the rest.
      if (!absl::IsUnavailable(last)) break;
      if (!SleepUnlessInterrupted(kBetweenTries, epoch)) {
        return absl::CancelledError("interrupted while connecting");
      }
    }
    if (absl::IsUnavailable(last)) {
      const bool tls = options_.credentials != nullptr;
      std::string error(last.message());
      if (const size_t at = error.find("last error: ");
          at != std::string::npos) {
        error = error.substr(at + std::strlen("last error: "));
      }
      std::string cause = DiagnoseConnection(HostOf(s), tls, absl::Seconds(1));
      // A plaintext server answering plaintext (or nothing listening): the
      // calls failed because the server went away, not on a handshake;
      // registration waits for it.
      if (!tls &&
          (cause.empty() || absl::StrContains(cause, ": cannot connect: "))) {
        continue;
      }
      if (cause.empty()) cause = CertificateHint(error);
      return absl::UnavailableError(absl::StrCat(
          tls ? "TLS handshake" : "plaintext gRPC", " with shard ", s, " (",
          HostOf(s), ") refused: ", error, "; likely cause: ", cause));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Registration> PsClient::Register(const ModelSchema& chosen,
                                                int num_workers,
                                                int worker_id) {
  if (chosen.block_elements() != kBlockElementsByModel) {
    return RegisterResolved(chosen, num_workers, worker_id);
  }
  ModelSchema schema = chosen;
  schema.set_block_elements(ResolvedBlockElements(schema));
  // Servers restored from a checkpoint of this model in other blocks (one
  // written before the rule, or with --block_elements set) resume it as it
  // was: a block size the client did not choose is no reason to refuse.
  // Asked first, so that no shard without a model installs a size the
  // others refuse; asked again after a refusal, for servers that were not
  // answering yet. Either way the question is best effort.
  const auto adopt_held = [&]() {
    absl::StatusOr<int64_t> held = HeldBlockElements(schema);
    if (!held.ok() || *held == schema.block_elements()) return false;
    LOG(INFO) << "the servers hold this model in blocks of " << *held
              << " elements (restored); registering with those instead of "
              << schema.block_elements();
    schema.set_block_elements(*held);
    return true;
  };
  adopt_held();
  absl::StatusOr<Registration> registered =
      RegisterResolved(schema, num_workers, worker_id);
  if (absl::IsFailedPrecondition(registered.status()) && adopt_held()) {
    return RegisterResolved(schema, num_workers, worker_id);
  }
  return registered;
}

absl::StatusOr<int64_t> PsClient::HeldBlockElements(const ModelSchema& schema) {
  absl::StatusOr<std::vector<StatsResponse>> stats = Stats();
  if (!stats.ok()) return stats.status();
  for (const StatsResponse& shard : *stats) {
    if (!shard.model_registered() || !shard.has_schema()) continue;
    ModelSchema held = shard.schema();
    const int64_t block_elements = held.block_elements();
    held.set_block_elements(schema.block_elements());
    if (FirstSchemaDifference(held, schema).empty()) return block_elements;
  }
  return absl::NotFoundError("no shard holds this model in other blocks");
}

absl::StatusOr<Registration> PsClient::RegisterResolved(
    const ModelSchema& schema, int num_workers, int worker_id) {
  absl::StatusOr<Partition> partition = Partition::Create(schema, num_shards());
  if (!partition.ok()) return partition.status();
  StopHeartbeats();
  if (absl::Status s = CheckTransports(); !s.ok()) return s;
  schema_ = schema;
  num_workers_ = num_workers;
  worker_id_ = worker_id;
  absl::StatusOr<std::vector<RegisterModelResponse>> responses =
      RegisterCalls(/*wait_out_dying_servers=*/true);
  if (!responses.ok()) return responses.status();
  if (!ResumesInPlaceEverywhere(*responses)) {
    // A restarted sync worker whose predecessor died in the middle of a
    // push: some shards hold its place at one step, others at the next. It
    // leaves and registers again, so every shard's step goes on without it
    // and it rejoins at the job's step (that step is short: steps_short).
    LOG(WARNING) << "worker " << worker_id_
                 << ": its previous process died in the middle of pushing a "
                    "step; that step completes without its gradient on the "
                    "shards that lack it, and this process starts at the "
                    "job's next step";
    if (absl::Status s = Leave(); !s.ok()) return s;
    responses = RegisterCalls(/*wait_out_dying_servers=*/true);
    if (!responses.ok()) return responses.status();
  }
  Registration registration;
  absl::StatusOr<ConsistencyMode> mode =
      ParseConsistencyMode((*responses)[0].mode());
  if (!mode.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard 0 (", HostOf(0), ") runs mode '", (*responses)[0].mode(),
        "', which this client does not know"));
  }
  registration.mode = *mode;
  bool torch_rules = false;
  for (const DenseTensorSpec& tensor : schema.dense()) {
    torch_rules |= tensor.has_optimizer();
  }
  for (int s = 0; s < num_shards(); ++s) {
    const RegisterModelResponse& response = (*responses)[s];
    if (torch_rules && !response.torch_optimizers()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", s, " (", HostOf(s),
          ") does not run per-tensor torch optimizers (a ps_server older "
          "than this client): it would train with its own --optimizer; "
          "upgrade the servers"));
    }
    if (response.mode() != ConsistencyModeName(registration.mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("shards disagree on the mode: shard 0 runs ",
                       ConsistencyModeName(registration.mode), ", shard ", s,
                       " runs ", response.mode()));
    }
    registration.start_step = std::max(
        registration.start_step,
        response.resumes_in_place() ? response.resume_step() : response.step());
    registration.resumes_in_place |= response.resumes_in_place();
  }
  registration.optimizer = (*responses)[0].optimizer();
  registration.learning_rate = (*responses)[0].learning_rate();
  mode_ = registration.mode;
  sparse_pull_tables_ = sparse_push_tables_ = true;
  for (int s = 0; s < num_shards(); ++s) {
    sparse_pull_tables_ &= (*responses)[s].sparse_pull_tables();
    sparse_push_tables_ &= (*responses)[s].sparse_push_tables();
  }
  pull_wire_type_ = options_.parameter_wire_type;
  for (int s = 0; s < num_shards() && pull_wire_type_ != FLOAT32; ++s) {
    if (!(*responses)[s].rounded_pulls()) {
      LOG(WARNING) << "shard " << s << " (" << HostOf(s)
                   << ") does not round pulled parameters (a ps_server older "
                      "than this client): pulling them as float32, not "
                   << DataType_Name(options_.parameter_wire_type);
      pull_wire_type_ = FLOAT32;
    }
  }
  std::optional<int64_t> pending_clip;
  for (const RegisterModelResponse& response : *responses) {
    if (response.clip_pending()) pending_clip = response.clip_pending_step();
  }

  // Group each shard's blocks into RPCs of at most one block's bytes (small
  // tensors share an RPC), dealt round-robin over the shard's connections.
  partition_ = std::make_unique<Partition>(std::move(*partition));
  groups_.clear();
  const int64_t group_elements = schema.block_elements();
  for (int s = 0; s < num_shards(); ++s) {
    int next_connection = 0;
    Group* open = nullptr;
    int64_t open_elements = 0;
    for (int g : partition_->BlocksOfShard(s)) {
      const int64_t length = partition_->blocks()[g].length;
      if (open == nullptr || open_elements + length > group_elements) {
        groups_.emplace_back();
        open = &groups_.back();
        open->shard = s;
        open->connection = next_connection++ % connections_;
        open_elements = 0;
      }
      open->blocks.push_back(g);
      open->elements += length;
      open_elements += length;
    }
  }
  // Every call of every worker takes the groups in one order, backward's,
  // which the pipelined step needs (PushPullStreamed): backward makes the
  // last layers' gradients first and the first layer's last, which the next
  // forward needs first, so the groups without the first two tensors (the
  // first layer's weight and bias) go ahead, the last layer's first, and
  // the first layer's follow in order. One order for all matters on a link
  // with one request in flight (--data_requests_in_flight, by host): were a
  // plain worker sending the first layer's first, each worker's first
  // request would wait for a group the other sends only later, and the step
  // would wait for a lease to run out.
  auto backward_rank = [this](const Group& group) {
    int lowest = std::numeric_limits<int>::max();
    for (int g : group.blocks) {
      lowest = std::min(lowest, partition_->blocks()[g].tensor);
    }
    return lowest <= 1 ? std::numeric_limits<int>::max() : -lowest;
  };
  std::stable_sort(groups_.begin(), groups_.end(),
                   [&](const Group& a, const Group& b) {
                     return backward_rank(a) < backward_rank(b);
                   });
  for (Group& group : groups_) {
    PullRequest pull;
    pull.set_protocol_version(kProtocolVersion);
    for (int g : group.blocks) {
      const BlockLocation& loc = partition_->blocks()[g];
      BlockRef* ref = pull.add_blocks();
      ref->set_tensor(schema_.dense(loc.tensor).name());
      ref->set_block(loc.block);
    }
    group.pull_request = pull.SerializeAsString();
  }
  block_versions_.assign(partition_->blocks().size(), 0);
  encoded_.assign(partition_->blocks().size(), std::string());
  topk_residual_.assign(partition_->blocks().size(), std::vector<float>());
  if (worker_id_ >= 0 && options_.heartbeat_interval > absl::ZeroDuration()) {
    heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
  }
  if (pending_clip.has_value() && worker_id_ >= 0) {
    // A clipped step whose workers died before they sent its coefficient:
    // its pulls would wait for it forever.
    if (absl::Status s = FinishClippedStep(*pending_clip); !s.ok()) return s;
  }
  return registration;
}

bool PsClient::ResumesInPlaceEverywhere(
    const std::vector<RegisterModelResponse>& responses) {
  bool any = false, all = true;
  for (const RegisterModelResponse& response : responses) {
    any |= response.resumes_in_place();
    all &= response.resumes_in_place() &&
           response.resume_step() == responses[0].resume_step();
  }
  return !any || all;
}

absl::Status PsClient::AwaitJobStart(const StartWaitReport& on_waiting,
                                     const std::atomic<bool>* stop) {
  if (worker_id_ < 0 || mode_ == ConsistencyMode::kAsync)
    return absl::OkStatus();
  // Each call is held by the servers for up to this long: short enough to
  // notice an Interrupt and report progress about once a second.
  constexpr absl::Duration kPoll = absl::Seconds(1);
  constexpr absl::Duration kLogEvery = absl::Seconds(5);
  AwaitJobStartRequest request;
  request.set_worker_id(worker_id_);
  request.set_incarnation(incarnation_);
  request.set_wait_ms(absl::ToInt64Milliseconds(kPoll));
  const std::string bytes = request.SerializeAsString();
  // Known once the servers say how long they wait; until then the connect
  // timeout bounds reaching them at all.
  absl::Time give_up = absl::Now() + options_.connect_timeout;
  absl::Time last_log = absl::Now();
  bool warmed_up = false;
  const uint64_t epoch = interrupts();
  while (true) {
    if (interrupts() != epoch || (stop != nullptr && stop->load())) {
      return absl::CancelledError(
          "interrupted while waiting for the job's workers to register");
    }
    std::vector<JobStart> answers;
    std::vector<Call> calls = CallsToEveryShard(bytes, &answers);
    absl::Status status = RunAll("AwaitJobStart", calls,
                                 kPoll + absl::Seconds(5), /*retry=*/true);
    if (absl::IsCancelled(status) && interrupts() != epoch) {
      return absl::CancelledError(
          "interrupted while waiting for the job's workers to register");
    }
    // A server from before the start rule has nothing to wait for.
    if (absl::IsUnimplemented(status)) return absl::OkStatus();
    if (!status.ok()) return status;
    JobStart waiting;
    bool started = true;
    std::set<int> missing;
    for (const JobStart& answer : answers) {
      started &= answer.started();
      if (answer.started()) continue;
      missing.insert(answer.missing_workers().begin(),
                     answer.missing_workers().end());
      waiting.set_waited_s(std::max(waiting.waited_s(), answer.waited_s()));
      waiting.set_startup_timeout_s(answer.startup_timeout_s());
      waiting.set_num_workers(answer.num_workers());
      waiting.set_min_workers(answer.min_workers());
    }
    if (started) return absl::OkStatus();
    if (!warmed_up) {
      // The wait is free time: the first step then finds its data-plane
      // connections open (with many workers, opening them all at the start
      // took most of the first step).
      OpenDataLinks();
      warmed_up = true;
    }
    for (int w : missing) waiting.add_missing_workers(w);
    // The servers end the wait at their timeout and say so; this bound
    // only matters if they never do.
    give_up = absl::Now() +
              absl::Seconds(waiting.startup_timeout_s() - waiting.waited_s()) +
              absl::Seconds(30);
    if (absl::Now() - last_log >= kLogEvery) {
      last_log = absl::Now();
      LOG(INFO) << "waiting for workers "
                << FormatIdList(waiting.missing_workers()) << " ("
                << waiting.missing_workers_size() << " of "
                << waiting.num_workers() << " missing), "
                << static_cast<int64_t>(waiting.waited_s()) << " s of "
                << waiting.startup_timeout_s() << " s";
    }
    if (on_waiting) on_waiting(waiting);
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the job has not started after ", waiting.waited_s(), " s: workers ",
          FormatIdList(waiting.missing_workers()), " have not registered"));
    }
  }
}

void PsClient::OpenDataLinks() {
  if (!DataPlaneAllowed()) return;
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  // Twice with connections by host: the first link to a shard tells where
  // it is, and so how many more it gets.
  for (int pass = 0; pass < (options_.connections_per_shard == 0 ? 2 : 1);
       ++pass) {
    std::map<int, std::vector<DataSlot*>> used;  // by shard
    for (const Group& group : groups_) {
      DataSlot* slot =
          data_slots_[SlotOf(group.shard,
                             DataConnectionOf(group.shard, group.connection))]
              .get();
      std::vector<DataSlot*>& slots = used[group.shard];
      if (std::find(slots.begin(), slots.end(), slot) == slots.end()) {
        slots.push_back(slot);
      }
    }
    OpenLinks(used, deadline);
  }
}

void PsClient::HeartbeatLoop() {
  HeartbeatRequest request;
  request.set_worker_id(worker_id_);
  request.set_incarnation(incarnation_);
  absl::Time last_warning = absl::InfinitePast();
  while (!stop_heartbeats_.WaitForNotificationWithTimeout(
      options_.heartbeat_interval)) {
    request.set_step(furthest_pulled_step_.load());
    const std::string bytes = request.SerializeAsString();
    std::vector<Call> calls(num_shards());
    for (int s = 0; s < num_shards(); ++s) {
      calls[s].shard = s;
      calls[s].flat = bytes;
    }
    absl::Status status =
        RunAll("Heartbeat", calls, options_.heartbeat_interval);
    // A server that is down is the pulls' and pushes' problem to retry;
    // here it is only worth a line now and then.
    if (!status.ok() && absl::Now() - last_warning > absl::Seconds(30)) {
      LOG(WARNING) << "heartbeat: " << status;
      last_warning = absl::Now();
    }
  }
}

void PsClient::StopHeartbeats() {
  if (!heartbeat_thread_.joinable()) return;
  stop_heartbeats_.Notify();
  heartbeat_thread_.join();
}

SparseRowCacheStats PsClient::sparse_row_cache_stats() const {
  return row_cache_ != nullptr ? row_cache_->stats() : SparseRowCacheStats();
}

void PsClient::DropSparseRowCache() {
  if (row_cache_ != nullptr) row_cache_->Clear();
}

absl::Status PsClient::Leave(bool stopping, absl::Duration stopping_grace) {
  StopHeartbeats();
  DropSparseRowCache();
  if (worker_id_ < 0) return absl::OkStatus();
  LeaveRequest request;
  request.set_worker_id(worker_id_);
  request.set_stopping(stopping);
  if (stopping) {
    request.set_stopping_grace_s(
        absl::ToDoubleSeconds(std::max(stopping_grace, absl::ZeroDuration())));
  }
  std::vector<Call> calls(num_shards());
  for (int s = 0; s < num_shards(); ++s) {
    calls[s].shard = s;
    calls[s].flat = request.SerializeAsString();
  }
  return RunAll("Leave", calls, options_.rpc_timeout);
}

absl::Status PsClient::LeaveStoppingWithin(absl::Duration stopping_grace,
                                           absl::Duration within) {
  absl::Status left;
  absl::Notification done;
  std::thread leaver([&] {
    left = Leave(/*stopping=*/true, stopping_grace);
    done.Notify();
  });
  if (!done.WaitForNotificationWithTimeout(within)) Interrupt();
  leaver.join();
  return left;
}

// async/ssp: the servers' model is final once no worker is a member any
// more and every worker's updates are applied (each applied push of a
// dense block bumps its version by one, so the smallest version reaches
// num_workers * steps). A worker that stopped early or died never brings
// it there: then the model counts as final once no member is left and it
// has not changed for kQuiet. Returns how the wait ended.
std::string PsClient::AwaitFinalModel(int64_t expected_version,
                                      absl::Duration timeout) {
  constexpr absl::Duration kQuiet = absl::Seconds(10);
  const absl::Time start = absl::Now();
  const uint64_t epoch = interrupts();
  absl::Time last_change = start;
  int64_t last_version = -1;
  std::string last_seen = "no stats";
  while (true) {
    absl::StatusOr<std::vector<StatsResponse>> stats = Stats();
    const absl::Time now = absl::Now();
    if (stats.ok()) {
      int members = 0;
      int64_t version = std::numeric_limits<int64_t>::max();
      for (const StatsResponse& shard : *stats) {
        members += shard.members();
        if (shard.num_blocks() > 0)
          version = std::min(version, shard.version());
      }
      if (members == 0 && version >= expected_version) return "all_done";
      if (version != last_version) {
        last_version = version;
        last_change = now;
      } else if (members == 0 && now - last_change >= kQuiet) {
        LOG(WARNING) << "the servers applied " << version << " of the "
                     << expected_version
                     << " updates expected and no worker is training: a "
                        "worker stopped early; evaluating the model as it is";
        return "quiet";
      }
      last_seen = absl::StrCat(members, " member(s) training, version ",
                               version, " of ", expected_version);
    } else {
      last_seen = stats.status().ToString();
    }
    if (now - start >= timeout) {
      LOG(WARNING) << "other workers still training after "
                   << absl::FormatDuration(timeout) << " (" << last_seen
                   << "); evaluating the model as it is now";
      return "timeout";
    }
    if (!SleepUnlessInterrupted(absl::Milliseconds(50), epoch)) {
      return "interrupted";
    }
  }
}

absl::StatusOr<FinalState> PsClient::SecureFinalState(int64_t final_version) {
  if (final_version <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("final_version must be > 0, got ", final_version));
  }
  CheckpointRequest request;
  request.set_final_version(final_version);
  request.set_worker_id(worker_id_);
  std::vector<CheckpointResponse> responses;
  std::vector<Call> calls =
      CallsToEveryShard(request.SerializeAsString(), &responses);
  FinalState state;
  // A ps_server older than this client takes the request for an operator's
  // checkpoint: it refuses it without --checkpoint_dir, and otherwise
  // answers only the path. It cannot say its version: "unknown".
  constexpr absl::string_view kOlderServer =
      ": a ps_server older than this worker, which does not say its version";
  if (absl::Status s =
          RunAll("Checkpoint", calls, options_.rpc_timeout, /*retry=*/true);
      !s.ok()) {
    if (!absl::IsFailedPrecondition(s) ||
        !absl::StrContains(s.message(), "has no --checkpoint_dir")) {
      return s;
    }
    state.summary = "unknown";
    state.problems.push_back(absl::StrCat(s.message(), kOlderServer));
    return state;
  }
  bool all_checkpointed = true;
  bool all_known = true;
  for (int s = 0; s < num_shards(); ++s) {
    const CheckpointResponse& shard = responses[s];
    const std::string who = absl::StrCat("shard ", s, " (", HostOf(s), ")");
    if (!shard.checkpointed() && !shard.path().empty()) {
      all_known = false;
      state.problems.push_back(
          absl::StrCat(who, " wrote ", shard.path(), kOlderServer));
      continue;
    }
    const bool behind = shard.version() >= 0 && shard.version() < final_version;
    const bool skipped = shard.skipped_to_step() >= final_version;
    if (behind || skipped || shard.rebuilt_with_losses()) {
      state.shards_behind.push_back(s);
      state.problems.push_back(
          behind    ? absl::StrCat(who, " is at version ", shard.version(),
                                   ", behind the final model's ", final_version,
                                   ": restored from an older checkpoint after "
                                      "the job's last steps, which the servers' "
                                      "model now lacks")
          : skipped ? absl::StrCat(who, " restarted and skipped to step ",
                                   shard.skipped_to_step(),
                                   " without the updates before it: the "
                                   "servers' model lacks steps of the final "
                                   "model (counted in steps_lost)")
                    : absl::StrCat(who,
                                   " restarted after this worker's final "
                                   "pull and rebuilt the last steps from an "
                                   "older checkpoint with updates lost "
                                   "(counted): the servers' model is not "
                                   "the one this worker holds"));
      LOG(WARNING) << "the servers' model is not the job's final model: "
                   << state.problems.back();
    } else if (!shard.checkpointed()) {
      all_checkpointed = false;
      state.problems.push_back(
          absl::StrCat(who, " holds the final model in memory only: ",
                       shard.not_checkpointed_reason()));
    }
  }
  state.summary = !state.shards_behind.empty() ? "behind"
                  : !all_known                 ? "unknown"
                  : all_checkpointed           ? "durable"
                                               : "in_memory";
  return state;
}

absl::StatusOr<int64_t> PsClient::StepsShort() {
  absl::StatusOr<std::vector<StatsResponse>> stats = Stats();
  if (!stats.ok()) return stats.status();
  int64_t most = 0;
  for (const StatsResponse& shard : *stats) {
    most = std::max(most, shard.steps_short());
  }
  return most;
}

absl::StatusOr<std::vector<StatsResponse>> PsClient::Stats() {
  std::vector<StatsResponse> responses;
  // A replicated shard's figures are its primary's: a backup, or a stale
  // primary a failover left behind, holds other ones.
  StatsRequest request;
  request.set_from_primary(replicas_ > 1);
  std::vector<Call> calls =
      CallsToEveryShard(request.SerializeAsString(), &responses);
  // Retried there: a backup refuses, and a failover may be under way.
  if (absl::Status s = RunAll("Stats", calls, options_.rpc_timeout,
                              /*retry=*/replicas_ > 1);
      !s.ok()) {
    return s;
  }
  return responses;
}

}  // namespace pstrain
