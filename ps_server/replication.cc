#include "ps_server/replication.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <thread>
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
// A new process at a replica's address, without the state: the one the
// sender had in its set is gone.
constexpr absl::string_view kNewProcess = "new process: ";

// A catch-up's chunks in flight at once: enough that the joiner copies one
// in while the next is on the wire (bench/replica_catchup.sh).
constexpr int kStateChunksInFlight = 3;

// Whether a forwarded `method` changes what the job holds, in a way a
// shard started afresh would lack: everything but a registration (the
// workers register again with the same schema, whose initial values are a
// pure function of its seed), a heartbeat and the set's order.
bool ChangesTheJobsState(absl::string_view method) {
  return method != "RegisterModel" && method != "Heartbeat" && method != "view";
}

// Until when a primary's answer to a call made at `asked` promises a fresh
// start (ReplicateResponse.start_afresh_ms); InfinitePast: no promise.
absl::Time PromisedUntil(absl::Time asked, const ReplicateResponse& answer) {
  return answer.start_afresh_ms() > 0
             ? asked + absl::Milliseconds(answer.start_afresh_ms())
             : absl::InfinitePast();
}

// A forward the receiver did not answer (it may yet have applied it).
bool Unanswered(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable ||
         status.code() == absl::StatusCode::kDeadlineExceeded ||
         status.code() == absl::StatusCode::kCancelled;
}

// A call not made, or cut short, by ReplicaSet::EndCalls.
absl::Status CallsEnded(int index, absl::string_view address) {
  return absl::CancelledError(
      absl::StrCat("replica ", index, " (", address,
                   "): not sent: this replica stopped or stepped down"));
}

// What a TCP connection to host:port meets within `timeout`: refused at
// every address (nothing listens there, so the process that did is gone),
// accepted at one (a process listens), or neither (a silent host, which may
// be cut off and alive; a name that does not resolve).
enum class Listening { kRefused, kAccepted, kUnknown };

Listening ProbeListening(const std::string& address, absl::Duration timeout) {
  std::string host;
  int port = 0;
  if (!SplitHostPort(address, &host, &port).ok()) return Listening::kUnknown;
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), absl::StrCat(port).c_str(), &hints, &found) !=
      0) {
    return Listening::kUnknown;
  }
  bool all_refused = found != nullptr;
  bool accepted = false;
  for (addrinfo* a = found; a != nullptr && all_refused; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      all_refused = false;
      break;
    }
    int error = ETIMEDOUT;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      error = 0;
    } else if (errno != EINPROGRESS) {
      error = errno;
    } else {
      pollfd p = {fd, POLLOUT, 0};
      if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) >
          0) {
        socklen_t length = sizeof(error);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
      }
    }
    close(fd);
    accepted |= error == 0;
    all_refused = error == ECONNREFUSED;
  }
  freeaddrinfo(found);
  return all_refused ? Listening::kRefused
         : accepted  ? Listening::kAccepted
                     : Listening::kUnknown;
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
    case Role::kCatchingUp:
      return "catching_up";
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
    peer->stub = ParameterServer::NewStub(ChannelTo(peer->address, args));
    peers_.push_back(std::move(peer));
  }
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < static_cast<int>(options_.addresses.size()); ++i) {
    succession_.push_back(i);
  }
}

ReplicaSet::~ReplicaSet() { Stop(); }

ReplicateRequest ReplicaSet::Message(absl::string_view method) const {
  ReplicateRequest message;
  message.set_method(std::string(method));
  message.set_from_replica(options_.replica_index);
  return message;
}

void ReplicaSet::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  EndCalls();
  if (watcher_.joinable()) watcher_.join();
}

void ReplicaSet::EndCalls() {
  absl::MutexLock lock(&calls_mu_);
  calls_ended_ = true;
  for (grpc::ClientContext* context : calls_) context->TryCancel();
  for (const DataLink* link : links_) link->Abort();
}

bool ReplicaSet::BeginCall(grpc::ClientContext* context,
                           const DataLink* link) const {
  absl::MutexLock lock(&calls_mu_);
  if (calls_ended_) return false;
  if (context != nullptr) calls_.push_back(context);
  if (link != nullptr) links_.push_back(link);
  return true;
}

void ReplicaSet::EndCall(grpc::ClientContext* context,
                         const DataLink* link) const {
  absl::MutexLock lock(&calls_mu_);
  if (context != nullptr) {
    calls_.erase(std::find(calls_.begin(), calls_.end(), context));
  }
  if (link != nullptr) {
    links_.erase(std::find(links_.begin(), links_.end(), link));
  }
}

std::shared_ptr<grpc::Channel> ReplicaSet::ChannelTo(
    const std::string& address, const grpc::ChannelArguments& args) const {
  return grpc::CreateCustomChannel(address,
                                   options_.credentials != nullptr
                                       ? options_.credentials
                                       : grpc::InsecureChannelCredentials(),
                                   args);
}

absl::StatusOr<ReplicateResponse> ReplicaSet::Call(
    Peer& peer, const ReplicateRequest& request, absl::Duration timeout,
    bool wait_for_ready, ParameterServer::Stub* stub) const {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  context.set_wait_for_ready(wait_for_ready);
  if (!options_.auth_token.empty()) {
    context.AddMetadata("authorization",
                        absl::StrCat("Bearer ", options_.auth_token));
  }
  ReplicateResponse response;
  if (!BeginCall(&context, nullptr)) {
    return CallsEnded(peer.index, peer.address);
  }
  const grpc::Status status = (stub != nullptr ? stub : peer.stub.get())
                                  ->Replicate(&context, request, &response);
  EndCall(&context, nullptr);
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
        std::min(deadline, absl::Now() + absl::Seconds(5)), options_.data_tls);
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
  if (!BeginCall(nullptr, link.get())) {
    return CallsEnded(peer.index, peer.address);
  }
  RunExchanges(absl::MakeSpan(&exchange, 1), deadline);
  EndCall(nullptr, link.get());
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
  return ProbeListening(peer.address, absl::Milliseconds(200)) ==
         Listening::kRefused;
}

void ReplicaSet::Start() {
  ReplicateRequest probe = Message("probe");
  std::vector<std::string> holders;
  int64_t epoch = 0;
  // When the whole set starts again from checkpoints, the first replica
  // installs its own and the others catch up from it, rather than each
  // installing its own (they may hold different steps, and a primary's
  // fast-forward to the workers' step would find them elsewhere): a replica
  // waits while one before it is still starting (it answers "joining",
  // reading or installing its checkpoint: up to startup_wait) or not up yet
  // (up to takeover_after_silence, as the watcher would wait for it).
  // A peer whose process is up (its port accepts connections) but did not
  // answer (busy, frozen, its port just opened) may hold the job's state: it
  // is waited for up to startup_wait, whatever its index, and this replica
  // does not start (it exits for a restart) if it stays silent. Taking it
  // for absent made a replica 0 restarted mid-job the primary of an empty
  // shard while its backup held every step, and the workers went on from
  // nothing. A peer that forwards to this one meanwhile serves the job: see
  // forwarded_while_joining_.
  std::vector<std::string> silent;
  std::vector<std::string> found;  // what each peer said, for the log
  const absl::Time started = absl::Now();
  while (true) {
    holders.clear();
    silent.clear();
    found.clear();
    bool wait = false;
    const absl::Duration waited = absl::Now() - started;
    for (auto& peer : peers_) {
      const bool before = peer->index < options_.replica_index;
      const absl::Time asked = absl::Now();
      absl::StatusOr<ReplicateResponse> answer =
          Call(*peer, probe, absl::Seconds(1), /*wait_for_ready=*/false);
      if (!answer.ok()) {  // not up yet, gone, or slow to answer
        const bool up =
            ProbeListening(peer->address, absl::Milliseconds(200)) ==
            Listening::kAccepted;
        if (up) silent.push_back(answer.status().ToString());
        found.push_back(
            absl::StrCat("replica ", peer->index, up ? " silent" : " not up"));
        // One not up yet is waited for as the watcher would wait out its
        // silence; one that is up may hold the state, and is waited for
        // longer (below: this replica does not start without it).
        wait |= (before && !up && waited < options_.takeover_after_silence) ||
                (up && waited < options_.startup_wait);
        continue;
      }
      epoch = std::max(epoch, answer->epoch());
      found.push_back(
          absl::StrCat("replica ", peer->index, " ", answer->role(),
                       " at epoch ", answer->epoch(),
                       answer->model_registered() ? "" : " without a model"));
      wait |= before && answer->role() == RoleName(Role::kJoining) &&
              waited < options_.startup_wait;
      // Only a replica that serves or follows holds the running state: one
      // still starting may hold a checkpoint at most, and one catching up
      // or stale holds nothing to catch up from. A primary without a model
      // holds the job's state too when this replica read a checkpoint: the
      // job goes on from the primary (its workers register there), and a
      // backup with other values would diverge from it.
      const bool running = answer->role() == RoleName(Role::kPrimary) ||
                           answer->role() == RoleName(Role::kBackup);
      if (running && (answer->model_registered() || answer->epoch() > 0 ||
                      (settle_restored_ != nullptr &&
                       answer->role() == RoleName(Role::kPrimary)))) {
        holders.push_back(absl::StrCat("replica ", peer->index, " (",
                                       answer->role(), ", epoch ",
                                       answer->epoch(), ")"));
      }
      if (answer->role() == RoleName(Role::kPrimary)) {
        primary_ = peer->index;
        start_promiser_ = peer->index;
        start_promise_until_ = PromisedUntil(asked, *answer);
      }
    }
    if (holders.empty()) {
      // A replica that forwards changes to this one serves the job and holds
      // its state, even if it did not answer the probe: its handlers may all
      // be waiting for this replica to stop joining (the first
      // registrations wait for every replica), which would leave both
      // waiting until this replica gave up on the silent peer.
      absl::MutexLock lock(&mu_);
      if (forwarded_while_joining_ >= 0) {
        holders.push_back(absl::StrCat("replica ", forwarded_while_joining_,
                                       " (forwarding to this one, epoch ",
                                       forwarded_while_joining_epoch_, ")"));
        primary_ = forwarded_while_joining_;
        epoch = std::max(epoch, forwarded_while_joining_epoch_);
      }
    }
    if (!wait || !holders.empty() ||
        stop_.WaitForNotificationWithTimeout(options_.probe_interval)) {
      break;
    }
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
  if (holders.empty() && !silent.empty()) {
    // One of them may hold the job's state (a primary frozen, or too busy to
    // answer): starting without it would serve an empty shard, and the
    // workers would go on from nothing.
    role_ = Role::kStale;
    LOG(ERROR) << self << ": replicas whose port accepts did not answer for "
               << absl::FormatDuration(options_.startup_wait) << " ("
               << absl::StrJoin(silent, "; ")
               << "); one may hold the shard's state, so this replica does "
                  "not start without them";
    if (on_stale_) on_stale_();
    return;
  }
  if (!holders.empty()) {
    if (settle_restored_) settle_restored_(/*keep=*/false);
    role_ = Role::kCatchingUp;
    catch_up_started_ = absl::Now();
    LOG(WARNING) << self << " started without the shard's state, which "
                 << absl::StrJoin(holders, ", ")
                 << " holds: it catches up from the primary";
    watcher_ = std::thread([this] {
      if (CatchUp()) Watch();
    });
    return;
  }
  // A checkpoint holds what workers were told is done.
  if (settle_restored_) may_have_acknowledged_ = true;
  if (settle_restored_ && !settle_restored_(/*keep=*/true)) {
    // Not stale in the sense of set_on_stale: a restart would fail alike.
    role_ = Role::kStale;
    LOG(ERROR) << self << " serves no one: its checkpoint could not be "
               << "installed";
    return;
  }
  if (options_.replica_index == 0) {
    primary_ = 0;
    role_ = Role::kPrimary;
    LOG(INFO) << self << " is the primary (epoch " << epoch_.load() << ") of "
              << options_.addresses.size()
              << " replicas; none holds the shard's state ("
              << absl::StrJoin(found, ", ") << ")";
    return;
  }
  role_ = Role::kBackup;
  LOG(INFO) << self << " is a backup of replica 0 (" << options_.addresses[0]
            << ")";
  watcher_ = std::thread([this] { Watch(); });
}

void ReplicaSet::Watch() {
  ReplicateRequest probe = Message("probe");
  const absl::Time watching_since = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    LOG(INFO) << "replica " << options_.replica_index << " of shard "
              << options_.shard_id << " watches the replicas before it in "
              << absl::StrJoin(succession_, ", ");
  }
  while (!stop_.WaitForNotificationWithTimeout(options_.probe_interval)) {
    if (role_.load() != Role::kBackup) {
      LOG(INFO) << "replica " << options_.replica_index << " of shard "
                << options_.shard_id << " stops watching: it is "
                << RoleName(role_.load());
      return;
    }
    bool all_down = true;
    std::vector<std::string> why;
    // Ahead and alive, as far as this one knows: only silent.
    std::vector<Peer*> silent;
    for (auto& peer : peers_) {
      if (!Ahead(peer->index)) continue;
      probe.set_epoch(epoch_.load());
      absl::StatusOr<ReplicateResponse> answer = Call(
          *peer, probe, std::max(absl::Seconds(1), 2 * options_.probe_interval),
          /*wait_for_ready=*/false);
      const absl::Time now = absl::Now();
      if (answer.ok()) {
        peer->last_heard = now;
        peer->refused_in_a_row = 0;
        NoteEpoch(answer->epoch());
        // One catching up does not hold the state: it cannot take over.
        peer->stale = answer->role() == RoleName(Role::kStale) ||
                      answer->role() == RoleName(Role::kCatchingUp);
        if (answer->role() == RoleName(Role::kPrimary)) {
          primary_ = peer->index;
        }
        if (peer->stale) {
          why.push_back(
              absl::StrCat("replica ", peer->index, " is ", answer->role()));
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
        if (heard) silent.push_back(peer.get());
      } else {
        all_down = false;
      }
    }
    if (all_down) {
      TakeOver(Role::kBackup, absl::StrJoin(why, "; "));
      TellDeposed(silent);
      return;
    }
  }
}

void ReplicaSet::TellDeposed(std::vector<Peer*> deposed) {
  constexpr absl::Duration kTellFor = absl::Seconds(60);
  const absl::Time give_up = absl::Now() + kTellFor;
  ReplicateRequest deposed_at = Message("deposed");
  while (!deposed.empty() && role_.load() == Role::kPrimary &&
         absl::Now() < give_up &&
         !stop_.WaitForNotificationWithTimeout(options_.probe_interval)) {
    deposed_at.set_epoch(epoch_.load());
    for (auto it = deposed.begin(); it != deposed.end();) {
      Peer& peer = **it;
      // A channel of its own each time: the peer's may sit on a connection
      // that a partition left in TCP's retransmission backoff.
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      std::unique_ptr<ParameterServer::Stub> stub =
          ParameterServer::NewStub(ChannelTo(peer.address, args));
      const absl::StatusOr<ReplicateResponse> answer =
          Call(peer, deposed_at,
               std::max(absl::Seconds(1), 2 * options_.probe_interval),
               /*wait_for_ready=*/false, stub.get());
      if (answer.ok()) {
        LOG(INFO) << "replica " << options_.replica_index << " of shard "
                  << options_.shard_id << " told replica " << peer.index
                  << ", which it replaced, of epoch " << deposed_at.epoch()
                  << " (it is " << answer->role() << ")";
      }
      if (answer.ok() || Gone(peer)) {
        it = deposed.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void ReplicaSet::NoteEpoch(int64_t epoch) {
  int64_t seen = epoch_.load();
  while (epoch > seen && !epoch_.compare_exchange_weak(seen, epoch)) {
  }
}

void ReplicaSet::TakeOver(Role from, const std::string& why) {
  {
    absl::MutexLock lock(&mu_);
    if (role_.load() != from) return;
    epoch_ = epoch_.load() + 1;
    // The replicas before this one are gone; those after it follow it.
    in_set_.clear();
    auto self = std::find(succession_.begin(), succession_.end(),
                          options_.replica_index);
    if (self != succession_.end()) in_set_.assign(self + 1, succession_.end());
    succession_ = {options_.replica_index};
    succession_.insert(succession_.end(), in_set_.begin(), in_set_.end());
    primary_ = options_.replica_index;
    role_ = Role::kPrimary;
    takeovers_.fetch_add(1);
    LOG(WARNING) << "replica " << options_.replica_index << " of shard "
                 << options_.shard_id << " takes over as primary at epoch "
                 << epoch_.load() << ": " << why << "; forwarding to "
                 << in_set_.size() << " replica(s)";
  }
  // The steps this replica holds every gradient of complete now: a request
  // retried here meanwhile would find them applied by no one (a clip's
  // coefficient is sent once).
  if (on_takeover_) on_takeover_();
  // The backups learn the new order (and epoch) now, not at the next
  // change: one of them may be next soon.
  Forward("view", {}).IgnoreError();
}

bool ReplicaSet::Ahead(int index) const {
  absl::MutexLock lock(&mu_);
  for (int i : succession_) {
    if (i == options_.replica_index) return false;
    if (i == index) return true;
  }
  // Not in the order this one knows (it was dropped from it): every
  // replica there comes first.
  return std::find(succession_.begin(), succession_.end(), index) !=
         succession_.end();
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
  EndCalls();
  LOG(ERROR) << "replica " << options_.replica_index << " of shard "
             << options_.shard_id << " steps down (stale): " << why;
  if (on_stale_) on_stale_();
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
          " is stale (replaced by another primary, or its catch-up failed) "
          "and serves no one"));
    case Role::kCatchingUp:
      return absl::UnavailableError(
          absl::StrCat("replica ", options_.replica_index, " of shard ",
                       options_.shard_id, " is catching up from the primary"));
    case Role::kJoining:
      break;
  }
  return absl::UnavailableError(absl::StrCat("replica ", options_.replica_index,
                                             " of shard ", options_.shard_id,
                                             " is starting"));
}

absl::Status ReplicaSet::AwaitedJoinerLocked() {
  const absl::Time now = absl::Now();
  for (auto it = awaited_joiners_.begin(); it != awaited_joiners_.end();) {
    if (it->second > now) {
      ++it;
      continue;
    }
    LOG(WARNING) << "replica " << options_.replica_index << " of shard "
                 << options_.shard_id << " stops waiting for replica "
                 << it->first << " to ask for the shard's state: updates are "
                 << "acknowledged without it until it catches up";
    it = awaited_joiners_.erase(it);
  }
  if (awaited_joiners_.empty()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "replica ", awaited_joiners_.front().first, " of shard ",
      options_.shard_id,
      " is catching up from the primary: no update is acknowledged until it "
      "holds the shard's state; retry"));
}

absl::Status ReplicaSet::Forward(absl::string_view method,
                                 absl::Span<const absl::string_view> request,
                                 bool wait_for_replicas, int* confirmed) {
  if (confirmed != nullptr) *confirmed = 0;
  if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
  // An update the primary applied while a joiner has not asked for the
  // state yet is not acknowledged (the worker's retry is a duplicate,
  // answered once the joiner holds it). The rest (a registration, a
  // heartbeat: nothing a step learns from) goes on: the joiner's catch-up
  // waits for the workers' first step request (Shard::QuietForTransfer),
  // which a refused registration would never let come.
  // Assign too: values a tensor gets once (pstrain.torch's), which a shard
  // started afresh would lack.
  const bool update = method == "Push" || method == "SparsePush" ||
                      method == "steps" || method == "Assign";
  const bool changes_state = ChangesTheJobsState(method);
  std::vector<Peer*> targets;
  ReplicateRequest forward = Message(method);
  {
    absl::MutexLock lock(&mu_);
    if (update) {
      if (absl::Status awaited = AwaitedJoinerLocked(); !awaited.ok()) {
        return awaited;
      }
    }
    forward.add_succession(options_.replica_index);
    for (int index : in_set_) {
      for (auto& peer : peers_) {
        if (peer->index == index) targets.push_back(peer.get());
      }
      forward.add_succession(index);
    }
    // Without every replica: it may be acknowledged alone. Under mu_, with
    // the awaited check, so that an answer promising a joiner a fresh start
    // (Answer) comes before it or sees it.
    if (changes_state && targets.size() < peers_.size()) NoteAcknowledged();
  }
  if (targets.empty()) return absl::OkStatus();
  forwards_.fetch_add(1, std::memory_order_relaxed);
  forward.set_epoch(epoch_.load());
  // A push goes on a replica's data plane, its bytes as they came; the
  // rest (small) in the gRPC message.
  const bool tensors = method == "Push" || method == "steps";
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
  if (method == "steps") {
    // Step records go to the last in the succession first, and to each
    // replica before it only once the ones after it have them: whichever
    // takes over then holds no record the others lack (a record sent to all
    // at once, and the primary dying between two of them, left the next
    // primary ahead of a backup, which then took its next record for one
    // after a gap). A replica that holds a record the new primary lacks
    // takes the primary's own record of that step, summed from the same
    // pushes, for a repeat.
    for (size_t i = targets.size(); i-- > 0;) {
      send(i);
      const absl::Status& result = results[i];
      const bool unconfirmed =
          Unanswered(result) &&
          !absl::StrContains(result.message(), kNewProcess);
      if (unconfirmed && !Gone(*targets[i])) {
        for (size_t j = 0; j < i; ++j) {
          results[j] = absl::UnavailableError(absl::StrCat(
              "not sent: replica ", targets[i]->index,
              ", after it in the succession, did not confirm it first"));
        }
        break;
      }
    }
  } else {
    std::vector<std::thread> others;
    for (size_t i = 1; i < targets.size(); ++i) others.emplace_back(send, i);
    send(0);
    for (std::thread& t : others) t.join();
  }

  absl::Status failure;
  for (size_t i = 0; i < targets.size(); ++i) {
    const absl::Status& result = results[i];
    if (result.ok()) {
      if (confirmed != nullptr) ++*confirmed;
      continue;
    }
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
    if (absl::StrContains(result.message(), kNewProcess)) {
      // A replica restarted before its old process was dropped, or one that
      // came up after the primary took the model (the job's start): in the
      // set it holds no state (waiting for it here would also hold up its
      // own catch-up, which waits for the changes in flight), and the
      // catch-up adds it back. Until it asks for the state, no update is
      // acknowledged: this one neither (a retry is a duplicate).
      Drop(peer.index, std::string(result.message()));
      {
        absl::MutexLock lock(&mu_);
        const bool awaited =
            std::any_of(awaited_joiners_.begin(), awaited_joiners_.end(),
                        [&](const auto& j) { return j.first == peer.index; });
        if (!awaited) {
          awaited_joiners_.emplace_back(peer.index,
                                        absl::Now() + options_.forward_timeout);
        }
      }
      if (update && failure.ok()) {
        failure = absl::UnavailableError(absl::StrCat(
            "replica ", peer.index, " of shard ", options_.shard_id,
            " is catching up from the primary: not acknowledged until it "
            "holds the shard's state; retry"));
      }
      continue;
    }
    if (Unanswered(result)) {
      const bool gone = Gone(peer);
      if (gone && !peer.answered.load() &&
          absl::Now() < created_ + options_.startup_wait) {
        // Never heard from since this process started: not up yet (the
        // job's start, a host slow to schedule it), not gone. Dropping it
        // would make this process the only one holding what it
        // acknowledges; a kill -9 of it then lost those updates to its
        // checkpoint. So no update is acknowledged until it is up (the
        // workers retry as duplicates), for up to startup_wait.
        if (update && failure.ok()) {
          failure = absl::UnavailableError(absl::StrCat(
              "replica ", peer.index, " of shard ", options_.shard_id, " (",
              peer.address, ") is not up yet: not acknowledged, retry"));
        }
        continue;
      }
      if (gone) {
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
    ReplicateRequest drop = Message("drop");
    drop.set_epoch(epoch_.load());
    Call(peer, drop, absl::Seconds(1), false).status().IgnoreError();
  }
  if (changes_state && failure.ok()) NoteAcknowledged();
  return failure;
}

absl::Status ReplicaSet::AdmitForward(const ReplicateRequest& request) {
  absl::MutexLock lock(&mu_);
  const std::string self = absl::StrCat("replica ", options_.replica_index,
                                        " of shard ", options_.shard_id);
  const Role role = role_.load();
  if (role == Role::kJoining) {
    forwarded_while_joining_ = request.from_replica();
    forwarded_while_joining_epoch_ = request.epoch();
    return absl::UnavailableError(
        absl::StrCat(self, " is ", kJoining, "it is still learning its role"));
  }
  if (role == Role::kStale) {
    return absl::FailedPreconditionError(
        absl::StrCat(kStale, self, " does not hold the shard's state"));
  }
  if (role == Role::kCatchingUp) {
    return absl::UnavailableError(
        absl::StrCat(kNewProcess, self, " is catching up from the primary"));
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
    StepDown(absl::StrCat("replica ", request.from_replica(),
                          " is primary at epoch ", request.epoch()));
    return absl::FailedPreconditionError(
        absl::StrCat(kStale, self, " was primary at a lower epoch"));
  }
  epoch_ = request.epoch();
  primary_ = request.from_replica();
  if (ChangesTheJobsState(request.method())) NoteAcknowledged();
  if (request.succession_size() > 0) {
    succession_.assign(request.succession().begin(),
                       request.succession().end());
  }
  for (auto& peer : peers_) {
    if (peer->index == request.from_replica()) peer->forwarded = true;
  }
  return absl::OkStatus();
}

bool ReplicaSet::CatchUp() {
  const std::string self = absl::StrCat("replica ", options_.replica_index,
                                        " of shard ", options_.shard_id);
  ReplicateRequest probe = Message("probe");
  ReplicateRequest join = Message("join");
  std::string last_problem;
  // The last primary heard from (Start's, at first: it may die before this
  // asks it anything), and until when its promise holds: a call's start
  // plus the answer's start_afresh_ms, no later than the primary's own
  // deadline. Then its refused connections in a row since it was last
  // heard, and when the first came.
  Peer* promiser = nullptr;
  absl::Time promise_until = start_promise_until_;
  for (auto& peer : peers_) {
    if (peer->index == start_promiser_) promiser = peer.get();
  }
  int promiser_refused = 0;
  absl::Time promiser_refused_since;
  auto note_promise = [&](Peer* from, absl::Time asked,
                          const ReplicateResponse& answer) {
    if (answer.role() != RoleName(Role::kPrimary)) return;
    promiser = from;
    promiser_refused = 0;
    promise_until = PromisedUntil(asked, answer);
  };
  // The first ask at once: a primary that found this process catching up
  // acknowledges no update until it asks (AwaitedJoinerLocked).
  absl::Duration wait = absl::ZeroDuration();
  while (!stop_.WaitForNotificationWithTimeout(wait)) {
    wait = absl::Milliseconds(200);
    if (role_.load() != Role::kCatchingUp) break;
    Peer* primary = nullptr;
    // A replica that holds the shard, may take it over, or may start it
    // afresh before this one: a backup, one starting (its checkpoint), one
    // catching up that comes first, one up but silent.
    std::vector<std::string> defer_to;
    for (auto& peer : peers_) {
      const absl::Time asked = absl::Now();
      absl::StatusOr<ReplicateResponse> answer =
          Call(*peer, probe, absl::Seconds(1), /*wait_for_ready=*/false);
      if (answer.ok()) {
        NoteEpoch(answer->epoch());
        if (answer->role() == RoleName(Role::kPrimary)) primary = peer.get();
        note_promise(peer.get(), asked, *answer);
        const bool holds_nothing =
            answer->role() == RoleName(Role::kStale) ||
            (answer->role() == RoleName(Role::kCatchingUp) &&
             peer->index > options_.replica_index);
        if (!holds_nothing) {
          defer_to.push_back(
              absl::StrCat("replica ", peer->index, " is ", answer->role()));
        }
      } else if (peer.get() != promiser && !Gone(*peer)) {
        defer_to.push_back(
            absl::StrCat("replica ", peer->index, " did not answer"));
      }
    }
    std::string problem = "no replica of the shard is primary now";
    if (primary == nullptr && promiser != nullptr) {
      if (Gone(*promiser)) {
        if (promiser_refused++ == 0) promiser_refused_since = absl::Now();
      } else {
        promiser_refused = 0;
      }
      if (promiser_refused >= options_.refused_probes && defer_to.empty() &&
          promiser_refused_since <= promise_until &&
          chunks_installed_.load() == 0) {
        StartAfresh(promiser->index,
                    absl::StrCat("its primary, replica ", promiser->index, " (",
                                 promiser->address,
                                 "), refuses connections, and had "
                                 "acknowledged nothing a fresh shard lacks"));
        return false;
      }
      if (promiser_refused >= options_.refused_probes) {
        problem = absl::StrCat(
            "the primary, replica ", promiser->index, ", refuses connections; ",
            !defer_to.empty() ? absl::StrJoin(defer_to, ", ")
            : promise_until == absl::InfinitePast()
                ? "it may have acknowledged updates this replica lacks, so "
                  "only it can go on (restarted, from its checkpoint)"
                : "it died after its promise of a fresh start ran out, so "
                  "only it can go on (restarted, from its checkpoint)");
      }
    }
    if (primary != nullptr) {
      const absl::Time asked = absl::Now();
      absl::StatusOr<ReplicateResponse> accepted =
          Call(*primary, join, absl::Seconds(5), /*wait_for_ready=*/false);
      problem = accepted.ok() ? "" : accepted.status().ToString();
      if (accepted.ok()) {
        note_promise(primary, asked, *accepted);
        // The primary sends the state once it finds a quiet moment (it
        // gives up after kCatchUpQuietWait); chunks then keep coming.
        absl::Time give_up =
            absl::Now() + kCatchUpQuietWait + absl::Seconds(15);
        absl::Time ask_again = absl::Now() + absl::Seconds(1);
        int64_t chunks = 0;
        while (role_.load() == Role::kCatchingUp && absl::Now() < give_up &&
               !stop_.WaitForNotificationWithTimeout(absl::Milliseconds(20))) {
          if (chunks_installed_.load() != chunks) {
            chunks = chunks_installed_.load();
            give_up = absl::Now() + options_.forward_timeout + absl::Seconds(5);
          }
          // Before the first chunk, the primary's attempt may have ended
          // without reaching this replica (its channel here was still
          // reconnecting to the process before this one, say): asking
          // again says so at once, rather than after give_up. While its
          // attempt runs, the primary refuses a second one.
          if (chunks_installed_.load() == 0 && absl::Now() >= ask_again) {
            ask_again = absl::Now() + absl::Seconds(1);
            const absl::Time asked_again = absl::Now();
            absl::StatusOr<ReplicateResponse> again =
                Call(*primary, join, absl::Seconds(5), false);
            if (again.ok()) {
              note_promise(primary, asked_again, *again);
              LOG(WARNING) << self << ": the primary's attempt to send the "
                           << "state ended without it; it tries again";
              give_up = absl::Now() + kCatchUpQuietWait + absl::Seconds(15);
            } else if (!absl::StrContains(again.status().message(),
                                          kAnotherReplicaCatchingUp)) {
              problem = again.status().ToString();
              break;  // find the primary again
            }
          }
        }
        if (role_.load() == Role::kBackup) return true;
        if (role_.load() != Role::kCatchingUp) return false;  // failed
        if (chunks_installed_.load() > 0) {
          CatchUpFailed(absl::StrCat("the transfer from replica ",
                                     primary->index, " broke off"));
          return false;
        }
        if (absl::Now() >= give_up) {
          problem = "the primary found no quiet moment to send the state";
        }
      }
    }
    if (!problem.empty() && problem != last_problem) {
      LOG(WARNING) << self
                   << " could not catch up yet (tries again): " << problem;
      last_problem = problem;
    }
    // Another replica's transfer takes tens of ms: until this one has the
    // state the shard has one replica fewer, so ask again soon.
    if (absl::StrContains(problem, kAnotherReplicaCatchingUp)) {
      wait = absl::Milliseconds(20);
    }
  }
  return role_.load() == Role::kBackup;
}

void ReplicaSet::StartAfresh(int dead_primary, const std::string& why) {
  {
    absl::MutexLock lock(&mu_);
    // The others follow it (one catching up is dropped at its first
    // forward, and catches up from this one once the workers registered
    // again).
    succession_ = {options_.replica_index};
    for (auto& peer : peers_) {
      if (peer->index != dead_primary) succession_.push_back(peer->index);
    }
  }
  TakeOver(Role::kCatchingUp,
           absl::StrCat("a fresh start of an empty shard (the workers "
                        "register again): ",
                        why));
}

absl::Status ReplicaSet::SendState(int joiner,
                                   const ReplicaStateExport& state) {
  const std::vector<ReplicaStateChunk>& chunks = state.chunks;
  Peer* peer = nullptr;
  for (auto& p : peers_) {
    if (p->index == joiner) peer = p.get();
  }
  if (peer == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("no replica ", joiner, " in this set"));
  }
  const absl::Time start = absl::Now();
  {
    // Its answer names its data port (a restarted replica has a new one):
    // the state goes there, as pushes do. Links to a process before it are
    // dead.
    peer->data_port = 0;
    {
      absl::MutexLock lock(&peer->links_mu);
      peer->idle_links.clear();
    }
    // The joiner has just asked, so it is up; this process's channel to
    // it may still be reconnecting (it refused while the process before it
    // was gone), which a probe that does not wait for it would take for an
    // answer: no data port, and every chunk refused.
    ReplicateRequest probe = Message("probe");
    Call(*peer, probe, absl::Seconds(2), /*wait_for_ready=*/true)
        .status()
        .IgnoreError();
  }
  ReplicateRequest message = Message("state");
  message.set_epoch(epoch_.load());
  std::atomic<int64_t> bytes{0};
  auto send_chunk = [&](size_t c,
                        const ReplicateRequest& chunk_message) -> absl::Status {
    if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
    const std::string header = chunks[c].SerializeAsString();
    char length[data_plane::kLengthPrefixBytes];
    data_plane::EncodeLengthPrefix(static_cast<uint32_t>(header.size()),
                                   length);
    // The floats go from the blocks' memory (changes are held).
    std::vector<absl::string_view> pieces = {
        absl::string_view(length, sizeof(length)), header};
    pieces.insert(pieces.end(), state.floats[c].begin(), state.floats[c].end());
    int64_t chunk_bytes = 0;
    for (absl::string_view piece : pieces) chunk_bytes += piece.size();
    bytes.fetch_add(chunk_bytes);
    absl::StatusOr<ReplicateResponse> answer;
    if (peer->data_port.load() > 0) {
      answer = CallOnDataPlane(*peer, chunk_message.SerializeAsString(), pieces,
                               absl::Now() + options_.forward_timeout);
    } else {
      ReplicateRequest inline_message = chunk_message;
      inline_message.set_request(absl::StrJoin(pieces, ""));
      answer = Call(*peer, inline_message, options_.forward_timeout,
                    /*wait_for_ready=*/true);
    }
    return answer.status();
  };
  // The last chunk makes the joiner a backup, in the set's new order.
  auto last_message = [&] {
    ReplicateRequest last = message;
    absl::MutexLock lock(&mu_);
    last.add_succession(options_.replica_index);
    for (int index : in_set_) {
      if (index != joiner) last.add_succession(index);
    }
    last.add_succession(joiner);
    return last;
  };
  // The first chunk installs the model (it carries no floats, so that
  // install is not behind a copy). The dense blocks' chunks after it fit
  // in any order, so several are in flight at once: one is sent while the
  // joiner copies another in. Sparse rows go in order (the order they are
  // loaded in is the joiner's eviction order), and the last chunk once
  // every other is in.
  const size_t last = chunks.size() - 1;
  if (absl::Status s = send_chunk(0, last == 0 ? last_message() : message);
      !s.ok()) {
    return s;
  }
  size_t first_in_order = 1;
  while (first_in_order < last && chunks[first_in_order].sparse_size() == 0) {
    ++first_in_order;
  }
  if (first_in_order > 1) {
    std::atomic<size_t> next{1};
    const int threads = static_cast<int>(
        std::min<size_t>(kStateChunksInFlight, first_in_order - 1));
    std::vector<absl::Status> failed(threads);
    std::vector<std::thread> senders;
    for (int t = 0; t < threads; ++t) {
      senders.emplace_back([&, t] {
        for (size_t c = next.fetch_add(1); c < first_in_order;
             c = next.fetch_add(1)) {
          failed[t] = send_chunk(c, message);
          if (!failed[t].ok()) {
            next.store(first_in_order);  // the others stop after theirs
            return;
          }
        }
      });
    }
    for (std::thread& sender : senders) sender.join();
    for (const absl::Status& s : failed) {
      if (!s.ok()) return s;
    }
  }
  for (size_t c = first_in_order; c < last; ++c) {
    if (absl::Status s = send_chunk(c, message); !s.ok()) return s;
  }
  if (last > 0) {
    if (absl::Status s = send_chunk(last, last_message()); !s.ok()) return s;
  }
  {
    absl::MutexLock lock(&mu_);
    if (std::find(in_set_.begin(), in_set_.end(), joiner) == in_set_.end()) {
      in_set_.push_back(joiner);
    }
    // Awaited until here, not only until it asked: a transfer that fails
    // leaves it awaited (it asks again), so that no update is acknowledged
    // without it within a fresh start's promise (Answer).
    awaited_joiners_.erase(
        std::remove_if(awaited_joiners_.begin(), awaited_joiners_.end(),
                       [&](const auto& j) { return j.first == joiner; }),
        awaited_joiners_.end());
    succession_ = {options_.replica_index};
    succession_.insert(succession_.end(), in_set_.begin(), in_set_.end());
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  catchups_.fetch_add(1);
  catchup_bytes_ = bytes.load();
  catchup_seconds_ = seconds;
  LOG(INFO) << "replica " << options_.replica_index << " of shard "
            << options_.shard_id << " brought replica " << joiner
            << " into its set: " << chunks.size() << " chunks, " << bytes.load()
            << " bytes in " << seconds << " s";
  // Every backup learns the new order (the joiner already has it).
  return Forward("view", {});
}

absl::Status ReplicaSet::AdmitState(const ReplicateRequest& request) {
  const std::string self = absl::StrCat("replica ", options_.replica_index,
                                        " of shard ", options_.shard_id);
  if (role_.load() != Role::kCatchingUp) {
    return absl::FailedPreconditionError(absl::StrCat(
        self, " is ", RoleName(role_.load()), ", not catching up"));
  }
  if (request.epoch() < epoch_.load()) {
    return absl::FailedPreconditionError(
        absl::StrCat(kFenced, self, " is at epoch ", epoch_.load(),
                     "; the state is of epoch ", request.epoch()));
  }
  chunks_installed_.fetch_add(1);
  return absl::OkStatus();
}

void ReplicaSet::Joined(const ReplicateRequest& request, int64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    epoch_ = request.epoch();
    primary_ = request.from_replica();
    succession_.assign(request.succession().begin(),
                       request.succession().end());
    for (auto& peer : peers_) {
      if (peer->index == request.from_replica()) peer->forwarded = true;
    }
    role_ = Role::kBackup;
  }
  may_have_acknowledged_ = true;
  catchup_bytes_ = bytes;
  catchup_seconds_ = absl::ToDoubleSeconds(absl::Now() - catch_up_started_);
  LOG(INFO) << "replica " << options_.replica_index << " of shard "
            << options_.shard_id << " caught up from replica "
            << request.from_replica() << " (epoch " << request.epoch() << ", "
            << chunks_installed_.load() << " chunks): a backup now";
}

void ReplicaSet::CatchUpFailed(const std::string& why) {
  StepDown(absl::StrCat("its catch-up failed: ", why));
}

std::vector<int> ReplicaSet::DataPorts() const {
  std::vector<int> ports(options_.addresses.size(), 0);
  ports[options_.replica_index] = data_port_.load();
  absl::MutexLock lock(&mu_);
  // Only the replicas in the set get the records: one dropped, catching up
  // or gone would never reach a step a worker waits to read.
  for (const auto& peer : peers_) {
    if (std::find(in_set_.begin(), in_set_.end(), peer->index) !=
        in_set_.end()) {
      ports[peer->index] = peer->data_port.load();
    }
  }
  return ports;
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
  // Only a primary of an older epoch: a new process at its address (joining,
  // or already the new primary's backup) is not the one deposed.
  if (request.method() == "deposed" && role_.load() == Role::kPrimary &&
      request.epoch() > epoch_.load()) {
    StepDown(absl::StrCat("replica ", request.from_replica(),
                          " took over at epoch ", request.epoch()));
  }
  ReplicateResponse response;
  response.set_epoch(epoch_.load());
  response.set_role(RoleName(role_.load()));
  response.set_model_registered(has_model_());
  response.set_data_port(data_port_.load());
  if ((request.method() == "probe" || request.method() == "join") &&
      role_.load() == Role::kPrimary) {
    // The promise: no update is acknowledged without the asker while it is
    // in the set (a forward to it fails while it catches up, and the first
    // that does makes it awaited for forward_timeout) or awaited.
    absl::MutexLock lock(&mu_);
    absl::Duration promise = absl::ZeroDuration();
    if (!may_have_acknowledged_.load()) {
      const int asker = request.from_replica();
      for (const auto& [index, until] : awaited_joiners_) {
        if (index == asker) promise = until - absl::Now();
      }
      if (std::find(in_set_.begin(), in_set_.end(), asker) != in_set_.end()) {
        promise = options_.forward_timeout;
      }
    }
    response.set_start_afresh_ms(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(promise)));
  }
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
  stats->set_replica_catchups(catchups_.load());
  stats->set_replica_catchup_bytes(catchup_bytes_.load());
  stats->set_replica_catchup_seconds(catchup_seconds_.load());
}

absl::StatusOr<ChangeGate::Pass> ChangeGate::Enter(int64_t step,
                                                   absl::Time until) {
  absl::MutexLock lock(&mu_);
  auto may_pass = [this, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    switch (phase_) {
      case Phase::kOpen:
        return true;
      case Phase::kFinishing:
        // A registration, a leave, ... may be what the step waits for (a
        // worker that moved to this primary registers before it pushes).
        return step < 0 || step <= finishing_step_;
      case Phase::kClosed:
        return false;
    }
    return false;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&may_pass), until)) {
    return absl::UnavailableError(
        "a replica is catching up and changes are held; retry");
  }
  highest_step_ = std::max(highest_step_, step);
  closed_.push_back(false);
  return Pass(this, oldest_open_ + static_cast<int64_t>(closed_.size()) - 1);
}

void ChangeGate::Exit(int64_t ticket) {
  std::vector<std::function<void()>> ready;
  {
    absl::MutexLock lock(&mu_);
    closed_[ticket - oldest_open_] = true;
    while (!closed_.empty() && closed_.front()) {
      closed_.pop_front();
      ++oldest_open_;
    }
    // Registered in ticket order: the ready ones lead.
    auto waiting = after_.begin();
    while (waiting != after_.end() && waiting->first <= oldest_open_) {
      ready.push_back(std::move(waiting->second));
      ++waiting;
    }
    after_.erase(after_.begin(), waiting);
  }
  for (auto& done : ready) done();
}

void ChangeGate::AfterChangesInFlight(std::function<void()> done) {
  {
    absl::MutexLock lock(&mu_);
    if (!closed_.empty()) {
      after_.emplace_back(oldest_open_ + static_cast<int64_t>(closed_.size()),
                          std::move(done));
      return;
    }
  }
  done();
}

void ChangeGate::Hold(bool finish_step, int64_t step_under_way) {
  absl::MutexLock lock(&mu_);
  phase_ = finish_step ? Phase::kFinishing : Phase::kClosed;
  finishing_step_ = std::max(step_under_way, highest_step_);
}

bool ChangeGate::AwaitQuiet(const std::function<bool()>& quiet,
                            absl::Time until) {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return closed_.empty();
      };
      // Under mu_ with nothing in flight, no change can start: what quiet()
      // sees stays so once the gate is closed.
      if (mu_.AwaitWithDeadline(absl::Condition(&drained), until) && quiet()) {
        phase_ = Phase::kClosed;
        return true;
      }
    }
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
}

void ChangeGate::Release() {
  absl::MutexLock lock(&mu_);
  phase_ = Phase::kOpen;
}

}  // namespace pstrain
