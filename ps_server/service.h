// The gRPC face of a shard, on gRPC's callback API: no thread is held while
// a sync pull waits for its step. Push and Pull are raw methods so tensor
// payloads are neither copied into nor out of protobuf strings: a push is
// decoded straight from the received slices into the shard, and a pull's
// response references the copied block values.
#ifndef PSTRAIN_PS_SERVER_SERVICE_H_
#define PSTRAIN_PS_SERVER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/random/random.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/handler_threads.h"
#include "proto/ps.grpc.pb.h"
#include "ps_server/checkpointer.h"
#include "ps_server/data_plane_server.h"
#include "ps_server/replication.h"
#include "ps_server/rounded_blocks.h"
#include "ps_server/shard.h"
#include "ps_server/step_intervals.h"

namespace pstrain {

// Every method on the callback API, and raw: requests are parsed here, so
// that bytes that do not parse get INVALID_ARGUMENT naming the message
// (gRPC's own parsing answers UNIMPLEMENTED with an empty message), and
// Push and Pull payloads are neither copied into nor out of protobuf
// strings. The chain is spelled out because a raw streaming method cannot
// sit on top of its typed twin (same signature, different reactor type).
using ParameterServerRawService = ParameterServer::WithRawCallbackMethod_Replicate<
    ParameterServer::WithRawCallbackMethod_Pull<ParameterServer::WithRawCallbackMethod_Push<
        ParameterServer::WithRawCallbackMethod_PullStream<ParameterServer::WithRawCallbackMethod_PushStream<
            ParameterServer::WithRawCallbackMethod_RegisterModel<ParameterServer::WithRawCallbackMethod_Stats<
                ParameterServer::WithRawCallbackMethod_Heartbeat<ParameterServer::WithRawCallbackMethod_Leave<
                    ParameterServer::WithRawCallbackMethod_Checkpoint<
                        ParameterServer::WithRawCallbackMethod_SparsePull<
                            ParameterServer::WithRawCallbackMethod_SparsePush<
                                ParameterServer::WithRawCallbackMethod_AwaitJobStart<
                                    ParameterServer::WithRawCallbackMethod_Assign<
                                        ParameterServer::WithRawCallbackMethod_ClipNorm<
                                            ParameterServer::WithRawCallbackMethod_ApplyClip<
                                                ParameterServer::
                                                    WithRawCallbackMethod_SparseChanges<
                                                        ParameterServer::
                                                            Service>>>>>>>>>>>>>>>>>;

struct ServiceOptions {
  // Fault injection for exactly-once tests: after applying a push, answer
  // UNAVAILABLE with this probability, as if the response was lost, so the
  // client retries a push the shard already has.
  double drop_push_response_probability = 0;
  // Fault injection: SIGKILL itself on a worker's first RegisterModel
  // ("register") or request for the job's final state ("final_state",
  // CheckpointRequest.final_version > 0); "": never.
  std::string crash_at;
  // When not empty, every call must carry "authorization: Bearer <token>";
  // others are refused UNAUTHENTICATED before they are read.
  std::string auth_token;
};

// Push and Pull are also served on the tensor data plane
// (DataPlaneHandler): both transports run the same code from the request's
// bytes on.
class ParameterServerService final : public ParameterServerRawService,
                                     public DataPlaneHandler {
 public:
  // `checkpointer` may be null (no --checkpoint_dir).
  explicit ParameterServerService(Shard* shard,
                                  const ServiceOptions& options = {},
                                  Checkpointer* checkpointer = nullptr)
      : shard_(shard),
        options_(options),
        life_(absl::Uniform<uint64_t>(absl::BitGen(), 1,
                                      std::numeric_limits<uint64_t>::max())),
        checkpointer_(checkpointer) {}
  ~ParameterServerService() override;

  grpc::ServerUnaryReactor* RegisterModel(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Pull(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* PushStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* PullStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Assign(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* AwaitJobStart(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ClipNorm(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ApplyClip(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* SparsePull(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* SparsePush(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* SparseChanges(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Replicate(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;

  // --replicas > 1: this shard's replica set. Workers are then served only
  // by the primary, which forwards what changes the shard before answering.
  // Set before the server starts; null (the default) for one replica.
  void set_replicas(ReplicaSet* replicas);

  // Ends every open PushStream/PullStream (each waits for its next request
  // with no deadline of its own), so that Server::Shutdown need not wait for
  // them; their clients see a cancelled call and retry elsewhere or later.
  // Call after Shard::BeginShutdown.
  // Also ends a replica catch-up in progress (ps_server/replication.h).
  void CancelCallStreams();

  // Push responses dropped on purpose (drop_push_response_probability).
  int64_t push_responses_dropped() const { return dropped_.load(); }

  // The shard's stats with this service's own counters added: what the
  // Stats RPC answers.
  StatsResponse CurrentStats() const;

  // The data plane's port, announced in every RegisterModelResponse; 0
  // (the default) announces none. `tls`: the port speaks TLS.
  void set_data_port(int port, bool tls = false) {
    data_port_tls_.store(tls);
    data_port_.store(port);
  }

  // DataPlaneHandler.
  absl::StatusOr<std::string> ServeDataPlanePush(
      absl::Span<const absl::string_view> request, absl::Time hold_until,
      absl::string_view pull_after) override;
  void ServeDataPlanePull(absl::Span<const absl::string_view> request,
                          absl::Time deadline, bool payloads_apart,
                          bool follows_own_push, PullDone done) override;
  absl::StatusOr<std::string> ServeDataPlaneForward(
      absl::string_view body, absl::Time deadline) override;
  bool TokenAccepted(absl::string_view token) const override;
  void CountRejected() override { shard_->CountRejected(); }
  void CountHandshakeRefused() override {
    data_plane_tls_refused_.fetch_add(1, std::memory_order_relaxed);
  }
  void CountTlsConnection(bool kernel_tls) override {
    (kernel_tls ? data_plane_ktls_ : data_plane_user_tls_)
        .fetch_add(1, std::memory_order_relaxed);
  }

 private:
  // The end of a job, as a worker holding its final model asks it
  // (CheckpointRequest.final_version > 0).
  absl::StatusOr<CheckpointResponse> FinalState(
      const CheckpointRequest& request);
  // OK when this process serves workers (one replica, or the primary).
  absl::Status ServesWorkers() const {
    return replicas_ == nullptr ? absl::OkStatus() : replicas_->ServesWorkers();
  }
  // The primary: `request` of `method` to the other replicas, after it
  // was applied here and before the worker's answer (OK with one replica).
  // Step records the change made go too (a heartbeat or a leave may
  // complete a step); a pull that shows them waits for them, so their
  // fate is not the change's answer.
  absl::Status Forward(absl::string_view method,
                       absl::Span<const absl::string_view> request,
                       bool wait_for_replicas = false) {
    if (replicas_ == nullptr) return absl::OkStatus();
    absl::Status forwarded =
        replicas_->Forward(method, request, wait_for_replicas);
    NudgeStepRecords();
    return forwarded;
  }
  // A small request, serialized only when there are replicas to send it to
  // (heartbeats and sparse pushes come every step).
  absl::Status Forward(absl::string_view method,
                       const google::protobuf::MessageLite& request,
                       bool wait_for_replicas = false) {
    if (replicas_ == nullptr) return absl::OkStatus();
    const std::string bytes = request.SerializeAsString();
    const absl::string_view piece = bytes;
    return Forward(method, absl::MakeConstSpan(&piece, 1), wait_for_replicas);
  }
  // A backup: applies `request` of `method` that the primary forwarded, as
  // the worker's own call would, holding what the shard wants retried
  // until `deadline`.
  absl::Status ApplyForwarded(absl::string_view method,
                              absl::Span<const absl::string_view> request,
                              absl::Time deadline);
  // A change to the shard (applied, then forwarded) of sync step `step`
  // (-1: of none) may start: a Pass of the gate, which holds changes while a
  // replica catches up. Always passes with one replica.
  absl::StatusOr<ChangeGate::Pass> EnterChange(int64_t step) {
    if (replicas_ == nullptr) return ChangeGate::Pass(nullptr);
    return gate_.Enter(step, absl::Now() + kCatchUpQuietWait);
  }
  // A pull's answer (dense or sparse): with replicas in sync mode, run once
  // every change before it is on the backups (ChangeGate); otherwise as is.
  template <typename... Result>
  std::function<void(absl::Status, Result...)> AfterForwards(
      std::function<void(absl::Status, Result...)> answer, absl::Time deadline);
  // Step records (Shard::TakeStepRecords), on a replicated sync primary.
  // kStepRecordSenders threads send them (RunStepRecordsSender), each
  // block's in step order; a request that may have made some wakes one and
  // goes on (a connection's thread that waited for the backup would hold
  // the pushes behind it, which complete the next block groups). Two:
  // a step's block groups complete one after another, and the records of
  // the last group then leave at once instead of after the round trip of
  // the group before it (on 2 vCPUs, where cores are free, a message's
  // newest record waited 0.35 ms from made to confirmed instead of
  // 0.42 ms, medians, when the step's pulls waited for it;
  // bench/results/replication_overhead.txt).
  void NudgeStepRecords();
  // Takes the records a take returns (Shard::TakeStepRecords) and sends
  // them to every backup.
  absl::Status SendStepRecords();
  // Ends the waits for records: OK those now on the backups, UNAVAILABLE
  // those past their deadline, and every one once this replica no longer
  // serves workers.
  void EndStepRecordWaits();
  // Returns once every record made so far is on the backups (UNAVAILABLE
  // when they do not confirm them within kStepRecordsWait).
  absl::Status AwaitStepRecords();
  // Runs `then` once the records made up to the `made`-th are on every
  // backup, or sooner once every record still unconfirmed is of step
  // `window_from` or later (now, or on the sender's thread); with
  // UNAVAILABLE at `deadline` or once it has waited kStepRecordsWait, or at
  // once when this replica no longer serves workers.
  void AfterStepRecords(int64_t made, absl::Time deadline,
                        std::function<void(absl::Status)> then,
                        int64_t window_from = kNoWindow);
  static constexpr int64_t kNoWindow = std::numeric_limits<int64_t>::max();
  // Whether the push need not be forwarded: the pull answered with it is of
  // a later step of every block it pushed, so the step's record carries it
  // (and its worker keeps it until the backups have that record).
  bool StepRecordCovers(const WirePushRequest& push,
                        absl::string_view pull_after);
  // A step_records_senders_ thread: sends the records when woken, and every
  // kStepRecordsRetry (a step the reaper completed; a send that failed),
  // and ends overdue waits.
  void RunStepRecordsSender();
  static constexpr absl::Duration kStepRecordsRetry = absl::Milliseconds(20);
  static constexpr absl::Duration kStepRecordsWait = absl::Seconds(15);
  // The most sums one "steps" message carries (a backup's data plane takes
  // up to 512 MiB a request).
  static constexpr int64_t kStepRecordsBytes = int64_t{64} << 20;
  static constexpr int kStepRecordSenders = 2;
  // How long a sender holds records no pull waits for (RunStepRecordsSender):
  // half the job's step, so that they travel and are applied while the
  // workers compute rather than beside the step's exchange, and are on the
  // backups before the next step's pulls wait for them. Within these
  // bounds: records sent at once cost a Fashion-MNIST MLP step on 1 server
  // x 1 worker 1.34x one without replicas, 0.5 ms after 1.25x, half its
  // step after 1.20x (bench/results/replication_overhead.txt).
  absl::Duration StepRecordsLinger() const;
  static constexpr absl::Duration kStepRecordsMinLinger =
      absl::Microseconds(500);
  static constexpr absl::Duration kStepRecordsMaxLinger =
      absl::Milliseconds(10);

  // The primary, asked by replica `joiner` to join: starts sending it the
  // shard's state (CatchUp, on catch_up_thread_), or says why it cannot.
  absl::Status StartCatchUp(int joiner);
  void CatchUp(int joiner);
  // The joiner: installs one chunk of the primary's state.
  absl::StatusOr<ReplicateResponse> ServeStateChunk(
      const ReplicateRequest& meta, absl::Span<const absl::string_view> bytes);
  // A forward, from either transport: admitted (epoch) and applied.
  absl::StatusOr<ReplicateResponse> ServeForward(
      const ReplicateRequest& meta, absl::Span<const absl::string_view> request,
      absl::Time deadline);
  // Dies (SIGKILL) when ServiceOptions::crash_at is `moment`.
  void CrashIfInjectedAt(absl::string_view moment);
  // --inject_crash_at=record_window, on a replicated primary that never
  // took over: its records of kInjectedWindowStep on stay here, and it dies
  // at the first push of the step after (its workers read the step's
  // model, its backups lack the step).
  bool InjectedRecordWindow() const {
    return options_.crash_at == "record_window" && replicas_ != nullptr &&
           replicas_->epoch() == 0;
  }
  static constexpr int64_t kInjectedWindowStep = 5;

  // Push and Pull from the request's bytes on, whichever transport brought
  // them: the encoded PushResponse / the PullResponse's pieces.
  // `hold_until`: see Shard::Push (gRPC's callback threads are not held).
  absl::StatusOr<std::string> PushFromBytes(
      absl::Span<const absl::string_view> request, absl::Time hold_until,
      absl::string_view pull_after);
  void PullFromBytes(absl::Span<const absl::string_view> request,
                     absl::Time deadline, bool payloads_apart,
                     bool follows_own_push, PullDone done);
  class CallStream;
  using PullAnswer = std::function<void(absl::Status, grpc::ByteBuffer)>;

  // The work of one Push call, unary or streamed: `response` is set when
  // the status is OK.
  absl::Status HandlePush(const grpc::ByteBuffer& request,
                          grpc::ByteBuffer* response);
  absl::Status HandleAssign(const grpc::ByteBuffer& request,
                            grpc::ByteBuffer* response);
  // Where a handler that forwards runs: off gRPC's threads when this
  // server has replicas (a forward waits for the backups); null (inline)
  // otherwise.
  HandlerThreads* Waiting() {
    return replicas_ != nullptr ? &waiting_handlers_ : nullptr;
  }
  // The work of one Pull call: `answer` runs exactly once, inline or when
  // the step completes (or `deadline`, capped by the shard, passes).
  void HandlePull(const grpc::ByteBuffer& request, absl::Time deadline,
                  PullAnswer answer);
  bool DropThisResponse();
  // False (and answers UNAUTHENTICATED) when the call lacks the token.
  bool Authorized(grpc::CallbackServerContext* context,
                  grpc::ServerUnaryReactor** refused);
  bool HasToken(grpc::CallbackServerContext* context) const;

  Shard* shard_;
  ReplicaSet* replicas_ = nullptr;
  const ServiceOptions options_;
  const uint64_t life_;  // PushResponse.server_life
  Checkpointer* checkpointer_;
  std::atomic<int64_t> dropped_{0};
  std::atomic<int> data_port_{0};
  std::atomic<int64_t> data_plane_requests_{0};
  std::atomic<bool> data_port_tls_{false};
  std::atomic<int64_t> data_plane_tls_refused_{0};
  std::atomic<int64_t> data_plane_ktls_{0};
  std::atomic<int64_t> data_plane_user_tls_{0};
  absl::Mutex streams_mu_;
  absl::flat_hash_set<CallStream*> streams_ ABSL_GUARDED_BY(streams_mu_);
  // Pulled parameters rounded to 16 bits, once per block version.
  RoundedBlocks rounded_blocks_;
  ChangeGate gate_;
  absl::Mutex catch_up_mu_;
  std::thread catch_up_thread_ ABSL_GUARDED_BY(catch_up_mu_);
  bool catching_up_ ABSL_GUARDED_BY(catch_up_mu_) = false;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> received_state_bytes_{0};
  // Step records: how many are on the backups, what waits for more, and
  // the sender's wake-up.
  struct RecordWait {
    int64_t made;
    // Or sooner, once no record of a step before this one is unconfirmed
    // (AfterStepRecords' `window_from`).
    int64_t window_from;
    absl::Time give_up;
    std::function<void(absl::Status)> then;
  };
  absl::Mutex step_records_mu_;
  std::vector<RecordWait> record_waits_ ABSL_GUARDED_BY(step_records_mu_);
  bool step_records_nudged_ ABSL_GUARDED_BY(step_records_mu_) = false;
  bool stop_step_records_ ABSL_GUARDED_BY(step_records_mu_) = false;
  std::vector<std::thread> step_records_senders_;
  // The job's step, learnt from the records each send takes.
  StepIntervals step_intervals_;
  // What the critical path of a replicated sync step spends on the
  // records (StatsResponse.step_record_*).
  // A pull came with values_elsewhere: workers read from the backups, so
  // records are not held (StepRecordsLinger).
  std::atomic<bool> backup_reads_seen_{false};
  std::atomic<int64_t> step_record_sends_{0};
  std::atomic<int64_t> step_record_send_ns_{0};
  std::atomic<int64_t> step_record_confirm_ns_{0};
  std::atomic<int64_t> step_record_applies_{0};
  std::atomic<int64_t> step_record_apply_ns_{0};
  absl::Mutex random_mu_;
  absl::BitGen random_ ABSL_GUARDED_BY(random_mu_);
  // Last: destroyed first, its handlers finished while the rest is here.
  HandlerThreads waiting_handlers_;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SERVICE_H_
