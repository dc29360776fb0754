#include "ps_server/replication.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/transport/data_plane.h"
#include "common/transport/grpc_status.h"
#include "common/transport/socket.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"

namespace pstrain {
namespace {

// The words that open a refused forward's message: the sender reacts to
// which one it is (steps down, or drops the receiver from its set).
constexpr absl::string_view kFenced = "fenced: ";
constexpr absl::string_view kStale = "stale: ";
constexpr absl::string_view kJoining = "joining: ";

// Whether every address of host:port refuses a TCP connection within
// `timeout`: nothing listens there, so the process that did is gone (a
// silent host is not gone: it may be cut off, and alive).
bool RefusesConnections(const std::string& address, absl::Duration timeout) {
  std::string host;
  int port = 0;
  if (!SplitHostPort(address, &host, &port).ok()) return false;
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), absl::StrCat(port).c_str(), &hints, &found) !=
      0) {
    return false;
  }
  bool all_refused = found != nullptr;
  for (addrinfo* a = found; a != nullptr && all_refused; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      all_refused = false;
      break;
    }
    int error = 0;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      error = errno;
      if (error == EINPROGRESS) {
        pollfd p = {fd, POLLOUT, 0};
        if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) >
            0) {
          socklen_t length = sizeof(error);
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
        }
      }
    }
    close(fd);
    all_refused = error == ECONNREFUSED;
  }
  freeaddrinfo(found);
  return all_refused;
}

}  // namespace

const char* ReplicaSet::RoleName(Role role) {
  switch (role) {
    case Role::kJoining:
      return "joining";
    case Role::kPrimary:
      return "primary";
    case Role::kBackup:
      return "backup";
    case Role::kStale:
      return "stale";
  }
  return "unknown";
}

ReplicaSet::ReplicaSet(const ReplicaOptions& options,
                       std::function<bool()> has_model)
    : options_(options), has_model_(std::move(has_model)) {
  for (int i = 0; i < static_cast<int>(options_.addresses.size()); ++i) {
    if (i == options_.replica_index) continue;
    auto peer = std::make_unique<Peer>();
    peer->index = i;
    peer->address = options_.addresses[i];
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    // A peer not up yet, or restarting, is tried again soon: gRPC's default
    // backoff (1 s growing to 120 s) would keep probes failing fast long
    // after it is back.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    peer->stub = ParameterServer::NewStub(grpc::CreateCustomChannel(
        peer->address, grpc::InsecureChannelCredentials(), args));
    peers_.push_back(std::move(peer));
  }
}

ReplicaSet::~ReplicaSet() { Stop(); }

void ReplicaSet::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (watcher_.joinable()) watcher_.join();
}

absl::StatusOr<ReplicateResponse> ReplicaSet::Call(
    Peer& peer, const ReplicateRequest& request, absl::Duration timeout,
    bool wait_for_ready) const {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  context.set_wait_for_ready(wait_for_ready);
  if (!options_.auth_token.empty()) {
    context.AddMetadata("authorization",
                        absl::StrCat("Bearer ", options_.auth_token));
  }
  ReplicateResponse response;
  const grpc::Status status =
      peer.stub->Replicate(&context, request, &response);
  if (!status.ok()) {
    return FromGrpcStatus(
        status, absl::StrCat("replica ", peer.index, " (", peer.address, ")"));
  }
  NoteAnswer(peer, response);
  return response;
}

void ReplicaSet::NoteAnswer(Peer& peer,
                            const ReplicateResponse& response) const {
  peer.answered = true;
  if (response.data_port() > 0) peer.data_port = response.data_port();
}

absl::StatusOr<ReplicateResponse> ReplicaSet::CallOnDataPlane(
    Peer& peer, const std::string& meta,
    absl::Span<const absl::string_view> request, absl::Time deadline) const {
  // Named in an error only: built then, not for every forward.
  auto who = [&peer] {
    return absl::StrCat("replica ", peer.index, " (", peer.address, ")");
  };
  std::unique_ptr<DataLink> link;
  {
    absl::MutexLock lock(&peer.links_mu);
    if (!peer.idle_links.empty()) {
      link = std::move(peer.idle_links.back());
      peer.idle_links.pop_back();
    }
  }
  if (link == nullptr || !link->usable()) {
    std::string host;
    int grpc_port = 0;
    if (absl::Status s = SplitHostPort(peer.address, &host, &grpc_port);
        !s.ok()) {
      return s;
    }
    absl::StatusOr<std::unique_ptr<DataLink>> opened = DataLink::Open(
        host, peer.data_port.load(), options_.auth_token, uint64_t{1} << 20,
        std::min(deadline, absl::Now() + absl::Seconds(5)));
    if (!opened.ok()) {
      return absl::Status(opened.status().code(),
                          absl::StrCat(who(), ": ", opened.status().message()));
    }
    link = std::move(*opened);
  }
  char prefix[data_plane::kLengthPrefixBytes];
  data_plane::EncodeLengthPrefix(static_cast<uint32_t>(meta.size()), prefix);
  DataExchange exchange;
  exchange.link = link.get();
  exchange.method = data_plane::Method::kForward;
  exchange.body = {absl::string_view(prefix, sizeof(prefix)), meta};
  exchange.body.insert(exchange.body.end(), request.begin(), request.end());
  ReplicateResponse response;
  exchange.on_response = [&response](absl::string_view body) {
    if (!response.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
      return absl::DataLossError("unreadable ReplicateResponse");
    }
    return absl::OkStatus();
  };
  RunExchanges(absl::MakeSpan(&exchange, 1), deadline);
  if (link->usable()) {
    absl::MutexLock lock(&peer.links_mu);
    peer.idle_links.push_back(std::move(link));
  }
  if (!exchange.status.ok()) {
    return absl::Status(exchange.status.code(),
                        absl::StrCat(who(), ": ", exchange.status.message()));
  }
  NoteAnswer(peer, response);
  return response;
}

bool ReplicaSet::Gone(const Peer& peer) const {
  return RefusesConnections(peer.address, absl::Milliseconds(200));
}

void ReplicaSet::Start() {
  ReplicateRequest probe;
  probe.set_method("probe");
  probe.set_from_replica(options_.replica_index);
  std::vector<std::string> holders;
  int64_t epoch = 0;
  for (auto& peer : peers_) {
    absl::StatusOr<ReplicateResponse> answer =
        Call(*peer, probe, absl::Seconds(1), /*wait_for_ready=*/false);
    if (!answer.ok()) continue;  // not up yet, or gone
    epoch = std::max(epoch, answer->epoch());
    if (answer->model_registered() || answer->epoch() > 0) {
      holders.push_back(absl::StrCat("replica ", peer->index, " (",
                                     answer->role(), ", epoch ",
                                     answer->epoch(), ")"));
    }
    if (answer->role() == RoleName(Role::kPrimary)) primary_ = peer->index;
  }
  epoch_ = epoch;
  {
    absl::MutexLock lock(&mu_);
    for (auto& peer : peers_) {
      peer->last_heard = absl::InfinitePast();
      in_set_.push_back(peer->index);
    }
  }
  const std::string self = absl::StrCat("replica ", options_.replica_index,
                                        " of shard ", options_.shard_id);
  if (!holders.empty()) {
    role_ = Role::kStale;
    LOG(ERROR) << self << " is stale: " << absl::StrJoin(holders, ", ")
               << " holds the shard's state, and this process started "
                  "without it. Catching up from a live replica is not built "
                  "yet: this process serves no one, and the shard runs on "
                  "the replicas it has.";
    return;
  }
  if (options_.replica_index == 0) {
    primary_ = 0;
    role_ = Role::kPrimary;
    LOG(INFO) << self << " is the primary (epoch " << epoch_.load() << ") of "
              << options_.addresses.size() << " replicas";
    return;
  }
  role_ = Role::kBackup;
  LOG(INFO) << self << " is a backup of replica 0 (" << options_.addresses[0]
            << ")";
  watcher_ = std::thread([this] { Watch(); });
}

void ReplicaSet::Watch() {
  ReplicateRequest probe;
  probe.set_method("probe");
  probe.set_from_replica(options_.replica_index);
  const absl::Time watching_since = absl::Now();
  while (!stop_.WaitForNotificationWithTimeout(options_.probe_interval)) {
    if (role_.load() != Role::kBackup) return;
    bool all_down = true;
    std::vector<std::string> why;
    for (auto& peer : peers_) {
      if (peer->index > options_.replica_index) continue;
      probe.set_epoch(epoch_.load());
      absl::StatusOr<ReplicateResponse> answer = Call(
          *peer, probe, std::max(absl::Seconds(1), 2 * options_.probe_interval),
          /*wait_for_ready=*/false);
      const absl::Time now = absl::Now();
      if (answer.ok()) {
        peer->last_heard = now;
        peer->refused_in_a_row = 0;
        NoteEpoch(answer->epoch());
        peer->stale = answer->role() == RoleName(Role::kStale);
        if (answer->role() == RoleName(Role::kPrimary)) {
          primary_ = peer->index;
        }
        if (peer->stale) {
          why.push_back(absl::StrCat("replica ", peer->index, " is stale"));
        } else {
          all_down = false;
        }
        continue;
      }
      if (peer->last_heard == absl::InfinitePast() && peer->forwarded.load()) {
        peer->last_heard = now;
      }
      const bool heard = peer->last_heard != absl::InfinitePast();
      // One never heard from may be starting still: its silence counts
      // from when this one began watching.
      const absl::Time since = heard ? peer->last_heard : watching_since;
      peer->refused_in_a_row = Gone(*peer) ? peer->refused_in_a_row + 1 : 0;
      if (peer->refused_in_a_row >= options_.refused_probes &&
          (heard || now - since >= options_.takeover_after_silence)) {
        why.push_back(absl::StrCat("replica ", peer->index, " (", peer->address,
                                   ") refuses connections"));
      } else if (now - since >= options_.takeover_after_silence) {
        why.push_back(absl::StrCat("replica ", peer->index, " (", peer->address,
                                   ") ", heard ? "silent" : "never heard from",
                                   " for ", absl::FormatDuration(now - since)));
      } else {
        all_down = false;
      }
    }
    if (all_down) {
      TakeOver(absl::StrJoin(why, "; "));
      return;
    }
  }
}

void ReplicaSet::NoteEpoch(int64_t epoch) {
  int64_t seen = epoch_.load();
  while (epoch > seen && !epoch_.compare_exchange_weak(seen, epoch)) {
  }
}

void ReplicaSet::TakeOver(const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (role_.load() != Role::kBackup) return;
  epoch_ = epoch_.load() + 1;
  // The replicas before this one are gone; those after it follow it.
  in_set_.clear();
  for (auto& peer : peers_) {
    if (peer->index > options_.replica_index) in_set_.push_back(peer->index);
  }
  primary_ = options_.replica_index;
  role_ = Role::kPrimary;
  takeovers_.fetch_add(1);
  LOG(WARNING) << "replica " << options_.replica_index << " of shard "
               << options_.shard_id << " takes over as primary at epoch "
               << epoch_.load() << ": " << why << "; forwarding to "
               << in_set_.size() << " replica(s)";
}

void ReplicaSet::Drop(int index, const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = std::find(in_set_.begin(), in_set_.end(), index);
  if (it == in_set_.end()) return;
  in_set_.erase(it);
  dropped_.fetch_add(1);
  LOG(WARNING) << "replica " << options_.replica_index << " of shard "
               << options_.shard_id << " drops replica " << index
               << " from its set: " << why << "; " << in_set_.size()
               << " replica(s) left besides this one";
}

void ReplicaSet::StepDown(const std::string& why) {
  Role role = role_.load();
  if (role == Role::kStale) return;
  role_ = Role::kStale;
  LOG(ERROR) << "replica " << options_.replica_index << " of shard "
             << options_.shard_id << " steps down (stale): " << why;
}

absl::Status ReplicaSet::ServesWorkers() const {
  switch (role_.load()) {
    case Role::kPrimary:
      return absl::OkStatus();
    case Role::kBackup: {
      const int primary = primary_.load();
      return absl::UnavailableError(absl::StrCat(
          "replica ", options_.replica_index, " of shard ", options_.shard_id,
          " is a backup; the primary is replica ", primary, " (",
          options_.addresses[primary], ")"));
    }
    case Role::kStale:
      return absl::UnavailableError(absl::StrCat(
          "replica ", options_.replica_index, " of shard ", options_.shard_id,
          " is stale (restarted, or replaced by another primary) and serves "
          "no one"));
    case Role::kJoining:
      break;
  }
  return absl::UnavailableError(absl::StrCat("replica ", options_.replica_index,
                                             " of shard ", options_.shard_id,
                                             " is starting"));
}

absl::Status ReplicaSet::Forward(absl::string_view method,
                                 absl::Span<const absl::string_view> request,
                                 bool wait_for_replicas) {
  if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
  std::vector<Peer*> targets;
  {
    absl::MutexLock lock(&mu_);
    for (int index : in_set_) {
      for (auto& peer : peers_) {
        if (peer->index == index) targets.push_back(peer.get());
      }
    }
  }
  if (targets.empty()) return absl::OkStatus();
  forwards_.fetch_add(1, std::memory_order_relaxed);
  ReplicateRequest forward;
  forward.set_epoch(epoch_.load());
  forward.set_from_replica(options_.replica_index);
  forward.set_method(std::string(method));
  // A push goes on a replica's data plane, its bytes as they came; the
  // rest (small) in the gRPC message.
  const bool tensors = method == "Push";
  const std::string meta = tensors ? forward.SerializeAsString() : "";
  if (!tensors) forward.set_request(absl::StrJoin(request, ""));
  const absl::Time give_up =
      absl::Now() +
      (wait_for_replicas ? options_.startup_wait : options_.forward_timeout);
  // One call per replica, in parallel past the first.
  std::vector<absl::Status> results(targets.size());
  auto send = [&](size_t i) {
    Peer& peer = *targets[i];
    while (true) {
      absl::StatusOr<ReplicateResponse> answer;
      if (tensors && peer.data_port.load() > 0) {
        answer = CallOnDataPlane(peer, meta, request, give_up);
      } else if (tensors) {
        // A replica that has not said where its data plane is (or has
        // none) gets the push inside the gRPC message.
        ReplicateRequest inline_forward = forward;
        inline_forward.set_request(absl::StrJoin(request, ""));
        answer = Call(peer, inline_forward, give_up - absl::Now(),
                      /*wait_for_ready=*/false);
      } else {
        answer = Call(peer, forward, give_up - absl::Now(),
                      /*wait_for_ready=*/false);
      }
      results[i] = answer.status();
      // A replica still learning its role answers in a moment; at the
      // job's start, one that never answered may not be up yet (gRPC's
      // wait-for-ready would also wait out one that died: one that answered
      // before and now refuses is gone).
      const bool again =
          !answer.ok() &&
          (absl::StrContains(answer.status().message(), kJoining) ||
           (wait_for_replicas && !peer.answered.load() &&
            absl::IsUnavailable(answer.status())));
      if (!again || absl::Now() + absl::Milliseconds(50) >= give_up ||
          !InSet(peer.index)) {
        return;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  };
  std::vector<std::thread> others;
  for (size_t i = 1; i < targets.size(); ++i) others.emplace_back(send, i);
  send(0);
  for (std::thread& t : others) t.join();

  absl::Status failure;
  for (size_t i = 0; i < targets.size(); ++i) {
    const absl::Status& result = results[i];
    if (result.ok()) continue;
    Peer& peer = *targets[i];
    if (absl::StrContains(result.message(), kFenced)) {
      StepDown(std::string(result.message()));
      failure = absl::UnavailableError(absl::StrCat(
          "replica ", options_.replica_index, " of shard ", options_.shard_id,
          " was replaced as primary: ", result.message()));
      continue;
    }
    if (absl::StrContains(result.message(), kStale)) {
      Drop(peer.index, std::string(result.message()));
      continue;
    }
    if (result.code() == absl::StatusCode::kUnavailable ||
        result.code() == absl::StatusCode::kDeadlineExceeded ||
        result.code() == absl::StatusCode::kCancelled) {
      if (Gone(peer)) {
        Drop(peer.index, absl::StrCat("its port refuses connections (",
                                      result.message(), ")"));
        continue;
      }
      if (failure.ok()) {
        failure = absl::UnavailableError(absl::StrCat(
            "replica ", peer.index, " of shard ", options_.shard_id, " (",
            peer.address, ") did not confirm the request: ", result.message(),
            "; not acknowledged, retry"));
      }
      continue;
    }
    // The backup refused what the primary applied: the two disagree, and
    // the backup can no longer stand in for it.
    LOG(ERROR) << "replica " << peer.index << " refused a forwarded " << method
               << " that the primary applied: " << result;
    Drop(peer.index, absl::StrCat("it disagrees: ", result.message()));
    ReplicateRequest drop;
    drop.set_epoch(epoch_.load());
    drop.set_from_replica(options_.replica_index);
    drop.set_method("drop");
    Call(peer, drop, absl::Seconds(1), false).status().IgnoreError();
  }
  return failure;
}

absl::Status ReplicaSet::AdmitForward(const ReplicateRequest& request) {
  absl::MutexLock lock(&mu_);
  const std::string self = absl::StrCat("replica ", options_.replica_index,
                                        " of shard ", options_.shard_id);
  const Role role = role_.load();
  if (role == Role::kJoining) {
    return absl::UnavailableError(
        absl::StrCat(self, " is ", kJoining, "it is still learning its role"));
  }
  if (role == Role::kStale) {
    return absl::FailedPreconditionError(
        absl::StrCat(kStale, self, " does not hold the shard's state"));
  }
  if (request.epoch() < epoch_.load() ||
      (request.epoch() == epoch_.load() && role == Role::kPrimary)) {
    return absl::FailedPreconditionError(
        absl::StrCat(kFenced, self, " is at epoch ", epoch_.load(), " (role ",
                     RoleName(role), "); the forward of replica ",
                     request.from_replica(), " is of epoch ", request.epoch()));
  }
  if (role == Role::kPrimary) {
    // Replaced while it served: what it applied since may not be anywhere
    // else.
    epoch_ = request.epoch();
    role_ = Role::kStale;
    LOG(ERROR) << self << " steps down (stale): replica "
               << request.from_replica() << " is primary at epoch "
               << request.epoch();
    return absl::FailedPreconditionError(
        absl::StrCat(kStale, self, " was primary at a lower epoch"));
  }
  epoch_ = request.epoch();
  primary_ = request.from_replica();
  for (auto& peer : peers_) {
    if (peer->index == request.from_replica()) peer->forwarded = true;
  }
  return absl::OkStatus();
}

bool ReplicaSet::InSet(int index) const {
  absl::MutexLock lock(&mu_);
  return std::find(in_set_.begin(), in_set_.end(), index) != in_set_.end();
}

ReplicateResponse ReplicaSet::Answer(const ReplicateRequest& request) {
  // A replica that probes this one is up: if it refuses connections later,
  // it is gone, not starting.
  for (auto& peer : peers_) {
    if (peer->index == request.from_replica()) peer->answered = true;
  }
  if (request.method() == "drop" && request.epoch() >= epoch_.load()) {
    StepDown(absl::StrCat("replica ", request.from_replica(),
                          " dropped it from its set"));
  }
  ReplicateResponse response;
  response.set_epoch(epoch_.load());
  response.set_role(RoleName(role_.load()));
  response.set_model_registered(has_model_());
  response.set_data_port(data_port_.load());
  return response;
}

void ReplicaSet::AddStats(StatsResponse* stats) const {
  stats->set_replica_index(options_.replica_index);
  stats->set_replicas(static_cast<int>(options_.addresses.size()));
  stats->set_replica_role(RoleName(role_.load()));
  stats->set_replica_epoch(epoch_.load());
  stats->set_replica_forwards(forwards_.load());
  stats->set_replica_takeovers(takeovers_.load());
  stats->set_replicas_dropped(dropped_.load());
}

}  // namespace pstrain
