#include "ps_server/service.h"

#include <algorithm>
#include <csignal>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/protocol.h"
#include "common/transport/data_plane.h"
#include "common/transport/grpc_bytes.h"
#include "common/transport/grpc_status.h"
#include "common/transport/grpc_tls_refusals.h"
#include "common/transport/tensor_codec.h"
#include "common/transport/wire.h"
#include "glog/logging.h"

namespace pstrain {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context,
                                 const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// Parses a small protobuf request (no tensor payload) from its bytes.
template <typename Message>
absl::Status ParseSmall(absl::Span<const absl::string_view> pieces,
                        Message* message) {
  if (pieces.size() == 1 &&
      message->ParseFromArray(pieces[0].data(),
                              static_cast<int>(pieces[0].size()))) {
    return absl::OkStatus();
  }
  std::string flat;
  for (absl::string_view piece : pieces)
    flat.append(piece.data(), piece.size());
  if (!message->ParseFromString(flat)) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed ", Message::descriptor()->name(), ": its ",
                     flat.size(), " bytes are not a valid encoding of it"));
  }
  return absl::OkStatus();
}

template <typename Message>
absl::Status ParseSmall(const grpc::ByteBuffer& buffer, Message* message) {
  ReceivedBytes bytes;
  if (!bytes.Load(buffer)) {
    return absl::InvalidArgumentError("unreadable request buffer");
  }
  return ParseSmall(bytes.views(), message);
}

template <typename Message>
absl::Status SerializeSmall(const Message& message, grpc::ByteBuffer* out) {
  bool own_buffer = false;
  const grpc::Status serialized =
      grpc::SerializationTraits<Message>::Serialize(message, out, &own_buffer);
  return absl::Status(static_cast<absl::StatusCode>(serialized.error_code()),
                      serialized.error_message());
}

// Finishes the call with what `handle` (() -> Status) returns: on `waiting`
// when given (the handler may wait, off gRPC's threads), here otherwise
// (then nothing is allocated for it: the path of every call with one
// replica).
template <typename Handle>
grpc::ServerUnaryReactor* FinishWith(grpc::CallbackServerContext* context,
                                     HandlerThreads* waiting, Handle handle) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (waiting == nullptr) {
    reactor->Finish(ToGrpcStatus(handle()));
  } else {
    waiting->Run([reactor, handle = std::move(handle)]() mutable {
      reactor->Finish(ToGrpcStatus(handle()));
    });
  }
  return reactor;
}

// A unary call of small messages: parses the request (refusing and counting
// bytes that do not parse), runs `handler` (Request -> StatusOr<Response>)
// and sends its response. With `waiting` the handler runs on those threads.
template <typename Request, typename Handler>
grpc::ServerUnaryReactor* ServeSmall(Shard* shard,
                                     grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response,
                                     Handler handler,
                                     HandlerThreads* waiting = nullptr) {
  Request parsed;
  if (absl::Status s = ParseSmall(*request, &parsed); !s.ok()) {
    shard->CountRejected();
    return Finish(context, s);
  }
  return FinishWith(context, waiting,
                    [response, handler = std::move(handler),
                     parsed = std::move(parsed)]() -> absl::Status {
                      auto result = handler(parsed);
                      if (!result.ok()) return result.status();
                      return SerializeSmall(*result, response);
                    });
}

// The blocks of a pull response and the encoded message that references
// them; kept alive by the response's slices until gRPC has sent them, which
// keeps updates off the blocks' memory until then.
struct PullReply {
  std::vector<PulledBlock> blocks;
  // The blocks' values in the pull's dtype, where it is not FLOAT32.
  std::vector<std::shared_ptr<const std::string>> rounded;
  WireMessage message;
  // A data-plane answer with payloads apart opens with this.
  char meta_length[data_plane::kLengthPrefixBytes] = {};
};

}  // namespace

bool ParameterServerService::HasToken(
    grpc::CallbackServerContext* context) const {
  if (options_.auth_token.empty()) return true;
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  const std::string expected = absl::StrCat("Bearer ", options_.auth_token);
  return it != metadata.end() &&
         absl::string_view(it->second.data(), it->second.size()) == expected;
}

bool ParameterServerService::Authorized(grpc::CallbackServerContext* context,
                                        grpc::ServerUnaryReactor** refused) {
  if (HasToken(context)) return true;
  shard_->CountRejected();
  *refused = Finish(
      context, absl::UnauthenticatedError("missing or wrong bearer token (see "
                                          "--auth_token_file)"));
  return false;
}

grpc::ServerUnaryReactor* ParameterServerService::RegisterModel(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  return ServeSmall<RegisterModelRequest>(
      shard_, context, request, response,
      [this](const RegisterModelRequest& r)
          -> absl::StatusOr<RegisterModelResponse> {
        if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
        if (r.worker_id() >= 0) CrashIfInjectedAt("register");
        absl::StatusOr<ChangeGate::Pass> pass = EnterChange(-1);
        if (!pass.ok()) return pass.status();
        // The job's first registration waits for replicas not up yet.
        const bool first = !shard_->HasModel();
        absl::StatusOr<RegisterModelResponse> response = shard_->Register(r);
        if (response.ok()) {
          if (absl::Status forwarded = Forward("RegisterModel", r, first);
              !forwarded.ok()) {
            return forwarded;
          }
          const int port = data_port_.load();
          response->set_data_port(port);
          response->set_data_push_pull(port > 0);
          response->set_data_port_tls(port > 0 && data_port_tls_.load());
          response->set_rounded_pulls(true);
          response->set_sparse_pull_tables(true);
          response->set_sparse_push_tables(true);
          if (replicas_ != nullptr && port > 0) {
            for (int p : replicas_->DataPorts()) {
              response->add_replica_data_ports(p);
            }
          }
        }
        return response;
      },
      Waiting());
}

StatsResponse ParameterServerService::CurrentStats() const {
  StatsResponse stats = shard_->Stats();
  stats.set_data_plane_requests(data_plane_requests_.load());
  if (checkpointer_ != nullptr)
    *stats.mutable_checkpoint() = checkpointer_->Stats();
  stats.set_data_port_tls(data_port_.load() > 0 && data_port_tls_.load());
  stats.set_data_plane_tls_refused(data_plane_tls_refused_.load());
  stats.set_grpc_tls_refused(GrpcTlsRefusals());
  stats.set_data_plane_ktls_connections(data_plane_ktls_.load());
  stats.set_data_plane_user_tls_connections(data_plane_user_tls_.load());
  if (replicas_ != nullptr) {
    replicas_->AddStats(&stats);
    stats.set_step_record_sends(step_record_sends_.load());
    stats.set_step_record_send_seconds(step_record_send_ns_.load() * 1e-9);
    stats.set_step_record_confirm_seconds(step_record_confirm_ns_.load() *
                                          1e-9);
    stats.set_step_record_applies(step_record_applies_.load());
    stats.set_step_record_apply_seconds(step_record_apply_ns_.load() * 1e-9);
  }
  return stats;
}

bool ParameterServerService::TokenAccepted(absl::string_view token) const {
  return options_.auth_token.empty() || token == options_.auth_token;
}

void ParameterServerService::PullFromBytes(
    absl::Span<const absl::string_view> request, absl::Time deadline,
    bool payloads_apart, bool follows_own_push, PullDone done) {
  PullRequest pull;
  if (absl::Status s = ParseSmall(request, &pull); !s.ok()) {
    shard_->CountRejected();
    return done(std::move(s));
  }
  // A read addressed to a backup: answered by a backup only, of a set of
  // two (of three, the backup that has a step may be the only one).
  const bool backup_read = pull.replica_read() && replicas_ != nullptr &&
                           replicas_->is_backup() && replicas_->size() == 2;
  if (pull.replica_read() && !backup_read) {
    return done(absl::UnavailableError(
        absl::StrCat("a read from a backup, but this server is ",
                     replicas_ == nullptr     ? "not replicated"
                     : replicas_->size() != 2 ? "one of more than two replicas"
                                              : "no backup",
                     ": read from the primary")));
  }
  if (absl::Status serves = ServesWorkers(); !serves.ok() && !backup_read) {
    return done(std::move(serves));
  }
  const DataType dtype = pull.dtype();
  if (dtype != FLOAT32 && dtype != BFLOAT16 && dtype != FLOAT16) {
    shard_->CountRejected();
    return done(absl::InvalidArgumentError(
        absl::StrCat("PullRequest dtype ", dtype,
                     ": the servers answer FLOAT32, BFLOAT16 or FLOAT16")));
  }
  const bool values_elsewhere = pull.values_elsewhere();
  // The workers read from the backups, which answer once they applied the
  // step's record: it is needed at once (RunStepRecordsSender).
  if (values_elsewhere) backup_reads_seen_.store(true);
  Shard::PullDone answer = [this, done = std::move(done), payloads_apart, dtype,
                            values_elsewhere](absl::Status status,
                                              std::vector<PulledBlock> blocks) {
    if (!status.ok()) return done(std::move(status));
    auto reply = std::make_shared<PullReply>();
    if (!values_elsewhere) reply->blocks = std::move(blocks);
    if (dtype != FLOAT32) reply->rounded.resize(reply->blocks.size());
    std::vector<OutgoingBlock> outgoing;
    outgoing.reserve(reply->blocks.size());
    for (size_t i = 0; i < reply->blocks.size(); ++i) {
      const PulledBlock& b = reply->blocks[i];
      if (dtype == FLOAT32 || b.state_values) {
        outgoing.push_back(OutgoingBlock{
            {*b.tensor, b.block, FLOAT32, b.version},
            absl::string_view(reinterpret_cast<const char*>(b.values->data()),
                              b.values->size() * sizeof(float))});
      } else {
        reply->rounded[i] =
            rounded_blocks_.Get(b.tensor, b.block, b.version, b.values, dtype);
        outgoing.push_back(OutgoingBlock{{*b.tensor, b.block, dtype, b.version},
                                         *reply->rounded[i]});
      }
    }
    OutgoingBytes bytes;
    if (!payloads_apart) {
      reply->message = EncodePullResponse(outgoing, kInlineBelowBytes);
      bytes.pieces = reply->message.Pieces();
    } else {
      // u32 meta length, the blocks without data, then the payloads.
      std::vector<absl::string_view> payloads;
      payloads.reserve(outgoing.size());
      for (OutgoingBlock& block : outgoing) {
        payloads.push_back(block.data);
        block.data = {};
      }
      reply->message = EncodePullResponse(outgoing);
      data_plane::EncodeLengthPrefix(
          static_cast<uint32_t>(reply->message.ByteSize()), reply->meta_length);
      bytes.pieces.emplace_back(reply->meta_length, sizeof(reply->meta_length));
      for (absl::string_view piece : reply->message.Pieces()) {
        bytes.pieces.push_back(piece);
      }
      bytes.pieces.insert(bytes.pieces.end(), payloads.begin(), payloads.end());
    }
    bytes.keep_alive = std::move(reply);
    done(std::move(bytes));
  };
  if (backup_read) return shard_->PullOnBackup(pull, deadline, answer);
  shard_->Pull(pull, deadline, AfterForwards(std::move(answer), deadline),
               follows_own_push);
}

namespace {

// A dense pull's answer may go out before the record of the step that made
// it is on the backups, never before the step's before it: every worker
// that reads it keeps the push of that step until its next one is answered,
// and sends it again to a new primary (PsClient), which then makes the step
// again from the same gradients in the same order. The pull need not wait
// for the record's round trip; a backup is at most one step behind what
// any worker read.
int64_t RecordWindowFrom(const std::vector<PulledBlock>& blocks) {
  if (blocks.empty()) return std::numeric_limits<int64_t>::max();
  int64_t newest = 0;
  for (const PulledBlock& block : blocks) {
    newest = std::max(newest, block.version);
  }
  return newest - 1;
}
// Sparse rows' changes travel as they came, not as step records: their
// pulls wait for every record made.
template <typename... Result>
int64_t RecordWindowFrom(const Result&...) {
  return std::numeric_limits<int64_t>::max();
}

}  // namespace

template <typename... Result>
std::function<void(absl::Status, Result...)>
ParameterServerService::AfterForwards(
    std::function<void(absl::Status, Result...)> answer, absl::Time deadline) {
  if (replicas_ == nullptr || shard_->mode() != ConsistencyMode::kSync) {
    return answer;
  }
  // What the pull shows goes out once the backups have it too: the
  // changes forwarded as they came, and the records of the steps completed
  // so far but the last one's where its workers' kept pushes make it again
  // (RecordWindowFrom).
  return [this, answer = std::move(answer), deadline](absl::Status status,
                                                      Result... result) {
    if (!status.ok()) return answer(std::move(status), std::move(result)...);
    int64_t window_from = RecordWindowFrom(result...);
    if (window_from != kNoWindow &&
        !shard_->StepRebuildsFromPushes(window_from)) {
      window_from = kNoWindow;
    }
    auto held = std::make_shared<std::tuple<Result...>>(std::move(result)...);
    const int64_t records = shard_->StepRecordsMade();
    gate_.AfterChangesInFlight([this, answer, held, records, deadline,
                                window_from] {
      AfterStepRecords(
          records, deadline,
          [answer, held](absl::Status sent) {
            std::apply(
                [&](Result&... r) { answer(std::move(sent), std::move(r)...); },
                *held);
          },
          window_from);
    });
  };
}

void ParameterServerService::HandlePull(const grpc::ByteBuffer& request,
                                        absl::Time deadline,
                                        PullAnswer answer) {
  ReceivedBytes bytes;
  if (!bytes.Load(request)) {
    shard_->CountRejected();
    return answer(absl::InvalidArgumentError("unreadable request buffer"), {});
  }
  PullFromBytes(
      bytes.views(), deadline, /*payloads_apart=*/false,
      /*follows_own_push=*/false,
      [answer = std::move(answer)](absl::StatusOr<OutgoingBytes> response) {
        if (!response.ok()) return answer(response.status(), {});
        answer(absl::OkStatus(),
               PiecesToByteBuffer(response->pieces,
                                  std::move(response->keep_alive)));
      });
}

absl::StatusOr<std::string> ParameterServerService::ServeDataPlanePush(
    absl::Span<const absl::string_view> request, absl::Time hold_until,
    absl::string_view pull_after) {
  data_plane_requests_.fetch_add(1, std::memory_order_relaxed);
  return PushFromBytes(request, hold_until, pull_after);
}

void ParameterServerService::ServeDataPlanePull(
    absl::Span<const absl::string_view> request, absl::Time deadline,
    bool payloads_apart, bool follows_own_push, PullDone done) {
  data_plane_requests_.fetch_add(1, std::memory_order_relaxed);
  PullFromBytes(request, deadline, payloads_apart, follows_own_push,
                std::move(done));
}

bool ParameterServerService::StepRecordCovers(const WirePushRequest& push,
                                              absl::string_view pull_after) {
  if (!shard_->records_steps() || pull_after.empty() ||
      push.clip_max_norm > 0) {
    return false;
  }
  PullRequest pull;
  if (!pull.ParseFromArray(pull_after.data(),
                           static_cast<int>(pull_after.size())) ||
      pull.worker_id() != push.worker_id || pull.step() <= push.step) {
    return false;
  }
  if (pull.blocks().empty()) return true;  // every block of the shard
  for (const WireBlock& pushed : push.blocks) {
    bool pulled = false;
    for (const BlockRef& ref : pull.blocks()) {
      if (ref.block() == pushed.block && ref.tensor() == pushed.tensor) {
        pulled = true;
        break;
      }
    }
    if (!pulled) return false;
  }
  return true;
}

absl::StatusOr<std::string> ParameterServerService::PushFromBytes(
    absl::Span<const absl::string_view> request, absl::Time hold_until,
    absl::string_view pull_after) {
  absl::StatusOr<WirePushRequest> push = ParsePushRequest(request);
  if (!push.ok()) {
    shard_->CountRejected();
    return absl::InvalidArgumentError(
        absl::StrCat("malformed PushRequest: ", push.status().message()));
  }
  if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
  if (InjectedRecordWindow() && push->step > kInjectedWindowStep) {
    CrashIfInjectedAt("record_window");
  }
  absl::StatusOr<ChangeGate::Pass> pass = EnterChange(push->step);
  if (!pass.ok()) return pass.status();
  absl::StatusOr<PushResponse> result = shard_->Push(*push, hold_until);
  if (!result.ok()) return result.status();
  if (replicas_ != nullptr) {
    if (StepRecordCovers(*push, pull_after)) {
      // Answered with the pull of a later step: the step's record goes to
      // the backups, and until the next step's pulls are answered the
      // worker keeps this push for a new primary (the record window).
      NudgeStepRecords();
    } else if (absl::Status forwarded = Forward("Push", request);
               !forwarded.ok()) {
      return forwarded;
    }
  }
  result->set_server_life(life_);
  if (DropThisResponse()) {
    return absl::UnavailableError(
        "push response dropped by fault injection "
        "(--inject_drop_push_response_probability)");
  }
  return result->SerializeAsString();
}

absl::Status ParameterServerService::HandlePush(const grpc::ByteBuffer& request,
                                                grpc::ByteBuffer* response) {
  ReceivedBytes bytes;
  if (!bytes.Load(request)) {
    shard_->CountRejected();
    return absl::InvalidArgumentError("unreadable request buffer");
  }
  absl::StatusOr<std::string> encoded =
      PushFromBytes(bytes.views(), absl::InfinitePast(), /*pull_after=*/{});
  if (!encoded.ok()) return encoded.status();
  grpc::Slice slice(encoded->data(), encoded->size());
  *response = grpc::ByteBuffer(&slice, 1);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* ParameterServerService::Pull(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // gRPC reports "no deadline" as the far future; Shard caps the wait.
  HandlePull(*request, absl::FromChrono(context->deadline()),
             [reactor, response](absl::Status status, grpc::ByteBuffer bytes) {
               if (status.ok()) *response = std::move(bytes);
               reactor->Finish(ToGrpcStatus(status));
             });
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::Push(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  return FinishWith(context, Waiting(), [this, request, response] {
    return HandlePush(*request, response);
  });
}

grpc::ServerUnaryReactor* ParameterServerService::Assign(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  return FinishWith(context, Waiting(), [this, request, response] {
    return HandleAssign(*request, response);
  });
}

absl::Status ParameterServerService::HandleAssign(
    const grpc::ByteBuffer& request, grpc::ByteBuffer* response) {
  ReceivedBytes bytes;
  if (!bytes.Load(request)) {
    shard_->CountRejected();
    return absl::InvalidArgumentError("unreadable request buffer");
  }
  absl::StatusOr<WirePushRequest> values = ParsePushRequest(bytes.views());
  if (!values.ok()) {
    shard_->CountRejected();
    return absl::InvalidArgumentError(
        absl::StrCat("malformed PushRequest: ", values.status().message()));
  }
  if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
  absl::StatusOr<ChangeGate::Pass> pass = EnterChange(-1);
  if (!pass.ok()) return pass.status();
  absl::StatusOr<PushResponse> result = shard_->Assign(*values);
  if (!result.ok()) return result.status();
  if (absl::Status forwarded = Forward("Assign", bytes.views());
      !forwarded.ok()) {
    return forwarded;
  }
  return SerializeSmall(*result, response);
}

// One PushStream or PullStream: reads a request, answers it, reads the
// next. Only one request is in flight, so a stream's answers come in the
// order of its requests without any tagging. Deletes itself when gRPC is
// done with it (OnDone), which is after Finish: every path below ends in
// Finish, including a pull answered after the client went away (its write
// then fails, and OnWriteDone finishes).
class ParameterServerService::CallStream final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  CallStream(ParameterServerService* service,
             grpc::CallbackServerContext* context, bool pull)
      : service_(service), context_(context), pull_(pull) {
    {
      absl::MutexLock lock(&service_->streams_mu_);
      service_->streams_.insert(this);
    }
    if (!service_->HasToken(context_)) {
      service_->shard_->CountRejected();
      Finish(ToGrpcStatus(absl::UnauthenticatedError(
          "missing or wrong bearer token (see --auth_token_file)")));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client closed its side, or the call was cancelled
      Finish(grpc::Status::OK);
      return;
    }
    if (!pull_) {
      Answer(service_->HandlePush(request_, &response_));
      return;
    }
    service_->HandlePull(request_, absl::FromChrono(context_->deadline()),
                         [this](absl::Status status, grpc::ByteBuffer bytes) {
                           response_ = std::move(bytes);
                           Answer(std::move(status));
                         });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      return;
    }
    request_.Clear();
    StartRead(&request_);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&service_->streams_mu_);
      service_->streams_.erase(this);
    }
    delete this;
  }

  // Under the service's streams_mu_, so before OnDone.
  void Cancel() { context_->TryCancel(); }

 private:
  void Answer(absl::Status status) {
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    StartWrite(&response_);
  }

  ParameterServerService* const service_;
  grpc::CallbackServerContext* const context_;
  const bool pull_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
};

ParameterServerService::~ParameterServerService() {
  stopping_ = true;
  std::vector<RecordWait> unsent;
  {
    absl::MutexLock lock(&step_records_mu_);
    stop_step_records_ = true;
  }
  for (std::thread& sender : step_records_senders_) sender.join();
  {
    absl::MutexLock lock(&step_records_mu_);
    unsent.swap(record_waits_);
  }
  for (RecordWait& wait : unsent) {
    wait.then(absl::UnavailableError("the server is shutting down"));
  }
  absl::MutexLock lock(&catch_up_mu_);
  if (catch_up_thread_.joinable()) catch_up_thread_.join();
}

void ParameterServerService::set_replicas(ReplicaSet* replicas) {
  replicas_ = replicas;
  if (replicas_ == nullptr || !shard_->records_steps()) return;
  shard_->set_leads_steps([replicas] { return replicas->is_primary(); });
  replicas_->set_on_takeover([this] {
    // A worker waiting here for its step's values cannot send that step
    // here until its read ends.
    shard_->FailReplicaReads(absl::UnavailableError(
        "this backup took over as primary: send the step here"));
    shard_->CompleteStepsNowLeading();
    NudgeStepRecords();
  });
  for (int i = 0; i < kStepRecordSenders; ++i) {
    step_records_senders_.emplace_back([this] { RunStepRecordsSender(); });
  }
}

void ParameterServerService::NudgeStepRecords() {
  // Most pushes complete no step: waking the sender for them would cost a
  // context switch each.
  if (replicas_ == nullptr || !shard_->records_steps() ||
      !shard_->HasStepRecords()) {
    return;
  }
  absl::MutexLock lock(&step_records_mu_);
  step_records_nudged_ = true;
}

absl::Duration ParameterServerService::StepRecordsLinger() const {
  return step_intervals_.HalfStep(kStepRecordsMinLinger, kStepRecordsMaxLinger);
}

absl::Status ParameterServerService::SendStepRecords() {
  const bool held = InjectedRecordWindow();
  Shard::TakenStepRecords taken = shard_->TakeStepRecords(
      kStepRecordsBytes, held ? kInjectedWindowStep : kNoWindow);
  if (taken.records.records_size() == 0) {
    return held ? absl::UnavailableError(
                      "records held by --inject_crash_at=record_window")
                : absl::OkStatus();
  }
  // The job's step, from when the steps a send takes were made; not from a
  // skip (a restored primary's jump to its workers' step, made at once).
  absl::InlinedVector<int64_t, 32> steps;
  absl::InlinedVector<absl::Time, 32> made;
  for (int i = 0; i < taken.records.records_size(); ++i) {
    if (taken.records.records(i).skip_to() != 0) continue;
    steps.push_back(taken.records.records(i).step());
    made.push_back(taken.made[i]);
  }
  step_intervals_.Saw(steps, made);
  const std::string header = taken.records.SerializeAsString();
  char length[data_plane::kLengthPrefixBytes];
  data_plane::EncodeLengthPrefix(static_cast<uint32_t>(header.size()), length);
  std::vector<absl::string_view> pieces = {
      absl::string_view(length, sizeof(length)), header};
  for (const std::vector<float>& sum : taken.sums) {
    if (sum.empty()) continue;
    pieces.emplace_back(reinterpret_cast<const char*>(sum.data()),
                        sum.size() * sizeof(float));
  }
  const absl::Time start = absl::Now();
  int backups = 0;
  if (absl::Status sent =
          replicas_->Forward("steps", pieces,
                             /*wait_for_replicas=*/false, &backups);
      !sent.ok()) {
    shard_->ReturnStepRecords(std::move(taken));
    return sent;
  }
  if (backups > 0) {  // not a set left with no backup
    const absl::Time confirmed = absl::Now();
    step_record_sends_.fetch_add(1, std::memory_order_relaxed);
    step_record_send_ns_.fetch_add(absl::ToInt64Nanoseconds(confirmed - start),
                                   std::memory_order_relaxed);
    step_record_confirm_ns_.fetch_add(
        absl::ToInt64Nanoseconds(
            confirmed -
            *std::max_element(taken.made.begin(), taken.made.end())),
        std::memory_order_relaxed);
  }
  shard_->ConfirmStepRecords(std::move(taken));
  return absl::OkStatus();
}

void ParameterServerService::EndStepRecordWaits() {
  // A replica no longer primary (fenced, stale) answers no pull: what it
  // shows may be on no other replica, and its workers should move to the
  // new primary now.
  const absl::Status serves = ServesWorkers();
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> done;
  {
    absl::MutexLock lock(&step_records_mu_);
    const absl::Time now = absl::Now();
    const int64_t confirmed = shard_->StepRecordsConfirmed();
    const int64_t oldest = shard_->OldestUnconfirmedStep();
    auto kept = std::stable_partition(
        record_waits_.begin(), record_waits_.end(),
        [&](const RecordWait& w)
            ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_records_mu_) {
              return serves.ok() && w.made > confirmed &&
                     w.window_from > oldest && w.give_up > now;
            });
    for (auto it = kept; it != record_waits_.end(); ++it) {
      absl::Status why = serves;
      if (serves.ok() && it->made > confirmed && it->window_from > oldest) {
        why = absl::UnavailableError(
            "the step this pull shows is not on every replica of the shard "
            "yet (a backup did not confirm it); retry");
      }
      done.emplace_back(std::move(it->then), std::move(why));
    }
    record_waits_.erase(kept, record_waits_.end());
  }
  for (auto& [then, why] : done) then(std::move(why));
}

absl::Status ParameterServerService::AwaitStepRecords() {
  if (replicas_ == nullptr || !shard_->records_steps()) {
    return absl::OkStatus();
  }
  struct Wait {
    absl::Notification done;
    absl::Status status;
  };
  auto wait = std::make_shared<Wait>();
  const int64_t made = shard_->StepRecordsMade();
  NudgeStepRecords();
  AfterStepRecords(made, absl::Now() + kStepRecordsWait,
                   [wait](absl::Status sent) {
                     wait->status = std::move(sent);
                     wait->done.Notify();
                   });
  // The sender thread ends the wait by kStepRecordsWait; the margin only
  // guards against that thread not running.
  if (!wait->done.WaitForNotificationWithTimeout(kStepRecordsWait +
                                                 absl::Seconds(5))) {
    return absl::UnavailableError(
        "the step's record is not on every replica yet; retry");
  }
  return wait->status;
}

void ParameterServerService::AfterStepRecords(
    int64_t made, absl::Time deadline, std::function<void(absl::Status)> then,
    int64_t window_from) {
  {
    absl::MutexLock lock(&step_records_mu_);
    if (made > shard_->StepRecordsConfirmed() &&
        window_from > shard_->OldestUnconfirmedStep()) {
      record_waits_.push_back(RecordWait{
          made, window_from, std::min(deadline, absl::Now() + kStepRecordsWait),
          std::move(then)});
      // Records no push nudged for (a restored primary's skip, made by a
      // pull or a heartbeat) go now, not at the sender's next round. Only
      // records a take would return: a pull of every step waits here, and
      // most find theirs already on the way.
      if (shard_->HasStepRecords()) step_records_nudged_ = true;
      return;
    }
  }
  then(ServesWorkers());
}

void ParameterServerService::RunStepRecordsSender() {
  while (true) {
    {
      absl::MutexLock lock(&step_records_mu_);
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_records_mu_) {
        return step_records_nudged_ || stop_step_records_;
      };
      step_records_mu_.AwaitWithTimeout(absl::Condition(&woken),
                                        kStepRecordsRetry);
      if (stop_step_records_) return;
      if (step_records_nudged_ && !backup_reads_seen_.load()) {
        // The pulls of the step the records are of do not wait for them
        // (the record window), the next step's do: until one of those
        // waits, or the linger passed, the records stay, off the cores that
        // answer the step's other pulls.
        auto needed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_records_mu_) {
          return !record_waits_.empty() || stop_step_records_;
        };
        step_records_mu_.AwaitWithTimeout(absl::Condition(&needed),
                                          StepRecordsLinger());
        if (stop_step_records_) return;
      }
      step_records_nudged_ = false;
    }
    // Everything made until the send starts goes in one message: the
    // records a step's block groups make while messages are on their way
    // go together in the next (on the other sender, or this one when it is
    // back). A send that fails leaves them for the next round
    // (kStepRecordsRetry), with the waits they hold.
    while (shard_->HasStepRecords()) {
      if (!SendStepRecords().ok()) break;
      EndStepRecordWaits();
    }
    EndStepRecordWaits();
  }
}

absl::Status ParameterServerService::StartCatchUp(int joiner) {
  if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
  if (!shard_->HasModel()) {
    return absl::UnavailableError(
        "no model is registered yet: there is no state to send; ask again");
  }
  if (stopping_.load()) return absl::UnavailableError("shutting down");
  absl::MutexLock lock(&catch_up_mu_);
  if (catching_up_) {
    return absl::UnavailableError(
        absl::StrCat(kAnotherReplicaCatchingUp, "; ask again once it has"));
  }
  if (catch_up_thread_.joinable()) catch_up_thread_.join();
  catching_up_ = true;
  catch_up_thread_ = std::thread([this, joiner] {
    CatchUp(joiner);
    absl::MutexLock lock(&catch_up_mu_);
    catching_up_ = false;
  });
  return absl::OkStatus();
}

void ParameterServerService::CatchUp(int joiner) {
  const absl::Time start = absl::Now();
  const absl::Time give_up = start + kCatchUpQuietWait;
  // Sync: the step under way finishes (its other pushes still come in),
  // so that the state is whole at a step; async has no step part done.
  gate_.Hold(shard_->mode() == ConsistencyMode::kSync, shard_->StepUnderWay());
  bool quiet = false;
  while (!quiet && !stopping_.load() && absl::Now() < give_up) {
    quiet = gate_.AwaitQuiet([this] { return shard_->QuietForTransfer(); },
                             std::min(give_up, absl::Now() + absl::Seconds(1)));
  }
  absl::Status sent;
  if (!quiet) {
    sent = absl::DeadlineExceededError(absl::StrCat(
        "no quiet moment in ", absl::FormatDuration(absl::Now() - start),
        " (a sync step waits for a worker?)"));
  } else {
    const absl::Time quiet_at = absl::Now();
    // Heartbeats wait with every other change until the state is sent.
    shard_->HoldLeaseClock(true);
    absl::StatusOr<ReplicaStateExport> state =
        shard_->ExportReplicaState(replicas_->catchup_chunk_bytes());
    sent = state.ok() ? replicas_->SendState(joiner, *state) : state.status();
    shard_->HoldLeaseClock(false);
    LOG(INFO) << "catch-up of replica " << joiner << ": changes held "
              << absl::FormatDuration(absl::Now() - start) << " (quiet after "
              << absl::FormatDuration(quiet_at - start) << ")";
  }
  gate_.Release();
  if (!sent.ok()) {
    LOG(WARNING) << "replica " << joiner << " could not catch up: " << sent;
  }
}

absl::StatusOr<ReplicateResponse> ParameterServerService::ServeStateChunk(
    const ReplicateRequest& meta, absl::Span<const absl::string_view> bytes) {
  if (absl::Status admitted = replicas_->AdmitState(meta); !admitted.ok()) {
    return admitted;
  }
  // A u32 length, the chunk, then its floats (ReplicaStateChunk); both
  // transports bring it in one piece.
  if (bytes.size() != 1) {
    return absl::InvalidArgumentError("a state chunk comes in one piece");
  }
  const absl::string_view request = bytes[0];
  const int64_t size = static_cast<int64_t>(request.size());
  ReplicaStateChunk chunk;
  absl::StatusOr<data_plane::LengthPrefixed> parts =
      data_plane::SplitLengthPrefixed(request, "state chunk");
  absl::Status installed = parts.status();
  if (installed.ok() &&
      !chunk.ParseFromArray(parts->head.data(),
                            static_cast<int>(parts->head.size()))) {
    installed = absl::InvalidArgumentError("unreadable state chunk");
  }
  if (installed.ok()) {
    installed = shard_->ImportReplicaChunk(chunk, parts->rest);
  }
  if (!installed.ok()) {
    replicas_->CatchUpFailed(installed.ToString());
    return installed;
  }
  const int64_t total = received_state_bytes_.fetch_add(size) + size;
  if (chunk.last()) replicas_->Joined(meta, total);
  return replicas_->Answer(ReplicateRequest());
}

void ParameterServerService::CancelCallStreams() {
  stopping_ = true;
  absl::MutexLock lock(&streams_mu_);
  for (CallStream* stream : streams_) stream->Cancel();
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
ParameterServerService::PushStream(grpc::CallbackServerContext* context) {
  return new CallStream(this, context, /*pull=*/false);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
ParameterServerService::PullStream(grpc::CallbackServerContext* context) {
  return new CallStream(this, context, /*pull=*/true);
}

grpc::ServerUnaryReactor* ParameterServerService::SparsePull(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  SparsePullRequest pull;
  if (absl::Status s = ParseSmall(*request, &pull); !s.ok()) {
    shard_->CountRejected();
    return Finish(context, s);
  }
  if (absl::Status serves = ServesWorkers(); !serves.ok()) {
    return Finish(context, serves);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time deadline = absl::FromChrono(context->deadline());
  if (pull.more_size() == 0) {
    shard_->SparsePull(
        pull, deadline,
        AfterForwards(Shard::SparsePullDone(
                          [reactor, response](absl::Status status,
                                              SparsePullResponse result) {
                            if (status.ok()) {
                              status = SerializeSmall(result, response);
                            }
                            reactor->Finish(ToGrpcStatus(status));
                          }),
                      deadline));
    return reactor;
  }
  // Several tables: each pulled on its own; the call is answered once every
  // one is in, or with the first failure.
  struct Gather {
    absl::Mutex mu;
    int left ABSL_GUARDED_BY(mu) = 0;
    absl::Status status ABSL_GUARDED_BY(mu);
    std::vector<SparsePullResponse> parts ABSL_GUARDED_BY(mu);
  };
  auto gather = std::make_shared<Gather>();
  const int tables = 1 + pull.more_size();
  {
    absl::MutexLock lock(&gather->mu);
    gather->left = tables;
    gather->parts.resize(tables);
  }
  // Each table's request: the call's worker and step, its own ids (moved,
  // not copied).
  std::vector<SparsePullRequest> parts(tables);
  for (int t = 0; t < tables; ++t) {
    parts[t].set_protocol_version(pull.protocol_version());
    parts[t].set_worker_id(pull.worker_id());
    parts[t].set_step(pull.step());
    SparseTableIds* more = t > 0 ? pull.mutable_more(t - 1) : nullptr;
    parts[t].set_table(more != nullptr ? more->table() : pull.table());
    parts[t].mutable_ids()->Swap(more != nullptr ? more->mutable_ids()
                                                 : pull.mutable_ids());
  }
  for (int t = 0; t < tables; ++t) {
    shard_->SparsePull(
        parts[t], deadline,
        AfterForwards(Shard::SparsePullDone([reactor, response, gather, t](
                                                absl::Status status,
                                                SparsePullResponse result) {
                        absl::MutexLock lock(&gather->mu);
                        if (status.ok()) {
                          gather->parts[t] = std::move(result);
                        } else if (gather->status.ok()) {
                          gather->status = std::move(status);
                        }
                        if (--gather->left > 0) return;
                        absl::Status done = gather->status;
                        if (done.ok()) {
                          SparsePullResponse all = std::move(gather->parts[0]);
                          for (int i = 1;
                               i < static_cast<int>(gather->parts.size());
                               ++i) {
                            *all.add_more() = std::move(gather->parts[i]);
                          }
                          done = SerializeSmall(all, response);
                        }
                        reactor->Finish(ToGrpcStatus(done));
                      }),
                      deadline));
  }
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::SparsePush(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  return ServeSmall<SparsePushRequest>(
      shard_, context, request, response,
      [this](const SparsePushRequest& r) -> absl::StatusOr<SparsePushResponse> {
        if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
        absl::StatusOr<ChangeGate::Pass> pass = EnterChange(r.step());
        if (!pass.ok()) return pass.status();
        absl::StatusOr<SparsePushResponse> pushed = shard_->SparsePush(r);
        if (!pushed.ok()) return pushed;
        if (absl::Status forwarded = Forward("SparsePush", r);
            !forwarded.ok()) {
          return forwarded;
        }
        return pushed;
      },
      Waiting());
}

bool ParameterServerService::DropThisResponse() {
  if (options_.drop_push_response_probability <= 0) return false;
  absl::MutexLock lock(&random_mu_);
  if (!absl::Bernoulli(random_, options_.drop_push_response_probability)) {
    return false;
  }
  dropped_.fetch_add(1);
  return true;
}

grpc::ServerUnaryReactor* ParameterServerService::Heartbeat(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  return ServeSmall<HeartbeatRequest>(
      shard_, context, request, response,
      [this](const HeartbeatRequest& r) -> absl::StatusOr<HeartbeatResponse> {
        if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
        absl::StatusOr<ChangeGate::Pass> pass = EnterChange(-1);
        if (!pass.ok()) return pass.status();
        if (absl::Status s = shard_->Heartbeat(r); !s.ok()) return s;
        if (absl::Status forwarded = Forward("Heartbeat", r); !forwarded.ok()) {
          return forwarded;
        }
        return HeartbeatResponse();
      },
      Waiting());
}

grpc::ServerUnaryReactor* ParameterServerService::AwaitJobStart(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  AwaitJobStartRequest await;
  if (absl::Status s = ParseSmall(*request, &await); !s.ok()) {
    shard_->CountRejected();
    return Finish(context, s);
  }
  if (absl::Status serves = ServesWorkers(); !serves.ok()) {
    return Finish(context, serves);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  shard_->AwaitJobStart(await, absl::FromChrono(context->deadline()),
                        [reactor, response](absl::StatusOr<JobStart> start) {
                          absl::Status status = start.status();
                          if (status.ok()) {
                            status = SerializeSmall(*start, response);
                          }
                          reactor->Finish(ToGrpcStatus(status));
                        });
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::ClipNorm(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  ClipNormRequest clip;
  if (absl::Status s = ParseSmall(*request, &clip); !s.ok()) {
    shard_->CountRejected();
    return Finish(context, s);
  }
  if (absl::Status serves = ServesWorkers(); !serves.ok()) {
    return Finish(context, serves);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  shard_->ClipNorm(clip, absl::FromChrono(context->deadline()),
                   [reactor, response](absl::StatusOr<ClipNormResponse> norm) {
                     absl::Status status = norm.status();
                     if (status.ok()) status = SerializeSmall(*norm, response);
                     reactor->Finish(ToGrpcStatus(status));
                   });
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::ApplyClip(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  return ServeSmall<ApplyClipRequest>(
      shard_, context, request, response,
      [this](const ApplyClipRequest& r) -> absl::StatusOr<ApplyClipResponse> {
        if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
        absl::StatusOr<ChangeGate::Pass> pass = EnterChange(r.step());
        if (!pass.ok()) return pass.status();
        absl::StatusOr<ApplyClipResponse> applied = shard_->ApplyClip(r);
        if (!applied.ok()) return applied;
        // With step records the step the coefficient completes travels as
        // its record, which must be on the backups before the answer (a
        // backup would not complete it from the forwarded request).
        if (absl::Status forwarded = shard_->records_steps()
                                         ? AwaitStepRecords()
                                         : Forward("ApplyClip", r);
            !forwarded.ok()) {
          return forwarded;
        }
        return applied;
      },
      Waiting());
}

grpc::ServerUnaryReactor* ParameterServerService::Leave(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  return ServeSmall<LeaveRequest>(
      shard_, context, request, response,
      [this](const LeaveRequest& r) -> absl::StatusOr<LeaveResponse> {
        if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
        // A worker that leaves no longer keeps its last push for a new
        // primary: the step it made must be on the backups first.
        if (absl::Status s = AwaitStepRecords(); !s.ok()) return s;
        absl::StatusOr<ChangeGate::Pass> pass = EnterChange(-1);
        if (!pass.ok()) return pass.status();
        if (absl::Status s = shard_->Leave(r); !s.ok()) return s;
        if (absl::Status forwarded = Forward("Leave", r); !forwarded.ok()) {
          return forwarded;
        }
        return LeaveResponse();
      },
      Waiting());
}

grpc::ServerUnaryReactor* ParameterServerService::Checkpoint(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  return ServeSmall<CheckpointRequest>(
      shard_, context, request, response,
      [this](const CheckpointRequest& r) -> absl::StatusOr<CheckpointResponse> {
        if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
        if (r.final_version() < 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "final_version must be >= 0, got ", r.final_version()));
        }
        if (r.final_version() > 0) return FinalState(r);
        if (checkpointer_ == nullptr) {
          return absl::FailedPreconditionError(
              "this server has no --checkpoint_dir");
        }
        absl::StatusOr<std::string> path = checkpointer_->CheckpointNow();
        if (!path.ok()) return path.status();
        CheckpointResponse answer;
        answer.set_path(*path);
        answer.set_version(shard_->StateVersion());
        answer.set_checkpointed(true);
        return answer;
      },
      &waiting_handlers_);
}

grpc::ServerUnaryReactor* ParameterServerService::SparseChanges(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  return ServeSmall<SparseChangesRequest>(
      shard_, context, request, response,
      [this](const SparseChangesRequest& r)
          -> absl::StatusOr<SparseChangesResponse> {
        if (absl::Status serves = ServesWorkers(); !serves.ok()) return serves;
        absl::StatusOr<SparseChangesResponse> answer = shard_->SparseChanges(r);
        if (answer.ok()) answer->set_server_life(life_);
        return answer;
      });
}

void ParameterServerService::CrashIfInjectedAt(absl::string_view moment) {
  if (options_.crash_at != moment) return;
  LOG(ERROR) << "--inject_crash_at=" << moment << ": dying (SIGKILL)";
  ::raise(SIGKILL);
}

absl::StatusOr<CheckpointResponse> ParameterServerService::FinalState(
    const CheckpointRequest& request) {
  CrashIfInjectedAt("final_state");
  // The job's last step may be on the backups' way still (the pulls of a
  // step wait for the record of the step before it only): its state is the
  // servers' once they hold it.
  if (absl::Status s = AwaitStepRecords(); !s.ok()) return s;
  absl::StatusOr<ChangeGate::Pass> pass = EnterChange(-1);
  if (!pass.ok()) return pass.status();
  if (absl::Status s = shard_->NoteJobFinalVersion(request.worker_id(),
                                                   request.final_version());
      !s.ok()) {
    return s;
  }
  if (absl::Status forwarded = Forward("FinalState", request);
      !forwarded.ok()) {
    return forwarded;
  }
  CheckpointResponse answer;
  answer.set_skipped_to_step(shard_->SkippedToStep());
  answer.set_rebuilt_with_losses(shard_->RebuiltWithLossesBefore(
      request.worker_id(), request.final_version()));
  if (checkpointer_ == nullptr) {
    answer.set_version(shard_->StateVersion());
    answer.set_not_checkpointed_reason("no --checkpoint_dir");
    return answer;
  }
  // The version first: the file then holds at least this state.
  answer.set_version(shard_->StateVersion());
  absl::StatusOr<std::string> path =
      checkpointer_->CheckpointFinalState(request.final_version());
  if (!path.ok()) {  // a failed write, or no model (restarted empty)
    answer.set_not_checkpointed_reason(path.status().ToString());
    return answer;
  }
  answer.set_path(*path);
  answer.set_checkpointed(true);
  return answer;
}

grpc::ServerUnaryReactor* ParameterServerService::Replicate(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  ReplicateRequest forward;
  if (absl::Status s = ParseSmall(*request, &forward); !s.ok()) {
    shard_->CountRejected();
    return Finish(context, s);
  }
  if (replicas_ == nullptr) {
    return Finish(context, absl::FailedPreconditionError(
                               "this server is its shard's only replica "
                               "(--replicas=1): it takes no forwards"));
  }
  if (forward.method() == "probe" || forward.method() == "drop" ||
      forward.method() == "deposed") {
    return Finish(context,
                  SerializeSmall(replicas_->Answer(forward), response));
  }
  if (forward.method() == "join") {
    if (absl::Status s = StartCatchUp(forward.from_replica()); !s.ok()) {
      return Finish(context, s);
    }
    // The answer carries the primary's promise to the asker
    // (start_afresh_ms).
    return Finish(context,
                  SerializeSmall(replicas_->Answer(forward), response));
  }
  // Applying a forward may wait for its step (up to the call's deadline).
  return FinishWith(
      context, &waiting_handlers_,
      [this, response, forward = std::move(forward),
       deadline = absl::FromChrono(context->deadline())]() -> absl::Status {
        const absl::string_view request_bytes = forward.request();
        absl::StatusOr<ReplicateResponse> answer = ServeForward(
            forward, absl::MakeConstSpan(&request_bytes, 1), deadline);
        if (!answer.ok()) return answer.status();
        return SerializeSmall(*answer, response);
      });
}

absl::StatusOr<std::string> ParameterServerService::ServeDataPlaneForward(
    absl::string_view body, absl::Time deadline) {
  data_plane_requests_.fetch_add(1, std::memory_order_relaxed);
  absl::StatusOr<data_plane::LengthPrefixed> parts =
      data_plane::SplitLengthPrefixed(body, "Forward request");
  ReplicateRequest meta;
  if (!parts.ok() ||
      !meta.ParseFromArray(parts->head.data(),
                           static_cast<int>(parts->head.size()))) {
    shard_->CountRejected();
    return absl::InvalidArgumentError("malformed Forward request");
  }
  absl::StatusOr<ReplicateResponse> answer =
      ServeForward(meta, absl::MakeConstSpan(&parts->rest, 1), deadline);
  if (!answer.ok()) return answer.status();
  return answer->SerializeAsString();
}

absl::StatusOr<ReplicateResponse> ParameterServerService::ServeForward(
    const ReplicateRequest& meta, absl::Span<const absl::string_view> request,
    absl::Time deadline) {
  if (replicas_ == nullptr) {
    return absl::FailedPreconditionError(
        "this server is its shard's only replica (--replicas=1): it takes no "
        "forwards");
  }
  if (meta.method() == "state") return ServeStateChunk(meta, request);
  if (absl::Status admitted = replicas_->AdmitForward(meta); !admitted.ok()) {
    return admitted;
  }
  if (absl::Status applied = ApplyForwarded(meta.method(), request, deadline);
      !applied.ok()) {
    return applied;
  }
  return replicas_->Answer(ReplicateRequest());
}

absl::Status ParameterServerService::ApplyForwarded(
    absl::string_view method, absl::Span<const absl::string_view> bytes,
    absl::Time deadline) {
  // One try; UNAVAILABLE means the shard wants it again a little later.
  auto apply_once = [&]() -> absl::Status {
    if (method == "Push") {
      absl::StatusOr<WirePushRequest> push = ParsePushRequest(bytes);
      if (!push.ok()) return push.status();
      shard_->WaitForPushStep(*push, deadline);
      return shard_->Push(*push, deadline).status();
    }
    if (method == "Assign") {
      absl::StatusOr<WirePushRequest> values = ParsePushRequest(bytes);
      if (!values.ok()) return values.status();
      return shard_->Assign(*values).status();
    }
    if (method == "RegisterModel") {
      RegisterModelRequest r;
      if (absl::Status s = ParseSmall(bytes, &r); !s.ok()) return s;
      return shard_->Register(r).status();
    }
    if (method == "SparsePush") {
      SparsePushRequest r;
      if (absl::Status s = ParseSmall(bytes, &r); !s.ok()) return s;
      shard_->WaitForSparsePushStep(r, deadline);
      return shard_->SparsePush(r).status();
    }
    if (method == "Heartbeat") {
      HeartbeatRequest r;
      if (absl::Status s = ParseSmall(bytes, &r); !s.ok()) return s;
      return shard_->Heartbeat(r);
    }
    if (method == "Leave") {
      LeaveRequest r;
      if (absl::Status s = ParseSmall(bytes, &r); !s.ok()) return s;
      return shard_->Leave(r);
    }
    if (method == "ApplyClip") {
      ApplyClipRequest r;
      if (absl::Status s = ParseSmall(bytes, &r); !s.ok()) return s;
      return shard_->ApplyClip(r).status();
    }
    if (method == "view") return absl::OkStatus();  // AdmitForward took it
    if (method == "steps") {
      if (bytes.size() != 1) {
        return absl::InvalidArgumentError("step records come in one piece");
      }
      absl::StatusOr<data_plane::LengthPrefixed> parts =
          data_plane::SplitLengthPrefixed(bytes[0], "step records");
      if (!parts.ok()) return parts.status();
      StepRecords records;
      if (!records.ParseFromArray(parts->head.data(),
                                  static_cast<int>(parts->head.size()))) {
        return absl::InvalidArgumentError("unreadable step records");
      }
      const absl::Time start = absl::Now();
      absl::Status applied = shard_->ApplyStepRecords(records, parts->rest);
      if (applied.ok()) {
        step_record_applies_.fetch_add(1, std::memory_order_relaxed);
        step_record_apply_ns_.fetch_add(
            absl::ToInt64Nanoseconds(absl::Now() - start),
            std::memory_order_relaxed);
      }
      return applied;
    }
    if (method == "FinalState") {
      CheckpointRequest r;
      if (absl::Status s = ParseSmall(bytes, &r); !s.ok()) return s;
      return shard_->NoteJobFinalVersion(r.worker_id(), r.final_version());
    }
    return absl::InvalidArgumentError(
        absl::StrCat("no forwarded method '", method, "'"));
  };
  while (true) {
    absl::Status applied = apply_once();
    if (applied.code() != absl::StatusCode::kUnavailable ||
        absl::Now() + absl::Milliseconds(20) >= deadline) {
      return applied;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

grpc::ServerUnaryReactor* ParameterServerService::Stats(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::ServerUnaryReactor * refused; !Authorized(context, &refused)) {
    return refused;
  }
  return ServeSmall<StatsRequest>(
      shard_, context, request, response,
      [this](const StatsRequest& r) -> absl::StatusOr<StatsResponse> {
        if (r.from_primary()) {
          if (absl::Status serves = ServesWorkers(); !serves.ok()) {
            return serves;
          }
        }
        return CurrentStats();
      });
}

}  // namespace pstrain
