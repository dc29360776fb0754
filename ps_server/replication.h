// A shard held by R server processes (--replicas=R): primary-backup with a
// synchronous forward.
//
// The primary serves the workers. Every request that changes the shard's
// state (a push, a registration, a heartbeat, ...) is applied by the
// primary and then forwarded, as the worker sent it, to every replica of
// its set; the worker gets its answer only once each of them has applied
// it too. A backup applies forwarded requests with the same shard code, so
// its state follows the primary's: in sync mode exactly (a step's gradients
// are summed in worker order, whatever order they came in), in async mode
// up to the order of concurrent pushes. Workers' requests to a backup are
// refused UNAVAILABLE, naming the primary; the client then tries the next
// replica of the shard.
//
// Sync steps travel as what the primary applied, not as every worker's
// push (ShardOptions::record_steps). A push that comes with the pull of
// the next step (the data plane's PushPull, what workers send every step)
// is applied by the primary alone and answered with that pull, which waits
// for the step anyway. When a dense block's step completes on the primary
// (the last push, a lease that ran out, a clip's coefficient), the shard
// records it: the summed gradients, the workers counted, the rate and the
// coefficient (Shard::TakeStepRecords). The service sends the records to
// every backup ("steps" messages, two on their way at once, each block's
// records in step order), and a backup applies each one as the primary did
// (Shard::ApplyStepRecords); it completes no dense step by itself.
// The record window: a pull that shows step s + 1 waits for the records
// of the steps before s only, so the record of s travels while the
// workers compute, not in front of their pulls. Each worker keeps its
// pushes of s until its PushPull of s + 1 is answered
// (PsClient::RetainPushes) and sends them again, before anything else, to
// a replica its calls move to (PsClient::ResendIfReplicaMoved): a new
// primary that lacks step s sums them in worker order as the old one did,
// and a push of s + 1 waits there for that step (Shard::Push). A backup is
// so at most one step behind what any worker read. A step the kept pushes
// would not make again exactly (it ran short: a lease ran out, a worker
// left, --replicas_to_aggregate; or --sync_sum_order=arrival) has its
// pulls wait for its record, as every step's did before
// (Shard::StepRebuildsFromPushes). The job's final state (FinalState) and
// a worker's Leave wait for every record: a worker that has left keeps
// nothing.
// With R = 3 the records go to the backups one after the other, the last
// in the succession first, so no next primary holds a record that a
// replica after it lacks.
// A backup so receives one sum a step instead of W pushes, and does no
// summing: on 2 cores a sync step with --replicas=2 went from 1.21-1.44x
// one without to 1.03-1.05x (bench/results/replication_overhead.txt).
// A push answered before its step is done (a plain Push, a clipped step's)
// is still forwarded as it came; the step's record then replaces what the
// backup summed. A primary that dies before a step's record is out
// answered the next step's pulls to some workers at most: those send the
// kept pushes of the step again, the others the pushes still in flight,
// and the new primary sums them in worker order, as the old one would
// have. Sparse tables, async and ssp forward every change as it came.
//
// Why primary-backup and not a chain: a sync step is one round of pushes
// from every worker, and its latency is what a job feels. A forward from
// the primary reaches every backup in one hop (in parallel for R = 3); a
// chain adds a hop per replica to every push. The chain's advantage (the
// tail answers reads, spreading them) matters little here, where each
// worker pulls every block of a shard once a step.
//
// Failover. A backup watches the replicas before it in the set (probes
// every 100 ms). It takes over, at a higher epoch, when every one of them
// is gone: refusing connections (the process died; its host is up) three
// probes in a row, silent for --replica_takeover_s (the host died or is cut
// off), or restarted without the state ("stale"). A replica never heard
// from (no probe answered, no forward sent) may still be starting: it is
// gone only once it has refused or been silent for --replica_takeover_s. Every
// forward carries the sender's epoch, and a replica refuses one from a lower
// epoch: a primary that was cut off and replaced can no longer get a forward
// acknowledged, so it acknowledges nothing to workers, and steps down
// (stale) when it hears of the higher epoch. A stale replica's server
// exits (status 75, set_on_stale) so that a restart catches it up. A primary
// drops a backup from its set only when the backup's port refuses connections
// (its process is gone, so it cannot have taken over) or the backup says it is
// stale; a backup that is merely silent holds the primary's answers (the job
// waits, nothing diverges) until it answers or its process is gone.
//
// Catch-up. A replica process that starts while another replica of its
// shard holds the model (a restarted one, or a replacement) asks the
// primary to join. The primary holds new changes (ChangeGate), waits for a
// quiet moment (no change in flight, and in sync mode no step part summed:
// the pushes of the step under way, and changes of no step such as the
// registration of a worker that just moved here, still pass; the next
// step's pushes wait), sends its
// whole state in chunks (Shard::ExportReplicaState), adds the joiner at the
// end of its set, and lets the changes go on. The job pauses for the
// transfer; the joiner is then a backup like any other.
//
// Succession. The primary's set is ordered: the primary, then its backups
// in the order they take over (a joiner goes last). Every forward carries
// that order, and a backup watches the replicas before it in it, so after
// failovers and catch-ups exactly one replica is next. A replica that is
// catching up is no one's successor.
#ifndef PSTRAIN_PS_SERVER_REPLICATION_H_
#define PSTRAIN_PS_SERVER_REPLICATION_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/transport/data_link.h"
#include "common/transport/tls_stream.h"
#include "grpcpp/security/credentials.h"
#include "proto/ps.grpc.pb.h"
#include "proto/ps.pb.h"
#include "ps_server/shard.h"

namespace pstrain {

struct ReplicaOptions {
  int shard_id = 0;
  // This process's index in its shard's replica set, and the set's
  // addresses (host:port of each replica's gRPC port, by index).
  int replica_index = 0;
  std::vector<std::string> addresses;
  // Sent on every forward when the servers require a token.
  std::string auth_token;
  // TLS (both null: plaintext): the credentials this replica calls the
  // others' gRPC ports with, and the client context of its links to their
  // data ports.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::shared_ptr<const TlsContext> data_tls;
  absl::Duration probe_interval = absl::Milliseconds(100);
  // Probes in a row that must find a replica's port refusing connections.
  int refused_probes = 3;
  // How long a replica may be silent before the next one takes over.
  absl::Duration takeover_after_silence = absl::Seconds(2);
  // How long a forward may take before the worker is answered UNAVAILABLE.
  absl::Duration forward_timeout = absl::Seconds(10);
  // How long a registration's forward waits for a replica that is not up
  // yet (the job's start).
  absl::Duration startup_wait = absl::Seconds(60);
  // A catch-up's chunks (Shard::ExportReplicaState): each link in flight
  // grows its receive buffer to one, faulted in once (8 MiB chunks took
  // 1.9-2.5x the time of a TCP copy of the state, 2 MiB 1.3-1.9x:
  // bench/replica_catchup.sh).
  int64_t catchup_chunk_bytes = int64_t{2} << 20;
};

// The changes a primary applies and forwards, counted; held while a replica
// catches up, so that the state it is sent is the state the forwards after
// it go on from. It also orders a sync pull after the forwards of what it
// shows: a step completes on the primary when it applies the step's last
// push, before that push is forwarded, and a worker that pulled the next
// step from the primary must not find the backup without it (the backup
// would refuse its next push if the primary died in between).
class ChangeGate {
 public:
  // A change let through; it ends (Exit) when the Pass goes.
  class Pass {
   public:
    explicit Pass(ChangeGate* gate, int64_t ticket = 0)
        : gate_(gate), ticket_(ticket) {}
    Pass(Pass&& other) : gate_(other.gate_), ticket_(other.ticket_) {
      other.gate_ = nullptr;
    }
    Pass& operator=(Pass&&) = delete;
    ~Pass() {
      if (gate_ != nullptr) gate_->Exit(ticket_);
    }

   private:
    ChangeGate* gate_;
    int64_t ticket_;
  };

  // A change of sync step `step` (-1: of no step: a registration, a
  // heartbeat, ...) starts: waits while the gate holds it, until `until`
  // (then UNAVAILABLE: retry).
  absl::StatusOr<Pass> Enter(int64_t step, absl::Time until);
  // Holds the changes that have not started. `finish_step` (sync): a step
  // part summed completes only with the rest of its pushes, so pushes of
  // steps up to `step_under_way`, and changes of no step, still pass until
  // AwaitQuiet.
  void Hold(bool finish_step, int64_t step_under_way = -1);
  // Waits until no change is in flight and `quiet()` holds (then holds
  // every change), or until `until` (false).
  bool AwaitQuiet(const std::function<bool()>& quiet, absl::Time until);
  void Release();

  // Runs `done` once every change that entered before this call has exited
  // (applied and forwarded): now, or on the thread of the last of them.
  void AfterChangesInFlight(std::function<void()> done);

 private:
  void Exit(int64_t ticket);

  absl::Mutex mu_;
  // Changes get tickets in the order they pass. oldest_open_ is the first
  // not yet exited; closed_[i] says whether ticket oldest_open_ + i has
  // (empty: nothing in flight). A deque, so that a change costs no
  // allocation of its own.
  int64_t oldest_open_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<bool> closed_ ABSL_GUARDED_BY(mu_);
  // Waiting for every ticket up to `first` to exit.
  std::vector<std::pair<int64_t, std::function<void()>>> after_
      ABSL_GUARDED_BY(mu_);
  // Open: every change passes. Finishing (sync, waiting for the quiet
  // moment): the step under way completes, so its pushes pass, and so do
  // changes of no step; the next step's pushes wait. Closed (the state is
  // being sent): every change waits.
  enum class Phase { kOpen, kFinishing, kClosed };
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kOpen;
  int64_t finishing_step_ ABSL_GUARDED_BY(mu_) = -1;
  // The highest step of a change that passed: one of a later step than the
  // shard's may be in flight when it is held, and its step must finish.
  int64_t highest_step_ ABSL_GUARDED_BY(mu_) = -1;
};

// How long a primary waits for a quiet moment to send a joiner its state
// (a sync step that waits for a worker's lease holds it up).
inline constexpr absl::Duration kCatchUpQuietWait = absl::Seconds(30);
// Opens a primary's refusal of a join while it sends another replica (or
// this one, in an attempt still running) its state.
inline constexpr absl::string_view kAnotherReplicaCatchingUp =
    "another replica is catching up";

class ReplicaSet {
 public:
  enum class Role { kJoining, kPrimary, kBackup, kStale, kCatchingUp };
  static const char* RoleName(Role role);

  // `has_model`: whether this process's shard holds a registered model.
  ReplicaSet(const ReplicaOptions& options, std::function<bool()> has_model);
  ~ReplicaSet();  // Stop()

  // Once the server listens (its peers' probes need an answer): asks the
  // other replicas where the set stands, takes this process's role, and
  // (a backup) starts watching the replicas before it. A process that
  // finds another replica holding the model catches up from the primary
  // (in the background: "catching_up" until it is a backup).
  void Start();
  void Stop();

  // OK when this replica serves workers (the primary); otherwise
  // UNAVAILABLE, naming the primary as far as this replica knows.
  absl::Status ServesWorkers() const;

  // The primary: `request` (the worker's request of `method`, as sent) to
  // every replica of the set, in parallel; OK once each has applied it.
  // UNAVAILABLE when one did not answer in time or this replica was
  // deposed: the worker's answer must not say the request is held.
  // `wait_for_replicas`: wait up to startup_wait for replicas that are not
  // up yet (a registration at the job's start).
  // Pushes travel on the replica's data port (common/transport/data_plane.h,
  // Method kForward), the rest over gRPC. `confirmed` (when given): how
  // many replicas applied it (0 when the set holds no other).
  absl::Status Forward(absl::string_view method,
                       absl::Span<const absl::string_view> request,
                       bool wait_for_replicas = false,
                       int* confirmed = nullptr);

  // The receiving side of Replicate, before the request is applied: OK
  // when a request of `epoch` may be applied here. Refuses one from a
  // lower epoch (FAILED_PRECONDITION "fenced"), and any forward to a stale
  // replica; a primary hearing of a higher epoch steps down (stale).
  absl::Status AdmitForward(const ReplicateRequest& request);
  // Answers "probe", "drop" (this replica left the set) and "deposed" (a
  // replica took over from this one while it was silent: a primary of an
  // older epoch steps down).
  ReplicateResponse Answer(const ReplicateRequest& request);

  // Catch-up, on the primary: sends `state` (Shard::ExportReplicaState)
  // to replica `joiner` as "state" messages (a u32 length, the chunk, its
  // floats): the first alone, the dense chunks after it several at once,
  // the sparse ones in order, the last once every other is in. Then adds
  // the joiner at the end of the set and tells every backup the new
  // order. Call with changes held.
  absl::Status SendState(int joiner, const ReplicaStateExport& state);
  int64_t catchup_chunk_bytes() const { return options_.catchup_chunk_bytes; }
  // Catch-up, on the joiner: OK when a "state" message may be installed
  // (this replica is catching up, and it comes from the primary it asked).
  absl::Status AdmitState(const ReplicateRequest& request);
  // The last chunk is installed: a backup from now.
  void Joined(const ReplicateRequest& request, int64_t bytes);
  // A chunk could not be installed: the shard holds part of a model, so
  // this process can only be stale.
  void CatchUpFailed(const std::string& why);

  // This process's data port, told to the primary in every answer.
  void set_data_port(int port) { data_port_ = port; }
  // Runs on the watcher's thread once this replica has taken over as
  // primary (set before Start).
  void set_on_takeover(std::function<void()> on_takeover) {
    on_takeover_ = std::move(on_takeover);
  }
  // A checkpoint this process read but did not install (set before Start):
  // Start calls `settle(true)` to install it when this replica holds its
  // own state (the first of the set to come up), or `settle(false)` to drop
  // it when a running replica holds the shard's state and this one catches
  // up from it (a catch-up starts empty, and the running state is newer).
  // settle(true) returns whether the install worked; a replica whose
  // install failed is stale (and the server exits 1: settle says so).
  void set_settle_restored(std::function<bool(bool keep)> settle) {
    settle_restored_ = std::move(settle);
  }
  // Runs once this replica is stale (set before Start): deposed, dropped
  // for disagreeing, or its catch-up or checkpoint failed. Its state is of
  // no use any more; a new process catches up (the server exits so that
  // its supervisor starts one).
  void set_on_stale(std::function<void()> on_stale) {
    on_stale_ = std::move(on_stale);
  }

  // The replica fields of StatsResponse.
  void AddStats(StatsResponse* stats) const;
  bool is_primary() const { return role_.load() == Role::kPrimary; }
  // 0 until a replica of the set takes over.
  int64_t epoch() const { return epoch_.load(); }
  bool is_backup() const { return role_.load() == Role::kBackup; }
  int size() const { return static_cast<int>(options_.addresses.size()); }
  // Each replica's data port by index: its own, and those of the replicas
  // in its set from their answers (0: unknown, or not in the set).
  std::vector<int> DataPorts() const;
  // Whether this replica holds the shard's running state: it serves or
  // follows (not starting, catching up or stale).
  bool holds_state() const {
    const Role role = role_.load();
    return role == Role::kPrimary || role == Role::kBackup;
  }

 private:
  struct Peer {
    int index = 0;
    std::string address;
    std::unique_ptr<ParameterServer::Stub> stub;
    // The watcher's view (backups, of the replicas before them).
    int refused_in_a_row = 0;
    absl::Time last_heard;  // InfinitePast: never
    bool stale = false;
    // It sent this replica a forward: it was up (the watcher then counts
    // it heard, though no probe of it has been answered yet).
    std::atomic<bool> forwarded{false};
    // It answered a call of this one's, or probed it: it was up.
    std::atomic<bool> answered{false};
    // Its data port (0: not known yet, or none), and idle connections to
    // it: a forward takes one, or opens one, and gives it back.
    std::atomic<int> data_port{0};
    absl::Mutex links_mu;
    std::vector<std::unique_ptr<DataLink>> idle_links ABSL_GUARDED_BY(links_mu);
  };

  // `stub`: one of the caller's for `peer` (default: the peer's own).
  absl::StatusOr<ReplicateResponse> Call(
      Peer& peer, const ReplicateRequest& request, absl::Duration timeout,
      bool wait_for_ready, ParameterServer::Stub* stub = nullptr) const;
  // A channel to a replica's gRPC port with this set's credentials.
  std::shared_ptr<grpc::Channel> ChannelTo(
      const std::string& address, const grpc::ChannelArguments& args) const;
  // `meta` (a ReplicateRequest with no request) and `request`'s pieces as
  // one Forward on `peer`'s data plane.
  absl::StatusOr<ReplicateResponse> CallOnDataPlane(
      Peer& peer, const std::string& meta,
      absl::Span<const absl::string_view> request, absl::Time deadline) const;
  // A message of `method` from this replica (its epoch is the caller's to
  // set).
  ReplicateRequest Message(absl::string_view method) const;
  void NoteAnswer(Peer& peer, const ReplicateResponse& response) const;
  // Whether `peer`'s port refuses TCP connections now: its process is gone.
  bool Gone(const Peer& peer) const;
  void Watch();
  // The joiner: asks the primary to join until it has (true) or stops. If
  // the primary dies while its promise (ReplicateResponse.start_afresh_ms)
  // holds, and no other replica holds the shard or comes before this one,
  // it starts the shard afresh (StartAfresh).
  bool CatchUp();
  // A joiner becomes the primary of an empty shard, at an epoch past every
  // one seen: `dead_primary` acknowledged nothing a fresh shard lacks
  // before it died, so the workers register again and lose nothing.
  void StartAfresh(int dead_primary, const std::string& why);
  // Whether replica `index` comes before this one in the succession.
  bool Ahead(int index) const;
  // Takes over as primary, at an epoch past every one seen, if this replica
  // is still `from` (a backup; one catching up: StartAfresh); the replicas
  // after it in the succession follow it.
  void TakeOver(Role from, const std::string& why);
  // After a takeover: tells the replicas it replaced for their silence
  // (they may be alive, cut off) that they are deposed, so that one that
  // comes back steps down at once rather than at its next forward's
  // answer, which the partition may hold in TCP's retransmission backoff
  // for seconds after the heal. Until each answered, refuses connections
  // or a minute passed.
  void TellDeposed(std::vector<Peer*> deposed);
  void Drop(int index, const std::string& why);
  // UNAVAILABLE (retry) for an update while a replica dropped as a new
  // process has not asked for the state yet (awaited_joiners_); those past
  // their deadline are given up, logged.
  absl::Status AwaitedJoinerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool InSet(int index) const;
  void StepDown(const std::string& why);
  void NoteEpoch(int64_t epoch);
  // Ends every call to a replica in flight, and fails every later one at
  // once: this replica stopped or stepped down, so no answer matters, and a
  // call on a connection that a partition left in TCP's retransmission
  // backoff would hold a worker's call here for seconds after the heal
  // (the handlers that forward run on threads of their own, and the
  // server's shutdown waits for them).
  void EndCalls();
  // A call's registration for EndCalls; false when calls have ended.
  bool BeginCall(grpc::ClientContext* context, const DataLink* link) const;
  void EndCall(grpc::ClientContext* context, const DataLink* link) const;

  const ReplicaOptions options_;
  const std::function<bool()> has_model_;
  // A peer never heard from until startup_wait after this is not up yet
  // rather than gone (Forward).
  const absl::Time created_ = absl::Now();
  std::function<void()> on_takeover_;
  // Set only when this process read a checkpoint.
  std::function<bool(bool keep)> settle_restored_;
  std::function<void()> on_stale_;
  std::vector<std::unique_ptr<Peer>> peers_;  // every replica but this one

  std::atomic<Role> role_{Role::kJoining};
  std::atomic<int64_t> epoch_{0};
  // The replica this one believes is primary (-1: none known).
  std::atomic<int> primary_{0};
  mutable absl::Mutex mu_;
  // The primary's set: the peers it forwards to, by index.
  std::vector<int> in_set_ ABSL_GUARDED_BY(mu_);
  // The set's order as last heard from the primary (the primary: itself,
  // then in_set_).
  std::vector<int> succession_ ABSL_GUARDED_BY(mu_);
  // The primary: replicas that answered a forward as a new process catching
  // up (so were dropped from in_set_), each until it asks for the state or
  // its deadline passes. Until then no update (a push, a step's record) is
  // acknowledged: the worker would hold as done what only this process has
  // (kill -9 it, and the joiner, which never got it, cannot give it back).
  std::vector<std::pair<int, absl::Time>> awaited_joiners_ ABSL_GUARDED_BY(mu_);
  // Whether the state this replica holds may include a change a worker was
  // told is done: it acknowledged one, applied one forwarded, caught up or
  // installed a checkpoint. Until then its probe answers promise a joiner
  // that it may start the shard afresh (start_afresh_ms). Set under mu_
  // where a change passes Forward without every replica, so that no
  // answer's promise and that change cross.
  std::atomic<bool> may_have_acknowledged_{false};
  // Sets it; a load first, so that the forwards of every push do not each
  // write the flag's cache line once it is set.
  void NoteAcknowledged() {
    if (!may_have_acknowledged_.load(std::memory_order_relaxed)) {
      may_have_acknowledged_ = true;
    }
  }
  // While joining: the replica that forwarded a change to this one (-1:
  // none), and its epoch. Start takes it for the primary holding the state.
  int forwarded_while_joining_ ABSL_GUARDED_BY(mu_) = -1;
  // The primary Start found, and until when its promise of a fresh start
  // holds (CatchUp's first; set before the watcher starts).
  int start_promiser_ = -1;
  absl::Time start_promise_until_ = absl::InfinitePast();
  int64_t forwarded_while_joining_epoch_ ABSL_GUARDED_BY(mu_) = 0;

  std::atomic<int> data_port_{0};
  std::atomic<int64_t> forwards_{0};
  std::atomic<int64_t> takeovers_{0};
  std::atomic<int64_t> dropped_{0};
  std::atomic<int64_t> catchups_{0};
  std::atomic<int64_t> catchup_bytes_{0};
  std::atomic<double> catchup_seconds_{0};
  // The joiner: when it asked to join, and the chunks installed since.
  absl::Time catch_up_started_;
  std::atomic<int64_t> chunks_installed_{0};
  absl::Notification stop_;
  std::thread watcher_;
  // Calls in flight (Call's contexts, CallOnDataPlane's links).
  mutable absl::Mutex calls_mu_;
  mutable std::vector<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(calls_mu_);
  mutable std::vector<const DataLink*> links_ ABSL_GUARDED_BY(calls_mu_);
  bool calls_ended_ ABSL_GUARDED_BY(calls_mu_) = false;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_REPLICATION_H_
